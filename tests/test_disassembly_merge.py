"""coverage.merge: function and non-function instructions in one Disassembly, by
address, written in place (no concatenated copy); the rows and their order are
those of a stable sort of the two parts (function rows first on equal
addresses), and the carried branch targets point at the merged rows."""

import numpy as np

from linepack.image.coverage import merge
from linepack.image.disasm import Disassembly


def _dis(rng, addrs, first_func):
    n = len(addrs)
    return Disassembly(np.asarray(addrs, np.uint64), rng.integers(1, 15, n).astype(np.uint8),
                       (np.arange(n) + first_func).astype(np.int32),
                       rng.integers(0, 255, (n, 16)).astype(np.uint8), [])


def _stable_sorted(f, e):
    order = np.argsort(np.concatenate([f.addr, e.addr]), kind="stable")
    return [np.concatenate([getattr(f, c), getattr(e, c)])[order]
            for c in ("addr", "size", "func", "raw")]


def test_merge_is_a_stable_sort_of_both_parts():
    rng = np.random.default_rng(7)
    for case in range(400):
        f_addr = np.sort(rng.integers(0, 80, rng.integers(0, 60)))
        if case % 7 == 0:                    # unsorted function rows: the sort path
            f_addr = rng.integers(0, 80, len(f_addr))
        e_addr = rng.integers(0, 80, rng.integers(0, 12))    # ties with f on purpose
        f, e = _dis(rng, f_addr, 0), _dis(rng, e_addr, 1000)
        got = merge(f, e)
        for col, want in zip(("addr", "size", "func", "raw"), _stable_sorted(f, e)):
            have = getattr(got, col)
            assert have.dtype == want.dtype and np.array_equal(have, want), (case, col)


def test_merge_carries_branch_targets_to_the_merged_rows():
    # e8 rel32 calls in both parts: after the merge each target sits on its own row
    f = Disassembly(np.array([0x10, 0x20], np.uint64), np.array([5, 5], np.uint8),
                    np.array([0, 0], np.int32), np.zeros((2, 16), np.uint8), [])
    e = Disassembly(np.array([0x18], np.uint64), np.array([5], np.uint8),
                    np.array([-1], np.int32), np.zeros((1, 16), np.uint8), [])
    for d in (f, e):
        d.raw[:, 0] = 0xE8
    f.raw[0, 1], f.raw[1, 1], e.raw[0, 1] = 0x10, 0x20, 0x30
    f.branch_targets(), e.branch_targets()
    got = merge(f, e)
    idx, tgt, _ = got._branch_targets
    assert idx.tolist() == [0, 1, 2]
    assert tgt.tolist() == [0x10 + 5 + 0x10, 0x18 + 5 + 0x30, 0x20 + 5 + 0x20]
    fresh = Disassembly(got.addr, got.size, got.func, got.raw, []).branch_targets()
    assert [a.tolist() for a in fresh] == [a.tolist() for a in got._branch_targets]
