"""Block-level split: a small cold block stays in the hot part when that makes the
hot part smaller (relayout/blocks.py keep_small_cold, the ``blocks`` strategy's
``inline_cold_max``), on a program built at test time.

h(x) has three cold blocks, each reached from a hot block:
- ``.Lh_inc``: 2 bytes (``inc %eax``) the hot ``jne`` skips: moved out, the jne
  becomes a 6-byte ``je`` into the cold part; inline it stays 2 bytes, plus the
  block's 2: the hot part is 2 bytes smaller, so it stays;
- ``.Lh_t4``: 4 bytes (``xor; jmp``) after the ``ret``: inline costs as many bytes
  as the longer ``je`` saves, so it goes to the cold part;
- ``.Lh_big``: 122 bytes, cold part.
"""

import subprocess

import numpy as np
import pytest
import helpers

from linepack.image import blockmap as bm
from linepack.image.cfg import CFG, block_counts
from linepack.image.disasm import disassemble
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.relayout import blocks as B
from linepack.relayout import strategies
from linepack.relayout.driver import relayout
from linepack.relayout.units import build_units

_requirements = helpers.requirements("gcc")

ASM = r"""
    .section .text.hot,"ax",@progbits
    .fill 4096, 1, 0xcc
    .p2align 4
    .globl h
    .type h, @function
h:
    mov %edi, %eax
    cmp $-1, %edi
    jne .Lh_skip
.Lh_inc:
    inc %eax
.Lh_skip:
    cmp $100000, %edi
    jg .Lh_big
    cmp $-3, %edi
    je .Lh_t4
    add $7, %eax
.Lh_end:
    ret
.Lh_t4:
    xor %eax, %eax
    jmp .Lh_end
.Lh_big:
    .rept 40
    add $3, %eax
    .endr
    jmp .Lh_end
    .size h, .-h
    .globl h_inc, h_skip, h_t4, h_big
    .set h_inc, .Lh_inc
    .set h_skip, .Lh_skip
    .set h_t4, .Lh_t4
    .set h_big, .Lh_big
    .section .note.GNU-stack,"",@progbits
"""

MAIN = r"""
#include <stdio.h>
int h(int);
int main(void) {
    long s = 0;
    for (int i = -5; i < 2000; i += 7) s += h(i);
    s += 3 * h(-1) + 5 * h(-3) + 7 * h(200000);
    printf("s=%ld\n", s);
    return 0;
}
"""


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("ksc")
    (d / "h.s").write_text(ASM)
    (d / "main.c").write_text(MAIN)
    exe = d / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(d / "main.c"), str(d / "h.s")], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return exe, out


def _ranges(im):
    """Executed ranges: h's entry block, and .Lh_skip up to .Lh_t4 (100 times each)."""
    h, inc, skip, t4 = (im.symbol_address(n) for n in ("h", "h_inc", "h_skip", "h_t4"))
    return (np.array([h, skip], np.uint64), np.array([inc - h, t4 - skip], np.uint64),
            np.array([100.0, 100.0]))


def _split(exe, inline_cold_max):
    im = ElfImage(str(exe))
    fn = FunctionTable(im)
    units, dis = build_units(im, fn, lambda u: disassemble(im, u))
    cfg = CFG(dis, units.start, units.end, None)
    counts = block_counts(cfg, *_ranges(im))
    heat = np.zeros(len(units))
    u = int(units.find([im.symbol_address("h")])[0])
    heat[u] = 100.0
    splits, _ = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True, invert_jcc=True,
                                inline_cold_max=inline_cold_max)
    (sf,) = [s for s in splits if s.unit == u]
    return im, cfg, sf


def _part_of(im, cfg, sf, name):
    b = int(np.searchsorted(cfg.start, np.uint64(im.symbol_address(name))))
    assert int(cfg.start[b]) == im.symbol_address(name)
    return sf.block_part[b]


