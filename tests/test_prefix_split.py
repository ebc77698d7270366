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

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# g: its prefix (16 NOPs, __pfx_g), then a hot entry that jumps over a cold block
# to a hot one; h: a prefixed function that is not hot (stays whole).
ASM = r"""
    .section .text.hot,"ax",@progbits
    .fill 4096, 1, 0xcc
    .p2align 4
    .type __pfx_g, @function
__pfx_g:
    .fill 16, 1, 0x90
    .size __pfx_g, 16
    .globl g
    .type g, @function
g:
    endbr64
    mov %edi, %eax
    test %edi, %edi
    jns .Lg_hot
.Lg_cold:
    neg %eax
    .rept 20
    add $3, %eax
    .endr
    ret
.Lg_hot:
    add $7, %eax
    ret
    .size g, .-g
    .globl g_cold, g_hot
    .set g_cold, .Lg_cold
    .set g_hot, .Lg_hot
    .section .note.GNU-stack,"",@progbits
"""
MAIN = r"""
#include <stdio.h>
int g(int);
int main(void) {
    long s = 0;
    for (int i = -5; i < 2000; i += 7) s += g(i);
    printf("s=%ld\n", s);
    return 0;
}
"""


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("pfxsplit")
    (d / "g.s").write_text(ASM)
    (d / "main.c").write_text(MAIN)
    exe = d / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(d / "main.c"), str(d / "g.s")], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return exe, out


def _ranges(im):
    """Executed ranges: g's entry block and its hot block (100 times each)."""
    g, cold, hot = (im.symbol_address(n) for n in ("g", "g_cold", "g_hot"))
    fn = FunctionTable(im)
    end = int(fn.end[fn.index_of("g")])
    return (np.array([g, hot], np.uint64), np.array([cold - g, end - hot], np.uint64),
            np.array([100.0, 100.0]))


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
    (tmp_path / "g.s").write_text(ASM.replace('    .section .note.GNU-stack', CALLER +
                                              '    .section .note.GNU-stack'))
    (tmp_path / "main.c").write_text(MAIN)
    exe = tmp_path / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(tmp_path / "main.c"), str(tmp_path / "g.s")], check=True)
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
