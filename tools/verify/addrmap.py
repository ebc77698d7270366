"""The verifier's own old -> new address map, rebuilt from the two symbol tables.

Each function of OLD is found in NEW by its symtab index (duplicate static names
are no problem), never read from the rewriter's output. FunctionMap moves every
address with the function (or code label) that holds it; BlockAwareMap lets the
pieces of a ``.linepack.blockmap`` take precedence inside split functions.
"""

from bisect import bisect_right

import numpy as np

from ..image import blockmap as bm
from ..image.intervals import in_slices

KERNEL_MAP = 0xFFFFFFFF80000000      # x86-64 __START_KERNEL_map
_MASK64 = (1 << 64) - 1



class FunctionMap:
    """Old -> new address map from matched functions (piecewise, numpy).

    Code outside functions (assembly labels without a size, e.g.
    ``bad_get_user``) moves with the nearest code symbol at or before it, as
    found in both symbol tables (``label_old``/``label_new``, same code section).
    """

    def __init__(self, old_start, old_end, new_start, label_old=None, label_new=None,
                 label_end=None, points=None):
        # region boundary labels: their new symbol values (an alternative meaning)
        points = dict(points or {})
        self.point_old = np.array(sorted(points), dtype=np.uint64)
        self.point_new = np.array([points[k] for k in sorted(points)], dtype=np.uint64)
        order = np.argsort(old_start, kind="stable")
        self.old_start = old_start[order]
        self.old_end = old_end[order]
        self.new_start = new_start[order]
        if label_old is None:
            label_old = label_new = label_end = np.zeros(0, np.uint64)
        order = np.argsort(label_old, kind="stable")
        self.label_old = np.asarray(label_old, np.uint64)[order]
        self.label_new = np.asarray(label_new, np.uint64)[order]
        self.label_end = np.asarray(label_end, np.uint64)[order]
        self.fixed = np.zeros(0, np.uint64)     # addresses that stay (userspace code section ends)
        self._lists = None

    def map1(self, a):
        """map() of one address (an int): the same steps on lists, with bisect (the
        block check asks for one branch target at a time, where map()'s numpy calls
        cost 30-50 us each)."""
        if self._lists is None or self._lists[-1] is not self.fixed:
            self._lists = (self.old_start.tolist(), self.old_end.tolist(),
                           self.new_start.tolist(), self.label_old.tolist(),
                           self.label_new.tolist(), self.label_end.tolist(),
                           set(self.fixed.tolist()), self.fixed)
        o_start, o_end, n_start, l_old, l_new, l_end, fixed, _ = self._lists
        a = int(a)
        i = bisect_right(o_start, a) - 1
        ic = max(i, 0)
        inside = i >= 0 and a <= o_end[ic]
        out = (a + n_start[ic] - o_start[ic]) & _MASK64 if inside else a
        if l_old:
            j = bisect_right(l_old, a) - 1
            jc = max(j, 0)
            if not inside and j >= 0 and a < l_end[jc]:
                out = (a + l_new[jc] - l_old[jc]) & _MASK64
        if fixed and a in fixed and not (inside and a == o_start[ic]):
            out = a
        return out

    def map(self, addrs):
        """Mapped addresses; an address inside (or exactly at the end of) a function
        moves with it; else with the code label before it; anything else maps to itself."""
        return in_slices(self._map, addrs)

    def _map(self, a):
        i = np.searchsorted(self.old_start, a, side="right").astype(np.int64) - 1
        ic = np.maximum(i, 0)
        inside = (i >= 0) & (a <= self.old_end[ic])
        # an address equal to a function's end that is also the next function's start
        # was caught by searchsorted as that next function: correct.
        delta = self.new_start[ic].astype(np.int64) - self.old_start[ic].astype(np.int64)
        out = np.where(inside, (a.astype(np.int64) + delta).astype(np.uint64), a)
        if len(self.label_old):
            j = np.searchsorted(self.label_old, a, side="right").astype(np.int64) - 1
            jc = np.maximum(j, 0)
            lab = ~inside & (j >= 0) & (a < self.label_end[jc])
            ldelta = self.label_new[jc].astype(np.int64) - self.label_old[jc].astype(np.int64)
            out = np.where(lab, (a.astype(np.int64) + ldelta).astype(np.uint64), out)
        if len(self.fixed):
            # the end of a code section is the start of the next one (.text's end is
            # _fini in .fini when no padding is between): relayout leaves it in place;
            # unless a function piece starts there (.text's first function right after
            # .plt.sec): that one moves with its piece
            at_start = inside & (a == self.old_start[ic])
            out = np.where(np.isin(a, self.fixed) & ~at_start, a, out)
        return out

    def point(self, addrs):
        """(is a region label, the label's new address) for each old address."""
        a = np.asarray(addrs, dtype=np.uint64)
        if not len(self.point_old):
            return np.zeros(a.shape, bool), a
        k = np.searchsorted(self.point_old, a)
        kc = np.minimum(k, len(self.point_old) - 1)
        hit = (k < len(self.point_old)) & (self.point_old[kc] == a)
        return hit, np.where(hit, self.point_new[kc], a)

    def translates(self, old_values, new_values, kernel=False):
        """True where new == map(old); for kernels also through the physical alias
        (``sym - __START_KERNEL_map``, e.g. in movabs of physical addresses)."""
        o = np.asarray(old_values, dtype=np.uint64)
        n = np.asarray(new_values, dtype=np.uint64)
        ok = self.map(o) == n
        # A value equal to a region label (e.g. __sched_text_start) may mean the
        # label rather than the function that started there: accept either.
        hit, label_new = self.point(o)
        ok |= hit & (label_new == n)
        if kernel:
            phys = (o > 0) & (o < np.uint64(1 << 31))
            if phys.any():
                km = np.uint64(KERNEL_MAP)
                alias = (self.map(o + km) - km) == n
                ok |= phys & alias
        return ok


