"""AddressMap: a piecewise map from old addresses to new addresses.

Pieces are (old range -> new start) and there may be many per function (the
relayout moves whole functions today, blocks later). Every table update and
every reference fix goes through ``map``; nothing computes "function start +
offset" on its own.

Rules, deliberately:
- an address inside a piece maps into the piece's new range; inside a
  "collapsed" piece (a re-encoded branch, a removed jmp: block-level layouts)
  every address maps to the piece's new start;
- an address exactly at a piece's end that is not the start of another piece
  maps to the moved piece's end (``foo + size`` references, ORC terminators,
  end markers): it belongs to the code before it. A piece's new end is its new
  start plus its old size unless ``new_end`` says otherwise (re-encoded branch);
- an address at an anchor (e.g. a region boundary label) with no piece there
  maps to the anchor's new address;
- an address inside a rewritten extent but in none of the above (dropped
  padding) is unmapped: ``map`` reports it in ``ok=False``;
- an address outside every rewritten extent maps to itself.
"""

import numpy as np

from .intervals import containing


class AddressMap:
    def __init__(self, old_start, old_end, new_start, extents=(), anchors=None,
                 new_end=None, collapse=None):
        old_start = np.asarray(old_start, dtype=np.uint64)
        order = np.argsort(old_start, kind="stable")
        self.old_start = old_start[order]
        self.old_end = np.asarray(old_end, dtype=np.uint64)[order]
        self.new_start = np.asarray(new_start, dtype=np.uint64)[order]
        self.new_end = None if new_end is None else np.asarray(new_end, dtype=np.uint64)[order]
        self.collapse = None if collapse is None else np.asarray(collapse, dtype=bool)[order]
        if len(self.old_start) > 1 and (self.old_end[:-1] > self.old_start[1:]).any():
            raise ValueError("AddressMap pieces overlap")
        ext = sorted((int(a), int(b)) for a, b in extents)
        self.ext_lo = np.array([a for a, _ in ext], dtype=np.uint64)
        self.ext_hi = np.array([b for _, b in ext], dtype=np.uint64)
        # new ranges that hold code but map no old address (block layouts' inserted
        # jmps): not padding
        self.occupied = (np.zeros(0, np.uint64), np.zeros(0, np.uint64))
        self.block_rows = None
        anchors = dict(anchors or {})
        self.anchor_old = np.array(sorted(anchors), dtype=np.uint64)
        self.anchor_new = np.array([anchors[a] for a in sorted(anchors)], dtype=np.uint64)

    @classmethod
    def identity(cls):
        return cls([], [], [])

    def __len__(self):
        return len(self.old_start)

    @property
    def delta(self):
        """Signed shift of each piece (new - old), int64."""
        return (self.new_start.astype(np.int64) - self.old_start.astype(np.int64))

    def is_identity(self):
        return bool((self.new_start == self.old_start).all())

    def piece(self, addrs):
        """Index of the piece containing each address (start included, end excluded), -1 if none."""
        return containing(self.old_start, self.old_end, addrs)

    def in_extent(self, addrs):
        return containing(self.ext_lo, self.ext_hi, addrs) >= 0

    def map(self, addrs, strict=False):
        """(new addresses, ok) for an array of old addresses (uint64).

        With ``strict=True`` unmapped addresses raise ValueError instead.
        """
        a = np.asarray(addrs, dtype=np.uint64)
        scalar = a.ndim == 0
        a = np.atleast_1d(a)
        out = a.copy()
        ok = np.ones(a.shape, bool)
        if len(self.old_start):
            i = np.searchsorted(self.old_start, a, side="right").astype(np.int64) - 1
            ic = np.maximum(i, 0)
            valid = i >= 0
            inside = valid & (a < self.old_end[ic])
            at_end = valid & ~inside & (a == self.old_end[ic])
            hit = inside | at_end
            lin = self.new_start[ic] + (a - self.old_start[ic])
            if self.collapse is not None:
                lin = np.where(self.collapse[ic], self.new_start[ic], lin)
            if self.new_end is not None:
                lin = np.where(at_end, self.new_end[ic], lin)
            out = np.where(hit, lin, out)
            rest = ~hit
        else:
            rest = np.ones(a.shape, bool)
        if len(self.anchor_old) and rest.any():
            j = np.searchsorted(self.anchor_old, a)
            jc = np.minimum(j, len(self.anchor_old) - 1)
            anc = rest & (j < len(self.anchor_old)) & (self.anchor_old[jc] == a)
            out = np.where(anc, self.anchor_new[jc], out)
            rest &= ~anc
        if rest.any():
            lost = rest & self.in_extent(a)
            ok &= ~lost
            if strict and lost.any():
                bad = a[lost][:5]
                raise ValueError("unmapped addresses (dropped padding): " +
                                 ", ".join(f"{int(x):#x}" for x in bad))
        if scalar:
            return out[0], ok[0]
        return out, ok

    def map1(self, addr):
        """One address (int) -> int; raises ValueError when unmapped."""
        new, ok = self.map(np.array([addr], dtype=np.uint64))
        if not ok[0]:
            raise ValueError(f"address {addr:#x} is in dropped padding")
        return int(new[0])

    def moved(self, addrs):
        """True where an address maps somewhere else."""
        new, _ = self.map(addrs)
        return new != np.asarray(addrs, dtype=np.uint64)

    def padding_runs(self):
        """(start, end) uint64 arrays of the new layout's gaps inside each rewritten
        extent: the padding the layout inserted (between moved pieces, and after
        the last piece up to the extent's end), in address order."""
        starts, ends = [], []
        for lo, hi in zip(self.ext_lo.tolist(), self.ext_hi.tolist()):
            m = (self.old_start >= np.uint64(lo)) & (self.old_start < np.uint64(hi))
            if not m.any():
                continue
            ns = self.new_start[m].astype(np.int64)
            ne = (self.new_end[m].astype(np.int64) if self.new_end is not None else
                  ns + (self.old_end[m] - self.old_start[m]).astype(np.int64))
            oc = (self.occupied[0] >= np.uint64(lo)) & (self.occupied[0] < np.uint64(hi))
            ns = np.concatenate([ns, self.occupied[0][oc].astype(np.int64)])
            ne = np.concatenate([ne, self.occupied[1][oc].astype(np.int64)])
            k = np.lexsort((-ne, ns))
            ns, ne = ns[k], ne[k]
            ne = np.maximum.accumulate(ne)
            bounds_lo = np.concatenate(([lo], ne))
            bounds_hi = np.concatenate((ns, [hi]))
            gap = bounds_hi > bounds_lo
            starts.append(bounds_lo[gap])
            ends.append(bounds_hi[gap])
        if not starts:
            return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
        return (np.concatenate(starts).astype(np.uint64), np.concatenate(ends).astype(np.uint64))

    @classmethod
    def from_plan(cls, plan):
        """One piece per unit of every rewritten extent of a LayoutPlan."""
        u = plan.units
        extents, anchors = plan_extents(plan)
        keep = units_of_extents(u, extents)
        return cls(u.start[keep], u.end[keep], plan.new_start[keep], extents, anchors)


