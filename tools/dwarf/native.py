"""The DWARF C core: line programs (lines.c) and DIEs and lists (info.c), built
with the system C compiler at first use into one shared object, cached per
source version, like the what-if replay core."""

import ctypes
import os

import numpy as np

from .. import native

_HERE = os.path.dirname(os.path.abspath(__file__))
_SRCS = [os.path.join(_HERE, n) for n in ("lines.c", "info.c", "fields.c")]
_HEADERS = [os.path.join(_HERE, "read.h")]
_lib = None


def library():
    global _lib
    if _lib is not None:
        return _lib
    lib = native.build("dwarf", _SRCS, "dwarf", "rewriting DWARF (the DWARF core)",
                       headers=_HEADERS)
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.lp_relines.argtypes = [P, I64, P, P, P, P, P, I64, ctypes.c_int, P, I64, P, P, I64, P]
    lib.lp_relines.restype = I64
    lib.lp_rows.argtypes = [P, I64, ctypes.c_int, P, P, P, P, P, P, I64]
    lib.lp_rows.restype = I64
    lib.lp_dies.argtypes = [P, I64, I64, I64, ctypes.c_int, ctypes.c_int, ctypes.c_int, P, I64, I64,
                            P, ctypes.c_int, P, P, P, P, P, P, P, I64, I64, P]
    lib.lp_dies.restype = I64
    lib.lp_seg_ranges.argtypes = [P, P, P, P, P, I64, I64, P, P, ctypes.c_int, P, P, P, P, I64]
    lib.lp_seg_ranges.restype = I64
    lib.lp_encode_ranges.argtypes = [ctypes.c_int, I64, P, P, P, I64, P, P, I64]
    lib.lp_encode_ranges.restype = I64
    lib.lp_relist.argtypes = [P, P, P, P, P, I64, P, I64, P, P, I64, P, P, P, P, P, P, P,
                              P, P, P, P, P, P, P, P, P]
    lib.lp_relist.restype = I64
    lib.lp_read_lists.argtypes = [P, I64, ctypes.c_int, ctypes.c_int, I64, P, P, P, P, P, I64]
    lib.lp_read_lists.restype = I64
    lib.lp_top_dies.argtypes = [P, I64, I64, P, P, P, P, P, P, P, I64, P, ctypes.c_int,
                                P, P, P, P, P, P, P, P]
    lib.lp_top_dies.restype = I64
    lib.lp_seg_ranges_grouped.argtypes = [P, P, P, P, P, I64, P, P, I64, P, P, P, P, I64]
    lib.lp_seg_ranges_grouped.restype = I64
    lib.lp_abbrev_entry.argtypes = [P, I64, I64, ctypes.c_uint64, P, P, P, P, P, P, I64]
    lib.lp_abbrev_entry.restype = I64
    lib.lp_abbrev_table.argtypes = [P, I64, I64, I64, P, P, P, P, I64]
    lib.lp_abbrev_table.restype = I64
    _lib = lib
    return lib


