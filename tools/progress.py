"""Progress lines on stderr, one helper for every verb: ``NAME: message`` (with
``clock``, ``NAME: [  1.2s] message``: seconds since the logger was made), or
nothing when quiet. stdout stays for results."""

import sys
import time


def stderr_log(name, quiet=False, clock=False):
    """A ``log(message)`` function for a verb's progress."""
    if quiet:
        return lambda msg: None
    t0 = time.time()

    def log(msg):
        stamp = f"[{time.time() - t0:5.1f}s] " if clock else ""
        print(f"{name}: {stamp}{msg}", file=sys.stderr, flush=True)
    return log


__all__ = ["stderr_log"]
