"""The block-level mutation self-test (tools/verify/mutation.py block_mutations) with the
block check's C scan (verify/blocks.c lp_block_scan) counted: shared by
tests/test_mutation_blocks.py (a gcc-built split) and tests/test_verify_blocks_vmlinux.py
(the 6.1 `blocks` output)."""

import types

import numpy as np
import pytest


def counting_scan(monkeypatch):
    """The C core with its lp_block_scan counted: returns a list that gets one entry per
    call; skips without a compiler."""
    from linepack.verify import blocks as vb
    monkeypatch.setattr(vb, "_lib", False)
    lib = vb._native_lib()
    if lib is None:
        pytest.skip("no C compiler: the block check runs in Python only")
    calls = []

    def scan(*a):
        calls.append(1)
        return lib.lp_block_scan(*a)
    monkeypatch.setattr(vb, "_lib", types.SimpleNamespace(lp_block_scan=scan))
    return calls


def block_mutation_rows(old, new, seed, count):
    """The rows of block_mutations on image ``new`` (split from ``old``): ``count``
    mutations drawn with ``seed``."""
    from linepack.image.context import ImageContext
    from linepack.image.elf import ElfImage
    from linepack.verify.mutation import block_mutations
    octx, nctx = ImageContext(ElfImage(str(old))), ImageContext(ElfImage(str(new)))
    return block_mutations(octx, nctx, np.random.default_rng(seed), count=count)
