"""DWARF address fields found by parsing (dwarf/fields.py, fields.c) where the
truth is known: fixtures linked with --emit-relocs (DWARF 4 and 5), whose
.rela.debug_* list every field. The parsed fields equal the relocated ones
section by section; the rewrite from parsed fields is byte-identical to the
rewrite from relocations (whole functions moved, and functions split into
parts); an image without .rela.debug_* (relocations removed, or a relayout
output) gets its DWARF rewritten, and the symbolizers agree at moved code."""

import json
import os
import struct
import subprocess

import numpy as np
import pytest

from linepack.dwarf.fields import DwarfFieldError, ParsedFields, compare_with_relocations
from linepack.dwarf.rewrite import rewrite_dwarf
from linepack.image.addrmap import AddressMap
from linepack.image.disasm import disassemble
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.relayout.driver import relayout

from helpers import FIXTURES, requirements, run_linepack
from symbolizers import differences

_requirements = requirements("gcc", "addr2line", "objcopy")

HOTS = {"fields": {"scan": 100, "fill": 90, "main": 50},
        "ab": {"delta": 100, "push": 95, "gamma_": 90, "alpha": 80, "beta": 70}}
SOURCES = {"fields": ["dwarf_fields.c"], "ab": ["dwarf_a.c", "dwarf_b.c"]}


def _build(d, v, which, extra=()):
    exe = d / f"{which}{v}"
    subprocess.run(["gcc", "-g", f"-gdwarf-{v}", "-O2", "-fno-pie", "-no-pie", *extra,
                    "-Wl,--emit-relocs", "-o", str(exe),
                    *[os.path.join(FIXTURES, "c", s) for s in SOURCES[which]]],
                   check=True, capture_output=True)
    return exe


@pytest.fixture(scope="module", params=[(4, "fields"), (5, "fields"), (4, "ab"), (5, "ab")],
                ids=["dwarf4-fields", "dwarf5-fields", "dwarf4-ab", "dwarf5-ab"])
def built(request, tmp_path_factory):
    v, which = request.param
    d = tmp_path_factory.mktemp(f"fields{v}{which}")
    extra = ("-ffunction-sections", "-Wl,--gc-sections") if which == "fields" else ()
    return v, _build(d, v, which, extra), HOTS[which]


def test_parsed_fields_equal_the_relocated_ones(built):
    v, exe, hot = built
    rows = compare_with_relocations(ElfImage(str(exe)))
    lists = (".debug_rnglists", ".debug_loclists") if v == 5 else (".debug_ranges", ".debug_loc")
    for name in (".debug_info", ".debug_line", ".debug_aranges") + lists:
        assert rows[name]["relocated"] > 0, name          # the fixture has fields there
    for t in lists:
        assert rows[f".debug_info -> {t}"]["relocated"] > 0
    for name, r in rows.items():
        assert r["missing"] == 0, (name, r)
        assert r["extra"] == r["extra_value_0"], (name, r)


@pytest.mark.parametrize("v", [4, 5])
def test_expressions_give_their_addresses(tmp_path, v):
    """DW_OP_addr of the globals (DW_AT_location exprloc) are among the fields."""
    exe = _build(tmp_path, v, "fields")
    im = ElfImage(str(exe))
    p = ParsedFields({s.name: bytes(im.section_bytes(s)) for s in im.sections
                      if s.name.startswith(".debug_")})
    _, val = p.addresses[".debug_info"]
    for g in ("counter", "table", "names"):
        assert im.symbol_address(g) in set(val.tolist()), g


def _rewrites(exe, amap):
    im = ElfImage(str(exe))
    a = rewrite_dwarf(im, amap, fields="relocations")
    b = rewrite_dwarf(im, amap, fields="parsed")
    return im, a, b


def _same(a, b):
    assert sorted(a[0]) == sorted(b[0]) and a[1] == b[1]
    for k in a[0]:
        assert np.array_equal(np.asarray(a[0][k]), np.asarray(b[0][k])), k
    assert a[2]["dwarf_fields_from"] == "relocations" and b[2]["dwarf_fields_from"] == "parsed"


def test_rewrite_from_parsed_fields_is_identical(built, tmp_path):
    v, exe, hot = built
    summary, plan, rw = relayout(str(exe), str(tmp_path / "new"), "hot64", hotness=hot)
    assert summary["dwarf"] == "rewritten" and summary["dwarf_address_fields_moved"] > 0
    _same(*_rewrites(exe, rw.amap)[1:])


def test_rewrite_of_split_functions_is_identical(built):
    """A hand-made map that cuts every hot function in two (its second half far
    away): DIEs converted to ranges, lists re-encoded, FDEs cut, the same from
    both sources."""
    v, exe, hot = built
    im = ElfImage(str(exe))
    ft = FunctionTable(im)
    text = im.section(".text")
    far = (text.addr + text.size + 0xfff) // 0x1000 * 0x1000 + 0x10000
    old, end, new = [], [], []
    for name in hot:
        i = ft.index_of(name)
        a, size = int(ft.start[i]), int(ft.size[i])
        half = a + size // 2
        old += [a, half]
        end += [half, a + size]
        new += [a, far]
        far += size + 64
    order = np.argsort(old)
    amap = AddressMap(np.array(old)[order], np.array(end)[order], np.array(new)[order])
    im, a, b = _rewrites(exe, amap)
    assert a[2]["dwarf_split_functions"] == len(hot)
    assert a[2]["dwarf_lists_reencoded"] > 0
    _same(a, b)


