"""Where the kernel patches code at boot: the alternative and paravirt sites.

objtool describes the replacement code's instruction boundaries too, so ORC IPs
legitimately fall inside an original instruction there (kernel/orc.py's check)."""

import numpy as np

from ..image.intervals import containing, reach_ranges
from .alternatives import Alternatives
from .paravirt import ParaInstructions


def _patch_ranges(ctx):
    starts, ends = [], []
    for cls, a, ln in ((Alternatives, "instr", "instrlen"), (ParaInstructions, "instr", "len")):
        e = cls().parse(ctx)
        starts.append(e[a])
        ends.append(e[a] + e[ln].astype(np.uint64))
    return reach_ranges(np.concatenate(starts), np.concatenate(ends))


def in_patch_site(ctx, addrs):
    """True where an address lies inside an alternative or paravirt patch site."""
    st, en = ctx.derived("patch_ranges", lambda: _patch_ranges(ctx))
    # ends made monotone above: "the last site starting before" answers overlaps too
    return containing(st, en, addrs) >= 0


__all__ = ["in_patch_site"]