def _p(a):
    return a.ctypes.data        # an int: ctypes passes it as the c_void_p argument


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
    # a view, not a copy: the buffer's untouched tail was never faulted in
    return out[:n], uo[:k], un[:k], dict(zip(
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
        # views, not copies: the arrays' untouched tails were never faulted in
        for k in ("addr", "unit", "file", "line", "column", "flags"):
            setattr(self, k, getattr(self, k)[:n])

    def __len__(self):
        return len(self.addr)


def _u8(b):
    """A uint8 view (no copy) of bytes or an array, for passing to C."""
    return b if isinstance(b, np.ndarray) and b.dtype == np.uint8 and b.flags.c_contiguous \
        else np.frombuffer(b, np.uint8) if isinstance(b, (bytes, bytearray, memoryview)) \
        else np.ascontiguousarray(b, dtype=np.uint8)


class Dies:
    """Every DIE of a unit: off, code, tag (int64, DIE order) and, per requested
    attribute (column j), form (0 absent), pos (-1 absent), end, val (the
    value's first <= 8 bytes, little-endian)."""

    __slots__ = ("off", "code", "tag", "form", "pos", "end", "val")

    def has(self, j):
        return self.pos[:, j] >= 0

    def size(self, j):
        return self.end[:, j] - self.pos[:, j]


class DieError(ValueError):
    """Malformed DWARF met by the DIE walk; ``kind``: the C core's error code."""

    def __init__(self, message, kind):
        super().__init__(message)
        self.kind = kind


UNKNOWN_CODE = -3
_DIE_ERRORS = {-1: "truncated DIE or attribute", -2: "unknown attribute form",
               -3: "unknown abbreviation code", -4: "unreadable abbreviation table"}


def dies(info, abbrev, un, want, limit=0):
    """Walk unit ``un`` (an encoding.Unit) of ``info`` with its abbreviations in
    ``abbrev``; ``want``: the attributes to report; ``limit``: at most that many
    DIEs (1: the unit DIE). Raises ValueError on
    malformed DWARF (one line naming the offset)."""
    lib = library()
    ib, ab = _u8(info), _u8(abbrev)
    w = np.array(want, np.uint64)
    nw = len(w)
    err = np.zeros(1, np.int64)
    cap = limit if limit > 0 else 0     # else a first pass counts (the arrays are the memory)
    while True:
        off, code, tag = (np.empty(max(cap, 1), np.int64) for _ in range(3))
        form = np.empty(max(cap * nw, 1), np.int32)
        pos, end = np.empty(max(cap * nw, 1), np.int64), np.empty(max(cap * nw, 1), np.int64)
        val = np.empty(max(cap * nw, 1), np.uint64)
        n = lib.lp_dies(_p(ib), len(ib), un.die, un.end, un.version, un.asz, un.osz,
                        _p(ab), len(ab), un.abbrev_off, _p(w), nw, _p(off), _p(code), _p(tag),
                        _p(form), _p(pos), _p(end), _p(val), cap, limit, _p(err))
        if n < 0:
            raise DieError(f".debug_info: {_DIE_ERRORS.get(n, 'malformed')} at offset "
                           f"{int(err[0]):#x} (unit at {un.off:#x})", int(n))
        if n <= cap:
            break
        cap = int(n)
    d = Dies()
    d.off, d.code, d.tag = off[:n], code[:n], tag[:n]
    d.form, d.pos = form[:n * nw].reshape(n, nw), pos[:n * nw].reshape(n, nw)
    d.end, d.val = end[:n * nw].reshape(n, nw), val[:n * nw].reshape(n, nw)
    return d


def top_dies(info, abbrev, units, want):
    """The first DIE of every unit (one Dies row per unit, in order); a unit
    whose first entry is unreadable or null has off -1 and no attributes."""
    lib = library()
    ib, ab = _u8(info), _u8(abbrev)
    w = np.array(want, np.uint64)
    nw, n = len(w), len(units)
    cols = {k: np.array([getattr(u, k) for u in units], np.int64)
            for k in ("die", "end", "version", "asz", "osz", "abbrev_off")}
    d = Dies()
    d.off, d.code, d.tag = (np.zeros(n, np.int64) for _ in range(3))
    d.form = np.zeros((n, nw), np.int32)
    d.pos, d.end = np.full((n, nw), -1, np.int64), np.zeros((n, nw), np.int64)
    d.val = np.zeros((n, nw), np.uint64)
    err = np.zeros(1, np.int64)
    r = lib.lp_top_dies(_p(ib), len(ib), n, *(_p(cols[k]) for k in
                                               ("die", "end", "version", "asz", "osz",
                                                "abbrev_off")),
                        _p(ab), len(ab), _p(w), nw, _p(d.off), _p(d.code), _p(d.tag), _p(d.form),
                        _p(d.pos), _p(d.end), _p(d.val), _p(err))
    if r < 0:
        raise DieError(f".debug_info: {_DIE_ERRORS.get(r, 'malformed')} at offset "
                       f"{int(err[0]):#x}", int(r))
    return d


def seg_ranges(seg, lo, hi, merge=True):
    """Old ranges [lo[i], hi[i]) through segments ``seg`` (old, end, new,
    new_end, collapse arrays): (count per item, linear flag per item, flat new
    lo, flat new hi). ``merge``: each item's ranges sorted and merged."""
    lib = library()
    so, se, sn, sne, sc = seg
    lo = np.ascontiguousarray(lo, np.uint64)
    hi = np.ascontiguousarray(hi, np.uint64)
    n = len(lo)
    count = np.zeros(n, np.int64)
    linear = np.zeros(n, np.uint8)
    cap = 2 * n + 16
    while True:
        olo, ohi = np.empty(cap, np.uint64), np.empty(cap, np.uint64)
        t = lib.lp_seg_ranges(_p(so), _p(se), _p(sn), _p(sne), _p(sc), len(so), n, _p(lo), _p(hi),
                              int(merge), _p(count), _p(linear), _p(olo), _p(ohi), cap)
        if t < 0:
            raise MemoryError("DWARF core: out of memory")
        if t <= cap:
            return count, linear.astype(bool), olo[:t], ohi[:t]
        cap = int(t)


def merged_groups(seg, lo, hi, sizes):
    """image.intervals.merge_ranges of each group's translated ranges: groups of
    ``sizes[g]`` consecutive old ranges (lo, hi) -> list of [(lo, hi)] per group."""
    lib = library()
    so, se, sn, sne, sc = seg
    lo = np.ascontiguousarray(lo, np.uint64)
    hi = np.ascontiguousarray(hi, np.uint64)
    first = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))]).astype(np.int64)
    ng = len(first) - 1
    count = np.zeros(max(ng, 1), np.int64)
    cap = 2 * len(lo) + 16
    while True:
        olo, ohi = np.empty(cap, np.uint64), np.empty(cap, np.uint64)
        t = lib.lp_seg_ranges_grouped(_p(so), _p(se), _p(sn), _p(sne), _p(sc), len(so), _p(lo),
                                      _p(hi), ng, _p(first), _p(count), _p(olo), _p(ohi), cap)
        if t < 0:
            raise MemoryError("DWARF core: out of memory")
        if t <= cap:
            break
        cap = int(t)
    olo, ohi = olo[:t].tolist(), ohi[:t].tolist()
    out, k = [], 0
    for c in count[:ng].tolist():
        out.append(list(zip(olo[k:k + c], ohi[k:k + c])))
        k += c
    return out


