"""verify --against: does NEW's DWARF describe NEW's code as OLD's described OLD's?

Independent of the rewriter: it reads both images' DWARF and translates OLD's
addresses through the verifier's own address map (any object with
``old_start``/``old_end``/``new_start`` piece arrays; identity outside pieces;
a block-level map also gives ``new_end``, ``collapse`` and the ``appended`` jmps,
see _Pieces).

- line rows: a seeded sample of OLD's line-table rows inside functions (moved
  code first); each
  must have a row in NEW, in the same unit, at the translated address, with the
  same file, line and column (``debuginfo.line-row``);
- subprograms: in a seeded sample of units (and as many again among the units
  holding code a block-level layout split), every subprogram's code ranges in
  NEW equal its OLD ranges translated piece by piece (``debuginfo.subprogram-range``:
  a stale or missing range), and so do every inlined subroutine's and lexical
  block's (``debuginfo.scope-range``: the inline chain a symbolizer prints);
- units: every unit's NEW ranges lie inside its translated OLD ranges and cover
  every translated subprogram of the unit (``debuginfo.unit-range``).
NEW without DWARF while OLD has it is an info finding (``--strip-debug``); DWARF
that cannot be read (an unknown abbreviation or form, a DIE or list past its
section) is one ``debuginfo.unreadable`` error naming the offset.
"""

import bisect
import os
import random

import numpy as np

from ..dwarf import encoding as enc
from ..dwarf import native
from ..image.elf import SHT_NOBITS, ElfImage
from ..image.intervals import append_range, merge_ranges
from ..dwarf.fields import read_section
from ..dwarf.native import LineRows
from ..kernel.base import Finding
from .findings import add_findings

DW_TAG_subprogram, DW_TAG_inlined_subroutine, DW_TAG_lexical_block = 0x2E, 0x1D, 0x0B


class _Pieces:
    """The verifier's map as pieces old [old, end) -> new [new, new_end): linear
    from ``new`` unless collapsed (a re-encoded branch or removed jmp: all of it
    is its new range). A jmp the layout appended (code with no old address)
    belongs to the code it follows in NEW, as if that piece had grown by it."""

    def __init__(self, amap):
        o = np.asarray(amap.old_start, np.uint64)
        order = np.argsort(o, kind="stable")
        self.old = [int(x) for x in o[order]]
        self.end = [int(x) for x in np.asarray(amap.old_end, np.uint64)[order]]
        self.new = [int(x) for x in np.asarray(amap.new_start, np.uint64)[order]]
        ne = getattr(amap, "new_end", None)
        self.new_end = [int(x) for x in np.asarray(ne, np.uint64)[order]] if ne is not None \
            else [n + e - b for b, e, n in zip(self.old, self.end, self.new)]
        co = getattr(amap, "collapse", None)
        self.collapse = [bool(x) for x in np.asarray(co, bool)[order]] if co is not None \
            else [False] * len(self.old)
        lo, hi = getattr(amap, "appended", (np.zeros(0, np.uint64),) * 2)
        after = {e: i for i, e in enumerate(self.new_end) if e > self.new[i]}
        for a, b in zip(np.asarray(lo).tolist(), np.asarray(hi).tolist()):
            i = after.pop(a, None)
            if i is not None:
                self.new_end[i] = b
                after[b] = i

    def segments(self):
        """The pieces and the identity between them as the C core's segments
        (old, end, new, new_end, collapse arrays), or None when a piece is empty
        (ranges() stops at one: kept to the Python path)."""
        if getattr(self, "_segments", False) is not False:
            return self._segments
        o, e = np.array(self.old, np.uint64), np.array(self.end, np.uint64)
        if (e <= o).any():
            self._segments = None
            return None
        cap = np.uint64((1 << 64) - 1)
        # the identity before each piece (from the furthest end so far) and after the last
        reach = np.maximum.accumulate(np.concatenate([np.zeros(1, np.uint64), e]))
        so = np.concatenate([o, [cap]]).astype(np.uint64)
        gap = so > reach
        go, ge = reach[gap], so[gap]
        old = np.concatenate([o, go])
        order = np.argsort(old, kind="stable")
        self._segments = (old[order], np.concatenate([e, ge])[order],
                          np.concatenate([np.array(self.new, np.uint64), go])[order],
                          np.concatenate([np.array(self.new_end, np.uint64), ge])[order],
                          np.concatenate([np.array(self.collapse, np.uint8),
                                          np.zeros(len(go), np.uint8)])[order])
        return self._segments

    def resized(self):
        """Sorted old starts of the pieces whose new size differs or that collapse
        (block-level code: re-encoded branches, removed and appended jmps)."""
        return sorted(o for o, e, n, ne, c in zip(self.old, self.end, self.new, self.new_end,
                                                   self.collapse) if c or ne - n != e - o)

    def empty(self, addrs):
        """True where an old address lies in a piece with nothing in NEW (a removed jmp)."""
        a = np.asarray(addrs, np.uint64)
        if not self.old:
            return np.zeros(a.shape, bool)
        if getattr(self, "_empty_arrays", None) is None:       # asked once per slice of rows
            self._empty_arrays = (np.array(self.old, np.uint64), np.array(self.end, np.uint64),
                                  np.array(self.new_end, np.uint64) -
                                  np.array(self.new, np.uint64))
        o, e, size = self._empty_arrays
        i = np.searchsorted(o, a, side="right").astype(np.int64) - 1
        ic = np.maximum(i, 0)
        return (i >= 0) & (a < e[ic]) & (size[ic] == 0)

    def ranges(self, lo, hi):
        """Translated [lo, hi): identity outside pieces, contiguous runs merged."""
        out = []
        pos = lo
        k = bisect.bisect_right(self.end, lo)
        while pos < hi:
            if k < len(self.old) and self.old[k] <= pos:
                b = min(hi, self.end[k])
                if self.collapse[k]:
                    na = self.new[k]
                    nb = self.new_end[k] if b == self.end[k] else na
                else:
                    na = self.new[k] + pos - self.old[k]
                    nb = self.new_end[k] if b == self.end[k] else na + b - pos
                k += 1
            else:
                b = min(hi, self.old[k]) if k < len(self.old) else hi
                na, nb = pos, b
            if b <= pos:
                break
            pos = b
            append_range(out, na, nb)
        return out