def test_a_small_cold_block_stays_where_it_makes_the_hot_part_smaller(prog):
    exe, _ = prog
    im, cfg, off = _split(exe, 0)
    _, _, on = _split(exe, 16)
    # without: every cold block in the cold part; the jne over .Lh_inc became a
    # 6-byte je into the cold part
    assert [_part_of(im, cfg, off, n) for n in ("h_inc", "h_t4", "h_big")] == [1, 1, 1]
    jcc_at = im.symbol_address("h") + 5          # mov (2) + cmp $-1 (3)
    (jcc,) = [p for p in off.parts[0] if p.old == jcc_at]
    assert jcc.size == 6 and jcc.long
    # with: .Lh_inc (2 bytes) stays, right after the entry block; the jcc is 2 bytes
    # and the hot part 2 bytes smaller. .Lh_t4 (4 bytes) would save nothing: cold.
    assert [_part_of(im, cfg, on, n) for n in ("h_inc", "h_t4", "h_big")] == [0, 1, 1]
    (jcc,) = [p for p in on.parts[0] if p.old == jcc_at]
    assert jcc.size == 2 and not jcc.long
    assert on.sizes[0] == off.sizes[0] - 2
    # the cold part loses the block and its jmp back to .Lh_skip
    assert on.sizes[1] == off.sizes[1] - 2 - 5
    # the kept block follows the entry block in the hot order; its short branches reach
    assert on.blocks[0][:2] == [on.blocks[0][0], int(np.searchsorted(
        cfg.start, np.uint64(im.symbol_address("h_inc"))))]
    for part in (0, 1):
        for p in on.parts[part]:
            if p.kind in (bm.KIND_BRANCH, bm.KIND_JMP_INSERTED) and not p.long:
                d = on.first[part][p.target_block] - (p.off + p.size)
                assert -128 <= d <= 127


