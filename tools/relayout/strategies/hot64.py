"""``hot64``: hot units first in their region (hottest first), each 64 B aligned;
cold units follow in their original order at their own alignment."""

from .base import Strategy


class Hot64(Strategy):
    name = "hot64"

    def __init__(self, min_count=1, align=64, **_):
        super().__init__(min_count)
        self.align = int(align)

    def layout(self, view, base):
        hot = self.hot_order(view)
        hs = set(hot)
        cold = [k for k in range(len(view)) if k not in hs]
        out, cur = self.sequential(view, hot, base, lambda k: self.align)
        out, _ = self.sequential(view, cold, cur, None, out)
        return out

    def compact_order(self, view):
        hot = self.hot_order(view)
        if not hot:
            return None          # no hot unit: the original order
        hs = set(hot)
        return hot + [k for k in range(len(view)) if k not in hs]
