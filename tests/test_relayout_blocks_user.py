"""Block-level relayout (hot/cold splitting) of userspace executables.

C fixture (tests/fixtures/c/split_user.c) and C++ fixture (split_throw.cc),
built at test time (-O2 -no-pie -Wl,--emit-relocs, gcc's own hot/cold
partitioning off so that linepack does the splitting), nothing else (the
moved code and the grown unwind tables go to a new segment), profiled under
qemu-x86_64 with linepack's plugin (no arguments: the error paths never run),
split with the ``blocks`` strategy, then run with the error paths taken:

- same output; glibc's backtrace() from inside a cold part (libgcc unwinder,
  .eh_frame_hdr + the cold part's own FDE) gives the same frames as the
  original, its first caller now in ``process.cold``; gdb's ``bt`` too;
- a C++ exception thrown in ``work.cold`` is caught by its caller's landing pad
  in ``guarded.cold`` (one LSDA per part); a function with an exception
  specification is moved whole with the named reason;
- ``verify --against`` passes and checks the unwind state at every piece and
  the exception lookup at every copied byte; a cold FDE with a wrong CFA offset
  (``equiv.eh_frame-part``) and a part LSDA with a wrong LPStart
  (``equiv.lsda-part``) are named;
- with no room in .eh_frame the unwind tables go to the new segment: no split refused;
- cfi.py: every FDE's program, evaluated and written again, gives the same rows;
- a PIE without --emit-relocs is refused with one line (exit 2).
"""

import json
import os
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest
import helpers

from linepack.image.elf import ElfImage
from linepack.relayout.user.cfi import evaluate, parse_cie_info, write_program
from linepack.relayout.driver import load_profile_full, relayout
from linepack.relayout.user.eh_frame import check_eh_frame
from linepack.relayout.user.eh_frame_split import (_records, check_split_cfi,
                                                   check_split_lsda)
from linepack.relayout.user.eh_frame import parse_eh_frame

_requirements = helpers.requirements("gcc", "g++", "qemu-x86_64")

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "c")
FLAGS = ["-O2", "-fno-pie", "-no-pie", "-fno-reorder-blocks-and-partition",
         "-Wl,--emit-relocs"]
def _build(d, src, name, cc="gcc", std=()):
    exe = os.path.join(d, name)
    subprocess.run([cc, *std, *FLAGS, "-o", exe, os.path.join(FIX, src)], check=True)
    return exe


def _profile(exe):
    from linepack.profile.user import record_user
    out = exe + ".lpprof"
    record_user(exe, [], output=out)
    return out


def _split(exe, prof, out):
    lp = load_profile_full(prof, exe)
    return relayout(exe, out, "blocks", hotness=lp.hotness, calls=lp.calls,
                    blocks=lp.blocks, profile_build_id=lp.build_id)


