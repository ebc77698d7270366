"""The one interval lookup: which of a set of sorted, non-overlapping half-open
ranges [start, end) holds each address (numpy searchsorted over the starts).

Every "address -> function / instruction / unit / piece" question goes through
:func:`containing`; an address exactly at a range's end belongs to no range.
"""

import numpy as np


def containing(starts, ends, addrs):
    """Index of the range holding each address, -1 where none.

    ``starts`` sorted ascending (uint64), ``ends`` the matching ends; ranges do
    not overlap (for overlapping ones the last range starting at or before the
    address is the one asked)."""
    a = np.asarray(addrs, dtype=np.uint64)
    if not len(starts):
        return np.full(a.shape, -1, np.int64)
    i = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
    ic = np.maximum(i, 0)
    return np.where((i >= 0) & (a < ends[ic]), i, -1)


__all__ = ["containing"]
