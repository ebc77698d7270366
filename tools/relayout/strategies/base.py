"""Helpers shared by the strategies."""

import numpy as np

from ..plan import LINE, align_up


class Strategy:
    name = "?"
    positional = None
    # what relayout's passes read (relayout/passes.py); pack and blocks set their own
    block_level = False        # split hot functions (the block-level pass list)
    use_blocks = False         # place small units by their executed blocks
    block_min = 0.0            # ... that run at least this often per iteration
    invert_jcc = False         # block level: invert a jcc so the hot path falls through
    block_order = "original"   # block level: order of the hot blocks

    def __init__(self, min_count=1):
        self.min_count = float(min_count)

    def layout(self, view, base):
        raise NotImplementedError

    def compact_order(self, view):
        """The region's units in this strategy's order, for a layout without its
        alignment padding (a region with no room for the padding before pinned code,
        relayout/plan.py); None: the order is the original one (nothing to gain)."""
        return None

    # -- helpers -------------------------------------------------------------
    def hot_mask(self, view):
        return view.heat >= self.min_count

    def hot_order(self, view):
        """Hot unit indices, hottest first (ties: original address)."""
        hot = np.nonzero(self.hot_mask(view))[0]
        return sorted(hot.tolist(), key=lambda k: (-float(view.heat[k]), k))

    @staticmethod
    def sequential(view, order, base, want_align=None, out=None):
        """Place units one after another; want_align(k) -> extra alignment."""
        out = [] if out is None else out
        cur = base
        # place() inlined over plain lists (numpy scalars per unit cost more than
        # the arithmetic; a cold region is tens of thousands of units)
        aligns, phases, sizes = view.align.tolist(), view.phase.tolist(), view.size.tolist()
        for k in order:
            ph = phases[k]
            cur = int(cur)
            if ph:
                pos = align_up(cur - ph, 16) + ph
                if pos < cur:
                    pos += 16
            else:
                m = max(aligns[k], 1, int(want_align(k)) if want_align else 1)
                pos = (cur + m - 1) // m * m
            out.append((k, pos))
            cur = pos + sizes[k]
        return out, cur

    @staticmethod
    def straddles(pos, size, line=LINE):
        return size > 0 and (pos // line) != ((pos + size - 1) // line)
