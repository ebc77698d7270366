"""Block-level splitting of a function with a prefix (``__pfx_<fn>``: 16 NOP bytes
of padding before it, one unit with it): the prefix is the first block of the hot
part and the entry block follows it, so the padding still ends at the function;
the cold part has no prefix; the symbol keeps the hot size from its entry."""

import shutil
import subprocess

import numpy as np
import pytest

from linepack.image import blockmap as bm
from linepack.image.cfg import CFG, R_SPLIT, block_counts
from linepack.image.disasm import disassemble
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.relayout import blocks as B
from linepack.relayout.driver import relayout
from linepack.relayout.units import build_units

import g_program

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# g: its prefix (16 NOPs, __pfx_g), then a hot entry that jumps over a cold block
# to a hot one (tests/g_program.py).


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    return g_program.build(tmp_path_factory.mktemp("pfxsplit"), prefix=True)


_ranges = g_program.hot_ranges


def test_choose_splits_keeps_the_prefix_first(prog):
    exe, _ = prog
    im = ElfImage(str(exe))
    fn = FunctionTable(im)
    units, dis = build_units(im, fn, lambda u: disassemble(im, u))
    heads = B.prefix_heads(units, fn)
    u = int(units.find([im.symbol_address("g")])[0])
    assert heads[u] == 16 and int(units.start[u]) == im.symbol_address("__pfx_g")
    assert heads.sum() == 16                       # no other unit is a prefix + function
    from linepack.image.cfg import TableSites
    sites = TableSites(leaders=(units.start + heads.astype(np.uint64))[heads > 0])
    cfg = CFG(dis, units.start, units.end, sites)
    counts = block_counts(cfg, *_ranges(im))
    heat = np.zeros(len(units))
    heat[u] = 100.0
    # without the heads the unit of two functions is glued and not split
    _, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True)
    assert reason[u] != R_SPLIT
    for order in ("original", "ext-tsp"):
        splits, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True,
                                         block_order=order, heads=heads)
        assert reason[u] == R_SPLIT
        (sf,) = splits
        assert sf.name == "g" and sf.head == 16 and sf.hot_size == sf.sizes[0] - 16
        hot = sf.parts[0]
        # the prefix piece, then the entry block's bytes right after it
        assert hot[0].old == im.symbol_address("__pfx_g") and hot[0].size == 16
        assert hot[0].kind == B.COPY and hot[1].old == im.symbol_address("g")
        assert all(p.old != im.symbol_address("__pfx_g") for p in sf.parts[1])


def test_split_program_runs_same(prog, tmp_path):
    exe, expected = prog
    im = ElfImage(str(exe))
    out = tmp_path / "split"
    summary, plan, rw = relayout(str(exe), str(out), "blocks", hotness={"g": 100.0},
                                 blocks=_ranges(im))
    assert not summary["problems"]
    assert "g" in {sf.name for sf in rw.block_split["splits"]}
    res = subprocess.run([str(out)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0 and res.stdout == expected
    new = ElfImage(str(out))
    names, syms = new.symbol_table()
    g, pfx, cold = (names.index(n) for n in ("g", "__pfx_g", "g.cold"))
    # the prefix still ends at g and is NOPs; g is sized from its entry
    assert int(syms["value"][pfx]) + 16 == int(syms["value"][g])
    assert bytes(new.read(int(syms["value"][pfx]), 16)) == b"\x90" * 16
    assert bytes(new.read(int(syms["value"][g]), 4)) == b"\xf3\x0f\x1e\xfa"
    rows = bm.read_blockmap(new)
    assert bm.check_rows(rows) == []
    hot_end = int(syms["value"][g]) + int(syms["size"][g])
    hot_rows = rows[rows["part"] == bm.PART_HOT]
    assert int((hot_rows["new"] + hot_rows["new_len"]).max()) == hot_end
    assert int(syms["size"][cold]) >= 60
    from linepack.verify.equivalence import verify_against
    from linepack.verify.standalone import verify_image
    rep = verify_image(str(out))
    verify_against(rep, str(out), str(exe))
    errors = [f for f in rep.findings if f.severity == "error"]
    assert not errors, errors[:5]


# a call to g's hot block (not its entry): call-depth tracking would patch a thunk
# into the 16 bytes before that block, so g is not split
CALLER = r"""
    .text
    .globl callmid
    .type callmid, @function
callmid:
    mov $1, %edi
    call g_hot
    ret
    .size callmid, .-callmid
"""


def test_call_after_the_entry_keeps_it_whole(tmp_path):
    from linepack.image.cfg import R_CALL_INSIDE, TableSites
    exe, _ = g_program.build(tmp_path, prefix=True, extra=CALLER)
    im = ElfImage(str(exe))
    fn = FunctionTable(im)
    units, dis = build_units(im, fn, lambda u: disassemble(im, u))
    heads = B.prefix_heads(units, fn)
    cfg = CFG(dis, units.start, units.end,
              TableSites(leaders=(units.start + heads.astype(np.uint64))[heads > 0]))
    u = int(units.find([im.symbol_address("g")])[0])
    heat = np.zeros(len(units))
    heat[u] = 100.0
    splits, reason = B.choose_splits(cfg, units, heat, block_counts(cfg, *_ranges(im)), 1.0, fn,
                                     True, heads=heads)
    assert reason[u] == R_CALL_INSIDE and not splits
