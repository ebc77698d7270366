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
    PREFIX call g_hot
    ret
    .size callmid, .-callmid
"""


@pytest.mark.parametrize("prefix", ["", ".byte 0x2e;"], ids=["call", "cs-call"])
def test_call_after_the_entry_keeps_it_whole(tmp_path, prefix):
    """Also a `cs call` (2E E8): the kernel patches prefixed calls as well."""
    from linepack.image.cfg import R_CALL_INSIDE, TableSites
    exe, _ = g_program.build(tmp_path, prefix=True, extra=CALLER.replace("PREFIX", prefix))
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


# the call-depth template symbols of a 6.12 kernel (9 bytes: sarq $5, %gs:0): with them the
# blocks strategy keeps only 9 of the prefix's 16 NOPs (prefix_padding = "template")
TEMPLATE = r"""
    .section .rodata
    .globl skl_call_thunk_template, skl_call_thunk_tail
skl_call_thunk_template:
    .byte 0x65, 0x48, 0xc1, 0x3c, 0x25, 0, 0, 0, 0
skl_call_thunk_tail:
"""


def test_prefix_trimmed_to_the_thunk_template(tmp_path):
    """The hot part keeps the template's 9 bytes of padding right before the entry: the
    prefix symbol moves to them and is sized 9, the dropped 7 NOPs are a padding-dropped
    row leading to the kept padding, verify --against is clean and checks that row; with
    the kept padding overwritten, verify names it (prefix.padding, equiv.prefix-room).
    ``prefix_padding = "full"`` keeps all 16 bytes."""
    from linepack.kernel.base import ImageContext
    from linepack.kernel.prefixes import check_prefix_room, check_prefixes
    from linepack.relayout import strategies
    from linepack.verify.addrmap import match_functions
    from linepack.verify.equivalence import verify_against
    from linepack.verify.findings import add_findings
    from linepack.verify.standalone import verify_image
    exe, expected = g_program.build(tmp_path, prefix=True, extra=TEMPLATE)
    im = ElfImage(str(exe))
    for mode, kept in (("template", 9), ("full", 16)):
        out = tmp_path / f"split-{mode}"
        strat = strategies.get("blocks", prefix_padding=mode)
        summary, plan, rw = relayout(str(exe), str(out), strat, hotness={"g": 100.0},
                                     blocks=_ranges(im))
        assert not summary["problems"]
        res = subprocess.run([str(out)], capture_output=True, text=True, timeout=20)
        assert res.returncode == 0 and res.stdout == expected
        new = ElfImage(str(out))
        names, syms = new.symbol_table()
        g, pfx = (names.index(n) for n in ("g", "__pfx_g"))
        assert int(syms["value"][pfx]) + kept == int(syms["value"][g])
        assert int(syms["size"][pfx]) == kept
        assert bytes(new.read(int(syms["value"][g]) - kept, kept)) == b"\x90" * kept
        rows = bm.read_blockmap(new)
        assert bm.check_rows(rows) == []
        dropped = rows[rows["kind"] == bm.KIND_PAD_DROPPED]
        if kept == 16:
            assert not len(dropped)
            continue
        assert len(dropped) == 1 and int(dropped["old"][0]) == im.symbol_address("__pfx_g")
        assert int(dropped["old_len"][0]) == 7 and int(dropped["new"][0]) == int(syms["value"][pfx])
        rep = verify_image(str(out))
        verify_against(rep, str(out), str(exe))
        errors = [f for f in rep.findings if f.severity == "error"]
        assert not errors, errors[:5]
        assert rep.extra["equivalence_blocks"]["padding_dropped"] == 7
        # evaluate's .text growth of a booted output rebuilds the parts from the block map
        # (planning units from sizes alone: it raised on the trimmed prefix)
        from linepack.evaluate.booted import text_growth_between
        assert isinstance(text_growth_between(str(exe), str(out)), int)
        # the kept padding overwritten with int3
        data = bytearray(out.read_bytes())
        sec = new.section_at(int(syms["value"][pfx]))
        off = sec.offset + int(syms["value"][pfx]) - sec.addr
        data[off:off + 9] = b"\xcc" * 9
        bad = tmp_path / "bad"
        bad.write_bytes(bytes(data))
        found = []
        check_prefixes(ImageContext(ElfImage(str(bad))), found)
        assert [f.check for f in found] == ["prefix.padding"]
        octx, nctx = ImageContext(im), ImageContext(ElfImage(str(bad)))
        oi, ni, _ = match_functions(octx, nctx)
        found, counter = [], {}
        assert check_prefix_room(octx, nctx, oi, ni, found, counter, add_findings) == 1
        assert [(f.check, f.address) for f in found] == [("equiv.prefix-room",
                                                          int(syms["value"][g]))]


def test_whole_hot_prefixed_function_trimmed_too(tmp_path):
    """A hot prefixed function with no cold block (every block ran) moves whole, in one
    part in its original order, with its prefix trimmed to the template's 9 bytes and
    no alignment kept; it runs the same and verify --against is clean."""
    from linepack.relayout import strategies
    from linepack.verify.equivalence import verify_against
    from linepack.verify.standalone import verify_image
    exe, expected = g_program.build(tmp_path, prefix=True, extra=TEMPLATE)
    im = ElfImage(str(exe))
    fn = FunctionTable(im)
    g = im.symbol_address("g")
    every = (np.array([g], np.uint64), np.array([int(fn.end[fn.index_of("g")]) - g], np.uint64),
             np.array([100.0]))
    out = tmp_path / "whole"
    summary, plan, rw = relayout(str(exe), str(out), strategies.get("blocks"),
                                 hotness={"g": 100.0}, blocks=every)
    assert not summary["problems"]
    (sf,) = rw.block_split["splits"]
    assert sf.whole and sf.sizes[1] == 0 and sf.head == 9
    res = subprocess.run([str(out)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0 and res.stdout == expected
    new = ElfImage(str(out))
    names, syms = new.symbol_table()
    gi, pfx = names.index("g"), names.index("__pfx_g")
    assert "g.cold" not in names
    assert int(syms["value"][pfx]) + 9 == int(syms["value"][gi]) and int(syms["size"][pfx]) == 9
    assert bytes(new.read(int(syms["value"][gi]) - 9, 9)) == b"\x90" * 9
    rep = verify_image(str(out))
    verify_against(rep, str(out), str(exe))
    errors = [f for f in rep.findings if f.severity == "error"]
    assert not errors, errors[:5]


def test_prefix_padding_none_opt_in(tmp_path, capfd):
    """``prefix_padding = "none"`` (opt-in): the hot part keeps none of the padding (the
    prefix symbol is sized 0 at the entry; one padding-dropped row of 16 bytes), relayout
    prints one warning line, the block map says so (FLAG_NO_PADDING), the program runs
    the same and verify --against has no error; the kernel checks name the lost padding
    as warnings (prefix.dropped, equiv.prefix-dropped), and as errors once the block map
    no longer declares it."""
    from linepack.kernel.base import ImageContext
    from linepack.kernel.prefixes import check_prefix_room, check_prefixes
    from linepack.relayout import strategies
    from linepack.verify.addrmap import match_functions
    from linepack.verify.equivalence import verify_against
    from linepack.verify.findings import add_findings
    from linepack.verify.standalone import verify_image
    exe, expected = g_program.build(tmp_path, prefix=True, extra=TEMPLATE)
    im = ElfImage(str(exe))
    out = tmp_path / "nopad"
    capfd.readouterr()
    summary, plan, rw = relayout(str(exe), str(out), strategies.get("blocks", prefix_padding="none"),
                                 hotness={"g": 100.0}, blocks=_ranges(im))
    err = capfd.readouterr().err
    assert not summary["problems"]
    assert [ln for ln in err.splitlines() if "warning" in ln] == \
        [ln for ln in err.splitlines() if "retbleed=stuff" in ln] and err.count("retbleed=stuff") == 1
    res = subprocess.run([str(out)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0 and res.stdout == expected
    new = ElfImage(str(out))
    names, syms = new.symbol_table()
    g, pfx = names.index("g"), names.index("__pfx_g")
    assert int(syms["value"][pfx]) == int(syms["value"][g]) and int(syms["size"][pfx]) == 0
    assert bm.read_flags(new) & bm.FLAG_NO_PADDING
    rows = bm.read_blockmap(new)
    assert bm.check_rows(rows) == []
    dropped = rows[rows["kind"] == bm.KIND_PAD_DROPPED]
    assert len(dropped) == 1 and int(dropped["old_len"][0]) == 16
    assert int(dropped["new"][0]) == int(syms["value"][g])
    rep = verify_image(str(out))
    verify_against(rep, str(out), str(exe))
    errors = [f for f in rep.findings if f.severity == "error"]
    assert not errors, errors[:5]
    assert rep.extra["equivalence_blocks"]["padding_dropped"] == 16

    def kernel_checks(path):
        found = []
        check_prefixes(ImageContext(ElfImage(str(path))), found)
        octx, nctx = ImageContext(im), ImageContext(ElfImage(str(path)))
        oi, ni, _ = match_functions(octx, nctx)
        room = []
        assert check_prefix_room(octx, nctx, oi, ni, room, {}, add_findings) == 1
        return [(f.severity, f.check) for f in found + room]
    assert kernel_checks(out) == [("warning", "prefix.dropped"),
                                  ("warning", "equiv.prefix-dropped")]
    # the same bytes without the block map's flag: the lost padding is an error
    data = bytearray(out.read_bytes())
    sec = new.section(bm.SECTION_NAME)
    data[sec.offset + 12:sec.offset + 16] = bytes(4)
    bad = tmp_path / "unflagged"
    bad.write_bytes(bytes(data))
    assert kernel_checks(bad) == [("error", "prefix.short"), ("error", "equiv.prefix-room")]


def test_default_and_full_padding_set_no_flag(tmp_path):
    """Only "none" marks the block map: "template" (the default) and "full" keep the
    padding call-depth tracking needs, and their block map declares nothing."""
    from linepack.relayout import strategies
    exe, _ = g_program.build(tmp_path, prefix=True, extra=TEMPLATE)
    im = ElfImage(str(exe))
    for mode in ("template", "full"):
        out = tmp_path / mode
        relayout(str(exe), str(out), strategies.get("blocks", prefix_padding=mode),
                 hotness={"g": 100.0}, blocks=_ranges(im))
        assert bm.read_flags(ElfImage(str(out))) == 0


def test_unknown_prefix_padding_is_refused():
    from linepack.relayout import strategies
    with pytest.raises(strategies.UnknownStrategy, match="template, full, none"):
        strategies.get("blocks", prefix_padding="some")


# h: a hot prefixed function exactly as long as its 16-byte prefix (as many of the
# kernel's bpf_lsm_* hooks are)
H16 = r"""
    .section .text.hot,"ax",@progbits
    .p2align 4
    .type __pfx_h, @function