def units_of_extents(units, extents):
    """Units whose start lies in a rewritten extent, and the unit starting right
    at an extent's end: when functions are contiguous (6.12's 16-byte prefixes
    leave no padding between them) the last piece of an extent ends where a
    unit that stays starts, and that address is the staying unit's start
    (its symbol, branches and ORC entry), not the moved piece's end."""
    keep = np.zeros(len(units), bool)
    his = np.array([hi for _, hi in extents], np.uint64)
    for lo, hi in extents:
        keep |= (units.start >= np.uint64(lo)) & (units.start < np.uint64(hi))
    return keep | np.isin(units.start, his)


def plan_extents(plan):
    """Rewritten extents (runs of movable regions where something moved) and
    region-boundary anchors of a plan."""
    u = plan.units
    regs = u.regions
    moved_region = set(int(r) for r in np.unique(u.region[plan.moved]))
    for ri, r in enumerate(regs):
        if plan.region_new_start[ri] != r.start:
            moved_region.add(ri)
    # regions laid out as one around their pinned units (relayout/plan.py cut_groups):
    # one extent, over the pinned units inside (code moved across them)
    grouped, first = set(), set()
    for a, b in getattr(plan, "groups", ()):
        grouped.update(range(a + 1, b + 1))
        if moved_region & set(range(a, b + 1)):
            moved_region.add(a)
            first.add(a)
    extents, anchors = [], {}
    ri = 0
    while ri < len(regs):
        if (regs[ri].pinned and ri not in first) or ri not in moved_region:
            ri += 1
            continue
        # Grow the run over following movable regions of the same section.
        a = ri
        b = ri
        while b + 1 < len(regs) and (not regs[b + 1].pinned or b + 1 in grouped) and \
                regs[b + 1].section == regs[a].section:
            b += 1
        lo = regs[a].start
        hi = regs[b].end
        extents.append((lo, hi))
        for k in range(a, b + 1):
            anchors[regs[k].start] = plan.region_new_start[k]
        anchors.setdefault(hi, hi)
        ri = b + 1
    # Merge adjacent extents.
    return extents, anchors