def _inside(r, rs):
    i = bisect.bisect_right(rs, (r[0], float("inf"))) - 1
    return i >= 0 and rs[i][0] <= r[0] and r[1] <= rs[i][1]


def _function_code(image):
    """(sorted starts, running max of ends) of the image's functions."""
    from ..image.context import ImageContext
    ft = ImageContext.of(image).functions
    from ..image.intervals import reach_ranges
    return reach_ranges(ft.start, np.asarray(ft.start, np.uint64) + np.asarray(ft.size, np.uint64))


def _padding_only(r, rs, code):
    """Are the parts of range ``r`` outside the sorted ranges ``rs`` all free of
    function code? A unit range may start in the padding before an assembler
    function that has no ``__pfx_`` symbol: relayout moves that padding with its
    function, the verifier's map (functions only) leaves it where it was."""
    starts, max_end = code
    pos, parts = r[0], []
    for lo, hi in rs:
        if hi <= pos or lo >= r[1]:
            continue
        if lo > pos:
            parts.append((pos, lo))
        pos = max(pos, hi)
    if pos < r[1]:
        parts.append((pos, r[1]))
    for lo, hi in parts:
        k = int(np.searchsorted(starts, np.uint64(hi), side="left"))
        if k and int(max_end[k - 1]) > lo:        # a function starting before hi ends after lo
            return False
    return True


def _has(image, name):
    s = image.section(name) if hasattr(image, "section") else None
    return s is not None and bool(s.size)


def _sec(image, name):
    s = image.section(name) if hasattr(image, "section") else None
    if s is None or not s.size:
        return None
    return read_section(image, s)        # from the file, not through the mapping


def _mapped(image, name):
    """A section read in place through the image's file mapping (a read-only
    memoryview): only the pages the checks touch become resident (the unit
    headers, the first DIE of each unit, the sampled units), not the whole
    .debug_info of both images (2 x 251 MB on 7.3)."""
    s = image.section(name) if hasattr(image, "section") else None
    if s is None or not s.size:
        return None
    if type(image) is ElfImage and s.type != SHT_NOBITS:
        return memoryview(image.section_bytes(s))
    return _sec(image, name)


