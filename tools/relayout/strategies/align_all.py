"""``align-all N``: original order, every function aligned to N bytes (1..512).

The 2015 ``-falign-functions=64`` experiment without rebuilding. A unit never
gets less than its inferred alignment, so ``align-all 1`` only squeezes out
padding beyond what alignment needs.
"""

from ...errors import LinepackError
from .base import Strategy


class AlignAll(Strategy):
    name = "align-all"
    positional = "align"

    def __init__(self, align=64, **kw):
        super().__init__(**{k: v for k, v in kw.items() if k == "min_count"})
        try:
            a = int(align)
        except (TypeError, ValueError):
            raise LinepackError(f"align-all: alignment must be a number, got '{align}'") from None
        if a < 1 or a > 512 or a & (a - 1):
            raise LinepackError(f"align-all: alignment must be a power of two in 1..512, got {a}")
        self.align = a
        self.name = f"align-all {a}"

    def layout(self, view, base):
        out, _ = self.sequential(view, range(len(view)), base, lambda k: self.align)
        return out
