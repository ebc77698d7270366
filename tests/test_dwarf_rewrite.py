"""relayout rewrites DWARF 4 and 5 for the new layout: C fixtures built at test
time with -Wl,--emit-relocs (two units: one with DW_AT_ranges and a .cold part,
one with low/high pc that the move splits), their functions moved; checked by
addr2line, llvm-symbolizer, llvm-dwarfdump --verify, gdb and verify --against;
and a hand-made map that splits functions into two parts."""

import json
import os
import re
import subprocess

import numpy as np
import pytest

from linepack.dwarf.rewrite import rewrite_dwarf
from linepack.image.addrmap import AddressMap
from linepack.image.disasm import disassemble
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.image.writer import write_image
from linepack.relayout.driver import relayout
from linepack.verify.debuginfo import check_debuginfo

from helpers import FIXTURES, require_tool, requirements, run_linepack
from symbolizers import differences, llvm_tool

_requirements = requirements("gcc", "addr2line")

PAD = '.section .text.zzpad,"ax",@progbits\n.fill 16384,1,0xcc\n.section .note.GNU-stack,"",@progbits\n'
HOT = HOT_C = {"delta": 100, "push": 95, "gamma_": 90, "alpha": 80, "beta": 70}


@pytest.fixture(scope="module", params=[4, 5], ids=["dwarf4", "dwarf5"])
def moved(request, tmp_path_factory):
    v = request.param
    d = tmp_path_factory.mktemp(f"dw{v}")
    exe = d / "prog"
    subprocess.run(["gcc", "-g", f"-gdwarf-{v}", "-O2", "-fno-pie", "-no-pie",
                    "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(FIXTURES, "c", "dwarf_a.c"), os.path.join(FIXTURES, "c", "dwarf_b.c")],
                   check=True, capture_output=True)
    out = d / "prog.new"
    summary, plan, rw = relayout(str(exe), str(out), "hot64", hotness=HOT)
    return v, exe, out, summary, rw


def _moved_insns(exe, rw):
    """(old, new) instruction addresses of every moved function."""
    im = ElfImage(str(exe))
    ft = FunctionTable(im)
    dis = disassemble(im, ft, jobs=1)
    new, _ = rw.amap.map(dis.addr)
    m = new != dis.addr
    return dis.addr[m].tolist(), new[m].tolist()


def test_rewritten_and_runs(moved):
    v, exe, out, summary, rw = moved
    assert summary["dwarf"] == "rewritten"
    assert summary["dwarf_line_sequences_out"] > summary["dwarf_line_sequences_in"]
    # b.c's unit had low/high pc; its functions now sit apart: converted to ranges
    assert summary["dwarf_units_converted_to_ranges"] == 1
    assert summary["dwarf_lists_reencoded"] > 0          # its location lists were relative
    a = subprocess.run([str(exe)], capture_output=True, text=True).stdout
    b = subprocess.run([str(out)], capture_output=True, text=True).stdout
    assert a == b and a.startswith("r=")
    new = ElfImage(str(out))
    assert new.section(".rela.debug_info").size == 0      # dropped, see rewrite.py


def test_symbolizers_agree(moved):
    v, exe, out, summary, rw = moved
    old, new = _moved_insns(exe, rw)
    assert len(old) > 100
    diff = differences(exe, out, old, new, ("addr2line", "llvm-symbolizer"))
    for tool in ("addr2line", "llvm-symbolizer"):
        assert diff[tool] == [], diff[tool][:3]
        assert diff[tool + ".unknown"] == 0


def test_symbolizers_see_the_difference_without_rewrite(moved, tmp_path):
    """The comparison can fail: NEW with OLD's DWARF spliced in disagrees."""
    v, exe, out, summary, rw = moved
    stale = _splice_old_dwarf(exe, out, tmp_path / "stale")
    old, new = _moved_insns(exe, rw)
    diff = differences(exe, stale, old, new, ("addr2line",))
    assert len(diff["addr2line"]) > len(old) // 2


def _splice_old_dwarf(old_path, new_path, dest):
    old, new = ElfImage(str(old_path)), ElfImage(str(new_path))
    patched = {s.index: np.array(old.section_bytes(old.section(s.name)), np.uint8)
               for s in new.sections if s.name.startswith(".debug_") and s.size}
    write_image(new, str(dest), patched)
    return dest


def test_verify_against_checks_debug_info(moved, tmp_path):
    v, exe, out, summary, rw = moved
    rep = tmp_path / "r.json"
    p = run_linepack("verify", "-q", out, "--against", exe, "--json", rep)
    d = json.loads(rep.read_text())
    assert p.returncode == 0, [f for f in d["findings"] if f["severity"] == "error"][:5]
    assert d["debuginfo_line_rows_checked"] > 100
    assert d["debuginfo_subprograms_checked"] >= 5


def test_stale_dwarf_is_a_named_finding(moved, tmp_path):
    v, exe, out, summary, rw = moved
    stale = _splice_old_dwarf(exe, out, tmp_path / "stale")
    rep = tmp_path / "r.json"
    p = run_linepack("verify", "-q", stale, "--against", exe, "--json", rep)
    assert p.returncode == 1
    checks = {f["check"] for f in json.loads(rep.read_text())["findings"]}
    assert {"debuginfo.line-row", "debuginfo.subprogram-range", "debuginfo.unit-range"} <= checks


def _dwarfdump_errors(path):
    tool = llvm_tool("llvm-dwarfdump")
    p = subprocess.run([tool, "--verify", str(path)], capture_output=True, text=True, timeout=300)
    text = p.stdout + p.stderr
    return len(re.findall(r"^error:", text, re.M)), text


def test_llvm_dwarfdump_verify(moved):
    v, exe, out, summary, rw = moved
    before, _ = _dwarfdump_errors(exe)
    after, text = _dwarfdump_errors(out)
    assert after <= before, text[-2000:]
    assert "No errors." in text


def _gdb(exe, *cmds):
    args = ["gdb", "-batch", "-nx"]
    for c in cmds:
        args += ["-ex", c]
    p = subprocess.run(args + [str(exe)], capture_output=True, text=True, timeout=120)
    return p.stdout


def test_gdb_source_of_moved_function(moved):
    require_tool("gdb")
    v, exe, out, summary, rw = moved
    for fn in ("delta", "gamma_", "alpha"):
        a = _gdb(exe, f"info line {fn}", f"disassemble /s {fn}")
        b = _gdb(out, f"info line {fn}", f"disassemble /s {fn}")
        assert "dwarf_b.c" in a or "dwarf_a.c" in a
        strip = lambda t: re.sub(r"0x[0-9a-f]+", "ADDR", t)   # noqa: E731
        assert strip(a) == strip(b)
        assert a != b            # the addresses did change


def test_split_functions_by_hand_made_map(moved, tmp_path):
    """Each function of the fixture cut in two at an instruction boundary and the
    halves swapped (what a block-level map does): only the DWARF is rewritten
    (the code stays), then symbolizers, gdb's view of lines, llvm-dwarfdump and
    the verifier read it at the translated addresses."""
    v, exe, out, summary, rw = moved
    im = ElfImage(str(exe))
    ft = FunctionTable(im)
    dis = disassemble(im, ft, jobs=1)
    olds, ends, news, split = [], [], [], []
    for i, name in enumerate(ft.name):
        if name not in HOT_C:      # assembler DIEs' 1-byte high pc cannot become ranges
            continue
        s, e = int(ft.start[i]), int(ft.start[i] + ft.size[i])
        ins = dis.addr[(dis.addr > s) & (dis.addr < e)]
        cut = int(ins[len(ins) // 2])
        olds += [s, cut]
        ends += [cut, e]
        news += [s + (e - cut), s]           # second half first
        split.append(name)
    amap = AddressMap(olds, ends, news)
    patched, drop, stats = rewrite_dwarf(im, amap)
    dest = tmp_path / "split"
    write_image(im, str(dest), patched, drop=drop)
    assert stats["dwarf_split_functions"] == len(split)
    assert stats["dwarf_dies_converted_to_ranges"] >= len(split)
    assert stats["dwarf_line_sequences_out"] >= 2 * len(split)
    m = np.isin(dis.func, [ft.index_of(n) for n in split])
    old_a = dis.addr[m]
    new_a, _ = amap.map(old_a)
    diff = differences(exe, dest, old_a.tolist(), new_a.tolist(), ("addr2line", "llvm-symbolizer"))
    for tool in ("addr2line", "llvm-symbolizer"):
        assert diff[tool] == [], diff[tool][:3]
    findings, counter = [], {}

    class R:
        extra = {}
    check_debuginfo(im, ElfImage(str(dest)), amap, findings, counter, R())
    assert counter["debuginfo.line-row"] == 0
    assert counter["debuginfo.subprogram-range"] == 0
    assert counter["debuginfo.unit-range"] == 0, [f.message for f in findings]
    before, _ = _dwarfdump_errors(exe)
    after, text = _dwarfdump_errors(dest)
    assert after <= before, text[-2000:]
    # the verifier sees a stale subprogram: the split map against whole-function DWARF
    findings, counter = [], {}
    check_debuginfo(im, ElfImage(str(out)), amap, findings, counter, R())
    assert counter["debuginfo.subprogram-range"] > 0


def test_strip_debug_and_keep_debug(moved, tmp_path):
    v, exe, out, summary, rw = moved
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"functions": HOT}))
    p = run_linepack("relayout", exe, "--profile", prof, "--strategy", "hot64", "-o",
                     tmp_path / "k", "--keep-debug")
    assert p.returncode == 2 and "--strip-debug" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    p = run_linepack("relayout", exe, "--profile", prof, "--strategy", "hot64", "-o",
                     tmp_path / "s", "--strip-debug", "-q")
    assert p.returncode == 0, p.stderr
    assert ElfImage(str(tmp_path / "s")).section(".debug_info").size == 0
    assert "DWARF:             dropped" in p.stdout


