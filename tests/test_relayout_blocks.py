"""Block-level relayout (strategy ``blocks``) on a fixture built at test time:
CFG leaders and terminators, branch relaxation to a fixpoint (a rel8 that
loses reach grows, a rel32 brought near shrinks, static-key sites both ways),
and an end-to-end split whose program still prints the same output."""

import subprocess

import numpy as np
import pytest
import g_program
import helpers

from linepack.image import blockmap as bm
from linepack.image.cfg import (CFG, R_SPLIT, TERM_FALL, TERM_JCC, TERM_JMP, TERM_STOP, TableSites,
                                block_counts)
from linepack.image.disasm import disassemble
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.relayout import blocks as B
from linepack.relayout import strategies
from linepack.relayout.driver import relayout
from linepack.relayout.units import build_units

_requirements = helpers.requirements("gcc")

# f sits in .text.hot (between main in .text.startup and crt's code in .text) so
# that it is a unit of its own.
# f(x): hot path entry -> key sites -> jmp to .Lhot3 over a 360-byte cold block,
# .Lhot2/.Lhot3 hot. .Lneg (x < 0) is cold. .Lkey5 is a nop5 static-key site whose
# target (.Lhot3) is far before the split and near after; .Lkey2 a nop2 site whose
# target (.Lneg) is near before and in the cold part after.
ASM = r"""
    .section .text.hot,"ax",@progbits
    .fill 4096, 1, 0xcc         # room for the layout (dropped padding before f)
    .p2align 4
    .globl f
    .type f, @function
f:
    mov %edi, %eax
    test %edi, %edi
    js .Lneg
.Lkey5:
    .byte 0x0f, 0x1f, 0x44, 0x00, 0x00
.Lkey2:
    .byte 0x66, 0x90
    add $1, %eax
    {disp32} jmp .Lhot3
.Lneg:
    neg %eax
    .rept 60
    add $3, %eax
    .endr
    .rept 60
    sub $3, %eax
    .endr
    ret
.Lud2:
    ud2                         # unreachable here; a WARN() site when the table says so
.Lhot2:
    add $2, %eax
.Lhot3:
    add $5, %eax
    cmp $1000, %eax
    jl .Lhot2
    ret
    .size f, .-f
    .globl key5, key2, hot3, neg_block, hot2, ud2_site
    .set key5, .Lkey5
    .set key2, .Lkey2
    .set hot3, .Lhot3
    .set hot2, .Lhot2
    .set neg_block, .Lneg
    .set ud2_site, .Lud2
    .section .note.GNU-stack,"",@progbits
"""
MAIN = r"""
#include <stdio.h>
int f(int);
int main(void) {
    long s = 0;
    for (int i = -5; i < 2000; i += 7) s += f(i);
    printf("s=%ld\n", s);
    return 0;
}
"""


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("blk")
    (d / "f.s").write_text(ASM)
    (d / "main.c").write_text(MAIN)
    exe = d / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(d / "main.c"), str(d / "f.s")], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return exe, out


def _cfg(exe, sites=None):
    im = ElfImage(str(exe))
    fn = FunctionTable(im)
    units, dis = build_units(im, fn, lambda u: disassemble(im, u))
    return im, fn, units, dis, CFG(dis, units.start, units.end, sites)


def _sym(im, name):
    return im.symbol_address(name)


def _hot_ranges(im):
    """Executed ranges: f's entry up to .Lneg and .Lhot2..end (count 100 each)."""
    f, neg, hot2 = _sym(im, "f"), _sym(im, "neg_block"), _sym(im, "hot2")
    fn = FunctionTable(im)
    end = int(fn.end[fn.index_of("f")])
    return (np.array([f, hot2], np.uint64), np.array([neg - f, end - hot2], np.uint64),
            np.array([100.0, 100.0]))


