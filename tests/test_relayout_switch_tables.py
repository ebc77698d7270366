"""Switch tables and other PC-relative data fields into code, PIE or not (issue 22).

tests/fixtures/c/switch_tables.c (a bytecode interpreter and two more dense
switches in its hot loop, error paths that only run with an argument, and one
PC-relative field relative to a data anchor that nothing can explain) built at
test time with gcc's defaults (-O2) and -Wl,--emit-relocs, three ways:

- ``fpie-exec``: -fPIE code linked -no-pie: an ET_EXEC with PIC tables
  (``.long .Lcase - .Ltable``, R_X86_64_PC32 in .rela.rodata), what Debian's
  gcc makes of a plain ``gcc -no-pie``; before issue 22 relayout translated
  these entries as S + A and the outputs crashed while verify passed them;
- ``nopie-exec``: -fno-pie code: absolute tables (``.quad .Lcase``);
- ``pie``: -fPIE -pie.

Each is profiled under qemu-x86_64, relaid out with ``pack`` and ``blocks``
(nothing else linked: the moved code goes to a new segment), run
with and without its error paths (same stdout, stderr and exit status as the
original) and checked with ``verify --against`` (exit 0). verify finds the
tables from the original's code on its own and names every wrong entry
written into the outputs (tools/verify/mutation.py), the pre-fix S + A
translation included; the loose field is kept and the function it designates
stays where it was. A rewriter problem that means a broken output stops
relayout (exit 2, nothing written); a note does not.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from linepack.image.elf import ElfImage

import helpers

_requirements = helpers.requirements("gcc", "qemu-x86_64")

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "c")
BUILDS = {"fpie-exec": ["-fPIE", "-no-pie"], "nopie-exec": ["-fno-pie", "-no-pie"],
          "pie": ["-fPIE", "-pie"]}
ENTRIES = 33                    # 13 (classify) + 8 (weigh) + 12 (run) table entries
STRATEGIES = ("pack", "blocks")


def _run(path, *args):
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def _relayout(exe, prof, strategy, out, env=None):
    p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", strategy,
                        "-o", out, "--json", out + ".json"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    with open(out + ".json") as f:
        return json.load(f)


def _verify(new, old):
    p = subprocess.run(["linepack", "verify", new, "--against", old, "--json", new + ".vjson"],
                       capture_output=True, text=True, timeout=300)
    with open(new + ".vjson") as f:
        return p.returncode, json.load(f), p.stdout + p.stderr


def _build(d, name):
    exe = os.path.join(d, name)
    subprocess.run(["gcc", "-O2", *BUILDS[name], "-Wl,--emit-relocs", "-o", exe,
                    os.path.join(FIX, "switch_tables.c")], check=True)
    return exe


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from linepack.profile.user import record_user
    d = str(tmp_path_factory.mktemp("switch"))
    out = {}
    for name in BUILDS:
        exe = _build(d, name)
        prof = exe + ".lpprof"
        record_user(exe, [], output=prof)
        outs = {s: (exe + "." + s, _relayout(exe, prof, s, exe + "." + s)) for s in STRATEGIES}
        out[name] = (exe, prof, outs)
    return out


def test_fixture_builds_are_what_they_claim(built):
    for name, (exe, _, _) in built.items():
        im = ElfImage(exe)
        assert im.type == (3 if name == "pie" else 2), name
        pcrel = sum(int((r.type == 2).sum()) for n, r in im.relocations.items()
                    if n == ".rodata")
        assert pcrel == (ENTRIES + 1 if name != "nopie-exec" else 1), (name, pcrel)


@pytest.mark.parametrize("name", list(BUILDS))
def test_relayout_and_verify_find_the_same_tables(built, name):
    """relayout's finder (relocations, nearest lea base) and verify's (from the
    lea / jmp of functions with an indirect jump, entries walked from the base)
    agree entry for entry; the anchor-relative field is loose and names
    via_anchor."""
    from linepack.relayout.units import units_of
    from linepack.kernel.base import ImageContext
    from linepack.relayout.user.pie import pic_table_entries
    from linepack.verify.pie import switch_tables
    exe = built[name][0]
    im = ElfImage(exe)
    _, functions, dis = units_of(im, lambda m: None)
    pic = pic_table_entries(im, dis, functions)
    ctx = ImageContext(ElfImage(exe))
    st = switch_tables(ctx.image, ctx.disasm, ctx.functions)
    if name == "nopie-exec":
        assert len(pic) == 0 and len(st.pic_field) == 0 and len(st.abs_field) == ENTRIES
    else:
        assert len(pic) == ENTRIES and len(st.abs_field) == 0
        assert np.array_equal(pic.field, st.pic_field) and np.array_equal(pic.case, st.pic_case)
        assert np.array_equal(pic.base, st.pic_base)
    loose = im.symbol_address("loose_field")
    assert pic.unexplained == 1 and pic.loose.tolist() == [loose]
    via = im.symbol_address("via_anchor")
    assert via in pic.loose_targets.tolist()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(BUILDS))
def test_output_runs_the_same(built, name, strategy):
    exe, _, outs = built[name]
    out, summary = outs[strategy]
    assert summary["units_moved"] > 0 and not summary["problems"], summary["problems"]
    assert summary["pie.pic_table_entries"] == (0 if name == "nopie-exec" else ENTRIES)
    assert summary["pie.pcrel_data_unexplained"] == 1
    assert summary["pcrel_data.pinned_units"] == 1
    assert summary["pcrel_data.unexplained_examples"][0]["section"] == ".rodata"
    base = _run(exe)
    assert base[0] == 0 and base[1].startswith("result ")
    assert _run(out) == base
    err = _run(exe, "x")
    assert err[0] == 3 and "bad opcode 99" in err[2]
    assert _run(out, "x") == err
    old, new = ElfImage(exe), ElfImage(out)
    # the loose field is unchanged and the function it designates stayed
    loose = old.symbol_address("loose_field")
    assert bytes(old.read(loose, 4)) == bytes(new.read(loose, 4))
    assert new.symbol_address("via_anchor") == old.symbol_address("via_anchor")
    assert new.symbol_address("run") != old.symbol_address("run") or \
        new.symbol_address("classify") != old.symbol_address("classify")
    if strategy == "blocks":
        names, _ = new.symbol_table()
        # run() dispatches through its switch table: split all the same
        assert summary["split"]["functions_split"] >= 1
        assert "run.cold" in names or "classify.cold" in names, summary["split"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(BUILDS))
def test_verify_against_passes(built, name, strategy):
    exe, _, outs = built[name]
    rc, rep, text = _verify(outs[strategy][0], exe)
    assert rc == 0, text
    extra = rep.get("extra", rep)
    if name == "nopie-exec":
        assert extra["equivalence_switch_table_entries_checked"] == ENTRIES
    else:
        assert extra["equivalence_pic_table_entries_checked"] == ENTRIES
    # the loose field, read relative to itself, lands in via_anchor
    assert extra["equivalence_pcrel_data_fields_checked"] == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(BUILDS))
def test_every_wrong_switch_table_entry_is_named(built, name, strategy):
    """Every entry of every table, each kind of wrong value (off by one, the
    original value left stale, another case of the table, and for a PIC
    table the entry translated as S + A where that differs): one finding of
    verify's table check at the entry's address, each."""
    from linepack.kernel.base import ImageContext
    from linepack.verify.mutation import switch_table_mutations
    exe, _, outs = built[name]
    octx = ImageContext(ElfImage(exe))
    nctx = ImageContext(ElfImage(outs[strategy][0]))
    rows = switch_table_mutations(octx, nctx, np.random.default_rng(22), per_kind=ENTRIES)
    kinds = {r[1] for r in rows}
    assert {"off by one", "stale (original value)", "another case of the table"} <= kinds
    assert {r[2] for r in rows} == {"absolute" if name == "nopie-exec" else "pic"}
    missed = [(r[1], hex(r[4])) for r in rows if not r[5]]
    assert not missed, missed
    check = "equiv.switch-table" if name == "nopie-exec" else "equiv.pic-table"
    assert all(f.check == check for r in rows for f in r[6])
    print(f"{name} {strategy}: {len(rows)} wrong entries, all named; kinds {sorted(kinds)}")


def _prefix_relayout(exe, prof, out):
    """relayout as before issue 22 for an ET_EXEC: no PC-relative field analysis
    (PIC entries translated as S + A), and problems only noted."""
    import linepack.relayout.passes as passes
    import linepack.relayout.user.pie as pie
    from linepack.relayout.driver import load_profile_full, relayout
    saved = pie.pic_table_entries, passes.BROKEN_OUTPUT
    try:
        pie.pic_table_entries = lambda *a, **k: pie.PicTables()
        passes.BROKEN_OUTPUT = frozenset()
        lp = load_profile_full(prof, exe)
        summary, _, _ = relayout(exe, out, "pack", hotness=lp.hotness, calls=lp.calls,
                                 blocks=lp.blocks, profile_build_id=lp.build_id)
    finally:
        pie.pic_table_entries, passes.BROKEN_OUTPUT = saved
    return summary


def test_prefix_translation_is_a_finding(built, tmp_path):
    """The ET_EXEC output relayout wrote before issue 22 (each PIC entry taken
    as relative to itself): verify names the entries it got wrong."""
    exe, prof, _ = built["fpie-exec"]
    out = str(tmp_path / "prefix")
    _prefix_relayout(exe, prof, out)
    rc, rep, text = _verify(out, exe)
    n = rep["equivalence_counts"]["equiv.pic-table"] if "equivalence_counts" in rep else \
        rep["extra"]["equivalence_counts"]["equiv.pic-table"]
    assert rc == 1 and n >= 1 and "equiv.pic-table" in text, text
    print(f"pre-fix S + A translation: {n} of {ENTRIES} entries wrong; the output's run: "
          f"{_run(out)[:2]} (the original's: {_run(exe)[:2]})")


_INJECT = """
import sys
import linepack.relayout.rewriter as r
orig = r.Rewriter.fix_rip_relative      # the references pass's last step
def fix_rip_relative(self):
    orig(self)
    self.problem(sys.argv[1], [0x401000], "injected by the test")
