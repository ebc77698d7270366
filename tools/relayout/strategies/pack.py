"""``pack`` (the default): hot units ordered by call-graph affinity, big ones
(> 64 B) starting on a line, small ones packed first-fit so none straddles a
64 B line; the holes that alignment leaves are filled with other small hot
units before anything is padded. Cold units follow in their original order.

Ordering: with call edges (``view.edges``: (caller k, callee k, count)) a
C3-style clustering (Ottoni & Maher, hfsort): visit units hottest first and
append each one's cluster to the cluster of its heaviest caller while the
merged cluster stays under ``max_cluster`` bytes; clusters are then ordered
by density (heat per byte). With function counts only, hotness order.
"""

from ..plan import LINE, align_up, place
from .base import Strategy


class Pack(Strategy):
    name = "pack"

    def __init__(self, min_count=1, line=LINE, max_cluster=4096, **_):
        super().__init__(min_count)
        self.line = int(line)
        self.max_cluster = int(max_cluster)

    def order(self, view):
        hot = self.hot_order(view)
        edges = [e for e in getattr(view, "edges", ()) or () if e[0] != e[1]]
        if not edges:
            return hot
        hs = set(hot)
        best = {}
        for a, b, w in edges:
            if a in hs and b in hs and w > best.get(b, (None, 0))[1]:
                best[b] = (a, w)
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
        keys = sorted(cluster, key=lambda c: (-heat[c] / max(size[c], 1), hot.index(c)))
        return [m for c in keys for m in cluster[c]]

    def layout(self, view, base):
        line = self.line
        out = []
        holes = []          # [start, end) gaps left by alignment, filled first-fit
        cur = base
        for k in self.order(view):
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
        hot = {k for k, _ in out}
        cold = [k for k in range(len(view)) if k not in hot]
        out, _ = self.sequential(view, cold, cur, None, out)
        return out

    def _fit_hole(self, holes, size, al, ph):
        for h in holes:
            hs, he = h
            if he - hs < size:
                continue
            pos = place(hs, al, ph)
            if pos + size <= he and not self.straddles(pos, size, self.line):
                # Split the hole around the placed unit.
                holes.remove(h)
                if pos > hs:
                    holes.append([hs, pos])
                if he > pos + size:
                    holes.append([pos + size, he])
                holes.sort()
                return pos
        return None
