"""Block-level splitting of executables linked by lld (rustc's linker since Rust 1.90).

lld puts ``.eh_frame_hdr`` after ``.eh_frame`` (GNU ld: before it), and in a
program with exception tables ``.gcc_except_table`` between the two. The
fixtures of tests/test_relayout_blocks_user.py, linked here by lld-19 (``gcc
-fuse-ld=lld``, ``-Wl,--emit-relocs``), profiled under qemu-x86_64 and split
with ``blocks``:

- split_throw.cc (``-no-pie``, ``-pie``): the two sections apart; the header has
  no room for a cold FDE's entry, so both are rebuilt in the new segment; an
  exception thrown in ``work.cold`` is caught in ``guarded.cold``;
- split_user.c (``-no-pie``, ``-pie``): ``.eh_frame_hdr`` right after
  ``.eh_frame``, no room: the new segment; glibc's ``backtrace()`` from
  ``process.cold`` names the original's callers;
- split_user.c with cfi_room.s (nops in an FDE program, which the rebuild drops):
  in place, the header keeps its end and grows down into ``.eh_frame``,
  ``PT_GNU_EH_FRAME`` follows it;
- order_whole.c with cfi_room.s and c_cleanup.c (an LSDA in C: the sections
  apart): a function reordered whole needs no header entry, its FDE is rewritten
  in place, each section keeps its place and size.

Each output: functions split (nothing split before: relayout refused the order),
the same output as the original, ``verify --against`` (and ``--strict``) clean,
``eu-elflint --gnu-ld`` says of it what it says of the original (lld's own
output has findings of its own: ``.relro_padding``, version indices) and
``readelf -lSW`` reads it without a complaint.

ud2_trap.c (GNU ld): a ud2 followed by a hot block, as rustc emits after calls
that do not return; verify names no edge from the ud2 (ripgrep's first split
output had 11 such findings).
"""

import os
import re
import subprocess

import numpy as np
import pytest

import helpers
from helpers import run_linepack
from linepack.image.elf import ElfImage
from linepack.relayout.user.eh_frame_split import APART, EH_FIRST, _unwind_layout

_requirements = helpers.requirements("gcc", "g++", "qemu-x86_64", "eu-elflint", "ld.lld-19")

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "c")
PT_LOAD, PT_GNU_EH_FRAME = 1, 0x6474E550

# name: (compiler, sources, flags, link mode, the layout lld gives, tables in place)
CASES = {
    "throw-exec": ("g++", ["split_throw.cc"], ["-std=gnu++14", "-Wno-deprecated"], "-no-pie",
                   APART, False),
    "throw-pie": ("g++", ["split_throw.cc"], ["-std=gnu++14", "-Wno-deprecated"], "-pie",
                  APART, False),
    "user-exec": ("gcc", ["split_user.c"], ["-fno-pie"], "-no-pie", EH_FIRST, False),
    "user-pie": ("gcc", ["split_user.c"], [], "-pie", EH_FIRST, False),
    "user-room": ("gcc", ["split_user.c", "cfi_room.s"], ["-fno-pie"], "-no-pie", EH_FIRST,
                  True),
}


def _lld_bin(d):
    """A directory whose ``ld.lld`` is Debian's lld-19: gcc -B DIR -fuse-ld=lld."""
    lld = helpers.require_tool("ld.lld-19")
    b = os.path.join(d, "lldbin")
    os.makedirs(b, exist_ok=True)
    link = os.path.join(b, "ld.lld")
    if not os.path.lexists(link):
        os.symlink(os.path.realpath(lld), link)
    return b


def _run(path, *args):
    """Exit status and output (addresses, which a layout changes, masked)."""
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    return p.returncode, re.sub(r"0x[0-9a-f]+", "X", p.stdout), p.stderr