def test_output_is_reproducible(moved, tmp_path):
    v, exe, out, summary, rw = moved
    relayout(str(exe), str(tmp_path / "again"), "hot64", hotness=HOT)
    assert (tmp_path / "again").read_bytes() == out.read_bytes()


@pytest.mark.parametrize("v", [4, 5])
def test_assembler_unit_with_one_byte_high_pc(tmp_path, v):
    """GNU as describes a unit by low pc + a 1-byte DW_FORM_udata high pc: moving one
    of its functions away still gives the unit DW_AT_ranges (same-size filler)."""
    (tmp_path / "pad.s").write_text(PAD)
    exe = tmp_path / "prog"
    subprocess.run(["gcc", "-g", f"-gdwarf-{v}", "-O2", "-fno-pie", "-no-pie",
                    "-Wl,--emit-relocs", "-o", str(exe), os.path.join(FIXTURES, "c", "dwarf_c.s"),
                    os.path.join(FIXTURES, "c", "dwarf_b.c"), str(tmp_path / "pad.s"),
                    "-nostartfiles", "-e", "asm_one"], check=True, capture_output=True)
    im = ElfImage(str(exe))
    two, pad = im.symbol_address("asm_two"), im.section(".text").addr + im.section(".text").size
    pad = (pad - 16384 + 63) // 64 * 64          # inside the int3 filler at .text's end
    amap = AddressMap([two], [two + 4], [pad])
    patched, drop, stats = rewrite_dwarf(im, amap)
    assert stats["dwarf_units_converted_to_ranges"] >= 1
    assert "dwarf_units_not_convertible" not in stats
    dest = tmp_path / "moved"
    write_image(im, str(dest), patched, drop=drop)
    diff = differences(exe, dest, [two, two + 3], [pad, pad + 3], ("addr2line",))
    assert diff["addr2line"] == [] and diff["addr2line.unknown"] == 0
    findings, counter = [], {}

    class R:
        extra = {}
    check_debuginfo(im, ElfImage(str(dest)), amap, findings, counter, R())
    assert counter["debuginfo.unit-range"] == 0, [f.message for f in findings]
    before, _ = _dwarfdump_errors(exe)
    after, text = _dwarfdump_errors(dest)
    assert after <= before, text[-2000:]


