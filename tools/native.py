"""Build a small C core with the system compiler at first use, cached per source.

linepack's native cores (the what-if replay, the DWARF core, the disassembly
loop) are plain C files shipped with the package. Each is compiled once into a
shared object under the cache (``<cache>/<kind>/<name>-<hash>.so``, the hash
over the sources and the compiler's path) and loaded with ctypes; a new source
version builds a new object. The build goes to a temp file renamed into place,
so concurrent first uses never load a half-written object.
"""

import ctypes
import os
import shutil
import tempfile

from .errors import ExternalToolError
from .io import sha256


def compiler():
    """The C compiler to use ($CC, else gcc, else cc), or None."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(name, sources, kind, what, headers=()):
    """The loaded shared object of ``sources`` (paths), built once.

    ``name``: the object's file name stem; ``kind``: its cache folder;
    ``what``: for messages ("the DWARF core"); ``headers``: files the sources
    include (part of the cache key, not compiled). Raises ExternalToolError
    (one line) when there is no compiler or the build fails."""
    src = b""
    for path in list(sources) + list(headers):
        with open(path, "rb") as f:
            src += f.read()
    cc = compiler()
    if not cc:
        raise ExternalToolError(f"{what} needs a C compiler (install gcc)")
    from .targets import cache_dir
    d = os.path.join(cache_dir(), kind)
    so = os.path.join(d, f"{name}-{sha256(src + cc.encode()).hexdigest()[:16]}.so")
    if not os.path.exists(so):
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{name}-", suffix=".so", dir=d)
        os.close(fd)
        try:
            import subprocess           # here: not every command builds a core
            try:
                p = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, *sources],
                                   capture_output=True, text=True)
            except OSError as e:        # no such compiler: the callers fall back to Python
                raise ExternalToolError(f"cannot build {what} with {cc}: {e.strerror}") from None
            if p.returncode != 0:
                err = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
                raise ExternalToolError(f"cannot build {what} with {cc}: {err}")
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(so)


def optional_core(name, sources, kind, what, declare):
    """``build`` for a core with a pure-Python fallback: the loaded object with
    ``declare(lib)`` applied (its argtypes), or None when there is no compiler or
    the build fails (the caller then computes the same results in Python)."""
    if not compiler():
        return None
    try:
        lib = build(name, sources, kind, what)
    except ExternalToolError:
        return None
    declare(lib)
    return lib


def _libc():
    """The C library's handle, or None where ctypes cannot load it."""
    global _LIBC
    if _LIBC is False:
        try:
            _LIBC = ctypes.CDLL(None)
        except OSError:
            _LIBC = None
    return _LIBC


_LIBC = False


def tune_malloc():
    """Have glibc hand every big freed block back to the system at once.

    glibc raises its mmap threshold (up to 32 MiB) each time a big block is
    freed, after which numpy temporaries of a few MiB come from the heap and
    stay resident as fragments: relayout and verify of a kernel peaked ~200 MiB
    higher that way. A fixed 1 MiB threshold hands every big array back on free."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:             # not glibc: nothing to tune
        mallopt(-3, 1 << 20)            # M_MMAP_THRESHOLD (fixed: no dynamic raise)
        mallopt(-1, 1 << 20)            # M_TRIM_THRESHOLD


def release_free_memory():
    """Hand the C heap's free pages back to the system (glibc ``malloc_trim``).

    Freed numpy arrays below malloc's mmap threshold (which glibc raises after
    large frees) stay in the heap, counted in the resident set; a long command
    calls this after dropping big tables so the next phase's peak does not sit
    on top of them. A no-op where the C library has no malloc_trim."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