def test_cfg_leaders_and_terminators(prog):
    exe, _ = prog
    im, fn, units, dis, cfg = _cfg(exe)
    u = int(units.find([_sym(im, "f")])[0])
    a, z = cfg.blocks_of(u)
    starts = cfg.start[a:z].tolist()
    for label in ("f", "neg_block", "hot2", "hot3"):
        assert _sym(im, label) in starts, label
    # the block holding the js ends in a jcc to .Lneg; the one before .Lneg in a jmp
    bj = starts.index(_sym(im, "f"))
    assert cfg.term[a + bj] == TERM_JCC and int(cfg.target[a + bj]) == _sym(im, "neg_block")
    bn = starts.index(_sym(im, "neg_block"))
    assert cfg.term[a + bn - 1] == TERM_JMP and int(cfg.target[a + bn - 1]) == _sym(im, "hot3")
    assert cfg.term[a + bn] == TERM_STOP                     # the cold block ends in ret
    assert cfg.reason[u] == R_SPLIT
    # no block crosses a leader: blocks tile the function
    assert (cfg.end[a:z - 1] == cfg.start[a + 1:z]).all()


def test_warn_ud2_falls_through(prog):
    """A BUG() ud2 ends control flow; a WARN() ud2 (bug table flag) resumes after itself."""
    exe, _ = prog
    im = ElfImage(str(exe))
    ud2 = _sym(im, "ud2_site")
    for warn, term in (((), TERM_STOP), ((ud2,), TERM_FALL)):
        _, _, _, _, cfg = _cfg(exe, TableSites(warn=warn))
        b = int(np.searchsorted(cfg.start, np.uint64(ud2)))
        assert int(cfg.start[b]) == ud2 and cfg.term[b] == term


def test_atomic_range_is_one_block(prog):
    exe, _ = prog
    im = ElfImage(str(exe))
    key5 = _sym(im, "key5")
    # an "alternative site" over the two key sites and the add after them
    sites = TableSites(leaders=[key5], atomic_lo=[key5], atomic_hi=[_sym(im, "key2") + 5])
    _, _, units, _, cfg = _cfg(exe, sites)
    inside = (cfg.start > np.uint64(key5)) & (cfg.start < np.uint64(key5 + 10))
    assert not inside.any()
    assert key5 in cfg.start.tolist()


def _split(exe, short_keys=True, with_keys=True):
    im = ElfImage(str(exe))
    sites = None
    if with_keys:
        sites = TableSites(leaders=[], key_code=[_sym(im, "key5"), _sym(im, "key2")],
                           key_target=[_sym(im, "hot3"), _sym(im, "neg_block")])
    im, fn, units, dis, cfg = _cfg(exe, sites)
    counts = block_counts(cfg, *_hot_ranges(im))
    heat = np.zeros(len(units))
    u = int(units.find([_sym(im, "f")])[0])
    heat[u] = 100.0
    splits, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, short_keys)
    assert reason[u] == R_SPLIT
    (sf,) = [s for s in splits if s.unit == u]
    return im, cfg, sf


def _pieces(sf, part):
    return [(p.old, p.kind, p.size) for p in sf.parts[part]]