LONG_ASM = """\t.text
\t.globl\tasm_one
\t.type\tasm_one, @function
asm_one:
\tleal\t1(%rdi), %eax
\t.fill\t200, 1, 0x90
\tret
\t.size\tasm_one, .-asm_one
\t.p2align 4
\t.globl\tasm_two
\t.type\tasm_two, @function
asm_two:
\tleal\t2(%rdi), %eax
\tret
\t.size\tasm_two, .-asm_two
\t.section .note.GNU-stack,"",@progbits
"""


def _unit_ranges_dwarfdump(path, name):
    """The address ranges llvm-dwarfdump gives the compile unit ``name`` (an
    independent reader: low/high pc or its DW_AT_ranges list)."""
    text = subprocess.run([llvm_tool("llvm-dwarfdump"), "--debug-info", str(path)],
                          capture_output=True, text=True, check=True).stdout
    for unit in text.split("DW_TAG_compile_unit")[1:]:
        head = unit.split("DW_TAG_", 1)[0]
        if f'"{name}"' not in head and not re.search(rf'"[^"]*/{re.escape(name)}"', head):
            continue
        rs = [(int(a, 16), int(b, 16)) for a, b in
              re.findall(r"\[(0x[0-9a-f]+), (0x[0-9a-f]+)\)", head)]
        if rs:
            return rs
        lo = re.search(r"DW_AT_low_pc\s+\((0x[0-9a-f]+)\)", head)
        hi = re.search(r"DW_AT_high_pc\s+\((0x[0-9a-f]+)\)", head)
        return [(int(lo.group(1), 16), int(hi.group(1), 16))]
    raise AssertionError(f"no unit {name} in {path}")