@pytest.fixture(scope="module", params=list(CASES))
def built(request, tmp_path_factory):
    from linepack.profile.user import record_user
    name = request.param
    cc, srcs, flags, link, _, _ = CASES[name]
    d = str(tmp_path_factory.mktemp(f"lld-{name}"))
    exe = os.path.join(d, name)
    subprocess.run([cc, "-O2", *flags, link, "-fno-reorder-blocks-and-partition",
                    "-B", _lld_bin(d), "-fuse-ld=lld", "-Wl,--emit-relocs", "-o", exe,
                    *[os.path.join(FIX, s) for s in srcs]], check=True)
    comment = subprocess.run(["readelf", "-p", ".comment", exe], capture_output=True,
                             text=True).stdout
    assert "LLD" in comment, comment
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    out = exe + ".blocks"
    p = run_linepack("relayout", exe, "--profile", prof, "--strategy", "blocks", "-o", out,
                     "--json", out + ".json")
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    with open(out + ".json") as f:
        summary = json.load(f)
    return name, exe, out, summary, p.stderr


def test_lld_puts_the_header_after_eh_frame(built):
    name, exe, _, _, _ = built
    im = ElfImage(exe)
    hs, es = im.section(".eh_frame_hdr"), im.section(".eh_frame")
    assert hs.addr > es.addr
    assert _unwind_layout(im, hs, es) == CASES[name][4]


def test_functions_split(built):
    name, exe, out, summary, log = built
    assert "not splitting functions with unwind information" not in log, log
    split = summary["split"]
    reasons = split["hot_functions_by_reason"]
    assert not [k for k in reasons if "no room" in k], reasons
    assert split["functions_split"] >= 2, reasons
    assert summary["eh_frame.cold_fdes"] >= 2
    names = {n.removesuffix(".cold") for n in ElfImage(out).symbol_table()[0]
             if n.endswith(".cold")}
    want = {"_Z4workii", "_Z7guardedii"} if name.startswith("throw") else {"process", "run"}
    assert want <= names, names


def test_unwind_tables_in_place_or_in_the_new_segment(built):
    name, exe, out, summary, _ = built
    old, im = ElfImage(exe), ElfImage(out)
    hdr, eh = im.section(".eh_frame_hdr"), im.section(".eh_frame")
    ph = next(p for p in im.phdrs if int(p["type"]) == PT_GNU_EH_FRAME)
    assert (int(ph["vaddr"]), int(ph["memsz"])) == (hdr.addr, hdr.size)
    assert int(ph["offset"]) == hdr.offset
    oh, oe = old.section(".eh_frame_hdr"), old.section(".eh_frame")
    if CASES[name][5]:
        # in place: .eh_frame keeps its start, the header its end and grows down
        assert not summary.get("new_segment") or not summary["new_segment"]["eh_bytes"]
        assert eh.addr == oe.addr and hdr.end == oh.end
        assert hdr.addr < oh.addr and eh.end == hdr.addr
    else:
        seg = [p for p in im.phdrs if int(p["type"]) == PT_LOAD][-1]
        lo, hi = int(seg["vaddr"]), int(seg["vaddr"]) + int(seg["memsz"])
        assert summary["new_segment"]["eh_bytes"] > 0
        assert lo <= hdr.addr < hi and lo <= eh.addr < hi


def test_runs_the_same(built):
    name, exe, out, _, _ = built
    assert _run(out) == _run(exe)
    if name.startswith("throw"):
        # thrown in work.cold, caught by guarded()'s landing pad in guarded.cold
        got = _run(out, "x")
        assert got == _run(exe, "x") and "caught Bad 2332" in got[1]
        return
    got, want = _run(out, "fail"), _run(exe, "fail")
    assert got == want
    if CASES[name][3] == "-pie":
        return                  # return addresses relative to a random load base
    # backtrace() from process.cold: the original's callers, their cold parts first
    frames = [[int(x, 16) for x in m.group(1).split()] for m in
              re.finditer(r"frames \d+:(.*)", subprocess.run(
                  [out, "fail"], capture_output=True, text=True).stdout)]
    assert frames
    im = ElfImage(out)
    names, syms = im.symbol_table()
    f = ((syms["info"] & 0xF) == 2) & (syms["size"] > 0)
    lo = syms["value"][f].astype(np.int64)
    hi = lo + syms["size"][f].astype(np.int64)
    nm = [n for n, k in zip(names, f) if k]
    for fr in frames:
        got = [next((nm[i] for i in np.nonzero((lo <= pc - 1) & (pc - 1 < hi))[0]), None)
               for pc in fr[:3]]
        assert got[0] == "process.cold", got
        assert [g and g.removesuffix(".cold") for g in got] == ["process", "run", "main"]


