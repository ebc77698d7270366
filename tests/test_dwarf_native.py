"""The DWARF C core (tools/dwarf/info.c) on real compiler output and on broken
DWARF: its DIE walk agrees with the Python reader (encoding.walk_dies) on every
DIE of DWARF 4 and 5 fixtures built at test time; truncated and byte-flipped
.debug_info/.debug_abbrev and list sections give one clear ValueError or a
per-list "unreadable" status, never a crash or a read out of bounds; and the
rewrite on an image whose DWARF is broken stops with one line."""

import os
import subprocess

import numpy as np
import pytest

from linepack.dwarf import encoding as enc
from linepack.dwarf import native
from linepack.dwarf.rewrite import rewrite_dwarf
from linepack.image.addrmap import AddressMap
from linepack.image.disasm import disassemble
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.verify.debuginfo import check_debuginfo

from helpers import FIXTURES
import helpers

_requirements = helpers.requirements("gcc")

WANT = (enc.DW_AT_low_pc, enc.DW_AT_high_pc, enc.DW_AT_ranges, enc.DW_AT_entry_pc, 0x02, 0x03)


@pytest.fixture(scope="module", params=[4, 5], ids=["dwarf4", "dwarf5"])
def prog(request, tmp_path_factory):
    v = request.param
    d = tmp_path_factory.mktemp(f"dn{v}")
    exe = d / "prog"
    subprocess.run(["gcc", "-g", f"-gdwarf-{v}", "-O2", "-fno-pie", "-no-pie",
                    "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(FIXTURES, "c", "dwarf_a.c"),
                    os.path.join(FIXTURES, "c", "dwarf_b.c")], check=True, capture_output=True)
    im = ElfImage(str(exe))
    sec = {n: bytes(im.section_bytes(im.section(n)))
           for n in (".debug_info", ".debug_abbrev", ".debug_rnglists", ".debug_ranges",
                     ".debug_loclists", ".debug_loc")
           if im.section(n) is not None and im.section(n).size}
    return v, exe, sec


def test_walk_agrees_with_python_reader(prog):
    v, exe, sec = prog
    info, abbrev = sec[".debug_info"], sec[".debug_abbrev"]
    units = enc.units(info)
    assert len(units) >= 2 and {u.version for u in units} == {v}
    total = 0
    for un in units:
        table = enc.parse_abbrevs(abbrev, un.abbrev_off)[0]
        ref = list(enc.walk_dies(info, un, table))
        d = native.dies(info, abbrev, un, WANT)
        assert d.off.tolist() == [off for off, _, _, _ in ref]
        assert d.tag.tolist() == [tag for _, tag, _, _ in ref]
        assert d.code.tolist() == [code for _, _, _, code in ref]
        for i, (_, _, attrs, _) in enumerate(ref):
            for j, at in enumerate(WANT):
                if at in attrs:
                    f, p, e = attrs[at]
                    assert (d.form[i, j], d.pos[i, j], d.end[i, j]) == (f, p, e)
                    assert d.val[i, j] == enc.u(info, p, min(e - p, 8))
                else:
                    assert d.pos[i, j] == -1
        top = native.dies(info, abbrev, un, WANT, limit=1)
        assert top.off.tolist() == [un.die]
        total += len(ref)
    assert total > 50