@pytest.mark.parametrize("v", [4, 5])
def test_assembler_unit_with_two_byte_high_pc(tmp_path, v):
    """GNU as's DW_FORM_udata high pc is LEB128: from 128 bytes of code on it takes
    two bytes, which read as a little-endian word would give a unit far past its code
    (Debian 13's generic 6.12 kernel: copy_user_uncached_64.S, 371 bytes). Moving one
    of the unit's functions gives it ranges over its own code only, as an independent
    reader (llvm-dwarfdump) sees them."""
    (tmp_path / "long.s").write_text(LONG_ASM)
    (tmp_path / "pad.s").write_text(PAD)
    exe = tmp_path / "prog"
    subprocess.run(["gcc", "-g", f"-gdwarf-{v}", "-O2", "-fno-pie", "-no-pie",
                    "-Wl,--emit-relocs", "-o", str(exe), str(tmp_path / "long.s"),
                    os.path.join(FIXTURES, "c", "dwarf_b.c"), str(tmp_path / "pad.s"),
                    "-nostartfiles", "-e", "asm_one"], check=True, capture_output=True)
    im = ElfImage(str(exe))
    [(lo, end)] = _unit_ranges_dwarfdump(exe, "long.s")
    two = im.symbol_address("asm_two")
    assert end - lo >= 128 and lo < two < end       # a 2-byte udata high pc, asm_two inside
    pad = im.section(".text").addr + im.section(".text").size
    pad = (pad - 16384 + 63) // 64 * 64
    amap = AddressMap([two], [end], [pad])
    patched, drop, stats = rewrite_dwarf(im, amap)
    dest = tmp_path / "moved"
    write_image(im, str(dest), patched, drop=drop)
    got = sorted(_unit_ranges_dwarfdump(dest, "long.s"))
    assert got == [(lo, two), (pad, pad + end - two)], [(hex(a), hex(b)) for a, b in got]
    findings, counter = [], {}

    class R:
        extra = {}
    check_debuginfo(im, ElfImage(str(dest)), amap, findings, counter, R())
    assert counter["debuginfo.unit-range"] == 0, [f.message for f in findings]
