"""``pack`` (the default): hot units ordered by call-graph affinity, big ones
(> 64 B) starting on a line, small ones packed first-fit so none straddles a
64 B line; the holes that alignment leaves are filled with other small hot
units before anything is padded. Cold units follow in their original order.

Hot set: units with ``heat >= min_count`` (heat = the profile's count per
workload iteration, see configs/relayout/pack.toml).

Ordering (``order``):
- with call edges (``view.edges``: (caller k, callee k, count)) a C3-style
  clustering (Ottoni & Maher, hfsort): visit units hottest first and append
  each one's cluster to the cluster of its heaviest caller while the merged
  cluster stays under ``max_cluster`` bytes; clusters are then ordered by
  density (heat per byte);
- without edges: by heat (``order = "heat"``, the default) or by density
  (``order = "density"``, heat per byte);
- ``order = "first"`` (block level, ``blocks``' default): in the order the hot
  units first ran in the recorded window, when the executed blocks carry that
  (evaluate's own traces: ``first_run``, set by relayout's plan pass); code that
  runs one after the other then sits on consecutive cache sets instead of on
  sets chosen by heat rank. Without it: as above.

Placement (``layout``):
- without block data (``view.hot_ranges`` is None): the rule above, big units
  64 B aligned, small ones first-fit into holes, never straddling a line;
- with block data (``view.hot_ranges[k]``: (offset, end) byte ranges of the
  unit holding blocks that run at least ``block_min`` times per iteration;
  make_plan(..., blocks=) builds them), each hot unit goes to the candidate
  start (the legal starts in the next line, and every hole it fits) that adds
  the fewest new cache lines holding hot bytes; ties go to holes, then to the
  lowest address. ``strict`` (default) keeps the rule above: a big unit's only
  candidate is the next line start, a small one never straddles; so block data
  only steers where small units go. ``strict = false`` lets a big unit start
  mid-line too, sharing a line with the hot tail of the unit before it.

Measured on Debian 6.1 cloud, VFS-mix, 32 KiB 8-way (what-if replay, misses vs
stock): function counts only -11.7%; + blocks -12.2%; + blocks + call edges
-12.2%; strict = false with blocks + calls -12.6% (booted -12.9%).
"""

from ..plan import LINE, align_up, place
from .base import Strategy


