"""Block map format: round trip, validation, and the AddressMap built from it."""

import numpy as np
import pytest

from linepack.errors import BadInput
from linepack.image import blockmap as bm


def _rows():
    # block A copied; a jcc re-encoded 2 -> 6 bytes; a cold block; an inserted jmp
    # before the block at 0x1007's original successor; a removed jmp at the end.
    return bm.make_rows(
        old=[0x1000, 0x1005, 0x1007, 0x1010, 0x1010],
        old_len=[5, 2, 9, 0, 3],
        new=[0x2000, 0x2005, 0x3000, 0x3009, 0x200b],
        new_len=[5, 6, 9, 5, 0],
        kind=[bm.KIND_COPIED, bm.KIND_BRANCH, bm.KIND_COPIED, bm.KIND_JMP_INSERTED,
              bm.KIND_JMP_REMOVED],
        part=[0, 0, 1, 1, 0], func=[7] * 5)


def test_round_trip_and_order():
    rows = _rows()
    assert bm.check_rows(rows) == []
    # a zero-length row sorts before the piece at the same address
    assert rows["kind"].tolist() == [0, 1, 0, 2, 3]
    data = bm.to_bytes(rows)
    assert data[:4] == b"LPBM" and len(data) == 16 + 32 * len(rows)
    assert (bm.from_bytes(data) == rows).all()


def test_malformed():
    data = bm.to_bytes(_rows())
    with pytest.raises(BadInput):
        bm.from_bytes(b"XXXX" + data[4:])
    with pytest.raises(BadInput):
        bm.from_bytes(data[:-1])
    rows = _rows()
    rows["old_len"][0] = 6          # overlaps the branch after it, and copied lengths differ
    problems = bm.check_rows(rows)
    assert any("overlap" in p for p in problems) and any("copied" in p for p in problems)


def test_address_map():
    m = bm.address_map(_rows(), extents=[(0x1000, 0x1013)])
    old = np.array([0x1000, 0x1004, 0x1005, 0x1006, 0x1007, 0x100f, 0x1010, 0x1012, 0x1013],
                   np.uint64)
    new, ok = m.map(old)
    assert ok.all()
    assert new.tolist() == [0x2000, 0x2004,
                            0x2005, 0x2005,      # inside the re-encoded branch: its start
                            0x3000, 0x3008,      # cold block, linear
                            0x200b, 0x200b,      # removed jmp: where its target now is
                            0x200b]              # end of the last piece: its new end
    # the branch's end maps to its new (longer) end via the next piece's start
    assert m.map1(0x1007) == 0x3000