def test_broken_debug_info_is_one_clear_error(prog):
    """Every truncation point of a unit, and seeded byte flips of .debug_info and
    .debug_abbrev: the walk returns or raises ValueError (one line), nothing else."""
    v, exe, sec = prog
    info, abbrev = sec[".debug_info"], sec[".debug_abbrev"]
    un = enc.units(info)[0]
    errors = 0
    for cut in range(un.die, un.end, max(1, (un.end - un.die) // 400)):
        try:
            native.dies(info[:cut], abbrev, un, WANT)
        except ValueError as e:
            assert "\n" not in str(e) and ".debug_info" in str(e)
            errors += 1
    assert errors > 0
    rng = np.random.default_rng(7)
    raised = 0
    for _ in range(300):
        bi, ba = bytearray(info), bytearray(abbrev)
        for buf in (bi, ba):
            for k in rng.integers(0, len(buf), 3).tolist():
                buf[k] = int(rng.integers(0, 256))
        for u in enc.units(bytes(info)):
            try:
                native.dies(bytes(bi), bytes(ba), u, WANT)
            except ValueError as e:
                assert "\n" not in str(e)
                raised += 1
    assert raised > 0
    # an abbreviation code the table does not have, named with its offset
    bad = bytearray(info)
    bad[un.die] = 0x7F
    with pytest.raises(ValueError, match=rf"unknown abbreviation code at offset {un.die:#x}"):
        native.dies(bytes(bad), abbrev, un, WANT)


def test_truncated_lists_are_unreadable_not_read_past(prog):
    v, exe, sec = prog
    rng_name = ".debug_rnglists" if v == 5 else ".debug_ranges"
    loc_name = ".debug_loclists" if v == 5 else ".debug_loc"
    rs, ls = sec[rng_name], sec[loc_name]
    # a range list and a location list the DIEs name (DW_AT_ranges, DW_AT_location)
    info, abbrev = sec[".debug_info"], sec[".debug_abbrev"]
    offs = {}
    for un in enc.units(info):
        d = native.dies(info, abbrev, un, WANT)
        for j, at in ((2, "ranges"), (4, "location")):
            hit = np.nonzero(d.form[:, j] == enc.DW_FORM_sec_offset)[0]
            if len(hit) and at not in offs:
                offs[at] = int(d.val[hit[0], j])
    first, loc = offs["ranges"], offs["location"]
    count, lo, hi = native.read_lists(rs, v == 5, 8, np.array([first]), np.zeros(1, np.uint64))
    assert count[0] > 0
    count, _, _ = native.read_lists(rs[:first + 3], v == 5, 8, np.array([first, len(rs) + 5]),
                                    np.zeros(2, np.uint64))
    assert count.tolist() == [-1, -1]
    seg = (np.array([0], np.uint64), np.array([(1 << 64) - 1], np.uint64),
           np.array([0], np.uint64), np.array([(1 << 64) - 1], np.uint64), np.zeros(1, np.uint8))
    names = [rs, None, ls, None] if v == 5 else [None, rs, None, ls]
    items = {"p": np.zeros(4, np.int64), "v": np.array([first, loc, loc, len(ls) - 1]),
             "base": np.zeros(4, np.uint64), "v5": np.full(4, v == 5), "asz": np.full(4, 8),
             "is_loc": np.array([0, 1, 1, 1]), "vp": np.full(4, -1)}
    whole = names + ([ls, None] if v == 5 else [None, ls])
    noff, voff, status, added = native.relist(seg, sec[".debug_info"], whole, items,
                                              [(len(rs), 0, True)] * 4)
    assert status[:3].tolist() == [0, 0, 0] and sum(map(len, added)) > 0
    cut = [None if s is None else s[:min(first, loc) + 2] for s in whole]
    noff, voff, status, added = native.relist(seg, sec[".debug_info"], cut, items,
                                              [(0, 0, True)] * 4)
    assert status.tolist() == [1, 1, 1, 1] and sum(map(len, added)) == 0


def test_rewrite_of_broken_dwarf_stops_with_one_line(prog, tmp_path):
    """A split map makes the rewrite walk the units: a unit whose DIEs name an
    abbreviation its table lacks stops the rewrite with one ValueError line (the
    driver turns it into exit status 2)."""
    v, exe, sec = prog
    im = ElfImage(str(exe))
    ft = FunctionTable(im)
    dis = disassemble(im, ft, jobs=1)
    i = ft.index_of("alpha")
    s, e = int(ft.start[i]), int(ft.start[i] + ft.size[i])
    ins = dis.addr[(dis.addr > s) & (dis.addr < e)]
    cut = int(ins[len(ins) // 2])
    amap = AddressMap([s, cut], [cut, e], [s + e - cut, s])
    patched, drop, stats = rewrite_dwarf(im, amap)
    assert stats["dwarf_dies_converted_to_ranges"] >= 1
    # every DIE code of every unit past its unit DIE replaced by an unknown one
    s_info = im.section(".debug_info")
    data = bytearray(open(exe, "rb").read())
    for un in enc.units(sec[".debug_info"]):
        table = enc.parse_abbrevs(sec[".debug_abbrev"], un.abbrev_off)[0]
        second = list(enc.walk_dies(sec[".debug_info"], un, table))[1][0]
        data[s_info.offset + second] = 0x7E
    broken = tmp_path / "broken"
    broken.write_bytes(bytes(data))
    with pytest.raises(ValueError) as ei:
        rewrite_dwarf(ElfImage(str(broken)), amap)
    assert "unknown abbreviation code" in str(ei.value) and "\n" not in str(ei.value)
    # verify --against names it (one finding) instead of stopping
    findings, counter = [], {}

    class R:
        extra = {}
    check_debuginfo(im, ElfImage(str(broken)), amap, findings, counter, R())
    bad = [f for f in findings if f.check == "debuginfo.unreadable"]
    assert len(bad) == 1 and "unknown abbreviation code" in bad[0].message
    assert counter["debuginfo.unreadable"] == 1


def test_verify_reads_by_slices_and_windows_as_whole(prog):
    """verify's DWARF check reads line tables a slice of units at a time and each
    unit's first DIE from a window of its bytes: the same rows (unit indices
    section-wide) and the same DIEs as reading the sections whole, also when
    every unit is its own slice and when a window cuts the first DIE (read in
    place then)."""
    from linepack.verify import debuginfo as di
    v, exe, sec = prog
    im = ElfImage(str(exe))
    line = np.frombuffer(bytes(im.section_bytes(im.section(".debug_line"))), np.uint8)
    whole = native.LineRows(line)
    for size in (1, 64, 1 << 30):
        slices = di._line_slices(line, size)
        assert slices[0][0] == 0 and slices[-1][1] == len(line)
        assert len(slices) >= (2 if size == 1 else 1)
        got = {k: [] for k in ("addr", "unit", "file", "line", "column", "flags")}
        orig = di._line_slices
        di._line_slices = lambda s, size=size: orig(s, size)
        try:
            for base, rows in di._rows_by_slice(line):
                assert base == sum(len(a) for a in got["addr"])
                for k in got:
                    got[k].append(getattr(rows, k))
        finally:
            di._line_slices = orig
        for k in got:
            assert np.concatenate(got[k]).tolist() == getattr(whole, k).tolist(), (size, k)
    info, abbrev = sec[".debug_info"], sec[".debug_abbrev"]
    units = enc.units(info)
    cus = [i for i, un in enumerate(units) if un.unit_type in (1, 3)]
    ref = native.top_dies(info, abbrev, [units[i] for i in cus], WANT)
    for window in (4096, 8):          # 8 bytes: every first DIE is cut, read in place
        us, got_cus, d = di._units_and_tops(im, memoryview(info), abbrev, WANT, window)
        assert got_cus == cus and [u.off for u in us] == [u.off for u in units]
        for k in ("off", "code", "tag", "form", "pos", "val"):
            assert getattr(d, k).tolist() == getattr(ref, k).tolist(), (window, k)
