"""References without link relocations (linepack.image.references): on a small
freestanding executable built with --emit-relocs (the truth), with a KASLR-style
table made from its absolute relocations as arch/x86/tools/relocs.c would:
0 missing, the same relayout from either source, unexplained values pinned.
The real kernel (Debian 6.1 with its vmlinuz) is in test_references_vmlinux.py."""

import json
import types

import numpy as np
import pytest

from linepack.image import references as R
from linepack.relayout.kernel import recovered as RK
from linepack.image.elf import ElfImage
from linepack.relayout.units import units_of
from linepack.kernel.base import ImageContext
from linepack.relayout.driver import relayout
import helpers

FLAGS = ("-nostdlib", "-no-pie", "-fno-pic", "-fno-asynchronous-unwind-tables",
         "-Wl,--emit-relocs")


def _kaslr_of(image):
    """What relocs.c writes for this link: every absolute field, by width."""
    a64, a32 = [], []
    for rel in image.relocations.values():
        if not rel.target.is_alloc:
            continue
        a64.append(rel.offset[rel.type == 1])
        a32.append(rel.offset[np.isin(rel.type, (10, 11))])
    return types.SimpleNamespace(kaslr=types.SimpleNamespace(
        abs64=np.concatenate(a64).astype(np.uint64), abs32=np.concatenate(a32).astype(np.uint64),
        inv32=np.zeros(0, np.uint64)), build_id=None)


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    d = tmp_path_factory.mktemp("refs")
    return helpers.build_c("refs_freestanding.c", d / "refs", *FLAGS)


@pytest.fixture(scope="module")
def exe_unexplained(tmp_path_factory):
    d = tmp_path_factory.mktemp("refsu")
    return helpers.build_c("refs_freestanding.c", d / "refsu", *FLAGS, "-DUNEXPLAINED")


def _profile(tmp_path):
    p = tmp_path / "prof.json"
    # the cold helpers go first in the file: pack moves the hot ones ahead of them
    p.write_text(json.dumps({"functions": {"pick": 100, "target_of_word": 90, "helper_c": 80,
                                           "_start": 1}}))
    return str(p)


def test_nothing_missing_against_the_link(exe):
    image = ElfImage(exe)
    units, functions, _ = units_of(image)
    lo, hi, _ = RK.movable_ranges(units)
    refs = RK.recover_for_layout(image, _kaslr_of(image).kaslr, units)
    link = R.link_references(image, ImageContext.of(image).disasm)
    c = R.compare(image, refs, link, lo.copy(), hi.copy())
    # every link relocation of this program but the two absolute ones to data (.rodata,
    # table) in moved code: their value stays
    assert c["relevant"] == 9 and c["absolute_in_movable_code_to_fixed_targets"] == 2, c
    assert c["missing"] == 0 and c["wrong_target"] == 0, c
    # the assembler's own references (calls between functions of one file) are extra
    assert c["extra_by_origin"]["code-branch"] >= 1, c
    assert refs.unexplained["fields"] == 0


def test_relayout_from_recovered_equals_link(exe, tmp_path):
    prof = _profile(tmp_path)
    hot = json.loads(open(prof).read())["functions"]
    a, b = tmp_path / "link", tmp_path / "recovered"
    s1, _, _ = relayout(exe, str(a), "pack", hotness=hot)
    s2, _, _ = relayout(exe, str(b), "pack", hotness=hot, vmlinuz=_kaslr_of(ElfImage(exe)))
    assert s1["units_moved"] > 0 and s1["units_moved"] == s2["units_moved"]
    assert s2["references"]["kaslr-64"] == 4 and s2["references"]["unexplained"]["fields"] == 0
    ia, ib = ElfImage(str(a)), ElfImage(str(b))
    for s in ia.alloc_sections():
        if s.type != 8:
            assert bytes(ia.section_bytes(s)) == bytes(ib.section_bytes(ib.section(s.name))), s.name
    # and the program still runs the same
    import subprocess
    want = subprocess.run([exe]).returncode
    assert subprocess.run([str(a)]).returncode == want == subprocess.run([str(b)]).returncode


