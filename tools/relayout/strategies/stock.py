"""``stock``: every unit stays where it is (the identity layout)."""

from .base import Strategy


class Stock(Strategy):
    name = "stock"

    def __init__(self, **_):
        super().__init__()

    def layout(self, view, base):
        # base == region start unless an earlier region grew; then shift as a block.
        shift = base - view.region.start
        if view.index.size and shift < 0:
            shift = 0
        first = int(view.start[0]) if len(view) else base
        shift = max(0, base - first) if first < base else 0
        return [(k, int(view.start[k]) + shift) for k in range(len(view))]
