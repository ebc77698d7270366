"""BOLT .fdata import/export: round trips, malformed input, and llvm-bolt-19 accepting our output."""

import os
import re
import subprocess

import numpy as np
import pytest

from linepack.cli import main
from linepack.image.elf import ElfImage
from linepack.profile.fdata import export_fdata, import_fdata
from linepack.profile.model import Profile
from linepack.profile.perf_script import import_perf_script
from helpers import require_tool
from test_perf_import import (compile_hotloop, func_lookup, one_error, record_native, write_rendered)

PIE_BIAS = 0x555555554000


def bolt():
    return require_tool("llvm-bolt-19", "/usr/lib/llvm-19/bin/llvm-bolt", "llvm-bolt")


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return compile_hotloop(tmp_path_factory.mktemp("fd"), pie=False)


@pytest.fixture(scope="module")
def pie(tmp_path_factory):
    return compile_hotloop(tmp_path_factory.mktemp("fdpie"), pie=True)


def branch_sites(binary, funcs=("crunch", "mix", "main")):
    """(site, target, kind) of the direct branches in funcs, decoded with Capstone."""
    import capstone
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    img = ElfImage(binary)
    ft, t = func_lookup(binary)
    out = []
    for f in funcs:
        i = t[f]
        start, size = int(ft.start[i]), int(ft.size[i])
        for ins in md.disasm(bytes(img.read(start, size)), start):
            m = ins.mnemonic
            if (m.startswith("j") or m == "call") and ins.op_str.startswith("0x"):
                out.append((ins.address, int(ins.op_str, 16), m))
    return out


def synth_lbr_text(binary, shift):
    """perf script -F ip,brstack text (6.1 style) for the binary's real branches."""
    ft, t = func_lookup(binary)
    lines = []
    sites = branch_sites(binary)
    for rep in range(50):
        entries = []
        for k, (site, target, m) in enumerate(sites):
            if m == "call" and ft.find([target])[0] < 0:
                continue                                   # PLT
            weight = 20 if site < target else 40           # back edges are hot loops
            if m == "call":
                weight = 2
            for _ in range(weight if rep % 5 == 0 else 1):
                ev = "M" if (k + rep) % 17 == 0 else "P"
                entries.append(f"0x{site + shift:x}/0x{target + shift:x}/{ev}/-/-/0/COND")
        for j in range(0, len(entries), 32):
            ip = entries[j].split("/")[0][2:]
            lines.append(f" {ip}  " + "  ".join(entries[j:j + 32]))
    return "\n".join(lines) + "\n"


def run_bolt(binary, fdata, tmp_path):
    out = str(tmp_path / (os.path.basename(binary) + ".bolt"))
    r = subprocess.run([bolt(), binary, "-o", out, f"-data={fdata}", "-reorder-blocks=ext-tsp",
                        "-reorder-functions=hfsort"], capture_output=True, text=True, timeout=600)
    return r, out


def profiled_functions(bolt_out):
    m = re.search(r"BOLT-INFO: (\d+) out of (\d+) functions in the binary .* have non-empty execution "
                  r"profile", bolt_out)
    return int(m.group(1)) if m else 0


def test_lbr_export_accepted_by_bolt(tmp_path, pie, capsys):
    text = tmp_path / "lbr.txt"
    text.write_text(synth_lbr_text(pie, PIE_BIAS))
    prof_path = str(tmp_path / "lbr.lpprof")
    assert main(["profile", "--perf-script", str(text), "--image", pie, "-o", prof_path]) == 0
    prof = Profile.load(prof_path)
    assert prof.source == "perf-lbr" and prof.meta["kaslr_offset"] == PIE_BIAS
    fdata = str(tmp_path / "out.fdata")
    assert main(["profile", "--export-fdata", prof_path, "-o", fdata]) == 0
    body = open(fdata).read()
    ft, t = func_lookup(pie)
    crunch = ft.name[t["crunch"]]
    assert re.search(rf"^2 {re.escape(crunch)}/1 [0-9a-f]+ 2 {re.escape(crunch)}/1 ", body, re.M)
    r, out = run_bolt(pie, fdata, tmp_path)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-2000:]
    assert "pre-processing profile using branch profile reader" in log
    assert profiled_functions(log) >= 3, log[-2000:]        # crunch, mix, main matched by name
    m = re.search(r"basic block reordering modified layout of (\d+) functions", log)
    assert m and int(m.group(1)) >= 1, log[-2000:]             # the profile drove the layout
    assert os.path.exists(out)


