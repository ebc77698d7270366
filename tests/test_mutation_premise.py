"""verify/mutation.py labels a missed swap of two __jump_table code fields
"another key of the same initial state" only when the image shows that premise:
both entries' key initial state and branch bit ask for the same built form (nop
or jump). A miss whose premise is false is a real miss, so a regression of the
static-key checks shows up as an escape in the mutation test (tests/test_mutation.py).

tests/fixtures/c/jump_swaps.c: four consistent sites in one function; entries 0/1
and 1/2 need different built forms, 2/3 the same one under different keys.
"""

import numpy as np
import pytest

from helpers import build_c

from linepack.image.elf import ElfImage
from linepack.kernel.base import ImageContext
from linepack.kernel.jump_table import JumpTable
from linepack.verify import mutation
from linepack.verify.mutation import TableMutator, patched_context, table_mutations, undetectable

LABEL = ("__jump_table", "key: another key of the same initial state")


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    exe = build_c("jump_swaps.c", tmp_path_factory.mktemp("swaps") / "jump_swaps",
                  "-fno-pie", "-no-pie")
    return ImageContext(ElfImage(exe))


def _code_swaps(ctx):
    """{k: (patches, involved, verify's findings, undetectable class)} of every generated
    swap of entry k's and k+1's code fields."""
    pctx = patched_context(ctx)
    m = TableMutator(ctx, pctx, JumpTable, np.random.default_rng(1))
    assert len(m.entries) == 4
    code = next(f for f in m.fields if f.name == "code")
    out = {}
    for k in range(len(m.entries) - 1):
        for kind, patches, involved in m.mutations(code, k):
            if kind == "swapped pair":
                out[k] = (m.check(k, patches, involved),
                          undetectable(ctx, m.table, code, kind, m.entries, k, patches, pctx))
    return out


def test_premise_is_checked_from_the_image(ctx):
    swaps = _code_swaps(ctx)
    assert sorted(swaps) == [0, 1, 2]
    # nop/jump pairs: verify names the swap, and a miss there would be a real one
    for k in (0, 1):
        found, why = swaps[k]
        assert found, k
        assert why is None, k
    # two nops under different keys: well-formed either way, the documented class
    found, why = swaps[2]
    assert why == LABEL


def test_a_regressed_static_key_check_escapes(ctx, monkeypatch):
    """With the __jump_table checks broken (they find nothing), the swaps of entries that
    need different built forms are escapes, not 'undetectable'."""
    monkeypatch.setattr(JumpTable, "check_window", lambda self, *a, **k: [])
    rows = table_mutations(ctx, np.random.default_rng(3), per_class=8, tables=["__jump_table"])
    swaps = [r for r in rows if r[1] == "code" and r[2] == "swapped pair"]
    assert len(swaps) == 3 and not any(r[5] for r in swaps)
    escapes = [r for r in swaps if r[7] is None]
    assert len(escapes) == 2
    assert [r[7] for r in swaps if r[7] is not None] == [LABEL]


def test_built_form_follows_key_and_branch(ctx):
    e = JumpTable().parse(ctx)
    assert [mutation._built_as_nop(ctx, e["key"][k], e["flags"][k]) for k in range(4)] == \
        [True, False, True, True]
