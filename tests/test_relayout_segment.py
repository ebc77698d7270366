"""Room without relinking: userspace layouts in a new PT_LOAD segment.

Executables built as people build them (gcc -O2 with its default PIE code,
``-Wl,--emit-relocs`` and nothing else; linked ``-no-pie`` and ``-pie``) have
no room after ``.text`` nor in ``.eh_frame``: ``pack`` and ``blocks`` put the
moved code (and, for ``blocks``, the grown unwind tables) in a new segment
(relayout/user/segment.py). Fixtures: tests/fixtures/c/switch_tables.c (PIC
switch tables, a pinned function that stays at its old place),
split_user.c (backtraces from cold parts) and split_throw.cc (a C++ exception
through split functions), profiled under qemu-x86_64; and lua 5.4 (Debian's
source, as tests/bench/bench_userspace_bolt.py builds it) running its
benchmark workload. Each output: exit 0, the same output as the original,
``verify --against`` clean, ``eu-elflint --gnu-ld`` and ``readelf -lSW``
clean, and a program header table that says what the segment holds; a
corrupted field in the new segment is a verify finding.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import helpers
from linepack.image.elf import ElfImage

_requirements = helpers.requirements("gcc", "g++", "qemu-x86_64", "eu-elflint")

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "c")
LINK = {"exec": ["-no-pie"], "pie": ["-pie"]}
CASES = {"switch_tables": ("gcc", "switch_tables.c", [], ["-lm", "-ldl"], [[]]),
         "split_user": ("gcc", "split_user.c", [], [], [[], ["fail"]]),
         "split_throw": ("g++", "split_throw.cc", ["-std=gnu++14"], [], [[]])}
PT_LOAD, PT_PHDR, PT_GNU_EH_FRAME = 1, 6, 0x6474E550
PT_GNU_STACK, PT_GNU_RELRO = 0x6474E551, 0x6474E552


def _run(path, *args):
    """Exit status and output (addresses, which a layout changes, masked)."""
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=120)
    return (p.returncode, re.sub(r"0x[0-9a-f]+", "X", p.stdout.replace(path, "PROG")),
            p.stderr.replace(path, "PROG"))


def _relayout(exe, prof, strategy, out):
    p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", strategy,
                        "-o", out, "--json", out + ".json"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(out + ".json") as f:
        return json.load(f)


def _record(exe, args, prof):
    from linepack.profile.user import record_user
    record_user(exe, args, output=prof)
    return prof


@pytest.fixture(scope="module", params=[(c, m) for c in CASES for m in LINK],
                ids=lambda p: f"{p[0]}-{p[1]}")
def built(request, tmp_path_factory):
    case, mode = request.param
    cc, src, std, libs, _ = CASES[case]
    d = str(tmp_path_factory.mktemp(f"seg-{case}-{mode}"))
    exe = os.path.join(d, case)
    subprocess.run([cc, *std, "-O2", *LINK[mode], "-Wl,--emit-relocs", "-o", exe,
                    os.path.join(FIX, src), *libs], check=True)
    prof = _record(exe, [], exe + ".lpprof")
    outs = {}
    for s in ("pack", "blocks"):
        out = f"{exe}.{s}"
        outs[s] = (out, _relayout(exe, prof, s, out))
    return case, exe, outs


def _phdrs(path):
    im = ElfImage(path)
    return im, [{k: int(p[k]) for k in p.dtype.names} for p in im.phdrs]


def check_segment(old, new, with_eh):
    """The program headers and sections of an output with a new segment."""
    io, po = _phdrs(old)
    im, pn = _phdrs(new)
    lo, ln = ([p for p in ps if p["type"] == PT_LOAD] for ps in (po, pn))
    assert len(ln) == len(lo) + 1
    seg = max(ln, key=lambda p: p["vaddr"])
    assert seg not in lo and seg["flags"] == 5           # R+X
    assert seg["vaddr"] % seg["align"] == seg["offset"] % seg["align"] == 0
    # the first segment's offset-to-address difference (AT_PHDR on any kernel)
    assert seg["vaddr"] - seg["offset"] == lo[0]["vaddr"] - lo[0]["offset"]
    assert seg["vaddr"] >= max(p["vaddr"] + p["memsz"] for p in lo)
    assert [p["vaddr"] for p in ln] == sorted(p["vaddr"] for p in ln)

    def inside(a, n):
        return seg["vaddr"] <= a and a + n <= seg["vaddr"] + seg["filesz"]
    text = im.section(".text")
    assert inside(text.addr, text.size) and text.offset - seg["offset"] == text.addr - seg["vaddr"]
    assert im.section(".linepack.orig.text").addr == io.section(".text").addr
    ph = next(p for p in pn if p["type"] == PT_PHDR)
    assert inside(ph["vaddr"], ph["filesz"]) and ph["filesz"] == 56 * len(pn)
    assert int(im.ehdr["phoff"]) == ph["offset"]
    hdr = im.section(".eh_frame_hdr")
    eh = next(p for p in pn if p["type"] == PT_GNU_EH_FRAME)
    assert (eh["vaddr"], eh["memsz"]) == (hdr.addr, hdr.size)
    assert inside(hdr.addr, hdr.size) == with_eh
    assert inside(im.section(".eh_frame").addr, 4) == with_eh
    for t in (PT_GNU_STACK, PT_GNU_RELRO):
        assert [p for p in po if p["type"] == t] == [p for p in pn if p["type"] == t]


def check_clean(old, new):
    p = subprocess.run(["eu-elflint", "--gnu-ld", new], capture_output=True, text=True)
    assert p.returncode == 0 and "No errors" in p.stdout, p.stdout + p.stderr
    p = subprocess.run(["readelf", "-lSW", new], capture_output=True, text=True)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr
    p = subprocess.run(["linepack", "verify", new, "--against", old],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]


@pytest.mark.parametrize("strategy", ["pack", "blocks"])
def test_output_in_a_new_segment_runs_the_same(built, strategy):
    case, exe, outs = built
    out, summary = outs[strategy]
    seg = summary["new_segment"]
    assert seg["text_bytes"] > 0 and summary["units_moved"] > 0
    if strategy == "blocks":
        assert summary["split"]["functions_split"] >= 2
        assert summary["eh_frame.cold_fdes"] == summary["split"]["functions_split"]
        assert seg["eh_bytes"] > 0
        reasons = summary["split"]["hot_functions_by_reason"]
        assert not [k for k in reasons if "no room" in k], reasons
    for args in CASES[case][4]:
        assert _run(out, *args) == _run(exe, *args)
    check_segment(exe, out, with_eh=strategy == "blocks")
    check_clean(exe, out)
    if case == "switch_tables":
        check_pinned_code_stays(exe, out, summary)


def check_pinned_code_stays(exe, out, summary):
    """switch_tables.c's via_anchor is designated by a PC-relative data field
    nothing explains: it stays, in .linepack.orig.text, and its symbol says so;
    the rest of the old place is int3."""
    assert summary["pcrel_data.pinned_units"] >= 1
    im = ElfImage(out)
    assert im.symbol_address("via_anchor") == ElfImage(exe).symbol_address("via_anchor")
    orig = im.section(".linepack.orig.text")
    names, syms = im.symbol_table()
    assert int(syms["shndx"][names.index("via_anchor")]) == orig.index
    data = bytes(im.section_bytes(orig))
    assert data.count(0xCC) > len(data) // 2


def test_a_wrong_field_in_the_new_segment_is_a_finding(built, tmp_path):
    """Change one relocated call displacement in the moved code: verify names it."""
    case, exe, outs = built
    out, _ = outs["pack"]
    im = ElfImage(out)
    text = im.section(".text")
    rel = im.relocations[".text"]
    k = int(np.nonzero(rel.type == 4)[0][0])          # R_X86_64_PLT32
    pos = text.offset + int(rel.offset[k]) - text.addr
    raw = bytearray(open(out, "rb").read())
    raw[pos] ^= 0x40
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    p = subprocess.run(["linepack", "verify", str(bad), "--against", exe],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "error" in p.stdout


# -- lua 5.4, nobody tuned it for us -----------------------------------------

@pytest.fixture(scope="module", params=["exec", "pie"])
def lua(request, tmp_path_factory):
    sys.path.insert(0, os.path.join(HERE, "bench"))
    import bench_userspace_bolt as bench
    d = str(tmp_path_factory.mktemp(f"lua-{request.param}"))
    exe = bench.build_lua(d, log=lambda m: None, pie=request.param == "pie")
    script = os.path.join(d, "work.lua")
    with open(script, "w") as f:
        f.write(bench.LUA_SCRIPT)
    prof = _record(exe, [script], exe + ".lpprof")
    return exe, script, prof


@pytest.mark.parametrize("strategy", ["pack", "blocks"])
def test_lua_relaid_out_without_relinking(lua, strategy):
    exe, script, prof = lua
    out = f"{exe}.{strategy}"
    summary = _relayout(exe, prof, strategy, out)
    seg = summary["new_segment"]
    old_text = ElfImage(exe).section(".text").size
    # the moved code is the old .text plus the layout's padding (and split growth)
    assert 0 < seg["text_bytes"] - old_text < 0.1 * old_text
    if strategy == "blocks":
        assert summary["split"]["functions_split"] > 100
        assert seg["eh_bytes"] > 0
    want = _run(exe, script)
    assert want[0] == 0 and want[1]
    assert _run(out, script) == want
    check_segment(exe, out, with_eh=strategy == "blocks")
    check_clean(exe, out)


INIT_C = r'''
#include <stdio.h>
static int v;
void myinit(void) { v = 42; }
__attribute__((noinline)) int f(int x) { return x * 3 + v; }
int main(void) { long s = 0; for (int i = 0; i < 1000; i++) s += f(i); printf("%d %ld\n", v, s); return 0; }
'''


@pytest.mark.parametrize("mode", list(LINK))
def test_dt_init_into_moved_code_follows(tmp_path, mode):
    """-Wl,-init,myinit: DT_INIT names a function in .text; it follows the layout
    (PIE or not: the old place is int3 now), and verify names a DT_INIT left behind."""
    from linepack.relayout.user.pie import DT_INIT, dynamic_entries
    src = tmp_path / "init.c"
    src.write_text(INIT_C)
    exe = str(tmp_path / "init")
    subprocess.run(["gcc", "-O2", *LINK[mode], "-Wl,--emit-relocs", "-Wl,-init,myinit", "-o", exe,
                    str(src)], check=True)
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"functions": {"f": 100, "main": 10, "myinit": 1}}))
    out = exe + ".out"
    summary = _relayout(exe, str(prof), "align-all 512", out)
    assert summary["new_segment"] and summary["dynamic_entries_updated"] == 1
    assert _run(out) == _run(exe) and _run(exe)[1].startswith("42 ")
    check_clean(exe, out)
    old = ElfImage(exe)
    dsec, dyn = dynamic_entries(old)
    k = int(np.nonzero(dyn["tag"] == DT_INIT)[0][0])
    raw = bytearray(open(out, "rb").read())
    nsec = ElfImage(out).section(".dynamic")
    pos = nsec.offset + k * 16 + 8
    raw[pos:pos + 8] = int(dyn["val"][k]).to_bytes(8, "little")      # the original's value
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    p = subprocess.run(["linepack", "verify", str(bad), "--against", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "equiv.dynamic" in p.stdout + p.stderr


BSS_C = r'''
#include <stdio.h>
static char big[64 << 20];
__attribute__((noinline)) int f(int x) { big[x] = x; return x * 3 + big[x / 2]; }
int main(void) { long s = 0; for (int i = 0; i < 100000; i++) s += f(i); printf("%ld\n", s); return 0; }
'''


@pytest.mark.parametrize("mode", list(LINK))
def test_large_bss_keeps_the_file_small(tmp_path, mode):
    """64 MiB of .bss: the segment goes after the file's content (not 64 MiB on),
    after the .bss in memory."""
    src = tmp_path / "bss.c"
    src.write_text(BSS_C)
    exe = str(tmp_path / "bss")
    subprocess.run(["gcc", "-O2", *LINK[mode], "-Wl,--emit-relocs", "-o", exe, str(src)],
                   check=True)
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"functions": {"f": 100, "main": 10}}))
    out = exe + ".out"
    _relayout(exe, str(prof), "align-all 512", out)
    assert _run(out) == _run(exe)
    assert os.path.getsize(out) < os.path.getsize(exe) + (1 << 20)
    _, pn = _phdrs(out)
    loads = [p for p in pn if p["type"] == PT_LOAD]
    assert loads[-1]["vaddr"] >= loads[-2]["vaddr"] + loads[-2]["memsz"] >= 64 << 20
    check_clean(exe, out)