def test_relaxation_fixpoint_and_static_keys(prog):
    exe, _ = prog
    im, cfg, sf = _split(exe)
    by_old = {p.old: p for part in sf.parts for p in part}
    f = _sym(im, "f")
    js_at = f + 4                      # mov (2) + test (2)
    js = by_old[js_at]
    # a rel8 jcc whose target went to the cold part grows to rel32
    assert js.kind == bm.KIND_BRANCH and js.size == 6 and js.long
    # the nop5 site whose target (.Lhot3) is now near shrinks to nop2 ...
    k5 = by_old[_sym(im, "key5")]
    assert k5.form == B.FORM_KEY_NOP and k5.size == 2
    # ... the nop2 site whose target (.Lneg) went cold grows to nop5
    k2 = by_old[_sym(im, "key2")]
    assert k2.form == B.FORM_KEY_NOP and k2.size == 5
    # the {disp32} jmp over the cold block: .Lhot2 comes next, so it stays a jump, now rel8
    jmps = [p for p in sf.parts[0] if p.kind == bm.KIND_BRANCH and p.form == B.FORM_JMP]
    assert jmps and all(p.size == 2 for p in jmps)
    # cold part: the .Lneg block and the unreachable ud2, copied
    assert [p.old for p in sf.parts[1]] == [_sym(im, "neg_block"), _sym(im, "ud2_site")]
    # every in-part short branch reaches its target (the fixpoint holds)
    for part in (0, 1):
        for p in sf.parts[part]:
            if p.kind in (bm.KIND_BRANCH, bm.KIND_JMP_INSERTED) and not p.long:
                d = sf.first[part][p.target_block] - (p.off + p.size)
                assert -128 <= d <= 127


def test_relaxation_grows_in_part_rel8(prog):
    """A short in-part branch pushed out of reach by grown branches grows too."""
    exe, _ = prog
    im, cfg, sf = _split(exe)
    part = sf.parts[0]
    # the loop's jl back to .Lhot2 is short; grow .Lhot2's copied bytes past rel8 reach
    jl = next(p for p in part if p.kind == bm.KIND_BRANCH and p.form == B.FORM_JCC and not p.long)
    assert jl.size == 2
    pad = next(p for p in part if p.kind == bm.KIND_COPIED and p.block == jl.target_block)
    pad.old_len = pad.size = 300                  # the block now spans 300 bytes
    B._relax(sf)
    assert jl.long and jl.size == 6


def test_no_keys_before_5_14(prog):
    exe, _ = prog
    _, _, sf = _split(exe, short_keys=False)
    keys = [p for part in sf.parts for p in part if p.form in (B.FORM_KEY_NOP, B.FORM_KEY_JMP)]
    assert keys and all(p.size == 5 for p in keys)