class _FileBytes:
    """A section's bytes read from its file on demand (os.pread, one small block
    cached), for walks that read a few bytes per unit (the unit headers):
    through the mapping each read would fault in 64 KB or more around it."""

    BLOCK = 256

    def __init__(self, path, offset, size):
        self.fd = os.open(path, os.O_RDONLY)
        self.offset, self.size = offset, size
        self._lo, self._blk = 0, b""

    def close(self):
        os.close(self.fd)

    def __len__(self):
        return self.size

    def _get(self, a, b):
        if a >= b:
            return b""
        if not (self._lo <= a and b <= self._lo + len(self._blk)):
            n = min(max(self.BLOCK, b - a), self.size - a)
            self._lo, self._blk = a, os.pread(self.fd, n, self.offset + a)
        return self._blk[a - self._lo:b - self._lo]

    def __getitem__(self, k):
        if isinstance(k, slice):
            a, b, step = k.indices(self.size)
            if step != 1:
                raise ValueError("a step")
            return self._get(a, b)
        if k < 0:
            k += self.size
        if not 0 <= k < self.size:
            raise IndexError("offset past the section")
        return self._get(k, k + 1)[0]


def _units_and_tops(image, info, abbrev, want, window=4096):
    """enc.units(info) and, of its compile and partial units, native.top_dies:
    (units, indices of those units, their first DIEs). For an image read from a
    file, each header and first DIE is read on its own (a window of the unit's
    first bytes; a DIE that does not fit is read in place): through the mapping,
    the first DIE of each of thousands of units would make most of .debug_info
    resident (+420 MB for OLD and NEW on 7.3)."""
    s = image.section(".debug_info") if hasattr(image, "section") else None
    if type(image) is not ElfImage or s is None or s.type == SHT_NOBITS:
        us = enc.units(info)
        cus = [i for i, un in enumerate(us) if un.unit_type in (1, 3)]
        return us, cus, native.top_dies(info, abbrev, [us[i] for i in cus], want)
    fb = _FileBytes(image.path, s.offset, s.size)
    try:
        us = enc.units(fb)
        cus = [i for i, un in enumerate(us) if un.unit_type in (1, 3)]
        sel = [us[i] for i in cus]
        n, nw = len(sel), len(want)
        d = native.Dies()
        d.off, d.code, d.tag = (np.zeros(n, np.int64) for _ in range(3))
        d.form = np.zeros((n, nw), np.int32)
        d.pos, d.end = np.full((n, nw), -1, np.int64), np.zeros((n, nw), np.int64)
        d.val = np.zeros((n, nw), np.uint64)
        redo = []
        try:
            for k, un in enumerate(sel):
                lo, hi = un.off, min(un.end, un.off + window, s.size)
                w = enc.Unit()
                for a in enc.Unit.__slots__:
                    setattr(w, a, getattr(un, a))
                w.die, w.end = un.die - lo, un.end - lo
                one = native.top_dies(np.frombuffer(fb[lo:hi], np.uint8), abbrev, [w], want)
                if one.off[0] < 0:      # cut by the window, or unreadable: read in place
                    redo.append(k)
                    continue
                has = one.pos[0] >= 0
                d.off[k], d.code[k], d.tag[k] = one.off[0] + lo, one.code[0], one.tag[0]
                d.form[k], d.val[k] = one.form[0], one.val[0]
                d.pos[k] = np.where(has, one.pos[0] + lo, -1)
                d.end[k] = np.where(has, one.end[0] + lo, one.end[0])
        except native.DieError:
            # malformed: read in place, so that the error names its offset as it did
            return us, cus, native.top_dies(info, abbrev, sel, want)
        if redo:
            got = native.top_dies(info, abbrev, [sel[k] for k in redo], want)
            for j, k in enumerate(redo):
                for a in ("off", "code", "tag", "form", "pos", "end", "val"):
                    getattr(d, a)[k] = getattr(got, a)[j]
        return us, cus, d
    finally:
        fb.close()


def _row_keys(rows, addrs):
    """One int64 per (unit, address, file, line, column)."""
    k = np.asarray(addrs, np.uint64).astype(np.int64)
    for col in (rows.unit, rows.file, rows.line, rows.column):
        k = k * np.int64(1000003) + col.astype(np.int64)
    return k