def test_native_ip_profile_exported_to_bolt(tmp_path, pie):
    text = record_native(tmp_path, pie)
    prof_path = str(tmp_path / "ip.lpprof")
    assert main(["profile", "--perf-script", text, "--image", pie, "-o", prof_path]) == 0
    fdata = str(tmp_path / "ip.fdata")
    assert main(["profile", "--export-fdata", prof_path, "-o", fdata]) == 0
    assert open(fdata).readline().startswith("no_lbr")
    r, _ = run_bolt(pie, fdata, tmp_path)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-2000:]
    assert "no LBR" in log and profiled_functions(log) >= 1, log[-2000:]
    # round trip: the hot function survives import of our own export
    back = import_fdata(fdata, pie)
    ft, t = func_lookup(pie)
    assert back.hot_functions(1)[0][0] == ft.name[t["crunch"]]
    assert back.function_counts("samples") == Profile.load(prof_path).function_counts("samples")


def test_branch_roundtrip(tmp_path, exe):
    path = write_rendered(tmp_path, "lbr-6.1.txt", exe)
    p = import_perf_script(path, exe)
    fd = str(tmp_path / "a.fdata")
    n = export_fdata(p, fd, image=exe)
    assert n == len(p.edge_from)
    q = import_fdata(fd, exe)
    assert q.source == "fdata" and q.metric == "blocks"
    for name in ("edge_from", "edge_to", "edge_count", "edge_mispred", "edge_kind", "func_addr",
                 "func_entries", "func_blocks"):
        assert np.array_equal(getattr(p, name), getattr(q, name)), name
    # export is deterministic
    fd2 = str(tmp_path / "b.fdata")
    export_fdata(q, fd2, image=exe)
    assert open(fd).read() == open(fd2).read()


def test_samples_roundtrip(tmp_path, exe):
    path = write_rendered(tmp_path, "ip-sym.txt", exe)
    p = import_perf_script(path, exe)
    fd = str(tmp_path / "s.fdata")
    export_fdata(p, fd, image=exe)
    assert open(fd).readline() == "no_lbr cpu-clock\n"
    q = import_fdata(fd, exe)
    assert q.function_counts("samples") == p.function_counts("samples")
    assert q.meta["fdata_mode"] == "no_lbr" and q.meta["fdata_events"] == ["cpu-clock"]


def test_qemu_blocks_export(tmp_path, exe):
    """QEMU edges (source = block start) become branches from the block's last instruction;
    fall-through edges are left to BOLT."""
    ft, t = func_lookup(exe)
    sites = [s for s in branch_sites(exe, ("mix",))]
    back = next(s for s in sites if s[0] > s[1])                 # the loop's back edge
    m = int(ft.start[t["mix"]])
    body = back[1]                                               # loop body block start
    size = back[0] - body + 2                                    # ends after the jne rel8
    p = Profile.from_blocks(exe, [m, body], [body - m, size], [4, 8], [10, 1000],
                            edge_src=[m, body, body], edge_dst=[body, body, body + size],
                            edge_count=[10, 990, 10])
    assert p.meta["edge_from"] == "block"
    fd = str(tmp_path / "q.fdata")
    assert export_fdata(p, fd, image=exe) == 1
    line = open(fd).read().split()
    assert line[1] == "mix" and int(line[2], 16) == back[0] - m and int(line[5], 16) == body - m
    assert line[-1] == "990"


def test_local_names_with_suffix(tmp_path, exe):
    ft, t = func_lookup(exe)
    crunch = ft.name[t["crunch"]]
    fd = tmp_path / "l.fdata"
    fd.write_text(f"1 main 20 2 {crunch}/1 0 0 5\n2 {crunch}/hotloop.c/1 39 2 {crunch}/1 20 1 700\n")
    p = import_fdata(str(fd), exe)
    assert p.function_counts("entries") == {crunch: 5}
    assert p.function_counts("blocks")[crunch] == 705
    assert p.meta["edges"] == 2 and int(p.edge_mispred.sum()) == 1


@pytest.mark.parametrize("content,needle", [
    ("", "no branch records"),
    ("hello world\nfoo bar\n", "not .fdata records"),
    ("1 main 20 1 mix 0 zero 5\n", "not .fdata records"),
    ("1 nosuchfunc 0 1 other 0 0 5\n", "no record names a function"),
    ("no_lbr cycles\n1 main 1 x\n", "not .fdata records"),
])
def test_malformed_fdata(tmp_path, exe, capsys, content, needle):
    fd = tmp_path / "bad.fdata"
    fd.write_text(content)
    rc = main(["profile", "--fdata", str(fd), "--image", exe, "-o", str(tmp_path / "p")])
    assert rc == 2 and needle in one_error(capsys.readouterr().err)