def test_split_program_runs_same(prog, tmp_path):
    exe, expected = prog
    im = ElfImage(str(exe))
    out = tmp_path / "split"
    smap = tmp_path / "System.map"
    summary, plan, rw = relayout(str(exe), str(out), "blocks", hotness={"f": 100.0, "main": 100.0},
                                 blocks=_hot_ranges(im), system_map=str(smap))
    assert not summary["problems"]
    # f, and main when .eh_frame has no room for its cold FDE in place (a new segment)
    assert "f" in {sf.name for sf in rw.block_split["splits"]}
    assert summary["split"]["functions_split"] == 1 + ("new_segment" in summary)
    from linepack.relayout.passes import BLOCK_PASSES
    assert [n for n, _ in summary.stats] == [n for n, _ in BLOCK_PASSES]
    res = subprocess.run([str(out)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0 and res.stdout == expected
    new = ElfImage(str(out))
    rows = bm.read_blockmap(new)
    assert rows is not None and bm.check_rows(rows) == [] and len(rows) >= 5
    # f keeps its symbol at its hot part with the hot part's size; f.cold holds the rest
    names, syms = new.symbol_table()
    fi, ci = names.index("f"), names.index("f.cold")
    f_old = int(im.symbol_address("f"))
    f_id = rows["func"][rows["old"] == f_old][0]
    cold_rows = rows[(rows["part"] == bm.PART_COLD) & (rows["func"] == f_id)]
    assert int(syms["value"][ci]) == int(cold_rows["new"].min())
    assert int(syms["size"][fi]) + int(syms["size"][ci]) < 410
    assert int(syms["size"][ci]) >= 360
    lines = smap.read_text().splitlines()
    assert f"{int(syms['value'][ci]):016x} t f.cold" in lines
    assert lines == sorted(lines, key=lambda r: (r[:16], r[19:]))
    # byte-reproducible
    relayout(str(exe), str(tmp_path / "again"), "blocks", hotness={"f": 100.0, "main": 100.0},
             blocks=_hot_ranges(im))
    assert (tmp_path / "again").read_bytes() == out.read_bytes()


# g(x): jns to the hot block right after a cold one (tests/g_program.py): with
# invert_jcc the jns becomes js to the cold block and the hot path falls through
# (no appended jmp).


@pytest.fixture(scope="module")
def prog_g(tmp_path_factory):
    return g_program.build(tmp_path_factory.mktemp("blkg"))


_g_hot_ranges = g_program.hot_ranges


@pytest.mark.parametrize("invert", [False, True])
def test_jcc_inversion(prog_g, tmp_path, invert):
    exe, expected = prog_g
    im, fn, units, dis, cfg = _cfg(exe)
    counts = block_counts(cfg, *_g_hot_ranges(im))
    heat = np.zeros(len(units))
    u = int(units.find([_sym(im, "g")])[0])
    heat[u] = 100.0
    splits, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True, invert_jcc=invert)
    (sf,) = [s for s in splits if s.unit == u]
    jcc_at = _sym(im, "g") + 4                       # mov (2) + test (2)
    jcc = next(p for p in sf.parts[0] if p.old == jcc_at)
    inserted = [p for p in sf.parts[0] if p.kind == bm.KIND_JMP_INSERTED]
    if invert:
        # js (0x78) to the cold block, long (other part); the hot block follows
        assert jcc.inverted and jcc.cc == 0x8 and jcc.long and jcc.size == 6
        assert sf.block_part[jcc.target_block] == 1 and not inserted
    else:
        # jns (0x79) to the next hot block (short) plus a jmp to the cold fall-through
        assert not jcc.inverted and jcc.cc == 0x9 and jcc.size == 2
        assert len(inserted) == 1 and inserted[0].size == 5
    # the rewritten program computes the same, and the block-level proof accepts it
    out = tmp_path / "g.out"
    strat = strategies.get({"strategy": "blocks", "invert_jcc": invert})
    summary, _, rw = relayout(str(exe), str(out), strat, hotness={"g": 100.0, "main": 100.0},
                              blocks=_g_hot_ranges(im))
    # g, and main when .eh_frame has no room for its cold FDE in place (a new segment)
    assert summary["split"]["functions_split"] == 1 + ("new_segment" in summary)
    g = next(sf for sf in rw.block_split["splits"] if sf.name == "g")
    assert sum(p.inverted for part in g.parts for p in part) == (1 if invert else 0)
    res = subprocess.run([str(out)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0 and res.stdout == expected
    from linepack.verify.equivalence import verify_against
    from linepack.verify.standalone import verify_image
    report = verify_image(str(out))
    verify_against(report, str(out), str(exe))
    blockish = [f for f in report.findings if f.check.startswith("equiv.")]
    assert blockish == [], [(f.check, f.message) for f in blockish]


def test_jmp_ending_an_alternative_site_keeps_its_fall_through(prog):
    """static_cpu_has() compiles to "jmp 6f" (into .altinstr_aux) as a whole
    alternative site; when the CPU has the feature the kernel patches it into
    NOPs and execution falls into the code after the site. So a jmp that ends a
    patch site also falls through: its block keeps its successor next, or gets a
    jmp to it (a layout that moved the successor away oopsed at boot)."""
    exe, _ = prog
    im = ElfImage(str(exe))
    neg = _sym(im, "neg_block")
    site = neg - 5                       # the {disp32} jmp .Lhot3 right before .Lneg
    keys = dict(key_code=[_sym(im, "key5"), _sym(im, "key2")],
                key_target=[_sym(im, "hot3"), neg])
    for patched in (False, True):
        sites = TableSites(leaders=[site, neg] if patched else [], atomic_lo=[site] if patched
                           else [], atomic_hi=[neg] if patched else [], **keys)
        im, fn, units, dis, cfg = _cfg(exe, sites)
        b = int(np.searchsorted(cfg.start, np.uint64(neg))) - 1     # the block ending at the jmp
        assert int(cfg.end[b]) == neg
        assert cfg.term[b] == (TERM_FALL if patched else TERM_JMP)
        assert bool(cfg.falls_through()[b]) == patched
        assert bool(cfg.patched_jmp[b]) == patched
        counts = block_counts(cfg, *_hot_ranges(im))
        heat = np.zeros(len(units))
        u = int(units.find([_sym(im, "f")])[0])
        heat[u] = 100.0
        splits, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True)
        (sf,) = [s for s in splits if s.unit == u]
        hot = sf.parts[0]
        k = next(i for i, p in enumerate(hot) if p.block == b)
        after = [p for p in hot[k + 1:] if p.block == b]
        inserted = [p for p in after if p.kind == bm.KIND_JMP_INSERTED]
        if patched:
            # .Lneg went cold: the site is copied as is and a jmp to .Lneg follows it
            assert sf.block_part[b + 1] == 1
            assert len(inserted) == 1 and inserted[0].target_block == b + 1 and inserted[0].long
            assert all(p.kind != bm.KIND_BRANCH for p in hot if p.block == b)
        else:
            assert not inserted


def test_noinstr_functions_split_only_when_asked_and_stay_in_their_region(prog):
    """A function in a noinstr region is moved whole unless the strategy asks for
    noinstr splits (``split_noinstr``); then its cold part is a unit of the same
    region (placed in that region's cold area: inside the noinstr bounds)."""
    import copy
    from linepack.image.cfg import R_NOINSTR
    exe, _ = prog
    im, fn, units, dis, cfg = _cfg(exe)
    counts = block_counts(cfg, *_hot_ranges(im))
    heat = np.zeros(len(units))
    u = int(units.find([_sym(im, "f")])[0])
    heat[u] = 100.0
    r = int(units.region[u])
    units.regions = list(units.regions)
    units.regions[r] = copy.copy(units.regions[r])
    units.regions[r].name = ".noinstr.text"
    _, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True)
    assert reason[u] == R_NOINSTR
    splits, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True, split_noinstr=True)
    assert reason[u] == R_SPLIT and [s.unit for s in splits] == [u]
    table, _, parent, part = B.planning_units(units, heat, splits)
    cold = np.nonzero((parent == u) & (part == 1))[0]
    assert len(cold) == 1 and int(table.region[cold[0]]) == r
    assert "noinstr" in table.regions[int(table.region[cold[0]])].name
    assert strategies.get("blocks").split_noinstr in (True, False)