def encode_ranges(v5, count, lo, hi, base):
    """Range lists (one per item, count[i] ranges from the flat lo/hi) encoded
    one after the other: (bytes, offsets = base + where each starts)."""
    lib = library()
    count = np.ascontiguousarray(count, np.int64)
    lo = np.ascontiguousarray(lo, np.uint64)
    hi = np.ascontiguousarray(hi, np.uint64)
    offsets = np.zeros(len(count), np.int64)
    cap = 32 * len(count) + 18 * len(lo) + 64
    while True:
        out = np.empty(cap, np.uint8)
        t = lib.lp_encode_ranges(int(bool(v5)), len(count), _p(count), _p(lo), _p(hi), int(base),
                                 _p(offsets), _p(out), cap)
        if t < 0:
            raise MemoryError("DWARF core: out of memory")
        if t <= cap:
            return out[:t].tobytes(), offsets
        cap = int(t)


def relist(seg, info, sections, items, areas):
    """Re-encode range/location lists (rewrite.rebase_lists): ``sections`` the
    six list sections (original rnglists, ranges, loclists, loc; patched
    loclists, loc; None when absent), ``items`` a dict of arrays p, v, base, v5,
    is_loc, vp, asz; ``areas`` four (original length, tail length, exists).
    Returns (noff, voff, status, [bytes appended per area])."""
    lib = library()
    so, se, sn, sne, sc = seg
    ib = _u8(info)
    secs = [None if s is None else _u8(s) for s in sections]
    ptrs = (ctypes.c_void_p * 6)(*[None if s is None else s.ctypes.data for s in secs])
    lens = np.array([0 if s is None else len(s) for s in secs], np.int64)
    n = len(items["p"])
    a = {k: np.ascontiguousarray(items[k], t) for k, t in
         (("p", np.int64), ("v", np.int64), ("base", np.uint64), ("v5", np.uint8),
          ("is_loc", np.uint8), ("vp", np.int64), ("asz", np.uint8))}
    orig_len = np.array([x[0] for x in areas], np.int64)
    tail_len = np.array([x[1] for x in areas], np.int64)
    exists = np.array([bool(x[2]) for x in areas], np.uint8)
    noff, voff = np.zeros(n, np.int64), np.zeros(n, np.int64)
    status = np.zeros(n, np.uint8)
    caps = np.full(4, 1 << 16, np.int64)
    out_len = np.zeros(4, np.int64)
    while True:
        outs = [np.empty(int(c), np.uint8) for c in caps]
        optrs = (ctypes.c_void_p * 4)(*[o.ctypes.data for o in outs])
        rc = lib.lp_relist(_p(so), _p(se), _p(sn), _p(sne), _p(sc), len(so), _p(ib), len(ib),
                           ptrs, _p(lens), n, _p(a["p"]), _p(a["v"]), _p(a["base"]), _p(a["v5"]),
                           _p(a["is_loc"]), _p(a["vp"]), _p(a["asz"]), _p(orig_len),
                           _p(tail_len), _p(exists), _p(noff), _p(voff), _p(status), optrs,
                           _p(caps), _p(out_len))
        if rc < 0:
            raise MemoryError("DWARF core: out of memory")
        if (out_len <= caps).all():
            return noff, voff, status, [outs[k][:out_len[k]].tobytes() for k in range(4)]
        caps = np.maximum(caps, out_len)