r.Rewriter.fix_rip_relative = fix_rip_relative
from linepack.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("kind,broken", [("branch-into-padding", True),
                                         ("target-in-padding", True),
                                         ("symbol-in-padding", False)])
def test_broken_output_problem_stops_relayout(built, tmp_path, kind, broken):
    exe, prof, _ = built["fpie-exec"]
    out, js = str(tmp_path / "out"), str(tmp_path / "out.json")
    p = subprocess.run([sys.executable, "-c", _INJECT, kind, "relayout", exe, "--profile", prof,
                        "--strategy", "pack", "-q", "-o", out, "--json", js],
                       capture_output=True, text=True, timeout=300)
    if broken:
        assert p.returncode == 2, p.stdout + p.stderr
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert kind in p.stderr and "nothing written" in p.stderr
        assert sorted(os.listdir(tmp_path)) == []
    else:
        assert p.returncode == 0, p.stderr
        assert f"problem: {kind}" in p.stdout
        assert os.path.exists(out) and os.path.exists(js)


def _lua_source():
    b = helpers.bench_module()
    try:
        return b.lua_source(log=lambda m: None), b.LUA_SCRIPT
    except (RuntimeError, OSError) as e:
        pytest.skip(f"lua5.4 source not available: {e}")


def test_lua_built_as_debian_builds_it(tmp_path):
    """The real program of issue 22: Debian's lua5.4 source built with gcc's
    defaults (-O2, -fPIE code) and linked -no-pie -Wl,--emit-relocs, nothing
    else. Before the fix both outputs
    crashed and verify passed them; now they print what the original prints
    and verify --against is clean, with every one of lua's 1,303 PIC switch-table
    entries found and checked."""
    import glob
    from linepack.profile.user import record_user
    src, script_text = _lua_source()
    obj = tmp_path / "obj"
    obj.mkdir()
    (obj / "lua5.4-deb-multiarch.h").write_text('#define DEB_HOST_MULTIARCH "x86_64-linux-gnu"\n')
    cs = sorted(c for c in glob.glob(os.path.join(src, "src", "*.c"))
                if os.path.basename(c) != "luac.c")
    objs = [str(obj / (os.path.basename(c)[:-2] + ".o")) for c in cs]
    procs = [subprocess.Popen(["gcc", "-O2", "-DLUA_COMPAT_5_3", "-DLUA_USE_LINUX", "-I", str(obj),
                               "-c", c, "-o", o]) for c, o in zip(cs, objs)]
    assert not any(p.wait() for p in procs)
    exe = str(tmp_path / "lua")
    subprocess.run(["gcc", "-no-pie", "-Wl,--emit-relocs", "-o", exe, *objs, "-lm", "-ldl"],
                   check=True)
    assert ElfImage(exe).type == 2
    script = str(tmp_path / "bench.lua")
    with open(script, "w") as f:
        f.write(script_text)
    expected = _run(exe, script)
    assert expected[0] == 0
    prof = exe + ".lpprof"
    record_user(exe, [script], output=prof)
    for strategy in STRATEGIES:
        out = exe + "." + strategy
        summary = _relayout(exe, prof, strategy, out)
        assert summary["pie.pic_table_entries"] == 1303 and not summary["problems"]
        assert summary["pie.pcrel_data_unexplained"] == 0
        assert _run(out, script) == expected, strategy
        rc, rep, text = _verify(out, exe)
        assert rc == 0, text
        assert rep.get("extra", rep)["equivalence_pic_table_entries_checked"] == 1303