def _run(path, *args):
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def c_case(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ub"))
    exe = _build(d, "split_user.c", "split_user")
    prof = _profile(exe)
    out = os.path.join(d, "split_user.blocks")
    summary, _, rw = _split(exe, prof, out)
    return exe, out, summary, rw


def _names(image_path, pcs):
    """Symbol (FUNC, incl. name.cold) holding each return address - 1; None outside."""
    im = ElfImage(image_path)
    names, syms = im.symbol_table()
    f = ((syms["info"] & 0xF) == 2) & (syms["size"] > 0)
    lo = syms["value"][f].astype(np.int64)
    hi = lo + syms["size"][f].astype(np.int64)
    nm = [n for n, k in zip(names, f) if k]
    out = []
    for pc in pcs:
        hit = np.nonzero((lo <= pc - 1) & (pc - 1 < hi))[0]
        out.append(nm[int(hit[0])] if len(hit) else None)
    return out


def _frames(text):
    """Backtraces printed by split_user.c's report(): lists of return addresses."""
    return [[int(x, 16) for x in m.group(2).split()]
            for m in re.finditer(r"frames (\d+):(.*)", text)]


def test_c_split_runs_and_unwinds_from_cold_parts(c_case):
    exe, out, summary, rw = c_case
    names = {sf.name for sf in rw.block_split["splits"]}
    assert {"process", "run"} <= names, names
    assert summary["eh_frame.cold_fdes"] == len(names)
    assert check_eh_frame(ElfImage(out)) == []
    assert _run(out) == _run(exe)
    want, got = _run(exe, "fail"), _run(out, "fail")
    assert re.sub(r"0x[0-9a-f]+", "X", got) == re.sub(r"0x[0-9a-f]+", "X", want)
    fw, fg = _frames(want), _frames(got)
    assert len(fw) == len(fg) == 2
    for a, b in zip(fw, fg):
        assert len(a) == len(b) >= 5          # process, run, main, libc..., _start
        na, nb = _names(exe, a), _names(out, b)
        assert na[:3] == ["process", "run", "main"]
        assert nb[0] == "process.cold"        # report() was called from the cold part
        assert [n and n.removesuffix(".cold") for n in nb] == na
        assert na[-1] == nb[-1] == "_start"


def test_c_gdb_backtrace_from_cold_part(c_case):
    exe, out, _, _ = c_case
    if shutil.which("gdb") is None:
        pytest.fail("gdb is installed by tools/setup.sh")

    def bt(path):
        p = subprocess.run(["gdb", "-batch", "-nx", "-ex", "break report", "-ex", "run",
                            "-ex", "bt", "--args", path, "fail"],
                           capture_output=True, text=True, timeout=120)
        return re.findall(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(\S+)", p.stdout, re.M)
    a, b = bt(exe), bt(out)
    assert a[:4] == ["report", "process", "run", "main"], a
    assert [re.sub(r"(\[cold\]|\.cold)$", "", n) for n in b] == a, b
    assert re.match(r"process(\[cold\]|\.cold)$", b[1]), b


def test_c_verify_against(c_case, tmp_path):
    exe, out, _, _ = c_case
    js = tmp_path / "v.json"
    p = subprocess.run(["linepack", "verify", out, "--against", exe, "--json", str(js)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(js.read_text())
    extra = rep.get("extra", rep)
    assert extra["equivalence_eh_frame_part_states"] > 20


def test_unwind_states_at_once_count_what_the_loop_counts(c_case, monkeypatch):
    """check_split_cfi's array pass (_all_states_equal) answers for every point the
    per-point loop checks: the same count on a correct output, and it leaves a
    wrong one to the loop (above: the findings)."""
    import linepack.relayout.user.eh_frame_split as split_mod
    exe, out, _, rw = c_case
    rows = rw.block_split["rows"]
    at_once = split_mod._all_states_equal(*split_mod.parse_for_check(ElfImage(exe),
                                                                     ElfImage(out)), rows)
    monkeypatch.setattr(split_mod, "_all_states_equal", lambda *a: None)
    probs, seen = check_split_cfi(ElfImage(exe), ElfImage(out), rows)
    assert not probs and seen > 20
    assert at_once == seen


def test_verify_names_a_wrong_cold_fde(c_case, tmp_path):
    """Bump the CFA offset the cold FDE of process sets: verify names it."""
    exe, out, _, rw = c_case
    im = ElfImage(out)
    cold = next(a for sf, a, _ in rw.block_split["cold_syms"] if sf.name == "process")
    sec = im.section(".eh_frame")
    data = bytes(im.section_bytes(sec))
    rec = next(r for r in _records(data, sec.addr, parse_eh_frame(data, sec.addr))
               if not r.is_cie and r.pc_begin == cold)
    # the cold part starts inside the function's body: its program's first
    # instruction sets the CFA offset (DW_CFA_def_cfa_offset, operand next)
    assert rec.prog[0] == 0x0E
    pos = sec.offset + rec.prog_off + 1
    bad = tmp_path / "bad"
    raw = bytearray(open(out, "rb").read())
    raw[pos] = (raw[pos] + 8) & 0x7F
    bad.write_bytes(bytes(raw))
    probs, seen = check_split_cfi(ElfImage(exe), ElfImage(str(bad)),
                                  rw.block_split["rows"])
    assert seen and probs and all(cold <= a for a, _ in probs)
    import linepack.relayout.user.eh_frame_split as split_mod
    assert split_mod._all_states_equal(*split_mod.parse_for_check(ElfImage(exe),
                                                                  ElfImage(str(bad))),
                                       rw.block_split["rows"]) is None
    p = subprocess.run(["linepack", "verify", str(bad), "--against", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert "equiv.eh_frame-part" in p.stdout + p.stderr


def test_no_room_in_eh_frame_puts_unwind_tables_in_a_new_segment(c_case):
    exe, out, summary, _ = c_case
    reasons = summary["split"]["hot_functions_by_reason"]
    assert not [k for k in reasons if "no room left in .eh_frame" in k], reasons
    assert summary["split"]["functions_split"] >= 2
    assert summary["new_segment"]["eh_bytes"] > 0
    im = ElfImage(out)
    seg = [p for p in im.phdrs if int(p["type"]) == 1][-1]
    hdr = im.section(".eh_frame_hdr")
    assert int(seg["vaddr"]) <= hdr.addr < int(seg["vaddr"]) + int(seg["memsz"])
    want, got = _run(exe, "fail"), _run(out, "fail")
    assert re.sub(r"0x[0-9a-f]+", "X", got) == re.sub(r"0x[0-9a-f]+", "X", want)


@pytest.fixture(scope="module")
def cxx_case(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ubx"))
    exe = _build(d, "split_throw.cc", "split_throw", cc="g++",
                 std=("-std=gnu++14", "-Wno-deprecated"))
    prof = _profile(exe)
    out = os.path.join(d, "split_throw.blocks")
    summary, _, rw = _split(exe, prof, out)
    return exe, out, summary, rw


def test_cxx_exceptions_through_split_functions(cxx_case):
    """Thrown in work.cold (no LSDA), caught by guarded()'s landing pad in
    guarded.cold (one LSDA per part); checked() (exception specification) whole."""
    exe, out, summary, rw = cxx_case
    split = {sf.name for sf in rw.block_split["splits"]}
    assert {"_Z4workii", "_Z7guardedii"} <= split, split
    assert "_Z7checkedi" not in split
    assert summary["eh_frame.part_lsdas"] == 2
    reasons = summary["split"]["hot_functions_by_reason"]
    assert any("has an LSDA linepack does not rewrite" in k for k in reasons), reasons
    assert _run(out) == _run(exe)
    got = _run(out, "x")
    assert got == _run(exe, "x") and "caught Bad 2332" in got
    # the landing pad really is in the cold part
    im = ElfImage(out)
    names, syms = im.symbol_table()
    cold = [(int(v), int(v) + int(n)) for nm, v, n in zip(names, syms["value"], syms["size"])
            if nm == "_Z7guardedii.cold"]
    assert cold
    probs, seen = check_split_lsda(ElfImage(exe), im, rw.block_split["rows"])
    assert not probs and seen >= 5          # intervals of constant lookup checked
    p = subprocess.run(["linepack", "verify", out, "--against", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def test_verify_names_a_wrong_part_lsda(cxx_case, tmp_path):
    """Shift the LPStart of guarded()'s hot-part LSDA by one: every landing pad
    it names is off by a byte; verify names it (equiv.lsda-part)."""
    exe, out, _, rw = cxx_case
    im = ElfImage(out)
    sf = next(sf for sf in rw.block_split["splits"] if sf.name == "_Z7guardedii")
    sec = im.section(".eh_frame")
    data = bytes(im.section_bytes(sec))
    rec = next(r for r in _records(data, sec.addr, parse_eh_frame(data, sec.addr))
               if not r.is_cie and r.pc_begin == sf.new_start[0])
    hs = im.section(".eh_frame_hdr")
    assert hs.addr < rec.lsda < hs.addr + hs.size       # new LSDAs live after the table
    pos = hs.offset + rec.lsda - hs.addr
    raw = bytearray(open(out, "rb").read())
    assert raw[pos] == 0x00                               # LPStart given, absptr
    lpstart = struct.unpack_from("<Q", raw, pos + 1)[0]
    struct.pack_into("<Q", raw, pos + 1, lpstart + 1)
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    probs, _ = check_split_lsda(ElfImage(exe), ElfImage(str(bad)), rw.block_split["rows"])
    assert probs
    p = subprocess.run(["linepack", "verify", str(bad), "--against", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "equiv.lsda-part" in p.stdout + p.stderr


def test_cfi_programs_round_trip(c_case):
    """Every FDE of the fixture and of its output: evaluate, write, evaluate again."""
    exe, out, _, _ = c_case
    n = 0
    for path in (exe, out):
        im = ElfImage(path)
        sec = im.section(".eh_frame")
        data = bytes(im.section_bytes(sec))
        for r in _records(data, sec.addr, parse_eh_frame(data, sec.addr)):
            if r.is_cie:
                continue
            info = parse_cie_info(data, r.cie, r.cie + 4)
            rows = evaluate(r.prog, info, info.init_state)
            again = evaluate(write_program(rows, info), info, info.init_state)
            dedup = lambda rs: [x for i, x in enumerate(rs) if i == 0 or rs[i - 1][1] != x[1]]  # noqa: E731,E501
            assert dedup(again) == dedup(rows)
            n += 1
    assert n >= 20
    assert struct.calcsize("<I") == 4


def test_pie_without_link_relocations_is_refused(tmp_path):
    """A PIE is relaid out (tests/test_relayout_pie.py) only with its link
    relocations: without --emit-relocs, one line naming it, exit 2."""
    exe = str(tmp_path / "pie")
    subprocess.run(["gcc", "-O2", "-fpie", "-pie", "-o", exe,
                    os.path.join(FIX, "split_user.c")], check=True)
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"functions": {"process": 100.0}}))
    p = subprocess.run(["linepack", "relayout", exe, "--profile", str(prof), "--strategy",
                        "blocks", "-o", str(tmp_path / "out")], capture_output=True, text=True)
    assert p.returncode == 2
    assert "--emit-relocs" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()


def test_dynsym_follows_the_layout(tmp_path):
    """-rdynamic: .dynsym holds the functions too (dlsym, dladdr); after the
    split each exported function's dynamic symbol equals its .symtab entry
    (value at the hot part, hot size)."""
    d = str(tmp_path)
    exe = os.path.join(d, "rdyn")
    subprocess.run(["gcc", *FLAGS, "-rdynamic", "-o", exe, os.path.join(FIX, "split_user.c")],
                   check=True)
    prof = _profile(exe)
    out = os.path.join(d, "rdyn.blocks")
    summary, _, rw = _split(exe, prof, out)
    assert "process" in {sf.name for sf in rw.block_split["splits"]}
    assert summary["dynsym_updated"] > 0
    im = ElfImage(out)
    names, syms = im.symbol_table()
    sym = {n: (int(v), int(z)) for n, v, z, i in zip(names, syms["value"], syms["size"],
                                                     syms["info"]) if i & 0xF == 2 and v}
    ds = next(s for s in im.sections if s.type == 11)
    dstr = bytes(im.section_bytes(im.sections[ds.link]))
    dyn = np.array(im.section_bytes(ds)).view(
        np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                  ("value", "<u8"), ("size", "<u8")]))
    checked = 0
    for row in dyn:
        if row["info"] & 0xF != 2 or not row["shndx"]:
            continue
        n = dstr[row["name"]:dstr.index(b"\0", row["name"])].decode()
        assert (int(row["value"]), int(row["size"])) == sym[n], n
        checked += 1
    assert checked >= 4


def test_verify_names_only_the_broken_relocation(c_case, tmp_path):
    """One relocated field (a reference to the global ``sink``) in a blocks output
    made wrong: verify names that field alone (the PLT calls, whose fields never
    hold S + A - P, are matched to the original's by symbol name, though the
    .cold symbols shifted the global symbols' indices)."""
    exe, out, _, _ = c_case
    im = ElfImage(out)
    rel = im.relocations[".text"]
    names, _ = im.symbol_table()
    k = next(i for i in range(len(rel)) if names[int(rel.sym[i])] == "sink")
    field = int(rel.offset[k])
    sec = im.section(".text")
    pos = sec.offset + field - sec.addr
    raw = bytearray(open(out, "rb").read())
    raw[pos] ^= 0x10
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    p = subprocess.run(["linepack", "verify", str(bad), "--against", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    found = re.findall(r"\[equiv\.relocation\] field at (0x[0-9a-f]+)", p.stdout)
    assert found == [hex(field)], p.stdout[-3000:]


def test_evaluate_growth_is_relayouts(c_case, cxx_case):
    """evaluate's .text growth of an output given by path (tools/evaluate/booted.py,
    read back from the two images and the block map) equals relayout's own figure."""
    from linepack.evaluate.booted import code_growth
    for exe, out, summary, _ in (c_case, cxx_case):
        assert summary["split"]["functions_split"] >= 1
        assert code_growth(exe, out) == summary["text_growth_bytes"], out


def test_summary_speaks_of_the_program(c_case):
    """A program's profile has no workload iterations and no retpoline thunks: the
    summary says what it counted over, in a program's words."""
    import numpy as np
    from linepack.image.cfg import R_INDIRECT, R_PINNED
    from linepack.relayout.blocks import reason_summary
    text = "\n".join(c_case[2].lines())
    assert "executed lines:" in text and "at least once in the profiled run" in text
    assert "per iteration" not in text and "retpoline" not in text
    reason, heat = np.array([R_INDIRECT, R_PINNED]), np.array([5.0, 5.0])
    user = " ".join(reason_summary(reason, heat, 1.0, userspace=True))
    assert "retpoline" not in user and "SRSO" not in user and "indirect jump" in user
    assert "retpoline" in " ".join(reason_summary(reason, heat, 1.0))
    # profile --show of a program's profile: no kernel emulation shares
    from helpers import run_linepack
    p = run_linepack("profile", "--show", c_case[0] + ".lpprof")
    assert p.returncode == 0 and "hottest" in p.stdout, p.stderr
    assert "emulation" not in p.stdout and "timekeeping" not in p.stdout