def check_debuginfo(old, new, amap, findings, counter, report, log=None, rows_sample=20000,
                    units_sample=24, seed=12):
    log = log or (lambda m: None)
    if not _has(old, ".debug_info"):
        return
    if not _has(new, ".debug_info"):
        findings.append(Finding("info", "debuginfo.stripped", None,
                                "OLD has DWARF, NEW has none (relayout --strip-debug)"))
        return
    problems = {"debuginfo.line-row": [], "debuginfo.subprogram-range": [],
                "debuginfo.unit-range": [], "debuginfo.scope-range": []}
    pieces = _Pieces(amap)
    rng = np.random.default_rng(seed)
    # in a function of its own, so that the row arrays are freed before step 2
    checked_rows = _check_line_rows(old, new, amap, pieces, rng, rows_sample, problems)
    report.extra["debuginfo_line_rows_checked"] = checked_rows
    try:
        _check_units(old, new, pieces, problems, report, units_sample, seed)
    except ValueError as e:     # malformed DWARF: the C core names the offset
        problems["debuginfo.unreadable"] = [(None, f"cannot read the DWARF: {e}")]
        for k in ("debuginfo_units_checked", "debuginfo_subprograms_checked",
                  "debuginfo_scopes_checked", "debuginfo_split_units_checked"):
            report.extra.setdefault(k, 0)
    for check, items in problems.items():
        add_findings(findings, "error", check, items, lambda it: it, counter)
    log(f"debug info: {checked_rows} line rows, {report.extra['debuginfo_units_checked']} units, "
        f"{report.extra['debuginfo_subprograms_checked']} subprograms, "
        f"{report.extra['debuginfo_scopes_checked']} inlined subroutines and lexical blocks "
        f"checked; {sum(len(v) for v in problems.values())} problems")


def _line_slices(sec, size=4 << 20):
    """(start, end, units before it) slices of a .debug_line, cut at unit
    boundaries about ``size`` bytes apart (the units as the C core walks them;
    whatever it would refuse stays in the last slice, where it refuses it)."""
    out, start, first, units, p, n = [], 0, 0, 0, 0, len(sec)
    while p + 4 <= n:
        ln, hdr = int.from_bytes(sec[p:p + 4], "little"), 4
        if ln == 0xFFFFFFFF:
            if p + 12 > n:
                break
            ln, hdr = int.from_bytes(sec[p + 4:p + 12], "little"), 12
        if ln < 2 or n - p - hdr < ln:
            break
        p += hdr + ln
        units += 1
        if p - start >= size:
            out.append((start, p, first))
            start, first = p, units
    if start < n or not out:
        out.append((start, n, first))
    return out


def _rows_by_slice(sec):
    """LineRows of each slice of ``sec`` (a uint8 array), yielded as (first row
    index, rows with section-wide unit indices), so that only one slice's rows
    are resident at a time; a slice the core cannot read is read whole, so that
    the error names the section offset."""
    row = 0
    for a, b, first in _line_slices(sec):
        try:
            rows = LineRows(sec[a:b])
        except ValueError:
            LineRows(sec)           # raises with the offset in the section
            raise
        if first:
            rows.unit = rows.unit + np.uint32(first)
        yield row, rows
        row += len(rows)


