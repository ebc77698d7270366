"""End to end on a small C program linked with --emit-relocs (compiled at test time)."""

import json
import os
import subprocess

import numpy as np
import pytest
import helpers

from linepack.errors import BadInput
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.relayout.driver import load_profile, relayout

_requirements = helpers.requirements("gcc")

PROG = r'''
#include <stdio.h>
typedef int (*op_t)(int, int);
static int __attribute__((noinline)) add(int a, int b) { return a + b; }
static int __attribute__((noinline)) sub(int a, int b) { return a - b; }
static int __attribute__((noinline)) mul(int a, int b) { return a * b; }
int __attribute__((noinline)) mix(int a, int b) { return add(a, b) ^ sub(b, a) ^ mul(a, 3); }
static const op_t ops[] = { add, sub, mul, mix };
static int counter;
int __attribute__((noinline)) classify(int x) {
    switch (x & 7) {
    case 0: return add(x, 11); case 1: return sub(x, 7); case 2: return mul(x, 5);
    case 3: return x ^ 0x55; case 4: return mix(x, x); case 5: return x * x - 1;
    case 6: return counter += x; default: return -x;
    }
}
static unsigned __attribute__((noinline)) hash(const char *s) {
    unsigned h = 5381; while (*s) h = h * 33 + (unsigned char)*s++; return h;
}
int __attribute__((noinline)) recurse(int n) { return n <= 1 ? 1 : n * recurse(n - 1) % 100003; }
/* A tail call between two functions in one section: jmp rel32 with no relocation. */
static int __attribute__((noinline)) tail2(int x) { return x * 7 + 1; }
int __attribute__((noinline)) tail1(int x) { if (x > 3) return tail2(x - 1); return x; }
/* A RIP-relative reference to a function with no relocation (same section). */
int where(void) { void *p; __asm__("lea tail2(%%rip), %0" : "=r"(p)); return p == (void *)tail2; }
void *fptr_for_data = (void *)recurse;
int main(void) {
    long acc = 0;
    for (int i = 0; i < 1000; i++) acc += ops[i & 3](i, 7) + classify(i) + tail1(i);
    int (*r)(int) = (int (*)(int))fptr_for_data;
    printf("acc=%ld hash=%u rec=%d counter=%d where=%d\n", acc, hash("linepack"), r(12),
           counter, where());
    return 0;
}
'''


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("fx")
    (d / "prog.c").write_text(PROG)
    exe = d / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(d / "prog.c")], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    prof = d / "prof.json"
    prof.write_text(json.dumps({"functions": {
        "classify": 100, "hash.constprop.0": 90, "recurse": 80, "mix": 70, "tail2": 65,
        "mul": 60, "sub": 50, "add": 40, "main": 30, "where": 20}}))
    return exe, out, prof


def run(path):
    return subprocess.run([str(path)], capture_output=True, text=True, timeout=20).stdout


@pytest.mark.parametrize("strategy", ["align-all 64", "align-all 512", "hot64", "pack", "align-all 1"])
def test_relayout_runs_same(prog, tmp_path, strategy):
    exe, expected, prof = prog
    hot, _, _ = load_profile(str(prof))
    out = tmp_path / "out"
    summary, plan, rw = relayout(str(exe), str(out), strategy, hotness=hot)
    assert run(out) == expected
    assert not summary["problems"]
    if strategy != "align-all 1":
        assert summary["units_moved"] > 0
    # Input untouched, output executable, symbols moved as planned.
    ft = FunctionTable(ElfImage(str(out)))
    if strategy.startswith("align-all") and strategy != "align-all 1":
        n = int(strategy.split()[1])
        i = ft.index_of("classify")
        assert int(ft.start[i]) % n == 0


def test_reversed_order(prog, tmp_path):
    exe, expected, _ = prog
    ft = FunctionTable(ElfImage(str(exe)))
    # Hotter the later it was: hot64 reverses the order of the text.
    hot = {n: float(i + 1) for i, n in enumerate(ft.name)}
    out = tmp_path / "rev"
    summary, plan, rw = relayout(str(exe), str(out), "hot64", hotness=hot)
    assert run(out) == expected
    nft = FunctionTable(ElfImage(str(out)))
    a, b = nft.start[nft.index_of("classify")], nft.start[nft.index_of("add")]
    assert a < b
    assert summary["branches.rel32_fixed"] > 0      # assembler-resolved calls were fixed
    assert summary["rip_relative.fixed"] >= 1       # the lea tail2(%rip) in where()
    # whole functions: the function-level pass list on the userspace target
    from linepack.relayout.passes import FUNCTION_PASSES
    assert [n for n, _ in summary.stats] == [n for n, _ in FUNCTION_PASSES]
    assert rw.block_split is None and summary.stats[0][1].kind == "userspace"


