"""The C loop around Capstone for bulk disassembly (decode.c), built with the
system C compiler at first use and cached per source version (as the DWARF
line core is). Without a C compiler ``library()`` returns None and callers
keep the Python loop: the results are the same, only slower.

Capstone formats each instruction's text, about half of its time, and the rows
here need none of it: where Capstone 5's handle layout is confirmed (the printer
field moves when the syntax option changes it) and a first decode gives the same
rows both ways, the loop runs with a no-op printer (``quiet_printer_offset``).
``LINEPACK_DECODE_PLAIN=1`` keeps Capstone's printer."""

import ctypes
import os

import numpy as np

import capstone
from capstone import _cs

from .. import native
from ..errors import ExternalToolError

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode.c")
_lib = False            # False: not tried yet; None: no compiler or no build
DONE, STUCK, FULL, NOMEM = 0, 1, 2, 3
_OFF = {n: getattr(capstone._cs_insn, n).offset for n, _ in capstone._cs_insn._fields_}
_quiet = None           # the printer field's offset once checked; -1: Capstone's printer
_PRINTER_FIELD = 8      # cs_priv.h (5.x): struct cs_struct { cs_arch; cs_mode; Printer_t printer; ...
_PROBE_BYTES = 1 << 16  # the first decode's bytes decoded both ways


def library():
    """The loaded core, or None when it cannot be built here."""
    global _lib
    if _lib is not False:
        return _lib
    _lib = None
    if not native.compiler():
        return None
    try:
        lib = native.build("decode", [_SRC], "decode", "the disassembly core")
    except ExternalToolError:
        return None
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.lp_decode.argtypes = [P, P, P, ctypes.c_size_t, P, P, P, P, I64, P, P, P, P, P, I64, I64,
                              I64, I64, I64, I64]
    lib.lp_decode.restype = ctypes.c_int
    _lib = lib
    return lib