def _check_line_rows(old, new, amap, pieces, rng, rows_sample, problems):
    """Step 1: sampled line rows of moved code are at their translated address.
    The rows are parsed a slice of units at a time (25 bytes a row, millions of
    rows per image): OLD's once to find the moved rows and once to read the
    sampled ones, NEW's to find their keys."""
    lo_ = _sec(old, ".debug_line")
    if lo_ is None or not _has(new, ".debug_line"):
        return 0
    osec = np.frombuffer(lo_, np.uint8)
    # rows of function code (a row may start in the padding after a function:
    # no instruction is there, and the rewrite drops it)
    from ..image.context import ImageContext
    ft = ImageContext.of(old).functions        # built once per image object
    fs = np.asarray(ft.start, np.uint64)
    order = np.argsort(fs, kind="stable")
    fs, fe = fs[order], (fs + np.asarray(ft.size, np.uint64))[order]
    from ..image.intervals import containing
    moved, still = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for base, ro in _rows_by_slice(osec):
        in_code = containing(fs, fe, ro.addr) >= 0
        # a row at a removed jmp has no code left in NEW to describe
        live = np.nonzero(((ro.flags & 1) == 0) & in_code & ~pieces.empty(ro.addr))[0]
        mapped = np.asarray(_map(amap, ro.addr[live]), np.uint64)
        moved.append(live[mapped != ro.addr[live]] + base)
        still.append(live[mapped == ro.addr[live]] + base)
    moved, still = np.concatenate(moved), np.concatenate(still)
    pick = moved if len(moved) <= rows_sample else rng.choice(moved, rows_sample, replace=False)
    if len(pick) < rows_sample and len(still):
        extra = min(len(still), rows_sample - len(pick), max(rows_sample // 10, 1))
        pick = np.concatenate([pick, rng.choice(still, extra, replace=False)])
    del moved, still
    pick = np.sort(pick)
    sub = _Picked(len(pick))
    for base, ro in _rows_by_slice(osec):
        i, j = np.searchsorted(pick, [base, base + len(ro)])
        sub.take(slice(i, j), ro, pick[i:j] - base)
    del osec, lo_
    want = _row_keys(sub, np.asarray(_map(amap, sub.addr), np.uint64))
    # np.isin(want, have), without sorting NEW's millions of rows: keep the
    # rows whose key is wanted (binary search in the sorted sample), then isin
    ws = np.sort(want)
    hits = [np.zeros(0, np.int64)]
    for _, rn in _rows_by_slice(np.frombuffer(_sec(new, ".debug_line"), np.uint8)):
        if not len(ws):
            continue
        nl = np.nonzero((rn.flags & 1) == 0)[0]
        have = _row_keys(_Sub(rn, nl), rn.addr[nl])
        j = np.minimum(np.searchsorted(ws, have), len(ws) - 1)
        hits.append(have[ws[j] == have])
    ok = np.isin(want, np.concatenate(hits)) if len(ws) else np.zeros(0, bool)
    for i in np.nonzero(~ok)[0].tolist():
        problems["debuginfo.line-row"].append(
            (int(sub.addr[i]), f"line row {int(sub.file[i])}:{int(sub.line[i])}:"
             f"{int(sub.column[i])} of unit {int(sub.unit[i])} is not at the translated "
             f"address {int(_map(amap, np.array([sub.addr[i]], np.uint64))[0]):#x}"))
    return len(pick)


class _Picked:
    """The sampled rows' columns, filled a slice of rows at a time."""

    def __init__(self, n):
        self.addr = np.zeros(n, np.uint64)
        self.unit, self.file, self.line, self.column = (np.zeros(n, np.uint32) for _ in range(4))

    def take(self, where, rows, idx):
        for k in ("addr", "unit", "file", "line", "column"):
            getattr(self, k)[where] = getattr(rows, k)[idx]


def _check_units(old, new, pieces, problems, report, units_sample, seed):
    """Step 2: unit and (sampled) subprogram ranges cover the translated code."""
    oi, ni = _mapped(old, ".debug_info"), _mapped(new, ".debug_info")
    oa, na = _mapped(old, ".debug_abbrev"), _mapped(new, ".debug_abbrev")
    olists = (_mapped(old, ".debug_rnglists"), _mapped(old, ".debug_ranges"))
    nlists = (_mapped(new, ".debug_rnglists"), _mapped(new, ".debug_ranges"))
    ou, ocus, otop = _units_and_tops(old, oi, oa, _WANT)
    nu, ncus, ntop = _units_and_tops(new, ni, na, _WANT)
    if len(ou) != len(nu):
        problems["debuginfo.unit-range"].append(
            (None, f"OLD has {len(ou)} units, NEW {len(nu)}"))
    cus = [i for i in range(min(len(ou), len(nu))) if ou[i].unit_type in (1, 3)]
    if ocus != cus or ncus != cus:     # NEW's units differ in kind (or number): as before
        otop = native.top_dies(oi, oa, [ou[i] for i in cus], _WANT)
        ntop = native.top_dies(ni, na, [nu[i] for i in cus], _WANT)
    sample = set(random.Random(seed).sample(cus, min(units_sample, len(cus))))
    subprograms = scopes = 0
    units = {}
    resized = pieces.resized()
    split_units = []
    rows = np.arange(len(cus))
    obases = [_base(otop, r) for r in rows.tolist()]
    nbases = [_base(ntop, r) for r in rows.tolist()]
    orrs = _die_ranges(otop, rows, [ou[i] for i in cus], obases, olists)
    nrrs = _die_ranges(ntop, rows, [nu[i] for i in cus], nbases, nlists)
    wants = _translate(pieces, orrs)
    new_code = _function_code(new)
    ocode = [(s.addr, s.end) for s in old.sections if s.is_code and s.is_alloc and s.size]
    for row, i in enumerate(cus):
        obase, nbase, orr, nrr = obases[row], nbases[row], orrs[row], nrrs[row]
        if orr is None:
            continue
        want_cu = wants[row]
        have_cu = merge_ranges(nrr or [])
        units[i] = (obase, nbase, have_cu)
        for r in have_cu:
            if not _inside(r, want_cu) and not _padding_only(r, want_cu, new_code):
                problems["debuginfo.unit-range"].append(
                    (r[0], f"unit {i}: range [{r[0]:#x}, {r[1]:#x}) is not code of this unit "
                     "after translation (stale)"))
        if any(bisect.bisect_left(resized, lo) < bisect.bisect_left(resized, hi)
               for lo, hi in orr):
            split_units.append(i)
    # a block-level layout: as many units again among those holding split code
    sample |= set(random.Random(seed).sample(split_units, min(units_sample, len(split_units))))
    for i in sorted(sample & set(units)):
        a, b = ou[i], nu[i]
        obase, nbase, have_cu = units[i]
        # DIEs pair up in order (the rewrite keeps every DIE where it was)
        od, nd = native.dies(oi, oa, a, _WANT), native.dies(ni, na, b, _WANT)
        m = min(len(od.off), len(nd.off))
        rows = np.nonzero(np.isin(od.tag[:m], (DW_TAG_subprogram, DW_TAG_inlined_subroutine,
                                               DW_TAG_lexical_block)))[0]
        olds = _die_ranges(od, rows, [a] * len(rows), [obase] * len(rows), olists)
        news = _die_ranges(nd, rows, [b] * len(rows), [nbase] * len(rows), nlists)
        wants = _translate(pieces, olds)
        for r, so, nr, want in zip(rows.tolist(), olds, news, wants):
            if not so:
                continue
            otag, ooff = int(od.tag[r]), int(od.off[r])
            have = merge_ranges(nr or [])
            if otag != DW_TAG_subprogram:
                scopes += 1
                if want != have:
                    problems["debuginfo.scope-range"].append(
                        (so[0][0], f"{'inlined subroutine' if otag == DW_TAG_inlined_subroutine else 'lexical block'}"
                         f" at DIE {ooff:#x}: ranges {_fmt(have)} in NEW, its code is at "
                         f"{_fmt(want)}"))
                continue
            subprograms += 1
            if want != have:
                problems["debuginfo.subprogram-range"].append(
                    (so[0][0], f"subprogram at DIE {ooff:#x}: ranges {_fmt(have)} in NEW, "
                     f"its code is at {_fmt(want)}"))
            if not any(lo < e and s < hi for lo, hi in so for s, e in ocode):
                continue    # code the link discarded (low_pc 0, lld's and ld's tombstone)
            for r in want:
                if not _inside(r, have_cu):     # have_cu is sorted and disjoint
                    problems["debuginfo.unit-range"].append(
                        (r[0], f"unit {i}: does not cover its subprogram's new range "
                         f"[{r[0]:#x}, {r[1]:#x})"))
    report.extra["debuginfo_units_checked"] = len(cus)
    report.extra["debuginfo_subprograms_checked"] = subprograms
    report.extra["debuginfo_scopes_checked"] = scopes
    report.extra["debuginfo_split_units_checked"] = len(sample & set(split_units))


def _map(amap, addrs):
    """New addresses from the verifier's map (an array) or an AddressMap ((new, ok))."""
    r = amap.map(np.asarray(addrs, np.uint64))
    return np.asarray(r[0] if isinstance(r, tuple) else r, np.uint64)


class _Sub:
    """Rows ``idx`` of a LineRows, for key building."""

    def __init__(self, rows, idx):
        self.unit, self.file = rows.unit[idx], rows.file[idx]
        self.line, self.column = rows.line[idx], rows.column[idx]


_WANT = (enc.DW_AT_low_pc, enc.DW_AT_high_pc, enc.DW_AT_ranges)
_LO, _HI, _RG = range(3)


def _base(d, row):
    """A unit's base address: its unit DIE's low pc (address form), else 0."""
    if d.pos[row, _LO] >= 0 and d.form[row, _LO] == enc.DW_FORM_addr:
        return int(d.val[row, _LO])
    return 0


def _die_ranges(d, rows, units, bases, lists):
    """Code ranges of DIE rows ``rows`` of ``d`` (encoding.die_ranges, in bulk;
    row k read as DWARF of ``units[k]`` with base address ``bases[k]``): per row
    [(lo, hi)] from DW_AT_ranges or low/high pc, or None."""
    out = [None] * len(rows)
    if not len(rows):
        return out
    form, val, pos = d.form[rows], d.val[rows], d.pos[rows]
    has_r = pos[:, _RG] >= 0
    fr = form[:, _RG]
    v5 = np.array([u.version >= 5 for u in units], bool)
    asz = np.array([u.asz for u in units], np.int64)
    base = np.array(bases, np.uint64)
    rsel = has_r & ((fr == enc.DW_FORM_sec_offset) | (fr == enc.DW_FORM_data4) |
                    (fr == enc.DW_FORM_data8))
    for is5 in (True, False):
        sec = lists[0] if is5 else lists[1]
        if sec is None:
            continue
        for width in np.unique(asz[rsel & (v5 == is5)]).tolist():
            sel = np.nonzero(rsel & (v5 == is5) & (asz == width))[0]
            count, lo, hi = native.read_lists(sec, is5, width, val[sel, _RG].astype(np.int64),
                                              base[sel])
            if (count < 0).any():
                bad = int(val[sel[np.nonzero(count < 0)[0][0]], _RG])
                raise ValueError(f"{'.debug_rnglists' if is5 else '.debug_ranges'}: cannot "
                                 f"read the range list at {bad:#x}")
            lo, hi = lo.tolist(), hi.tolist()
            k = 0
            for j, c in zip(sel.tolist(), count.tolist()):
                out[j] = list(zip(lo[k:k + c], hi[k:k + c]))
                k += c
    lsel = np.nonzero(~has_r & (pos[:, _LO] >= 0) & (pos[:, _HI] >= 0) &
                      (form[:, _LO] == enc.DW_FORM_addr))[0]
    if len(lsel):
        lo = val[lsel, _LO]
        hi = np.where(form[lsel, _HI] == enc.DW_FORM_addr, val[lsel, _HI], lo + val[lsel, _HI])
        for j, a, b in zip(lsel.tolist(), lo.tolist(), hi.tolist()):
            out[j] = [(a, b)]
    return out


def _translate(pieces, range_lists):
    """merge_ranges(translated ranges) of each list of old ranges (None stays None),
    through the C core (pieces plus identity segments between them)."""
    seg = pieces.segments()
    if seg is None:
        return [None if rs is None else
                merge_ranges(x for lo, hi in rs for x in pieces.ranges(lo, hi)) for rs in range_lists]
    flat = [r for rs in range_lists if rs for r in rs]
    count, _, nlo, nhi = native.seg_ranges(seg, np.array([r[0] for r in flat], np.uint64),
                                           np.array([r[1] for r in flat], np.uint64), merge=True)
    first = np.concatenate([[0], np.cumsum(count)]).tolist()
    nlo, nhi = nlo.tolist(), nhi.tolist()
    out, k = [], 0
    for rs in range_lists:
        if rs is None:
            out.append(None)
            continue
        if len(rs) == 1:                        # merged by the core already
            out.append(list(zip(nlo[first[k]:first[k + 1]], nhi[first[k]:first[k + 1]])))
        else:
            out.append(merge_ranges(list(zip(nlo[first[k]:first[k + len(rs)]],
                                       nhi[first[k]:first[k + len(rs)]]))))
        k += len(rs)
    return out


def _fmt(rs):
    return ", ".join(f"[{lo:#x}, {hi:#x})" for lo, hi in rs[:4]) + (" ..." if len(rs) > 4 else "")