def test_image_without_debug_relocations(built, tmp_path):
    """relayout of the image with its .rela.debug_* removed (code relocations
    kept) rewrites the DWARF by parsing it: the same DWARF as from the link's
    relocations, and the summary says where the fields came from."""
    v, exe, hot = built
    bare = tmp_path / "bare"
    rm = [a for s in ElfImage(str(exe)).sections if s.name.startswith(".rela.debug_")
          for a in ("-R", s.name)]
    subprocess.run(["objcopy", *rm, str(exe), str(bare)], check=True)
    assert not any(s.name.startswith(".rela.debug_") for s in ElfImage(str(bare)).sections)
    prof = tmp_path / "hot.json"
    prof.write_text(json.dumps({"functions": hot}))
    outs = {}
    for src, tag in ((exe, "rel"), (bare, "parsed")):
        out = tmp_path / f"out.{tag}"
        p = run_linepack("relayout", src, "--profile", prof, "--strategy", "hot64", "-o", out,
                         "--json", tmp_path / f"{tag}.json")
        assert p.returncode == 0, p.stderr
        assert "DWARF:             rewritten" in p.stdout
        outs[tag] = ElfImage(str(out))
    assert "address fields from parsed" in p.stdout
    ra, pa = outs["rel"], outs["parsed"]
    for s in ra.sections:
        if s.name.startswith(".debug_") and s.size:
            assert bytes(ra.section_bytes(s)) == bytes(pa.section_bytes(pa.section(s.name))), s.name
    # and it runs
    assert subprocess.run([str(tmp_path / "out.parsed")], capture_output=True).returncode == 0


def test_relaid_out_image_is_rewritten_again(built, tmp_path):
    """A relayout output has no .rela.debug_*: relaying it out again parses its
    (already rewritten) DWARF and rewrites it; addr2line gives the second output
    at each moved instruction what it gives the first at the old address."""
    v, exe, hot = built
    first = tmp_path / "first"
    relayout(str(exe), str(first), "hot64", hotness=hot)
    again = tmp_path / "again"
    hot2 = {k: 200 - x for k, x in hot.items()}          # another order: code moves again
    s2, _, rw2 = relayout(str(first), str(again), "pack", hotness=hot2)
    assert s2["dwarf"] == "rewritten" and s2["dwarf_fields_from"] == "parsed"
    im = ElfImage(str(first))
    dis = disassemble(im, FunctionTable(im), jobs=1)
    new, ok = rw2.amap.map(dis.addr)
    m = (new != dis.addr) & ok
    assert m.sum() > 20
    diff = differences(first, again, dis.addr[m].tolist(), new[m].tolist(), ("addr2line",))
    assert diff["addr2line"] == [] and diff["addr2line.unknown"] == 0


def _unit(expr):
    """A DWARF 5 .debug_info + .debug_abbrev: one unit, one variable DIE whose
    DW_AT_location is ``expr``."""
    abbrev = bytes([1, 0x11, 1, 0, 0, 2, 0x34, 0, 0x02, 0x18, 0, 0, 0])
    body = bytes([5, 0, 1, 8]) + struct.pack("<I", 0) + bytes([1, 2, len(expr)]) + expr + b"\0"
    return {".debug_info": struct.pack("<I", len(body)) + body, ".debug_abbrev": abbrev}


def test_expression_scan_on_hand_made_units():
    addr = 0xffffffff81234567
    p = ParsedFields(_unit(b"\x03" + struct.pack("<Q", addr) + b"\x9f"))
    pos, val = p.addresses[".debug_info"]
    assert val.tolist() == [addr] and pos.tolist() == [16]
    # an entry value holding a DW_OP_addr: found inside the sub-expression
    sub = b"\x03" + struct.pack("<Q", addr)
    p = ParsedFields(_unit(b"\xa3" + bytes([len(sub)]) + sub + b"\x9f"))
    assert p.addresses[".debug_info"][1].tolist() == [addr]
    # an operation it does not know: refused (an address after it could be missed)
    with pytest.raises(DwarfFieldError, match="operation"):
        ParsedFields(_unit(b"\xee\x03" + struct.pack("<Q", addr)))


def test_verify_accepts_moved_padding_only():
    """verify's unit-range check: a new unit range whose part outside the
    translated old ranges holds no function code (16 bytes of padding moved with
    the asm function after it) is accepted; a part over another function is not."""
    from linepack.verify.debuginfo import _padding_only
    starts = np.array([0x1000, 0x1040, 0x1100], np.uint64)
    ends = np.maximum.accumulate(np.array([0x1029, 0x10a1, 0x1180], np.uint64))
    code = (starts, ends)
    want = [(0x1040, 0x10a1)]
    assert _padding_only((0x1030, 0x10a1), want, code)          # 0x1030-0x1040: padding
    assert not _padding_only((0x1020, 0x10a1), want, code)      # reaches into 0x1000's code
    assert not _padding_only((0x1040, 0x1110), want, code)      # into the next function
