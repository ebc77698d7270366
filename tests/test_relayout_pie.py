"""Relayout of position-independent executables (PIE), pack and blocks.

Fixtures built at test time (-O2 -fpie -pie -Wl,--emit-relocs, nothing else:
the moved code goes to a new segment):

- tests/fixtures/c/pie_main.c against its own shared library (pie_lib.c):
  function pointers in .data.rel.ro (R_X86_64_RELATIVE), a PIC switch table,
  a call into the shared library and a callback from libc (qsort), a
  constructor in .init_array, an ifunc (IRELATIVE), and error paths that only
  run with an argument; built again -fpic -Wl,--no-relax, so that code loads
  function addresses from GOT slots ld filled in without a link relocation;
- tests/fixtures/c/split_throw.cc as a PIE: a C++ exception thrown in a split
  function's cold part, caught by its caller's landing pad in another cold part.

Each is profiled under qemu-x86_64 (the PIE's load base read from QEMU's page
log and taken off the addresses), relaid out with ``pack`` and ``blocks``, run
with and without its error paths (same output as the original), and checked
with ``verify --against`` (exit 0); a broken RELATIVE addend and a broken
switch-table entry are named. A shared library stays refused with one line.
"""

import json
import os
import subprocess

import numpy as np
import pytest
import helpers

from linepack.image.elf import RELA, ElfImage
from linepack.relayout.user.pie import is_pie, pic_table_entries

_requirements = helpers.requirements("gcc", "g++", "qemu-x86_64")

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "c")
PIE = ["-O2", "-fpie", "-pie", "-fno-reorder-blocks-and-partition", "-Wl,--emit-relocs"]


def _run(path, *args):
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout, p.stderr


def _relayout(exe, prof, strategy, out):
    p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", strategy,
                        "-o", out, "--json", out + ".json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    with open(out + ".json") as f:
        return json.load(f)


def _verify(new, old):
    p = subprocess.run(["linepack", "verify", new, "--against", old, "--json", new + ".vjson"],
                       capture_output=True, text=True, timeout=300)
    with open(new + ".vjson") as f:
        return p.returncode, json.load(f), p.stdout + p.stderr


def _build_c(d, name, flags=()):
    lib = os.path.join(d, "libpielib.so")
    if not os.path.exists(lib):
        subprocess.run(["gcc", "-O2", "-fpic", "-shared", "-o", lib,
                        os.path.join(FIX, "pie_lib.c")], check=True)
    exe = os.path.join(d, name)
    subprocess.run(["gcc", *PIE, *flags, "-o", exe, os.path.join(FIX, "pie_main.c"),
                    "-L", d, "-lpielib", f"-Wl,-rpath,{d}"], check=True)
    return exe, lib


@pytest.fixture(scope="module")
def c_pie(tmp_path_factory):
    from linepack.profile.user import record_user
    d = str(tmp_path_factory.mktemp("pie"))
    exe, lib = _build_c(d, "pie_main", ["-g"])            # DWARF rewritten and checked too
    prof = exe + ".lpprof"
    profile = record_user(exe, [], output=prof)
    outs = {s: (os.path.join(d, f"pie_main.{s}"),) for s in ("pack", "blocks")}
    for s in outs:
        outs[s] += (_relayout(exe, prof, s, outs[s][0]),)
    return exe, lib, profile, outs


def test_profile_takes_the_load_base_off(c_pie):
    exe, _, profile, _ = c_pie
    bias = int(profile.meta["load_bias"], 16)
    assert bias and bias % 4096 == 0
    # link addresses: the hot functions are found by name, nothing is outside
    hot = set(profile.function_counts())
    assert {"process", "classify", "kernel_b", "main"} <= hot, hot
    assert profile.meta["result_line"].startswith("result ")


def test_pic_switch_table_is_found(c_pie):
    exe = c_pie[0]
    im = ElfImage(exe)
    assert is_pie(im)
    from linepack.relayout.units import units_of
    _, functions, dis = units_of(im, lambda m: None)
    pic = pic_table_entries(im, dis)
    cls = functions.index_of("classify")
    lo = int(functions.start[cls])
    hi = lo + int(functions.size[cls])
    inside = (pic.case >= np.uint64(lo)) & (pic.case < np.uint64(hi))
    # one entry per case 0..9 (gcc range-checks the default), each its own block
    assert inside.sum() == len(pic) == 10 and len(np.unique(pic.case)) == 10
    assert pic.unexplained == 0
    assert (pic.base == pic.base[0]).all() and int(pic.field[0]) == int(pic.base[0])