def read_lists(section, v5, asz, off, base):
    """DW_AT_ranges lists at ``off`` (bases ``base``) of a rnglists (v5) or
    ranges section: (count per item, -1 unreadable; flat lo; flat hi)."""
    lib = library()
    sb = _u8(section) if section is not None else np.zeros(0, np.uint8)
    off = np.ascontiguousarray(off, np.int64)
    base = np.ascontiguousarray(base, np.uint64)
    n = len(off)
    count = np.zeros(n, np.int64)
    cap = 4 * n + 16
    while True:
        lo, hi = np.empty(cap, np.uint64), np.empty(cap, np.uint64)
        t = lib.lp_read_lists(_p(sb), len(sb), int(bool(v5)), int(asz), n, _p(off), _p(base),
                              _p(count), _p(lo), _p(hi), cap)
        if t <= cap:
            return count, lo[:t], hi[:t]
        cap = int(t)


class AbbrevTable:
    """One abbreviation table read on demand: ``table[code]`` is (tag, children,
    [(attr, form, implicit_const or None)]) like encoding.parse_abbrevs' (the
    last entry of a code), from the C core; KeyError when absent."""

    def __init__(self, abbrev, off):
        self.ab, self.off, self._memo = _u8(abbrev), off, {}

    def __getitem__(self, code):
        hit = self._memo.get(code)
        if hit is not None:
            return hit
        lib = library()
        cap = 64
        while True:
            tag, children = np.zeros(1, np.uint64), np.zeros(1, np.int64)
            at, form = np.zeros(cap, np.uint64), np.zeros(cap, np.uint64)
            ic = np.zeros(cap, np.int64)
            has = np.zeros(cap, np.uint8)
            n = lib.lp_abbrev_entry(_p(self.ab), len(self.ab), self.off, code, _p(tag),
                                    _p(children), _p(at), _p(form), _p(ic), _p(has), cap)
            if n == -1:
                raise KeyError(code)
            if n < 0:
                raise ValueError(f".debug_abbrev: cannot read the table at offset {self.off:#x}")
            if n <= cap:
                break
            cap = int(n)
        specs = [(a, f, c if h else None) for a, f, c, h in
                 zip(at[:n].tolist(), form[:n].tolist(), ic[:n].tolist(), has[:n].tolist())]
        hit = self._memo[code] = (int(tag[0]), int(children[0]), specs)
        return hit


def abbrev_table_with(abbrev, off, mods, encode_entry):
    """encoding.encode_abbrevs of the table at ``off`` updated with ``mods``
    ({code: entry}); ``encode_entry(code, entry)`` gives a mod's bytes."""
    lib = library()
    ab = _u8(abbrev)
    codes = sorted(mods)
    parts = [encode_entry(c, mods[c]) for c in codes]
    mb = np.frombuffer(b"".join(parts) or b"\0", np.uint8)
    mo = np.concatenate([[0], np.cumsum([len(x) for x in parts], dtype=np.int64)]).astype(np.int64)
    mc = np.array(codes, np.uint64)
    cap = 4096
    while True:
        out = np.empty(cap, np.uint8)
        n = lib.lp_abbrev_table(_p(ab), len(ab), off, len(codes), _p(mc), _p(mb), _p(mo),
                                _p(out), cap)
        if n < 0:
            raise ValueError(f".debug_abbrev: cannot read the table at offset {off:#x}")
        if n <= cap:
            return out[:n].tobytes()
        cap = int(n)