ALT_ASM = r"""
    .section .text.hot,"ax",@progbits
    .p2align 4
    .globl g
    .type g, @function
g:
    mov $4, %ecx
.Lsite:                        # an "alternative site" holding a rel8 loop of its own
    dec %ecx
    jnz .Lsite
.Lsite_end:
    test %edi, %edi
    js .Lgcold
    lea 1(%rdi), %eax
    ret
.Lgcold:
    .rept 40
    add $3, %eax
    .endr
    ret
    .size g, .-g
    .globl h
    .type h, @function
h:
    test %edi, %edi
.Lhsite:                       # a site whose rel8 jcc leaves it (to another block)
    js .Lhcold
.Lhsite_end:
    lea 2(%rdi), %eax
    ret
.Lhcold:
    .rept 40
    sub $3, %eax
    .endr
    ret
    .size h, .-h
    .globl gsite, gsite_end, hsite, hsite_end, gcold
    .set gcold, .Lgcold
    .set gsite, .Lsite
    .set gsite_end, .Lsite_end
    .set hsite, .Lhsite
    .set hsite_end, .Lhsite_end
    .section .note.GNU-stack,"",@progbits
"""
ALT_MAIN = r"""
#include <stdio.h>
int g(int), h(int);
int main(void) { printf("%d\n", g(3) + h(4)); return 0; }
"""