@pytest.mark.parametrize("strategy", ["pack", "blocks"])
def test_relaid_pie_runs_the_same(c_pie, strategy):
    exe, _, _, outs = c_pie
    out, summary = outs[strategy]
    assert summary["units_moved"] > 0
    assert summary["dynamic_relocs_updated"] >= 3      # ops[], indirect, .init_array ctor
    assert summary["pie.pic_table_entries"] == 10 and summary["pie.pcrel_data_unexplained"] == 0
    assert _run(out) == _run(exe)
    assert _run(out, "77") == _run(exe, "77")
    if strategy == "blocks":
        split = summary["split"]
        assert split["functions_split"] >= 2, split
        im = ElfImage(out)
        names, _ = im.symbol_table()
        # classify() jumps through its PIC switch table: split all the same
        assert {"process.cold", "kernel_b.cold", "classify.cold"} <= set(names)


@pytest.mark.parametrize("strategy", ["pack", "blocks"])
def test_verify_against_passes(c_pie, strategy):
    exe, _, _, outs = c_pie
    rc, rep, text = _verify(outs[strategy][0], exe)
    assert rc == 0, text
    extra = rep.get("extra", rep)
    assert extra["equivalence_dynamic_relocs_checked"] >= 5
    assert extra["equivalence_pic_table_entries_checked"] == 10
    assert extra["debuginfo_line_rows_checked"] > 100 and extra["debuginfo_subprograms_checked"] > 5


@pytest.mark.parametrize("relr", [False, True], ids=["rela", "relr"])
def test_got_slots_and_ifunc(tmp_path, relr):
    """Built -fpic -Wl,--no-relax: code loads main's and cmp_desc's addresses
    from GOT slots only ld wrote (no link relocation covers them), and the ifunc
    is called through a PLT entry whose relocation names the resolver. The slots
    follow the layout, the calls keep their stubs; qsort (libc) calls back into
    the moved cmp_desc; the IRELATIVE resolver moved too. ``relr``: relative
    relocations packed in .relr.dyn (-z pack-relative-relocs, the field is the
    addend); a GOT slot left at its old value there is named by verify."""
    from linepack.profile.user import record_user
    from linepack.relayout.user.pie import relr_addresses
    d = str(tmp_path)
    exe, _ = _build_c(d, "pie_got", ["-fpic", "-Wl,--no-relax"] +
                      (["-Wl,-z,pack-relative-relocs"] if relr else []))
    assert bool(len(relr_addresses(ElfImage(exe)))) == relr
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    rows = np.array(ElfImage(exe).section_bytes(ElfImage(exe).section(".rela.plt"))).view(RELA)
    assert ((rows["info"] & 0xFFFFFFFF) == 37).sum() == 1          # R_X86_64_IRELATIVE
    for strategy in ("pack", "blocks"):
        out = os.path.join(d, f"pie_got.{strategy}")
        summary = _relayout(exe, prof, strategy, out)
        assert summary["got_slots_updated"] >= 2, summary
        assert _run(out) == _run(exe)
        assert _run(out, "5") == _run(exe, "5")
        rc, _, text = _verify(out, exe)
        assert rc == 0, text
    if relr:
        # main's GOT slot (what _start hands to __libc_start_main) back at its old value
        old_im = ElfImage(exe)
        main = old_im.symbol_address("main")
        slots = relr_addresses(old_im)
        vals = [int.from_bytes(old_im.read(int(a), 8), "little") for a in slots]
        slot = int(slots[vals.index(main)])
        bad = os.path.join(d, "bad")
        _patch(out, bad, slot, main, 8)
        rc, _, text = _verify(bad, exe)
        assert rc == 1 and "equiv.dynamic-reloc" in text and f"{slot:#x}" in text, text


def _patch(path, out, addr, value, size):
    im = ElfImage(path)
    off = im.vaddr_to_offset(addr)
    raw = bytearray(open(path, "rb").read())
    raw[off:off + size] = int(value).to_bytes(size, "little", signed=value < 0)
    with open(out, "wb") as f:
        f.write(bytes(raw))
    os.chmod(out, 0o755)


