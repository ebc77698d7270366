"""Hand-written instructions for verify's unit tests (tests/test_verify_kept_bytes.py,
tests/test_verify_other_branches.py): a Disassembly of (address, bytes) rows, and an
address map that moves one range."""

import numpy as np

from linepack.image.disasm import Disassembly


class ShiftMap:
    """Addresses in [lo, hi) move by ``by``; the rest stay."""

    def __init__(self, lo, hi, by):
        self.lo, self.hi, self.by = np.uint64(lo), np.uint64(hi), np.uint64(by)

    def map(self, a):
        a = np.asarray(a, np.uint64)
        return np.where((a >= self.lo) & (a < self.hi), a + self.by, a)

    def translates(self, old, new, kernel=False):
        return self.map(old) == np.asarray(new, np.uint64)


def disassembly(rows):
    """A Disassembly of (address, bytes) rows."""
    raw = np.zeros((len(rows), 16), np.uint8)
    for i, (_, b) in enumerate(rows):
        raw[i, :len(b)] = np.frombuffer(b, np.uint8)
    return Disassembly(np.array([a for a, _ in rows], np.uint64),
                       np.array([len(b) for _, b in rows], np.uint8),
                       np.zeros(len(rows), np.int32), raw, [])
