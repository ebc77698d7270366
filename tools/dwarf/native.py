"""The C core for line programs (lines.c), built with the system C compiler at
first use and cached per source version, like the what-if replay core."""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

from ..errors import ExternalToolError

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lines.c")
_lib = None


def library():
    global _lib
    if _lib is not None:
        return _lib
    with open(_SRC, "rb") as f:
        src = f.read()
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise ExternalToolError("rewriting DWARF line tables needs a C compiler (install gcc)")
    from ..targets import cache_dir
    d = os.path.join(cache_dir(), "dwarf")
    so = os.path.join(d, f"lines-{hashlib.sha256(src + cc.encode()).hexdigest()[:16]}.so")
    if not os.path.exists(so):
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="lines-", suffix=".so", dir=d)
        os.close(fd)
        try:
            p = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", tmp, _SRC],
                               capture_output=True, text=True)
            if p.returncode != 0:
                err = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
                raise ExternalToolError(f"cannot build the DWARF line core with {cc}: {err}")
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(so)
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.lp_relines.argtypes = [P, I64, P, P, P, P, P, I64, ctypes.c_int, P, I64, P, P, I64, P]
    lib.lp_relines.restype = I64
    lib.lp_rows.argtypes = [P, I64, ctypes.c_int, P, P, P, P, P, P, I64]
    lib.lp_rows.restype = I64
    _lib = lib
    return lib


def _p(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def relines(section, seg_old, seg_end, seg_new, seg_new_end=None, seg_collapse=None, addr_size=8):
    """Re-sequence every line program of ``section`` (uint8 array) for the
    segments (old start, old end, new start; new end, default new start + old
    size; collapse: every address inside maps to the new start). Returns (new
    bytes, unit old offsets, unit new offsets, stats)."""
    lib = library()
    src = np.ascontiguousarray(section, dtype=np.uint8)
    so = np.ascontiguousarray(seg_old, dtype=np.uint64)
    se = np.ascontiguousarray(seg_end, dtype=np.uint64)
    sn = np.ascontiguousarray(seg_new, dtype=np.uint64)
    sne = np.ascontiguousarray(sn + (se - so) if seg_new_end is None else seg_new_end,
                               dtype=np.uint64)
    sc = np.ascontiguousarray(np.zeros(len(so), bool) if seg_collapse is None else seg_collapse,
                              dtype=np.uint8)
    cap = len(src) * 2 + (1 << 20)
    max_units = max(16, len(src) // 32)
    while True:
        out = np.zeros(cap, np.uint8)
        uo = np.zeros(max_units, np.int64)
        un = np.zeros(max_units, np.int64)
        stats = np.zeros(5, np.int64)
        n = lib.lp_relines(_p(src), len(src), _p(so), _p(se), _p(sn), _p(sne), _p(sc), len(so),
                           addr_size,
                           _p(out), cap, _p(uo), _p(un), max_units, _p(stats))
        if n < 0:
            raise ValueError(f".debug_line: cannot parse the unit at offset {-n - 1:#x}")
        if n <= cap and stats[0] <= max_units:
            break
        cap, max_units = max(cap, int(n)) + 1024, max(max_units, int(stats[0]))
    k = int(stats[0])
    return out[:n].copy(), uo[:k], un[:k], dict(zip(
        ("units", "sequences_in", "sequences_out", "rows_out", "rows_dropped"), stats.tolist()))


class LineRows:
    """Every row of a .debug_line as arrays: addr, unit (index in section
    order), file, line, column, flags (1 end_sequence, 2 is_stmt)."""

    def __init__(self, section, addr_size=8):
        lib = library()
        src = np.ascontiguousarray(section, dtype=np.uint8)
        cap = max(1024, len(src) // 2)
        while True:
            self.addr = np.zeros(cap, np.uint64)
            self.unit, self.file, self.line, self.column = (np.zeros(cap, np.uint32)
                                                            for _ in range(4))
            self.flags = np.zeros(cap, np.uint8)
            n = lib.lp_rows(_p(src), len(src), addr_size, _p(self.addr), _p(self.unit),
                            _p(self.file), _p(self.line), _p(self.column), _p(self.flags), cap)
            if n < 0:
                raise ValueError(f".debug_line: cannot parse the unit at offset {-n - 1:#x}")
            if n <= cap:
                break
            cap = int(n)
        for k in ("addr", "unit", "file", "line", "column", "flags"):
            setattr(self, k, getattr(self, k)[:n].copy())

    def __len__(self):
        return len(self.addr)
