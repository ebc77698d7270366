"""Run one independent check group in a forked child while the parent runs another.

``verify --against`` is single-threaded Python between its Capstone decodes; on
a 2-core machine a second check group can run beside it in a child that
inherits every array it needs (fork: copy-on-write, nothing is re-read or
re-decoded) and sends back its result pickled through a pipe.

The result is the same as calling the function in the parent: if the fork
fails, the child dies, or the function raises there, the parent runs it itself
(an exception then surfaces in the parent, as it would have without the fork).
"""

import os
import pickle
import signal


class Forked:
    """``fn(*args)`` computed in a forked child; ``result()`` collects it."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args
        self.pid = None
        if os.environ.get("LINEPACK_VERIFY_NOFORK"):
            return
        try:
            r, w = os.pipe()
        except OSError:
            return
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            return
        if pid == 0:                                    # child
            os.close(r)
            status = 1
            try:
                value = fn(*args)
                with os.fdopen(w, "wb") as f:       # streamed: no second copy of big arrays
                    pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
                status = 0
            except BaseException:                       # the parent runs it again
                pass
            finally:
                os._exit(status)                        # no atexit handlers in the child
        os.close(w)
        self.pid, self.fd = pid, r

    def result(self):
        if self.pid is None:
            return self.fn(*self.args)
        value, ok = None, False
        with os.fdopen(self.fd, "rb") as f:
            try:
                value, ok = pickle.load(f), True
            except Exception:                           # the child died or failed
                pass
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        if ok and status == 0:
            return value
        return self.fn(*self.args)

    def cancel(self):
        """Stop the child if its result is not wanted (the command failed first)."""
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        os.close(self.fd)
        os.waitpid(self.pid, 0)
        self.pid = None


class Computed:
    """A value already computed, with Forked's interface (``result``, ``cancel``)."""

    def __init__(self, fn, *args):
        self.value = fn(*args)

    def result(self):
        return self.value

    def cancel(self):
        pass


__all__ = ["Computed", "Forked"]