@pytest.mark.parametrize("name", list(BUILDS))
def test_switch_table_entries_are_the_walk_from_each_base(tmp_path, name):
    """verify's switch tables (checked all at once) are what a walk field by field
    from each base finds: the relocated fields one after the other, each designating
    an instruction start of its base's source function, up to the first that does
    not (or the next base, or the first field without a relocation)."""
    from linepack.kernel.base import ImageContext
    from linepack.verify.pie import R_64, R_PC32, _data_reloc_fields, switch_tables
    exe = _build(str(tmp_path), name)
    ctx = ImageContext(ElfImage(exe))
    im, fn, dis = ctx.image, ctx.functions, ctx.disasm
    st = switch_tables(im, dis, fn)
    width = 8 if name == "nopie-exec" else 4
    field, base, case = (st.abs_field, st.abs_base, st.abs_case) if width == 8 else \
        (st.pic_field, st.pic_base, st.pic_case)
    assert len(field) == ENTRIES
    have = set(_data_reloc_fields(im, R_64 if width == 8 else R_PC32).tolist())
    bases = sorted(set(base.tolist()))
    stem = lambda c: fn.name[int(fn.find(np.array([c], np.uint64))[0])].split(".")[0]  # noqa
    walked = []
    for k, b in enumerate(bases):
        stop = bases[k + 1] if k + 1 < len(bases) else 1 << 64
        family = stem(int(case[base == b][0]))
        a = b
        while a < stop and a in have:
            v = int.from_bytes(bytes(im.read(a, width)), "little", signed=width == 4)
            c = (b + v) & (2**64 - 1) if width == 4 else v
            f = int(fn.find(np.array([c], np.uint64))[0])
            if f < 0 or stem(c) != family or not dis.is_boundary(np.array([c], np.uint64))[0]:
                break
            walked.append((a, b, c))
            a += width
    assert sorted(walked) == list(zip(field.tolist(), base.tolist(), case.tolist()))