def test_verify_names_a_stale_relative_addend(c_pie, tmp_path):
    """The addend of the RELATIVE entry for ``indirect`` (= kernel_b) left at
    its original value: verify names it."""
    exe, _, _, outs = c_pie
    new = outs["blocks"][0]
    im = ElfImage(new)
    old = ElfImage(exe)
    sec = im.section(".rela.dyn")
    rows = np.array(im.section_bytes(sec)).view(RELA)
    target = old.symbol_address("indirect")
    k = int(np.nonzero(rows["offset"] == target)[0][0])
    assert int(rows["addend"][k]) == im.symbol_address("kernel_b")
    bad = str(tmp_path / "bad")
    raw = bytearray(open(new, "rb").read())
    pos = sec.offset + k * RELA.itemsize + 16
    raw[pos:pos + 8] = int(old.symbol_address("kernel_b")).to_bytes(8, "little")
    open(bad, "wb").write(bytes(raw))
    rc, rep, text = _verify(bad, exe)
    assert rc == 1 and "equiv.dynamic-reloc" in text, text


def test_verify_names_a_wrong_switch_table_entry(c_pie, tmp_path):
    exe, _, _, outs = c_pie
    new = outs["pack"][0]
    from linepack.relayout.units import units_of
    im = ElfImage(exe)
    _, _, dis = units_of(im, lambda m: None)
    pic = pic_table_entries(im, dis)
    f = int(pic.field[3])
    v = int.from_bytes(ElfImage(new).read(f, 4), "little", signed=True)
    bad = str(tmp_path / "bad")
    _patch(new, bad, f, v + 1, 4)
    rc, rep, text = _verify(bad, exe)
    assert rc == 1 and "equiv.pic-table" in text, text


@pytest.fixture(scope="module")
def cxx_pie(tmp_path_factory):
    from linepack.profile.user import record_user
    exe = str(tmp_path_factory.mktemp("piecxx") / "split_throw")
    subprocess.run(["g++", "-std=gnu++14", "-Wno-deprecated", *PIE, "-o", exe,
                    os.path.join(FIX, "split_throw.cc")], check=True)
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    return exe, prof


def test_cxx_exception_through_split_pie(cxx_pie):
    """Thrown in work.cold, caught in guarded.cold: the CIE's pc-relative
    personality pointer is re-encoded where the rebuilt .eh_frame puts it, and
    each part's LSDA has a pc-relative LPStart."""
    exe, prof = cxx_pie
    assert is_pie(ElfImage(exe))
    out = exe + ".blocks"
    summary = _relayout(exe, prof, "blocks", out)
    im = ElfImage(out)
    names, _ = im.symbol_table()
    assert {"_Z4workii.cold", "_Z7guardedii.cold"} <= set(names)
    assert summary["eh_frame.part_lsdas"] == 2
    assert _run(out) == _run(exe)
    got = _run(out, "x")
    assert got == _run(exe, "x") and "caught Bad 2332" in got[0]
    rc, _, text = _verify(out, exe)
    assert rc == 0, text
    pack = exe + ".pack"
    assert _relayout(exe, prof, "pack", pack)["units_moved"] > 0
    assert _run(pack) == _run(exe) and _run(pack, "x") == _run(exe, "x")
    rc, _, text = _verify(pack, exe)
    assert rc == 0, text


def test_verify_names_an_absolute_lpstart(cxx_pie, tmp_path):
    """Part LSDAs written with an absolute LPStart (right for a non-PIE, the
    link address in a PIE: the exception lands on an unmapped page): verify
    names each one."""
    import linepack.relayout.user.eh_frame_split as es
    from linepack.relayout.driver import load_profile_full, relayout
    exe, prof = cxx_pie
    orig = es.lsda_encode
    try:
        es.lsda_encode = lambda *a, **k: orig(*a, **dict(k, pcrel_lpstart=False))
        lp = load_profile_full(prof, exe)
        bad = str(tmp_path / "abs")
        relayout(exe, bad, "blocks", hotness=lp.hotness, calls=lp.calls, blocks=lp.blocks,
                 profile_build_id=lp.build_id)
    finally:
        es.lsda_encode = orig
    rc, rep, text = _verify(bad, exe)
    assert rc == 1 and "absolute LSDA LPStart" in text, text
    assert rep["equivalence_counts"]["equiv.pie-absolute-pointer"] == 2


def test_shared_library_is_refused(c_pie, tmp_path):
    _, lib, _, _ = c_pie
    p = subprocess.run(["linepack", "relayout", lib, "--profile", c_pie[0] + ".lpprof",
                        "-o", str(tmp_path / "x.so")], capture_output=True, text=True)
    assert p.returncode == 2 and "shared library" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = subprocess.run(["linepack", "profile", "--program", lib, "-o", str(tmp_path / "q")],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "shared library" in p.stderr and "Traceback" not in p.stderr