def test_export_checks_build_id(tmp_path, exe, capsys):
    path = write_rendered(tmp_path, "lbr-6.1.txt", exe)
    prof = str(tmp_path / "p.lpprof")
    assert main(["profile", "--perf-script", path, "--image", exe, "-o", prof]) == 0
    other = compile_hotloop(tmp_path, name="other", pie=False, extra=("-O1",))
    rc = main(["profile", "--export-fdata", prof, "--image", other, "-o", str(tmp_path / "x.fdata")])
    assert rc == 2 and "profile was recorded for build-id" in one_error(capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "x.fdata")


LIBCALLS = r'''
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
static char buf[256];
static void __attribute__((noinline)) fill(int c) {
    char *d = buf; long n = sizeof buf;
    __asm__ volatile("rep stosb" : "+D"(d), "+c"(n) : "a"(c) : "memory");
}
int main(int argc, char **argv) {
    unsigned long s = 0;
    for (int i = 0; i < 3000; i++) {
        fill(i & 0x7f);
        s += strlen(buf + (i & 63)) + (unsigned long)abs(argc - i);
    }
    printf("%lu\n", s);
    return 0;
}
'''


def _readable(image, a, n):
    try:
        image.read(a, n)
        return True
    except ValueError:
        return False


def test_qemu_export_only_branches_inside_the_image(tmp_path):
    """A real QEMU profile of a program calling libc through the PLT and running a
    `rep stosb` (QEMU joins it to itself): every exported record leaves a branch
    instruction of the image; an end outside its functions is "0 [unknown] 0"."""
    from linepack.image.disasm import _Decoder
    from linepack.profile.fdata import _is_branch
    from linepack.profile.user import record_user
    require_tool("qemu-x86_64")
    require_tool("gcc")
    src, exe = tmp_path / "libcalls.c", str(tmp_path / "libcalls")
    src.write_text(LIBCALLS)
    subprocess.run(["gcc", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", "-o", exe,
                    str(src)], check=True)
    prof = record_user(exe, [])
    image = ElfImage(exe)
    ft, table = func_lookup(exe)
    # the raw profile has what BOLT refuses: edges out of the image and a rep self-edge
    outside = (ft.find(prof.edge_from) < 0) | (ft.find(prof.edge_to) < 0)
    assert outside.any()
    fd = str(tmp_path / "l.fdata")
    n = export_fdata(prof, fd, image=exe)
    recs = [ln.split() for ln in open(fd)]
    assert len(recs) == n > 0
    # an end outside the image's functions is written as BOLT's instrumentation writes
    # it, never as an address in the executable
    assert not any(exe.rsplit("/", 1)[-1] in (r[1], r[4]) for r in recs)
    assert all(r[0:3] == ["0", "[unknown]", "0"] for r in recs if r[0] == "0")
    assert all(r[3:6] == ["0", "[unknown]", "0"] for r in recs if r[3] == "0")
    assert any(r[3] == "0" for r in recs)                          # the calls into libc
    entries = [r for r in recs if r[0] == "0"]
    assert entries and all(r[5] == "0" for r in entries)           # entries only (main)
    assert any(r[4] == "main" for r in entries)
    assert len({tuple(r[:6]) for r in recs}) == len(recs)          # one record per pair
    dec = _Decoder()
    for r in recs:
        if r[0] == "0":
            continue
        a = int(ft.start[table[r[1].split("/")[0]]]) + int(r[2], 16)
        n = next(n for n in range(16, 0, -1) if _readable(image, a, n))
        ins = dec.decode(bytes(image.read(a, n)), a)
        assert _is_branch(ins["bytes"][0]), r
    # a conditional jump's not-taken edge, counted exactly, to the next instruction (the
    # loop's exit in main: taken 2999 times back, once through)
    jcc = []
    for r in recs:
        if r[0] != "0" and r[3] != "0" and r[1] == r[4]:
            a = int(ft.start[table[r[1].split("/")[0]]]) + int(r[2], 16)
            n = next(n for n in range(16, 0, -1) if _readable(image, a, n))
            ins = dec.decode(bytes(image.read(a, n)), a)
            if _is_branch(ins["bytes"][0], conditional=True) and \
                    int(r[5], 16) == int(r[2], 16) + int(ins["size"][0]):
                jcc.append(r)
    assert any(r[1] == "main" for r in jcc), jcc
    dec.close()
    fill = int(ft.start[table["fill"]])
    assert not any(r[1].startswith("fill") and r[1:3] == r[4:6] for r in recs)  # no rep self-edge
    assert any(r[4].startswith("fill") and r[5] == "0" for r in recs)           # the call to fill
    r, _ = run_bolt(exe, fd, tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert profiled_functions(r.stdout + r.stderr) >= 2
    assert fill
