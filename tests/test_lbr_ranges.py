"""LBR fall-through ranges -> executed basic blocks (tools/profile/lbr.py).

A small C program whose three functions are written in assembly (exact code
layout) is compiled at test time; the fixtures tests/fixtures/perf/lbr-ranges-*.txt
are `perf script -F ip,brstack` text (newest branch first) following a known path
through them, with {func+0xOFF} placeholders filled in from the ELF.
"""

import subprocess

import numpy as np
import pytest
import helpers

from linepack.cli import main
from linepack.image.elf import ElfImage
from linepack.profile.lbr import INVALID_KINDS, lbr_blocks, pair_ranges
from linepack.profile.model import Profile
from linepack.profile.perf_script import import_perf_script, parse
from linepack.profile.symbolize import Symbolizer
from test_perf_import import func_lookup, write_rendered

C_SRC = r'''
/* Exact code layout: the three lp_* functions are assembly. */
__asm__(
"	.text\n"
"	.p2align 4\n"
"	.globl lp_loop\n"
"	.type lp_loop,@function\n"
"lp_loop:\n"
"	xorl %eax,%eax\n"          /* 0x00, 2 bytes */
"	movl $10,%ecx\n"           /* 0x02, 5 */
"1:	addl $1,%eax\n"            /* 0x07, 3 */
"	subl $1,%ecx\n"            /* 0x0a, 3 */
"	jne 1b\n"                  /* 0x0d, 2 */
"	call lp_leaf\n"            /* 0x0f, 5 */
"	ret\n"                     /* 0x14, 1 */
"	.size lp_loop,.-lp_loop\n"
"	.p2align 4\n"
"	.globl lp_leaf\n"
"	.type lp_leaf,@function\n"
"lp_leaf:\n"
"	movq %rax,%rdx\n"          /* 0x00, 3 */
"	testl %edx,%edx\n"         /* 0x03, 2 */
"	je 2f\n"                   /* 0x05, 2 */
"	addl $2,%eax\n"            /* 0x07, 3 */
"2:	ret\n"                     /* 0x0a, 1 */
"	.size lp_leaf,.-lp_leaf\n"
"	.p2align 4\n"
"	.globl lp_big\n"
"	.type lp_big,@function\n"
"lp_big:\n"
"	.fill 5000,1,0x90\n"       /* 5000 nops: a range over it is too long */
"	ret\n"                     /* 0x1388 */
"	.size lp_big,.-lp_big\n"
);
int lp_loop(void);
void lp_big(void);
int main(void) { lp_big(); return lp_loop() > 0 ? 0 : 1; }
'''

# (function, offset, size, instructions, count) of the blocks the fixture's path executes:
# line 1, oldest first: main -> lp_loop; jne taken twice; call lp_leaf; je taken; ret; ret.
EXPECTED = [
    ("lp_loop", 0x00, 0x7, 2, 1),     # xor, mov (first pass only)
    ("lp_loop", 0x07, 0x8, 3, 3),     # add, sub, jne: three passes
    ("lp_loop", 0x0f, 0x5, 1, 1),     # call
    ("lp_loop", 0x14, 0x1, 1, 1),     # ret
    ("lp_leaf", 0x00, 0x7, 3, 1),     # mov, test, je (taken: 0x07..0x0a never runs)
    ("lp_leaf", 0x0a, 0x1, 1, 1),     # ret
]
INVALID = {"outside": 1, "cross_function": 1, "reversed": 1, "too_long": 1, "not_insn": 1}


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    helpers.require_tool("gcc")
    d = tmp_path_factory.mktemp("lbr")
    src = d / "lbr-ranges.c"
    src.write_text(C_SRC)
    out = str(d / "lbr-ranges")
    subprocess.run(["gcc", "-O1", "-no-pie", "-fno-pie", "-o", out, str(src)], check=True)
    return out


def _addr(prog, name, off=0):
    ft, table = func_lookup(prog)
    return int(ft.start[table[name]]) + off


def _expected_blocks(prog):
    rows = sorted((_addr(prog, f, o), s, i, c) for f, o, s, i, c in EXPECTED)
    return [list(col) for col in zip(*rows)]


