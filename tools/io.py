"""Small shared I/O: checked, atomic, all-or-none output files; TOML configs.

Outputs: the OutputSet API
--------------------------
A command declares every file it will write, and every file it reads, before
it does any work::

    from ..io import OutputSet

    with OutputSet(inputs=[args.image, args.profile],
                   outputs={"-o": args.output, "--json": args.json}):
        ...  # the work; anything written with atomic_output()/write_atomic()
             # to a declared path is staged, not yet visible

Declaring (the constructor, or ``add()``) checks each output path at once and
raises BadInput (one line, exit 2) unless: its directory exists and is a
writable directory; the path is absent or a regular file (a symlink is
followed: the file it names is replaced, the link stays); it is none of the
inputs (by name and by ``os.path.samefile``, so hard links count); no two
outputs are the same file. ``None`` entries are skipped, so optional flags
need no ``if``. Device nodes, FIFOs and sockets are refused: an output goes
to a temp file and is renamed, and renaming over /dev/null would replace the
device with a regular file (use '-' for stdout where a verb offers it).

While the set is active, atomic_output()/write_atomic() to a declared path
write a temp file beside it (``.NAME.XXXXXXXX``) and keep it. Leaving the
``with`` block normally renames every temp file into place (signals blocked
during the renames); leaving it by an exception, or by SIGINT/SIGTERM/SIGHUP
(turned into ``Interrupted`` while the set is active), deletes every temp file
and no declared output appears or changes. The CLI maps Interrupted to exit
128 + signal number (130, 143, 129).

Writes to paths that were not declared (caches) keep the old behaviour:
temp file + rename at the end of their own ``with`` block.
"""

import contextlib
import os
import signal
import stat
import tempfile
import threading

from .errors import BadInput

# The signals that end a run cleanly (temp files removed, nothing half-written).
TRAPPED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_active = None          # the OutputSet of the running command, if any