def test_the_rewritten_program_runs_the_same_and_verifies(prog, tmp_path):
    exe, expected = prog
    im = ElfImage(str(exe))
    out = tmp_path / "h.out"
    summary, _, rw = relayout(str(exe), str(out), strategies.get("blocks"),
                              hotness={"h": 100.0, "main": 100.0}, blocks=_ranges(im))
    assert not summary["problems"]
    sf = next(s for s in rw.block_split["splits"] if s.name == "h")
    cfg = rw.block_split["cfg"]
    assert [_part_of(im, cfg, sf, n) for n in ("h_inc", "h_t4", "h_big")] == [0, 1, 1]
    res = subprocess.run([str(out)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0 and res.stdout == expected
    from linepack.verify.equivalence import verify_against
    from linepack.verify.standalone import verify_image
    report = verify_image(str(out))
    verify_against(report, str(out), str(exe))
    bad = [f for f in report.findings if f.check.startswith("equiv.") or f.severity == "error"]
    assert bad == [], [(f.check, f.message) for f in bad]


# k(x) with a kernel-style prefix: a cold ``jmp k`` (x == -1) is worth keeping (2 bytes
# against the long je's 4 more); right before the entry the jmp would disappear, but
# the prefix's padding must end at the entry (the symbol and its ENDBR)
PFX_ASM = r"""
    .section .text.hot,"ax",@progbits
    .fill 4096, 1, 0xcc
    .p2align 4
    .type __pfx_k, @function
__pfx_k:
    .fill 16, 1, 0x90
    .size __pfx_k, 16
    .globl k
    .type k, @function
k:
    endbr64
    inc %edi
    mov %edi, %eax
    test %edi, %edi
    jne .Lk_skip
.Lk_again:
    jmp k
.Lk_skip:
    cmp $100000, %edi
    jg .Lk_big
    add $7, %eax
    ret
.Lk_big:
    .rept 40
    add $3, %eax
    .endr
    ret
    .size k, .-k
    .globl k_again, k_skip, k_big
    .set k_again, .Lk_again
    .set k_skip, .Lk_skip
    .set k_big, .Lk_big
    .section .note.GNU-stack,"",@progbits
"""


def test_a_kept_block_never_goes_between_the_prefix_and_the_entry(tmp_path):
    (tmp_path / "k.s").write_text(PFX_ASM)
    (tmp_path / "main.c").write_text(MAIN.replace("h(", "k("))
    exe = tmp_path / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(tmp_path / "main.c"), str(tmp_path / "k.s")], check=True)
    im = ElfImage(str(exe))
    fn = FunctionTable(im)
    units, dis = build_units(im, fn, lambda u: disassemble(im, u))
    heads = B.prefix_heads(units, fn)
    u = int(units.find([im.symbol_address("k")])[0])
    assert heads[u] == 16
    from linepack.image.cfg import TableSites
    cfg = CFG(dis, units.start, units.end,
              TableSites(leaders=(units.start + heads.astype(np.uint64))[heads > 0]))
    k, again, skip, big = (im.symbol_address(n) for n in ("k", "k_again", "k_skip", "k_big"))
    counts = block_counts(cfg, np.array([k, skip], np.uint64),
                          np.array([again - k, big - skip], np.uint64), np.array([100.0, 100.0]))
    heat = np.zeros(len(units))
    heat[u] = 100.0
    for order in ("original", "ext-tsp"):
        splits, _ = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True, invert_jcc=True,
                                    block_order=order, heads=heads, inline_cold_max=16)
        (sf,) = [s for s in splits if s.unit == u]
        hot = sf.parts[0]
        assert hot[0].old == im.symbol_address("__pfx_k") and hot[0].size == 16
        assert hot[1].kind == B.COPY and hot[1].old == k
        # kept, after the entry block
        assert _part_of(im, cfg, sf, "k_again") == 0
        assert sf.blocks[0].index(int(np.searchsorted(cfg.start, np.uint64(again)))) > 1
    # the program still computes the same
    out = tmp_path / "k.out"
    summary, _, _ = relayout(str(exe), str(out), strategies.get("blocks"),
                             hotness={"k": 100.0, "main": 100.0},
                             blocks=(np.array([k, skip], np.uint64),
                                     np.array([again - k, big - skip], np.uint64),
                                     np.array([100.0, 100.0])))
    assert not summary["problems"]
    want = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([str(out)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0 and res.stdout == want


def test_the_c_sizing_of_a_hot_part_is_build_parts_own(tmp_path):
    """keep_small_cold sizes its tries in C (parts.c, HotPartSizer): on the functions of
    a real static executable (glibc's code: jcc, jmp, jrcxz, padding after branches),
    random hot sets and orders, the size is what build_parts + _relax_parts give."""
    exe = helpers.build_c("split_user.c", tmp_path / "su", "-Wl,--emit-relocs", static=True)
    im = ElfImage(exe)
    fn = FunctionTable(im)
    units, dis = build_units(im, fn, lambda u: disassemble(im, u))
    cfg = CFG(dis, units.start, units.end, None)
    falls = cfg.falls_through()
    columns = B.PartColumns(cfg, falls, [cfg.blocks_of(u) for u in range(len(units))])
    rng = np.random.default_rng(22)
    many = [u for u in range(len(units)) if 3 <= cfg.blocks_of(u)[1] - cfg.blocks_of(u)[0]]
    assert len(many) > 300
    compared = native = 0
    for u in rng.choice(many, 300, replace=False).tolist():
        a, z = cfg.blocks_of(u)
        for trial in range(4):
            short_keys, invert = bool(trial & 1), bool(trial & 2)

            def build(m, o, h, u=u, short_keys=short_keys, invert=invert):
                return B.build_parts(cfg, u, u, "f", m, short_keys, 0, falls, invert, o, h)
            mask = np.zeros(len(cfg.start), bool)
            mask[a:z] = rng.random(z - a) < 0.6
            mask[a] = True
            order = [b for b in range(a, z) if mask[b]]
            if trial >= 2:
                rest = order[1:]
                rng.shuffle(rest)
                order = order[:1] + rest
            want = build(mask, order, True)
            sizer = B.HotPartSizer(cfg, u, short_keys, falls, invert, build)
            assert sizer.size(mask, order) == (None if want is None else want.sizes[0])
            # the columns of every block made once (choose_splits'): the same answer
            shared = B.HotPartSizer(cfg, u, short_keys, falls, invert, build, columns=columns)
            assert shared.size(mask, order) == (None if want is None else want.sizes[0])
            native += sizer.lib is not None
            compared += 1
            assert (shared.lib is None) == (sizer.lib is None)
            if sizer.lib is not None:
                for name in ("copy_len", "trail", "tb", "kind", "flags"):
                    mine, theirs = getattr(shared, name), getattr(sizer, name)
                    assert mine.dtype == theirs.dtype and mine.tolist() == theirs.tolist()
    assert native == compared        # all in C (a test machine has gcc)
