"""Helpers shared by the strategies."""

import numpy as np

from ..plan import LINE, place


class Strategy:
    name = "?"
    positional = None

    def __init__(self, min_count=1):
        self.min_count = float(min_count)

    def layout(self, view, base):
        raise NotImplementedError

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
        for k in order:
            a = want_align(k) if want_align else 1
            pos = place(cur, view.align[k], view.phase[k], a)
            out.append((k, pos))
            cur = pos + int(view.size[k])
        return out, cur

    @staticmethod
    def straddles(pos, size, line=LINE):
        return size > 0 and (pos // line) != ((pos + size - 1) // line)