def _p(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _printer_field(handle):
    """The offset of the handle's printer pointer, or None where this Capstone is
    not laid out as 5.x is: the field must hold a pointer that the syntax option
    changes (AT&T) and puts back (Intel)."""
    if not capstone.__version__.startswith("5.") or not handle:
        return None
    try:
        if ctypes.c_int.from_address(handle).value != capstone.CS_ARCH_X86:
            return None
        field = ctypes.c_void_p.from_address(handle + _PRINTER_FIELD)
        intel = field.value
        if _cs.cs_option(handle, capstone.CS_OPT_SYNTAX, capstone.CS_OPT_SYNTAX_ATT):
            return None
        att = field.value
        if _cs.cs_option(handle, capstone.CS_OPT_SYNTAX, capstone.CS_OPT_SYNTAX_INTEL):
            return None
        return _PRINTER_FIELD if intel and att and att != intel and field.value == intel \
            else None
    except (ValueError, TypeError, AttributeError, capstone.CsError):
        return None


def quiet_printer_offset(lib, handle, code):
    """The printer offset to pass to lp_decode: confirmed once per Capstone build, on
    the first decode of at least 4 KB (its first 64 KB decoded with and without the
    printer: the same rows, or Capstone's printer stays); -1: keep the printer. The
    verdict is kept in the cache (_verdict_path: keyed by the Capstone library and this
    core), so that later commands skip the double decode (7 ms of each process that
    decodes a program)."""
    global _quiet
    if _quiet is not None:
        return _quiet
    if os.environ.get("LINEPACK_DECODE_PLAIN") or len(code) < 4096:
        return -1
    off = _printer_field(handle)
    if off is None:
        _quiet = -1
        return _quiet
    path = _verdict_path(lib, off)
    got = _read_verdict(path)
    if got is not None:
        _quiet = got
        return _quiet
    sample = bytes(code[:_PROBE_BYTES])
    args = (lib, handle, sample, [0x1000], [len(sample)], 0, lambda k, pos, rest: 0)
    same = all(np.array_equal(a, b) for a, b in zip(_decode(*args, -1), _decode(*args, off)))
    _quiet = off if same else -1
    _write_verdict(path, _quiet)
    return _quiet


def _verdict_path(lib, off):
    """Where the quiet-printer verdict of this Capstone library (its path, size and
    mtime, version) with this core (its object's path: per source hash) and printer
    offset is kept; None when the library cannot be stat'ed."""
    try:
        st = os.stat(_cs._name)
    except (OSError, AttributeError, TypeError):
        return None
    from ..io import sha256
    from ..targets import cache_dir
    key = f"{capstone.__version__}|{os.path.realpath(_cs._name)}|{st.st_size}|" \
          f"{st.st_mtime_ns}|{getattr(lib, '_name', '')}|{off}"
    return os.path.join(cache_dir(), "decode",
                        f"quiet-{sha256(key.encode()).hexdigest()[:16]}.verdict")


def _read_verdict(path):
    if path is None:
        return None
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _write_verdict(path, value):
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{value}\n")
        os.replace(tmp, path)
    except OSError:
        pass                    # no cache: the next process checks again


def decode_ranges(lib, handle, code, starts, sizes, first_index, stuck):
    """Decode ranges (``starts``/``sizes``; their bytes end to end in ``code``).

    ``stuck(k, pos, rest)``: called where Capstone stops inside range k at
    offset pos (``rest``: the range's remaining bytes); returns the length of
    an instruction it decoded there (appended as a row: address, length, its
    bytes) or 0 (skip one byte). Returns (addr, size, func, raw)."""
    return _decode(lib, handle, code, starts, sizes, first_index, stuck,
                   quiet_printer_offset(lib, handle, code))


def _decode(lib, handle, code, starts, sizes, first_index, stuck, printer_off):
    st = np.ascontiguousarray(starts, np.uint64)
    ln = np.ascontiguousarray(sizes, np.int64)
    off = np.ascontiguousarray(np.concatenate([[0], np.cumsum(ln)[:-1]]), np.int64)
    buf = np.frombuffer(code, np.uint8)
    cap = max(1024, int(ln.sum()) // 3)
    addr = np.zeros(cap, np.uint64)
    size = np.zeros(cap, np.uint8)
    func = np.zeros(cap, np.int32)
    raw = np.zeros((cap, 16), np.uint8)
    state = np.zeros(3, np.int64)
    iter_p = ctypes.cast(_cs.cs_disasm_iter, ctypes.c_void_p).value
    malloc_p = ctypes.cast(_cs.cs_malloc, ctypes.c_void_p).value
    free_p = ctypes.cast(_cs.cs_free, ctypes.c_void_p).value
    while True:
        rc = lib.lp_decode(iter_p, malloc_p, free_p, handle, _p(buf), _p(off), _p(st), _p(ln),
                           len(st), _p(state), _p(addr), _p(size), _p(func), _p(raw), cap,
                           first_index, _OFF["address"], _OFF["size"], _OFF["bytes"],
                           printer_off)
        if rc == DONE:
            break
        if rc == NOMEM:
            raise MemoryError("Capstone could not allocate an instruction (cs_malloc)")
        n = int(state[2])
        if rc == FULL or n + 1 > cap:
            cap *= 2
            addr, size, func = (np.concatenate([a, np.zeros(cap - len(a), a.dtype)])
                                for a in (addr, size, func))
            raw = np.concatenate([raw, np.zeros((cap - len(raw), 16), np.uint8)])
            continue
        k, pos = int(state[0]), int(state[1])
        o = int(off[k]) + pos
        rest = code[o:o + int(ln[k]) - pos]
        known = stuck(k, pos, rest)
        if known:
            addr[n], size[n], func[n] = int(st[k]) + pos, known, first_index + k
            raw[n, :known] = np.frombuffer(rest[:known], np.uint8)
            state[2] = n + 1
            pos += known
        else:
            pos += 1
        if pos >= int(ln[k]):
            k, pos = k + 1, 0
        state[0], state[1] = k, pos
    n = int(state[2])
    # trimmed in place (the allocator shrinks the block) rather than copied
    for a in (addr, size, func, raw):
        a.resize((n,) + a.shape[1:], refcheck=False)
    return addr, size, func, raw
