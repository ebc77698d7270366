"""The mutation self-test on a block-level rewrite (tools/verify/mutation.py
block_mutations): copied instructions of a split function corrupted one at a time
in a PatchedImage, each checked by the block check. The PatchedImage's reader is
accepted by the block check's C scan (verify/blocks.c), so the self-test runs
the path ``verify --against`` runs: the C scan is called on the patched bytes (counted
here), and a C scan that read the unpatched image would let the mutations through
(shown by hiding the patched copies from it)."""

import pytest

from block_scan import block_mutation_rows, counting_scan
from test_verify_blocks import _split_h, prog_h  # noqa: F401  (prog_h: a fixture)


@pytest.fixture(scope="module")
def split_h(prog_h, tmp_path_factory):  # noqa: F811
    exe, _ = prog_h
    out = tmp_path_factory.mktemp("mut-blocks") / "split"
    _split_h(exe, out)
    return str(exe), str(out)


def test_block_mutations_run_the_c_scan_and_are_named(split_h, monkeypatch):
    calls = counting_scan(monkeypatch)
    rows = block_mutation_rows(*split_h, seed=3, count=40)
    kinds = {r[1] for r in rows}
    assert len(rows) >= 10 and {"immediate", "nop over the instruction"} <= kinds, rows
    # every mutation's block check went through the C scan, and each is named
    assert len(calls) >= len(rows)
    missed = [(r[1], hex(r[4])) for r in rows if not r[5]]
    assert missed == []


def test_a_c_scan_reading_the_unpatched_image_would_let_them_through(split_h, monkeypatch):
    """The premise: with the patched copies hidden from the C scan (it reads NEW as
    mapped), the C scan passes the corrupted instructions as unchanged and the
    self-test reports them missed."""
    from linepack.verify import mutation
    calls = counting_scan(monkeypatch)
    monkeypatch.setattr(mutation.PatchedImage, "copies", lambda self: {})
    rows = block_mutation_rows(*split_h, seed=3, count=40)
    assert calls and sum(not r[5] for r in rows) >= len(rows) // 2, rows
