"""The C loop around Capstone for bulk disassembly (decode.c), built with the
system C compiler at first use and cached per source version (as the DWARF
line core is). Without a C compiler ``library()`` returns None and callers
keep the Python loop: the results are the same, only slower."""

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
                              I64, I64, I64]
    lib.lp_decode.restype = ctypes.c_int
    _lib = lib
    return lib


def _p(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def decode_ranges(lib, handle, code, starts, sizes, first_index, stuck):
    """Decode ranges (``starts``/``sizes``; their bytes end to end in ``code``).

    ``stuck(k, pos, rest)``: called where Capstone stops inside range k at
    offset pos (``rest``: the range's remaining bytes); returns the length of
    an instruction it decoded there (appended as a row: address, length, its
    bytes) or 0 (skip one byte). Returns (addr, size, func, raw)."""
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
                           first_index, _OFF["address"], _OFF["size"], _OFF["bytes"])
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