def test_stock_is_byte_identical_and_reproducible(prog, tmp_path):
    exe, _, prof = prog
    hot, _, _ = load_profile(str(prof))
    relayout(str(exe), str(tmp_path / "s"), "stock", hotness=hot)
    assert (tmp_path / "s").read_bytes() == exe.read_bytes()
    relayout(str(exe), str(tmp_path / "p1"), "pack", hotness=hot)
    relayout(str(exe), str(tmp_path / "p2"), "pack", hotness=hot)
    assert (tmp_path / "p1").read_bytes() == (tmp_path / "p2").read_bytes()
    assert os.access(tmp_path / "p1", os.X_OK)


def test_relocations_stay_valid(prog, tmp_path):
    """Every relocated PC32/PLT32 field in the output agrees with its relocation."""
    exe, _, prof = prog
    hot, _, _ = load_profile(str(prof))
    out = tmp_path / "v"
    relayout(str(exe), str(out), "pack", hotness=hot)
    _, _, rw = relayout(str(out), str(tmp_path / "again"), "stock")
    assert rw.stats["relocations.stale"] <= relayout(str(exe), str(tmp_path / "s2"),
                                                     "stock")[2].stats["relocations.stale"]


def test_refuses_without_relocations(prog, tmp_path):
    exe, _, _ = prog
    plain = tmp_path / "plain"
    subprocess.run(["gcc", "-O2", "-no-pie", "-o", str(plain), "-x", "c", "-"],
                   input="int main(void){return 0;}", text=True, check=True)
    with pytest.raises(BadInput, match="emit-relocs"):
        relayout(str(plain), str(tmp_path / "o"), "pack")


def test_refuses_output_equal_input(prog, tmp_path):
    exe, _, _ = prog
    with pytest.raises(BadInput, match="input"):
        relayout(str(exe), str(exe), "pack")


def test_layout_and_system_map(prog, tmp_path):
    exe, _, prof = prog
    hot, _, _ = load_profile(str(prof))
    lm, sm = tmp_path / "layout.tsv", tmp_path / "System.map"
    relayout(str(exe), str(tmp_path / "o"), "align-all 64", hotness=hot,
             layout_map=str(lm), system_map=str(sm))
    rows = [l.split("\t") for l in lm.read_text().splitlines() if not l.startswith("#")]
    assert any(r[0] == "classify" and int(r[2], 16) % 64 == 0 for r in rows)
    nft = FunctionTable(ElfImage(str(tmp_path / "o")))
    line = [l for l in sm.read_text().splitlines() if l.endswith(" classify")][0]
    assert int(line.split()[0], 16) == int(nft.start[nft.index_of("classify")])


def test_layout_that_does_not_fit_goes_to_a_new_segment(prog, tmp_path):
    """No room after .text: the moved code goes to a new segment (not refused)."""
    exe, _, _ = prog
    tiny = tmp_path / "tiny"
    src = tmp_path / "t.c"
    src.write_text("int f1(int x){return x+1;} int f2(int x){return f1(x)*3;}"
                   "int main(int c, char **v){return f2(c);}")
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(tiny),
                    str(src)], check=True)
    out = tmp_path / "o"
    said = []
    summary, _, _ = relayout(str(tiny), str(out), "align-all 512", log=said.append)
    assert summary["new_segment"]["text_bytes"] >= 3 * 512
    # the log says where the code went, without the planner's advice for layouts that must fit
    (line,) = [m for m in said if "goes to a new segment" in m]
    assert line.startswith("layout does not fit") and "less padding" not in line
    assert subprocess.run([str(out), "x"]).returncode == subprocess.run([str(tiny), "x"]).returncode
    im = ElfImage(str(out))
    seg = max((p for p in im.phdrs if int(p["type"]) == 1), key=lambda p: int(p["vaddr"]))
    f1 = im.symbol_address("f1")
    assert int(seg["vaddr"]) <= f1 < int(seg["vaddr"]) + int(seg["memsz"])
