"""image/intervals.py: overlapping and nested ranges as containing() asks them."""

import numpy as np

from linepack.image.intervals import containing, merge_overlapping, reach_ranges

# [10, 20) holds [12, 14); [18, 30) overlaps it; [40, 50) stands alone; [50, 55) touches it
LO = [40, 18, 10, 12, 50]
HI = [50, 30, 20, 14, 55]
ADDRS = [9, 10, 15, 19, 25, 29, 30, 39, 45, 50, 54, 55]
HELD = [False, True, True, True, True, True, False, False, True, True, True, False]


def test_reach_ranges_answer_for_any_range():
    s, e = reach_ranges(LO, HI)
    assert s.tolist() == [10, 12, 18, 40, 50] and e.tolist() == [20, 20, 30, 50, 55]
    assert (containing(s, e, ADDRS) >= 0).tolist() == HELD
    assert [len(x) for x in reach_ranges([], [])] == [0, 0]


def test_merge_overlapping_keeps_touching_ranges_apart():
    s, e = merge_overlapping(LO, HI)
    assert list(zip(s.tolist(), e.tolist())) == [(10, 30), (40, 50), (50, 55)]
    assert (containing(s, e, ADDRS) >= 0).tolist() == HELD
    assert [len(x) for x in merge_overlapping(np.zeros(0), np.zeros(0))] == [0, 0]