def test_rel8_inside_an_alternative_site_splits_when_it_stays_in_its_block(tmp_path):
    """A rel8 loop inside an atomic site is copied with its block: the function splits;
    a rel8 that leaves the site for another block still keeps the function whole."""
    from linepack.image.cfg import R_ALT_REL8
    (tmp_path / "a.s").write_text(ALT_ASM)
    (tmp_path / "m.c").write_text(ALT_MAIN)
    exe = tmp_path / "alt"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(tmp_path / "m.c"), str(tmp_path / "a.s")], check=True)
    im = ElfImage(str(exe))
    lo = [_sym(im, "gsite"), _sym(im, "hsite")]
    hi = [_sym(im, "gsite_end"), _sym(im, "hsite_end")]
    sites = TableSites(leaders=lo + hi, atomic_lo=lo, atomic_hi=hi)
    im, fn, units, dis, cfg = _cfg(exe, sites)
    g, h = (int(units.find([_sym(im, n)])[0]) for n in ("g", "h"))
    assert cfg.reason[g] == R_SPLIT and cfg.reason[h] == R_ALT_REL8
    # the loop's block is the whole site and keeps its jnz (not re-encoded) in the hot part
    counts = block_counts(cfg, np.array([_sym(im, "g")], np.uint64),
                          np.array([_sym(im, "gcold") - _sym(im, "g")], np.uint64),
                          np.array([100.0]))
    heat = np.zeros(len(units))
    heat[g] = 100.0
    splits, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True)
    assert reason[g] == R_SPLIT, (reason[g], counts[cfg.blocks_of(g)[0]:cfg.blocks_of(g)[1]])
    (sf,) = [s for s in splits if s.unit == g]
    site = [p for p in sf.parts[0] if p.old <= _sym(im, "gsite") < p.old + max(p.old_len, 1)]
    assert site and site[0].kind == B.COPY and \
        site[0].old + site[0].old_len >= _sym(im, "gsite_end")


GLUE_ASM = r"""
    .text
    .p2align 4
    .globl panic
    .type panic, @function
panic:                          # named like the kernel's: a function that never returns
    ud2
    .size panic, .-panic
    .p2align 4
    .globl ends_in_panic
    .type ends_in_panic, @function
ends_in_panic:
    test %edi, %edi
    jne 1f
    ret
1:  call panic                  # nothing after it: gcc's code for a noreturn call
    .size ends_in_panic, .-ends_in_panic
    .globl next_fn
    .type next_fn, @function
next_fn:
    lea 1(%rdi), %eax
    ret
    .size next_fn, .-next_fn
    .globl ends_in_call
    .type ends_in_call, @function
ends_in_call:
    call next_fn                # a call that returns: the function falls through
    .size ends_in_call, .-ends_in_call
    .globl after_call
    .type after_call, @function
after_call:
    ret
    .size after_call, .-after_call
    .section .note.GNU-stack,"",@progbits
"""


def test_a_call_to_a_noreturn_function_does_not_glue_units(tmp_path):
    """A unit ending with a call to a known noreturn function (cfg.NORETURN) is not
    glued to the next one; a unit ending with any other call still is."""
    (tmp_path / "g.s").write_text(GLUE_ASM)
    (tmp_path / "m.c").write_text("int next_fn(int);\nint main(void) { return next_fn(-1); }\n")
    exe = tmp_path / "glue"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(tmp_path / "m.c"), str(tmp_path / "g.s")], check=True)
    im, fn, units, dis, cfg = _cfg(exe)
    unit = {n: int(units.find([_sym(im, n)])[0])
            for n in ("ends_in_panic", "next_fn", "ends_in_call", "after_call")}
    assert unit["ends_in_panic"] != unit["next_fn"]
    assert unit["ends_in_call"] == unit["after_call"]