def test_unexplained_word_pins_its_function(exe_unexplained, tmp_path):
    prof = _profile(tmp_path)
    hot = json.loads(open(prof).read())["functions"]
    out = tmp_path / "out"
    s, plan, _ = relayout(exe_unexplained, str(out), "pack", hotness=hot,
                          vmlinuz=_kaslr_of(ElfImage(exe_unexplained)))
    un = s["references"]["unexplained"]
    assert un["fields"] == 1 and un["functions_pinned"] == 1, un
    assert un["examples"][0]["function"] == "target_of_word"
    assert un["examples"][0]["kind"] == "pc32"
    im, new = ElfImage(exe_unexplained), ElfImage(str(out))
    assert new.symbol_address("target_of_word") == im.symbol_address("target_of_word")
    assert new.symbol_address("pick") != im.symbol_address("pick")     # the rest moved
    import subprocess
    assert subprocess.run([str(out)]).returncode == subprocess.run([exe_unexplained]).returncode


def test_refusal_names_vmlinuz(exe, tmp_path):
    import subprocess
    stripped = tmp_path / "stripped"
    subprocess.run(["objcopy", "--remove-relocations=*", exe, str(stripped)], check=True)
    r = helpers.run_linepack("relayout", stripped, "-o", tmp_path / "o", "--strategy", "stock")
    assert r.returncode == 2 and "--vmlinuz" in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_pin_cuts_regions_and_keep_first():
    """A pinned unit in mid-region becomes a pinned region of its own (the
    planner keeps pinned code only as a region's prefix); a kept-first unit
    gets a region of its own at its region's start and moves with it."""
    from linepack.relayout import strategies
    from linepack.relayout.plan import make_plan
    from linepack.relayout.units import Region, UnitTable
    regs = [Region("r0", 0x1000, 0x1100, 1), Region("r1", 0x1100, 0x1200, 1)]
    start = [0x1000, 0x1020, 0x1040, 0x1060, 0x1100, 0x1130]
    u = UnitTable(start, [0x20, 0x20, 0x20, 0x20, 0x30, 0x30], [0, 0, 0, 0, 1, 1], regs,
                  name=[f"f{i}" for i in range(6)])
    RK.pin_units(u, np.array([2]))
    RK.keep_first(u, [4])
    names = [(r.name, r.start, r.end, r.pinned) for r in u.regions]
    assert names == [("r0", 0x1000, 0x1040, False), ("r0+1", 0x1040, 0x1060, True),
                     ("r0+2", 0x1060, 0x1100, False), ("r1", 0x1100, 0x1130, False),
                     ("r1+rest", 0x1130, 0x1200, False)]
    heat = np.array([0, 10, 0, 10, 0, 10], float)
    plan = make_plan(u, strategies.get("hot64"), heat)
    assert int(plan.new_start[2]) == 0x1040                 # pinned stays
    refs = types.SimpleNamespace(kept_first=["f4@0x1100"])
    RK.check_plan(refs, plan)                               # f4 first in its region
    assert int(plan.new_start[4]) == int(plan.region_new_start[3])


def test_kept_first_unit_placed_after_padding_takes_its_label():
    """A kept-first unit the strategy places after padding (a hot unit aligned for
    its lines, a block-level hot part) takes its region's start label with it: the
    padding goes before the label (Debian 13's PREEMPT_RT 6.12: _raw_spin_lock_irqsave,
    first in the lock text, split, its hot part placed 0x37 bytes in)."""
    from linepack.relayout import strategies
    from linepack.relayout.plan import make_plan
    from linepack.relayout.units import Region, UnitTable
    regs = [Region("r0", 0x1000, 0x1108, 1), Region("r1", 0x1108, 0x1200, 1)]
    u = UnitTable([0x1000, 0x1108, 0x1140], [0x40, 0x30, 0x30], [0, 1, 1], regs,
                  name=["f0", "f1", "f2"], align=[16, 64, 16])
    RK.keep_first(u, [1])
    assert u.regions[1].label_at_first and not u.regions[2].label_at_first
    plan = make_plan(u, strategies.get("hot64"), np.array([10, 10, 10], float))
    assert int(plan.new_start[1]) % 64 == 0 and int(plan.new_start[1]) > 0x1108
    refs = types.SimpleNamespace(kept_first=["f1@0x1108"])
    RK.check_plan(refs, plan)
    assert int(plan.region_new_start[1]) == int(plan.new_start[1])