class BlockMap:
    """old -> new addresses through the pieces; ``outside`` maps everything else
    (functions moved whole)."""

    def __init__(self, rows, outside):
        r = rows[rows["old_len"] > 0]
        order = np.argsort(r["old"], kind="stable")
        r = r[order]
        self.old = r["old"].astype(np.uint64)
        self.old_end = self.old + r["old_len"].astype(np.uint64)
        self.new = r["new"].astype(np.uint64)
        self.new_len = r["new_len"].astype(np.uint64)
        self.kind = r["kind"]
        self.collapse = self.kind != bm.KIND_COPIED
        self.outside = outside
        # outside is the function-level map (FunctionMap.map) or, in tests, any
        # function: the FunctionMap itself where there is one, and its one-address form
        owner = getattr(outside, "__self__", None)
        self.function_map = owner if isinstance(owner, FunctionMap) else None
        self._outside1 = owner.map1 if self.function_map is not None else None
        # map1 is called per instruction and edge: plain lists and a memo beat
        # one-element numpy calls
        self._old_l, self._end_l = self.old.tolist(), self.old_end.tolist()
        self._new_l, self._col_l = self.new.tolist(), self.collapse.tolist()
        self._memo = {}

    def piece(self, addrs):
        """Index of the piece covering each address, -1 where none."""
        a = np.asarray(addrs, dtype=np.uint64)
        i = np.searchsorted(self.old, a, side="right").astype(np.int64) - 1
        ic = np.maximum(i, 0)
        ok = (i >= 0) & (a < self.old_end[ic]) if len(self.old) else np.zeros(a.shape, bool)
        return np.where(ok, i, -1)

    def map(self, addrs):
        return in_slices(self._map, addrs)

    def _map(self, a):
        out = np.asarray(self.outside(a), dtype=np.uint64).copy()
        if not len(self.old):
            return out
        p = self.piece(a)
        pc = np.maximum(p, 0)
        lin = self.new[pc] + (a - self.old[pc])
        lin = np.where(self.collapse[pc], self.new[pc], lin)
        return np.where(p >= 0, lin, out)

    def map1(self, addr):
        addr = int(addr)
        got = self._memo.get(addr)
        if got is not None:
            return got
        i = bisect_right(self._old_l, addr) - 1
        if i >= 0 and addr < self._end_l[i]:
            got = self._new_l[i] if self._col_l[i] else self._new_l[i] + (addr - self._old_l[i])
        elif self._outside1 is not None:
            got = self._outside1(addr)
        else:
            got = int(np.asarray(self.outside(np.array([addr], np.uint64)), np.uint64)[0])
        self._memo[addr] = got
        return got