def test_a_five_byte_static_key_site_leaving_the_function_does_not_keep_it_whole(prog):
    """A 5-byte static-key site whose target is another function reaches it from
    anywhere: the function splits (the site is copied with its block); a 2-byte one
    keeps the function whole."""
    from linepack.image.cfg import R_KEY_OUT
    exe, _ = prog
    im = ElfImage(str(exe))
    main = _sym(im, "main")
    for site, want in ((_sym(im, "key5"), R_SPLIT), (_sym(im, "key2"), R_KEY_OUT)):
        sites = TableSites(leaders=[], key_code=[site], key_target=[main])
        im, fn, units, dis, cfg = _cfg(exe, sites)
        u = int(units.find([_sym(im, "f")])[0])
        assert cfg.reason[u] == want
        if want == R_SPLIT:
            counts = block_counts(cfg, *_hot_ranges(im))
            heat = np.zeros(len(units))
            heat[u] = 100.0
            splits, reason = B.choose_splits(cfg, units, heat, counts, 1.0, fn, True)
            (sf,) = [s for s in splits if s.unit == u]
            # the site is copied, not re-encoded: no branch piece stands for it
            assert not [p for part in sf.parts for p in part
                        if p.kind == B.BRANCH and p.old == site]
            assert [p for p in sf.parts[0] if p.kind == B.COPY and
                    p.old <= site < p.old + p.old_len]


GAP_ASM = r"""
    .text
    .p2align 4
    .globl before
    .type before, @function
before:
    lea 1(%rdi), %eax
    ret
    .size before, .-before
label_code:                     # code with no function symbol (like ret_from_fork)
    lea 2(%rdi), %eax
    {disp32} jmp before         # rel32: a rel8 between units would glue them
    .p2align 4, 0x90            # NOP padding after the jmp
    .globl after
    .type after, @function
after:
    lea 3(%rdi), %eax
    ret
    .size after, .-after
    .globl falls_code_fn
    .type falls_code_fn, @function
falls_code_fn:
    ret
    .size falls_code_fn, .-falls_code_fn
label_falls:                    # code that falls into the next function over NOPs
    lea 4(%rdi), %eax
    .p2align 4, 0x90
    .globl fallen_into
    .type fallen_into, @function
fallen_into:
    ret
    .size fallen_into, .-fallen_into
    .section .note.GNU-stack,"",@progbits
"""


def test_code_between_functions_is_a_unit_glued_only_where_it_falls(tmp_path):
    """Code without a function symbol after a function stays in that function's unit;
    the function after it is a unit of its own, glued to it only when the code can fall
    into it (trailing NOP padding after its last instruction does not count), so that
    function can move (and split) alone."""
    (tmp_path / "g.s").write_text(GAP_ASM)
    (tmp_path / "m.c").write_text("int after(int);\nint main(void) { return after(-3); }\n")
    exe = tmp_path / "gap"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(tmp_path / "m.c"), str(tmp_path / "g.s")], check=True)
    im, fn, units, dis, cfg = _cfg(exe)
    u = {n: int(units.find([_sym(im, n)])[0])
         for n in ("before", "after", "falls_code_fn", "fallen_into")}
    assert len({u["before"], u["after"]}) == 2 and units.name[u["after"]] == "after"
    gap = int(units.find([_sym(im, "before") + 4])[0])       # label_code: lea 3 B + ret 1 B
    assert gap == u["before"]                                 # it moves with the function before
    # label_falls has no stop before its padding: it stays glued to fallen_into
    assert u["fallen_into"] == int(units.find([_sym(im, "fallen_into") - 1])[0])
    # a split of before's unit would put label_code's blocks outside the function the
    # block map names: it moves whole (7.3's bpf_lsm_mmap_addr); after has no such code
    trailing = B._trailing_code(dis, units, fn, np.ones(len(units), bool))
    assert trailing[u["before"]] and not trailing[u["after"]]
    assert not trailing[u["falls_code_fn"]] or u["falls_code_fn"] == u["fallen_into"]