def test_verify_and_elf_tools_clean(built):
    name, exe, out, _, _ = built
    for strict in ((), ("--strict",)):
        p = run_linepack("verify", out, "--against", exe, *strict)
        assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    lint = [subprocess.run(["eu-elflint", "--gnu-ld", x], capture_output=True,
                           text=True).stdout.replace(x, "F") for x in (exe, out)]
    assert lint[1] == lint[0], lint[1]
    p = subprocess.run(["readelf", "-lSW", out], capture_output=True, text=True)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr


def test_no_edge_from_a_ud2(tmp_path):
    """A program's ud2 never falls through: the block after it (hot) may go elsewhere."""
    from linepack.profile.user import record_user
    exe = str(tmp_path / "ud2_trap")
    subprocess.run(["gcc", "-O2", "-no-pie", "-fno-reorder-blocks-and-partition",
                    "-Wl,--emit-relocs", "-o", exe, os.path.join(FIX, "ud2_trap.c")], check=True)
    record_user(exe, [], output=exe + ".lpprof")
    out = exe + ".blocks"
    p = run_linepack("relayout", exe, "--profile", exe + ".lpprof", "--strategy", "blocks",
                     "-o", out)
    assert p.returncode == 0, p.stderr[-2000:]
    im = ElfImage(out)
    names, syms = im.symbol_table()
    cold = int(syms["value"][names.index("trap_guard.cold")])
    size = int(syms["size"][names.index("trap_guard.cold")])
    assert b"\x0f\x0b" in bytes(im.read(cold, size))       # the trap block went cold
    assert _run(out) == _run(exe)
    p = run_linepack("verify", out, "--against", exe)
    assert p.returncode == 0 and "[equiv.edge]" not in p.stdout, p.stdout[-2000:]


def test_apart_in_place(tmp_path):
    """The two sections apart, and room in .eh_frame (cfi_room.s): a function
    reordered whole (order_whole.c's mix: no cold part, no new header entry) has its
    FDE rewritten in place; each section keeps its place and size."""
    from linepack.profile.user import record_user
    exe = str(tmp_path / "apart")
    subprocess.run(["gcc", "-O2", "-no-pie", "-fno-reorder-blocks-and-partition",
                    "-falign-jumps=1", "-falign-loops=1", "-falign-labels=1",
                    "-B", _lld_bin(str(tmp_path)), "-fuse-ld=lld", "-Wl,--emit-relocs",
                    "-o", exe, os.path.join(FIX, "order_whole.c"),
                    os.path.join(FIX, "cfi_room.s"), "-fexceptions",
                    os.path.join(FIX, "c_cleanup.c")], check=True)
    old = ElfImage(exe)
    assert _unwind_layout(old, old.section(".eh_frame_hdr"), old.section(".eh_frame")) == APART
    record_user(exe, [], output=exe + ".lpprof")
    cfg = tmp_path / "whole.toml"          # no cold part worth moving: mix reordered whole
    cfg.write_text('strategy = "blocks"\ncold_min = 4096\norder_whole = true\n')
    out = exe + ".blocks"
    p = run_linepack("relayout", exe, "--profile", exe + ".lpprof", "--config", cfg, "-o", out,
                     "--json", out + ".json")
    assert p.returncode == 0, p.stderr[-2000:]
    import json
    summary = json.loads(open(out + ".json").read())
    assert summary["split"]["functions_reordered_whole"] >= 1
    assert not summary.get("new_segment")
    im = ElfImage(out)
    for name in (".eh_frame", ".eh_frame_hdr"):
        a, b = old.section(name), im.section(name)
        assert (a.addr, a.size) == (b.addr, b.size)
    assert bytes(im.section_bytes(im.section(".eh_frame"))) != \
        bytes(old.section_bytes(old.section(".eh_frame")))
    for args in ((), ("1",), ("2",)):
        assert _run(out, *args) == _run(exe, *args)
    p = run_linepack("verify", out, "--against", exe, "--strict")
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    lint = [subprocess.run(["eu-elflint", "--gnu-ld", x], capture_output=True,
                           text=True).stdout.replace(x, "F") for x in (exe, out)]
    assert lint[1] == lint[0], lint[1]