@pytest.mark.parametrize("fixture,style", [("lbr-ranges-6.1.txt", "6.1"), ("lbr-ranges-6.12.txt", "6.2+")])
def test_blocks_from_ranges(tmp_path, prog, fixture, style):
    path = write_rendered(tmp_path, fixture, prog)
    ps = parse(open(path, "rb").read(), path)
    assert ps.style == style
    # 7 + 6 + 2 records (the zero entry is dropped); its neighbours stay apart (pos 0 and 2).
    assert len(ps.br_from) == 15
    # br_sample numbers the lines (comments too): increasing, one value per sample.
    assert np.unique(ps.br_sample, return_inverse=True)[1].tolist() == [0] * 7 + [1] * 6 + [2] * 2
    assert ps.br_pos.tolist() == list(range(7)) + list(range(6)) + [0, 2]
    logs = []
    p = import_perf_script(path, prog, log=logs.append)
    addr, size, insns, count = _expected_blocks(prog)
    assert p.block_addr.tolist() == addr
    assert p.block_size.tolist() == size
    assert p.block_insns.tolist() == insns
    assert p.block_count.tolist() == count
    assert p.meta["lbr_ranges"] == 6
    assert p.meta["lbr_ranges_invalid"] == INVALID
    assert p.meta["blocks"] == 6 and p.meta["block_executions"] == 8
    assert p.meta["instructions"] == 2 + 9 + 1 + 1 + 3 + 1
    assert p.function_counts("insns") == {"lp_loop": 13, "lp_leaf": 4}
    # func_blocks / entries stay the taken-branch counts (what fdata carries).
    assert p.function_counts("entries")["lp_loop"] == 1
    assert p.function_counts("blocks")["lp_loop"] == 2 + 2 + 2 + 1 + 1 + 1
    assert any("6 fall-through ranges -> 6 blocks" in ln and "5 invalid range(s) dropped" in ln
               and "1 cross function" in ln for ln in logs), logs


def test_both_styles_agree(tmp_path, prog):
    a = import_perf_script(write_rendered(tmp_path, "lbr-ranges-6.1.txt", prog), prog)
    b = import_perf_script(write_rendered(tmp_path, "lbr-ranges-6.12.txt", prog), prog)
    for name in ("block_addr", "block_size", "block_insns", "block_count", "func_insns", "edge_from",
                 "edge_to", "edge_count"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert int(b.edge_mispred.sum()) == int(a.edge_mispred.sum()) == 1


def test_newest_first_order(prog):
    """Text order is newest first: the range of rows (i, i+1) is [to_{i+1}, from_i]."""
    loop = _addr(prog, "lp_loop")
    # Executed: A = loop+0xd -> loop+0x7, then B = loop+0xf -> leaf; printed B, A.
    f = np.array([loop + 0xf, loop + 0xd], np.uint64)
    t = np.array([_addr(prog, "lp_leaf"), loop + 0x7], np.uint64)
    s, e = pair_ranges(f, t, np.array([0, 0]), np.array([0, 1]))
    assert s.tolist() == [loop + 0x7] and e.tolist() == [loop + 0xf]
    # Different samples or a gap in the positions: no range.
    assert len(pair_ranges(f, t, np.array([0, 1]), np.array([0, 0]))[0]) == 0
    assert len(pair_ranges(f, t, np.array([0, 0]), np.array([0, 2]))[0]) == 0


def test_max_len_and_counts(prog):
    image = ElfImage(prog)
    sym = Symbolizer(image)
    big = _addr(prog, "lp_big")
    f = np.array([big + 0x1388, big + 0x1388, _addr(prog, "main")], np.uint64)
    t = np.array([0x10, 0x10, big], np.uint64)
    smp, pos = np.array([0, 1, 1]), np.array([0, 0, 1])
    blocks, st = lbr_blocks(image, sym, f, t, smp, pos)
    assert st["ranges"] == 0 and st["ranges_invalid"]["too_long"] == 1 and not len(blocks["block_addr"])
    blocks, st = lbr_blocks(image, sym, f, t, smp, pos, max_len=8192)
    assert st["ranges"] == 1 and sum(st["ranges_invalid"].values()) == 0
    assert blocks["block_addr"].tolist() == [big] and blocks["block_size"].tolist() == [5001]
    assert blocks["block_insns"].tolist() == [5001] and blocks["block_count"].tolist() == [1]
    assert set(st["ranges_invalid"]) == set(INVALID_KINDS)


def test_saved_profile_and_show(tmp_path, prog, capsys):
    path = write_rendered(tmp_path, "lbr-ranges-6.1.txt", prog)
    out = str(tmp_path / "r.lpprof")
    assert main(["profile", "--perf-script", path, "--image", prog, "-o", out]) == 0
    capsys.readouterr()
    q = Profile.load(out)
    addr, size, insns, count = _expected_blocks(prog)
    assert q.block_addr.tolist() == addr and q.block_count.tolist() == count
    assert q.meta["lbr_ranges_invalid"] == INVALID
    assert main(["profile", "--show", out, "--image", prog]) == 0
    shown = capsys.readouterr().out
    assert "6 blocks" in shown and "8 block executions" in shown and "17 instructions" in shown
    # relayout's block-aware pack reads these blocks.
    from linepack.relayout.plan import profile_blocks
    ba, bs, bc = profile_blocks(q)
    assert ba.tolist() == addr and bs.tolist() == size and bc.tolist() == count


def test_ranges_can_be_disabled(tmp_path, prog):
    path = write_rendered(tmp_path, "lbr-ranges-6.1.txt", prog)
    p = import_perf_script(path, prog, ranges=False)
    assert len(p.block_addr) == 0 and "lbr_ranges" not in p.meta