class Pack(Strategy):
    name = "pack"
    # a region cut around pinned units is laid out as one (relayout/plan.py cut_groups):
    # hot units move by whole lines around the pinned ones, cold ones follow each other
    flows_around_pinned = True

    def __init__(self, min_count=1, line=LINE, max_cluster=4096, order="heat",
                 use_blocks=True, block_min=0.5, strict=True, set_spread=None, **_):
        super().__init__(min_count)
        self.line = int(line)
        self.max_cluster = int(max_cluster)
        if order not in ("density", "heat", "first"):
            from ...errors import LinepackError
            raise LinepackError(f"pack: order must be 'density', 'heat' or 'first', got '{order}'")
        self.order_by = order
        self.use_blocks = bool(use_blocks)
        self.block_min = float(block_min)
        self.strict = bool(strict)
        # set-aware placement: a cache model (configs/cache name); each region's hot
        # area starts where its hot lines add the least load to the sets that the
        # regions placed before it already fill (see _spread_over_sets)
        self.set_spread = None
        if set_spread:
            from ...profile.trace import cache_config
            self.set_spread = cache_config(set_spread)
        self._set_placed = ([], [])      # lines and weights of earlier regions' hot code
        self.first_run = None            # {unit index: first execution} (order = "first")

    # -- ordering -----------------------------------------------------------------
    def _key(self, view, heat, size):
        if self.order_by == "density":
            return -heat / max(size, 1)
        return -heat

    def order(self, view):
        hot = self.hot_order(view)
        rank = {k: i for i, k in enumerate(hot)}
        first = self.first_run if self.order_by == "first" else None
        if first:
            never = float("inf")       # hot, yet not seen in the window: after, by heat
            idx = view.index
            return sorted(hot, key=lambda k: (first.get(int(idx[k]), never), rank[k]))
        edges = [e for e in getattr(view, "edges", ()) or () if e[0] != e[1]]
        if not edges:
            return sorted(hot, key=lambda k: (self._key(view, float(view.heat[k]),
                                                         int(view.size[k])), rank[k]))
        hs = set(hot)
        best = {}
        for a, b, w in edges:
            if a in hs and b in hs and (w, -a) > best.get(b, (None, 0, 0))[1:]:
                best[b] = (a, w, -a)
        cluster = {k: [k] for k in hot}
        owner = {k: k for k in hot}
        size = {k: int(view.size[k]) for k in hot}
        for k in hot:
            if k not in best:
                continue
            caller = best[k][0]
            ca, cb = owner[caller], owner[k]
            if ca == cb or size[ca] + size[cb] > self.max_cluster:
                continue
            cluster[ca].extend(cluster[cb])
            size[ca] += size[cb]
            for m in cluster[cb]:
                owner[m] = ca
            del cluster[cb]
        heat = {c: sum(float(view.heat[m]) for m in ms) for c, ms in cluster.items()}
        keys = sorted(cluster, key=lambda c: (-heat[c] / max(size[c], 1), rank[c]))
        return [m for c in keys for m in cluster[c]]

    # -- placement ----------------------------------------------------------------
    def layout(self, view, base):
        ranges = getattr(view, "hot_ranges", None) if self.use_blocks else None
        order = self.order(view)
        if ranges is None:
            out, cur = self._layout_units(view, base, order)
        else:
            out, cur = self._layout_blocks(view, base, order, ranges)
        if self.set_spread and out:
            out, cur = self._spread_over_sets(view, out, cur, ranges)
        hot = {k for k, _ in out}
        cold = [k for k in range(len(view)) if k not in hot]
        out, _ = self.sequential(view, cold, cur, None, out)
        return out

    def compact_order(self, view):
        hot = self.order(view)
        if not hot:
            return None          # no hot unit: the original order
        hs = set(hot)
        return hot + [k for k in range(len(view)) if k not in hs]

    def _layout_units(self, view, base, order):
        line = self.line
        out = []
        holes = []          # [start, end) gaps left by alignment, filled first-fit
        cur = base
        for k in order:
            size = int(view.size[k])
            al, ph = view.align[k], view.phase[k]
            if size > line:
                pos = place(cur, al, ph, line)
                if pos > cur:
                    holes.append([cur, pos])
                out.append((k, pos))
                cur = pos + size
                continue
            pos = self._fit_hole(holes, size, al, ph)
            if pos is None:
                pos = place(cur, al, ph)
                if self.straddles(pos, size, line):
                    nxt = place(align_up(pos, line), al, ph)
                    holes.append([cur, nxt])
                    pos = nxt
                elif pos > cur:
                    holes.append([cur, pos])
                cur = pos + size
            out.append((k, pos))
        return out, cur

    def _fit_hole(self, holes, size, al, ph):
        for h in holes:
            hs, he = h
            if he - hs < size:
                continue
            pos = place(hs, al, ph)
            if pos + size <= he and not self.straddles(pos, size, self.line):
                self._take(holes, h, pos, size)
                return pos
        return None

    @staticmethod
    def _take(holes, h, pos, size):
        """Split hole h around [pos, pos + size)."""
        hs, he = h
        holes.remove(h)
        if pos > hs:
            holes.append([hs, pos])
        if he > pos + size:
            holes.append([pos + size, he])
        holes.sort()

    def _lines(self, pos, rng):
        line = self.line
        out = set()
        for s, e in rng:
            out.update(range((pos + s) // line, (pos + e - 1) // line + 1))
        return out

    def _candidates(self, lo, hi, al, ph, size):
        """Legal starts p with lo <= p and p + size <= hi (hi None: p < lo + line).

        strict: a unit larger than a line only at a line start, a smaller one
        only where it does not straddle a line."""
        line = self.line
        if self.strict and size > line:
            p = place(lo, al, ph, line)
            if hi is None or p + size <= hi:
                return [p]
            return []
        out = []
        p = place(lo, al, ph)
        step = 16 if ph else max(int(al), 1)
        limit = lo + line if hi is None else hi - size + 1
        while p < limit:
            if not (self.strict and self.straddles(p, size, line)):
                out.append(p)
            p += step
        if hi is None and not out:
            out.append(place(align_up(lo, line), al, ph))
        return out

    def _layout_blocks(self, view, base, order, ranges):
        out = []
        holes = []
        touched = set()     # lines holding hot bytes of units placed so far
        cur = base
        for k in order:
            size = int(view.size[k])
            al, ph = view.align[k], view.phase[k]
            rng = ranges[k]
            if rng is None or not len(rng):
                rng = [(0, size)] if size else []
            best = None
            for h in holes:
                if h[1] - h[0] < size:
                    continue
                for p in self._candidates(h[0], h[1], al, ph, size):
                    ln = self._lines(p, rng)
                    c = (len(ln - touched), 0, p)
                    if best is None or c < best[0]:
                        best = (c, h, ln)
            for p in self._candidates(cur, None, al, ph, size):
                ln = self._lines(p, rng)
                c = (len(ln - touched), 1, p)
                if best is None or c < best[0]:
                    best = (c, None, ln)
            (_, _, pos), h, ln = best
            if h is not None:
                self._take(holes, h, pos, size)
            else:
                if pos > cur:
                    holes.append([cur, pos])
                    holes.sort()
                cur = pos + size
            touched |= ln
            out.append((k, pos))
            # Holes far behind the cursor are kept: small units still fit there.
        return out, cur

    # -- set-aware placement ---------------------------------------------------------
    def begin_plan(self):
        self._set_placed = ([], [])

    def _spread_over_sets(self, view, out, cur, ranges):
        """Shift the region's hot area by whole lines (padding at its start) so that its
        hot lines, weighted by their units' heat, overflow the cache's sets least,
        given the hot lines of the regions placed before it. Cost: per set, the
        weight of the lines beyond its ``ways`` heaviest (they cannot all stay)."""
        import numpy as np
        cfg = self.set_spread
        line = int(cfg["line"])
        sets = int(cfg["size"]) // (int(cfg["ways"]) * line)
        ways = int(cfg["ways"])
        step = max([line] + [int(view.align[k]) for k, _ in out])
        if step % line or step >= sets * line:
            return out, cur
        lns, wts = [], []
        for k, pos in out:
            rng = ranges[k] if ranges is not None and ranges[k] is not None and len(ranges[k]) \
                else [(0, int(view.size[k]))]
            ls = sorted(self._lines(int(pos), rng))
            lns += ls
            wts += [float(view.heat[k])] * len(ls)
        lns = np.array(lns, np.int64)
        wts = np.array(wts, np.float64)
        prev_l = np.array(self._set_placed[0], np.int64)
        prev_w = np.array(self._set_placed[1], np.float64)
        allw = np.concatenate([prev_w, wts])

        def cost(shift_lines):
            s = np.concatenate([prev_l, lns + shift_lines]) % sets
            o = np.lexsort((-allw, s))
            ss = s[o]
            rank = np.arange(len(ss)) - np.searchsorted(ss, ss)
            return float(allw[o][rank >= ways].sum())

        best = min(range(0, sets * line, step), key=lambda d: (cost(d // line), d))
        self._set_placed[0].extend((lns + best // line).tolist())
        self._set_placed[1].extend(wts.tolist())
        if not best:
            return out, cur
        return [(k, pos + best) for k, pos in out], cur + best
