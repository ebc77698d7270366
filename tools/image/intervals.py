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


def reach_ranges(starts, ends):
    """Ranges that may overlap or nest, as ``containing`` can ask them: the starts
    sorted, each end the farthest any range starting at or before it reaches (the
    last range starting at or before an address then holds it when any does)."""
    starts, ends = np.asarray(starts, np.uint64), np.asarray(ends, np.uint64)
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], ends[order]
    return starts, np.maximum.accumulate(ends) if len(ends) else ends


def merge_overlapping(starts, ends):
    """Disjoint sorted ranges covering what ``starts``/``ends`` cover (overlapping
    or nested ones merged into one; touching ones stay apart)."""
    starts, ends = reach_ranges(starts, ends)
    if len(starts):
        keep = np.ones(len(starts), bool)
        keep[1:] = starts[1:] >= ends[:-1]
        starts, ends = starts[keep], np.maximum.reduceat(ends, np.nonzero(keep)[0])
    return starts, ends


def merge_ranges(ranges):
    """Ranges [(lo, hi)] sorted, the empty ones dropped, overlapping or touching
    ones merged into one."""
    rs = ranges if isinstance(ranges, list) else list(ranges)
    if len(rs) <= 1:            # most DIEs: one range
        return [tuple(rs[0])] if rs and rs[0][1] > rs[0][0] else []
    out = []
    for lo, hi in sorted(r for r in rs if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def append_range(out, lo, hi):
    """Append [lo, hi) to the list ``out``, extending its last range when the two
    touch; an empty range adds nothing."""
    if hi <= lo:
        return
    if out and out[-1][1] == lo:
        out[-1] = (out[-1][0], hi)
    else:
        out.append((lo, hi))


__all__ = ["containing", "reach_ranges", "merge_overlapping", "merge_ranges", "append_range"]


# addresses per slice of a bulk map: mapping all of an image's instructions at once
# held about ten temporaries of their size (zstd: 14 MiB over verify's peak)
MAP_ROWS = 1 << 15


def in_slices(fn, addrs):
    """``fn`` (an elementwise map of a uint64 array) over ``addrs``, a slice at a time."""
    a = np.asarray(addrs, dtype=np.uint64)
    if a.ndim != 1 or len(a) <= MAP_ROWS:
        return fn(a)
    out = np.empty(len(a), np.uint64)
    for lo in range(0, len(a), MAP_ROWS):
        out[lo:lo + MAP_ROWS] = fn(a[lo:lo + MAP_ROWS])
    return out