class Interrupted(BaseException):
    """SIGINT/SIGTERM/SIGHUP arrived; BaseException so ``except Exception`` cannot
    swallow it. ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.exit_code = 128 + signum


_held = 0              # depth of _signals_blocked blocks in the main thread
_pending = None        # a signal that arrived while held: raised when the block ends


def sha256(data=b""):
    """hashlib.sha256(data) without importing hashlib when CPython's own SHA-256
    module is there: hashlib loads OpenSSL's libcrypto (3.6 MiB resident in every
    relayout and verify, for the C cores' cache keys and file hashes). The same
    digest either way."""
    try:
        from _sha2 import sha256 as impl            # CPython >= 3.12
    except ImportError:
        try:
            from _sha256 import sha256 as impl      # CPython 3.11
        except ImportError:
            from hashlib import sha256 as impl
    return impl(data)


def _raise_interrupted(signum, frame):
    global _pending
    if _held:
        # Blocking the mask holds a signal back only in this thread; a process-directed
        # signal may land in any other (pool, Dask, BLAS threads) and still run this
        # handler here at once. So the handler itself defers while a block is open.
        _pending = _pending or signum
        return
    raise Interrupted(signum)


_untrapped = None      # the handlers before the outermost trap_signals (None: not trapped)


@contextlib.contextmanager
def trap_signals():
    """Turn SIGINT/SIGTERM/SIGHUP into Interrupted inside the block (main thread
    only; elsewhere a no-op), so every ``finally``/``except`` cleanup runs."""
    global _untrapped
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, _raise_interrupted) for s in TRAPPED_SIGNALS}
    outermost = _untrapped is None
    if outermost:
        _untrapped = old
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if outermost:
            _untrapped = None


def _after_fork_in_child():
    # A forked worker (multiprocessing's fork pool) must die on the SIGTERM its pool
    # sends at the end, not raise Interrupted; and it owns no staged outputs.
    global _active, _untrapped, _held, _pending
    _active = None
    _held, _pending = 0, None
    if _untrapped is not None:
        for s, h in _untrapped.items():
            signal.signal(s, h)
        _untrapped = None


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def _signals_blocked():
    """Hold the trapped signals back (they are delivered after the block): masked in
    this thread, and deferred by the trap handler whichever thread the kernel chose."""
    global _held, _pending
    main = threading.current_thread() is threading.main_thread()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, TRAPPED_SIGNALS)
    if main:
        _held += 1
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)   # a masked one runs the handler
        if main:
            _held -= 1
            if not _held and _pending:
                signum, _pending = _pending, None
                raise Interrupted(signum)


def _real(path):
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _same_file(a, b):
    if _real(a) == _real(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:          # one of them does not exist (yet)
        return False


def check_output_path(path, flag="output"):
    """BadInput (one line) unless ``path`` can be an output file; returns its real path."""
    if path is None or str(path) == "":
        raise BadInput(f"{flag}: empty output path")
    path = os.fspath(path)
    real = _real(path)
    name = f"{flag} {path}"
    parent = os.path.dirname(real)
    try:
        pst = os.stat(parent)
    except FileNotFoundError:
        raise BadInput(f"{name}: directory {parent} does not exist") from None
    except NotADirectoryError:
        raise BadInput(f"{name}: a parent of it is not a directory") from None
    except OSError as e:
        raise BadInput(f"{name}: cannot use directory {parent}: {e.strerror}") from None
    if not stat.S_ISDIR(pst.st_mode):
        raise BadInput(f"{name}: {parent} is not a directory")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise BadInput(f"{name}: a parent of it is not a directory") from None
    except OSError as e:
        raise BadInput(f"{name}: cannot use it: {e.strerror}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise BadInput(f"{name}: is a directory")
        if not stat.S_ISREG(st.st_mode):
            kind = ("a character device" if stat.S_ISCHR(st.st_mode) else
                    "a block device" if stat.S_ISBLK(st.st_mode) else
                    "a FIFO" if stat.S_ISFIFO(st.st_mode) else
                    "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise BadInput(f"{name}: is {kind}; linepack writes outputs only to regular files "
                           "(temp file + rename)")
    # The true test of a writable directory (root passes os.access everywhere, and
    # /proc, read-only mounts and full quotas only fail at create time).
    # Signals are held back so a SIGINT/SIGTERM at this moment cannot leave the probe.
    with _signals_blocked():
        try:
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".linepack-probe.")
        except OSError as e:
            raise BadInput(f"{name}: cannot create files in {parent}: {e.strerror}") from None
        os.close(fd)
        os.unlink(probe)
    return real


class OutputSet:
    """The outputs of one command: checked up front, written all or none.

    ``inputs``: paths the command reads (None skipped; an output may not be one).
    ``outputs``: {flag: path} (None skipped), checked at once. See the module doc.
    """

    def __init__(self, inputs=(), outputs=None):
        self.inputs = [os.fspath(p) for p in inputs if p is not None and str(p) not in ("", "-")]
        self.outputs = {}            # real path -> flag
        self._staged = {}            # real path -> temp path
        self._trap = None
        for flag, path in (outputs or {}).items():
            self.add(path, flag)

    def add(self, path, flag="output"):
        """Declare one more output (None: nothing); returns its real path."""
        if path is None:
            return None
        real = check_output_path(path, flag)
        for inp in self.inputs:
            if _same_file(path, inp):
                raise BadInput(f"{flag} {path}: is also an input of this command ({inp}); "
                               "linepack never overwrites its input")
        for other, other_flag in self.outputs.items():
            if _same_file(real, other):
                raise BadInput(f"{flag} {path}: is also the output of {other_flag}")
        self.outputs[real] = flag
        return real

    def owns(self, path):
        return _real(path) in self.outputs

    # -- staging (used by atomic_output) --------------------------------------
    def _stage(self, path):
        real = _real(path)
        with _signals_blocked():     # the temp file is always on the list to delete
            old = self._staged.pop(real, None)
            if old:
                _unlink(old)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(real),
                                       prefix="." + os.path.basename(real) + ".")
            self._staged[real] = tmp
        return fd, tmp

    def _unstage(self, path):
        with _signals_blocked():
            tmp = self._staged.pop(_real(path), None)
            if tmp:
                _unlink(tmp)

    def commit(self):
        """Rename every staged temp file into place (signals held back meanwhile)."""
        with _signals_blocked():
            items = sorted(self._staged.items())
            try:
                for real, tmp in items:
                    os.replace(tmp, real)
                    del self._staged[real]
            except OSError as e:
                self.discard()
                raise BadInput(f"cannot rename {tmp} to {real}: {e.strerror}") from None

    def discard(self):
        """Delete every staged temp file; no declared output is touched."""
        with _signals_blocked():
            for tmp in self._staged.values():
                _unlink(tmp)
            self._staged.clear()

    def __enter__(self):
        global _active
        if _active is not None and _active is not self:
            raise RuntimeError("an OutputSet is already active")
        _active = self
        self._trap = trap_signals()
        self._trap.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        global _active
        try:
            if exc_type is None:
                self.commit()
            else:
                self.discard()
        finally:
            _active = None
            trap, self._trap = self._trap, None
            trap.__exit__(None, None, None)
        return False


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def active_outputs():
    """The OutputSet of the running command, or None."""
    return _active


@contextlib.contextmanager
def atomic_output(path, mode=0o644):
    """Open a temp file beside ``path`` for binary writing. Declared in the active
    OutputSet: the temp file waits for the set's commit. Otherwise: renamed into
    place when the block succeeds. Deleted on failure either way."""
    path = os.fspath(path)
    outs = _active
    if outs is not None and outs.owns(path):
        fd, tmp = outs._stage(path)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
            os.chmod(tmp, mode)
        except BaseException:
            outs._unstage(path)
            raise
        return
    d = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        with _signals_blocked():
            fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".")
        with os.fdopen(fd, "wb") as f:
            yield f
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if tmp:
            with _signals_blocked():
                _unlink(tmp)
        raise


def write_atomic(path, data, mode=0o644):
    """Write bytes (or str, as UTF-8) to path via a temp file + rename."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    with atomic_output(path, mode) as f:
        f.write(data)


def load_toml(path):
    """A TOML file as a dict; one clear BadInput line when missing or malformed."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ImportError:
            raise BadInput("reading TOML needs Python >= 3.11 or the 'tomli' package") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"{path}: bad TOML: {e}") from None


_hashes = {}


def file_hash(path):
    """sha256 of a file's bytes, remembered per (path, size, mtime) in this process."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    h = _hashes.get(key)
    if h is None:
        d = sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                d.update(chunk)
        h = _hashes[key] = d.hexdigest()
    return h