class BlockAwareMap:
    """The function-level map, with the pieces of a block map taking precedence
    inside split functions."""

    def __init__(self, base, rows):
        self.base = base
        self.rows = rows
        self.blocks = BlockMap(rows, base.map)
        self._pieces = None

    def pieces(self):
        """(old_start, old_end, new_start, new_end, collapse) as one piecewise
        list: the block map's rows inside split functions (a re-encoded branch or
        removed jmp is collapsed: every address inside maps to its new start, and
        it covers new [new_start, new_end)), the function-level pieces elsewhere.
        What the DWARF check walks."""
        if self._pieces is None:
            r = self.rows[self.rows["old_len"] > 0]
            ro = r["old"].astype(np.uint64)
            re_ = ro + r["old_len"].astype(np.uint64)
            rn = r["new"].astype(np.uint64)
            rne = rn + r["new_len"].astype(np.uint64)
            rc = r["kind"] != bm.KIND_COPIED
            o = np.argsort(ro, kind="stable")
            ro, re_, rn, rne, rc = ro[o], re_[o], rn[o], rne[o], rc[o]
            b = self.base
            k = np.searchsorted(ro, b.old_start)
            kc = np.minimum(k, max(len(ro) - 1, 0))
            covered = (k < len(ro)) & (ro[kc] < b.old_end) if len(ro) else \
                np.zeros(len(b.old_start), bool)
            old = np.concatenate((b.old_start[~covered], ro))
            end = np.concatenate((b.old_end[~covered], re_))
            new = np.concatenate((b.new_start[~covered], rn))
            new_end = np.concatenate((b.new_start[~covered] + (b.old_end[~covered] -
                                                                b.old_start[~covered]), rne))
            collapse = np.concatenate((np.zeros(int((~covered).sum()), bool), rc))
            o = np.argsort(old, kind="stable")
            self._pieces = (old[o], end[o], new[o], new_end[o], collapse[o])
        return self._pieces

    @property
    def old_start(self):
        return self.pieces()[0]

    @property
    def old_end(self):
        return self.pieces()[1]

    @property
    def new_start(self):
        return self.pieces()[2]

    @property
    def new_end(self):
        return self.pieces()[3]

    @property
    def collapse(self):
        return self.pieces()[4]

    @property
    def appended(self):
        """New [start, end) of the jmps the layout appended (no old address)."""
        j = self.rows[self.rows["kind"] == bm.KIND_JMP_INSERTED]
        return (j["new"].astype(np.uint64),
                j["new"].astype(np.uint64) + j["new_len"].astype(np.uint64))

    def map(self, addrs):
        return self.blocks.map(addrs)

    def point(self, addrs):
        return self.base.point(addrs)

    translates = FunctionMap.translates


def match_functions(old_ctx, new_ctx):
    """(old indices, new indices) of matched functions, plus unmatched old indices."""
    of, nf = old_ctx.functions, new_ctx.functions
    new_by_sym = {int(s): i for i, s in enumerate(nf.sym_index.tolist())}
    oi, ni, missing = [], [], []
    for i, s in enumerate(of.sym_index.tolist()):
        j = new_by_sym.get(int(s))
        if j is None or nf.name[j] != of.name[i]:
            # symtab re-ordered: fall back to name + occurrence
            missing.append(i)
        else:
            oi.append(i)
            ni.append(j)
    if missing:
        by_name = {}
        for j, n in enumerate(nf.name):
            by_name.setdefault(n, []).append(j)
        used = set(ni)
        still = []
        for i in missing:
            cands = [j for j in by_name.get(of.name[i], []) if j not in used]
            if cands:
                oi.append(i)
                ni.append(cands[0])
                used.add(cands[0])
            else:
                still.append(i)
        missing = still
    return np.array(oi, dtype=np.int64), np.array(ni, dtype=np.int64), missing


def piece_ends(image, functions):
    """Where each function's piece ends: at the next function or its section's end
    (code between functions without a symbol moves with the function before it)."""
    ends = functions.end.copy()
    nxt = np.append(functions.start[1:], np.uint64(2**64 - 1))
    sec_end = np.zeros(len(functions), np.uint64)
    for sec in image.sections:
        if sec.is_code and sec.is_alloc and sec.size:
            inside = (functions.start >= np.uint64(sec.addr)) & (functions.start < np.uint64(sec.end))
            sec_end[inside] = sec.end
    return np.maximum(ends, np.minimum(nxt, sec_end))


def region_points(old, new):
    """{old address: new address} of the kernel's region boundary labels."""
    from ..image.functions import KERNEL_REGION_LABELS
    pts = {}
    for label in KERNEL_REGION_LABELS:
        a, b = old.symbol_address(label), new.symbol_address(label)
        if a is not None and b is not None:
            pts[a] = b
    return pts


def code_labels(old, new, functions):
    """Code symbols outside functions, present in both images (same symtab index):
    (old addresses, new addresses, old end of the code each governs)."""
    so, sn = old.symtab, new.symtab
    if len(so) != len(sn):
        return None, None, None
    code = [s for s in old.sections if s.is_code and s.is_alloc and s.size]
    secs = np.array([s.index for s in code], dtype=np.int64)
    typ = so["info"] & 0xF
    sel = np.isin(so["shndx"].astype(np.int64), secs) & (typ != 3) & (typ != 4) & \
        (so["shndx"] == sn["shndx"])
    idx = np.nonzero(sel)[0]
    v_old, v_new = so["value"][idx], sn["value"][idx]
    outside = functions.find(v_old) < 0
    v_old, v_new = v_old[outside], v_new[outside]
    # one delta per address (aliases agree in a correct rewrite; keep the first)
    v_old, first = np.unique(v_old, return_index=True)
    v_new = v_new[first]
    # each label governs code up to the next label or function start or section end
    stops = np.unique(np.concatenate([v_old, functions.start,
                                      np.array([s.end for s in code], np.uint64)]))
    k = np.searchsorted(stops, v_old, side="right")
    end = stops[np.minimum(k, len(stops) - 1)]
    return v_old, v_new, end


def code_ranges(image):
    """[(start, end)] of the allocated code sections."""
    return [(s.addr, s.end) for s in image.sections if s.is_code and s.is_alloc and s.size]