__pfx_h:
    .fill 16, 1, 0x90
    .size __pfx_h, 16
    .globl h
    .type h, @function
h:
    endbr64
    mov %edi, %eax
    add $1, %eax
    .fill 6, 1, 0x90
    ret
    .size h, .-h
"""


def test_prefix_dropped_before_a_function_of_its_size(tmp_path):
    """With its prefix dropped whole, ``__pfx_h`` shares h's address; h (16 bytes, like
    its prefix) is no alias of it: the prefix stays sized 0, h 16, and verify finds h."""
    from linepack.relayout import strategies
    from linepack.verify.equivalence import verify_against
    from linepack.verify.standalone import verify_image
    exe, expected = g_program.build(tmp_path, prefix=True, extra=TEMPLATE + H16)
    im = ElfImage(str(exe))
    h = im.symbol_address("h")
    lo, size, cnt = _ranges(im)
    ranges = (np.append(lo, np.uint64(h)), np.append(size, np.uint64(16)), np.append(cnt, 100.0))
    out = tmp_path / "nopad"
    # (order_whole off, as on a kernel: h moves whole with its prefix trimmed)
    strat = strategies.get("blocks", prefix_padding="none", order_whole=False)
    summary, plan, rw = relayout(str(exe), str(out), strat, hotness={"g": 100.0, "h": 100.0},
                                 blocks=ranges)
    assert not summary["problems"]
    assert "h" in {sf.name for sf in rw.block_split["splits"]}
    new = ElfImage(str(out))
    names, syms = new.symbol_table()
    hi, pfx = names.index("h"), names.index("__pfx_h")
    assert int(syms["value"][pfx]) == int(syms["value"][hi])
    assert (int(syms["size"][pfx]), int(syms["size"][hi])) == (0, 16)
    rep = verify_image(str(out))
    verify_against(rep, str(out), str(exe))
    errors = [f for f in rep.findings if f.severity == "error"]
    assert not errors, errors[:5]
