"""verify --against on the PC-relative branches outside the usual jmp/jcc/call set:
loop, loope, loopne, jecxz (67 E3) and xbegin (rel8 / rel32, tools/verify/code.py
other_branch_targets), and EIP-based operands (67 prefix) whose bytes changed.

Function level (compare_instructions): an instruction NEW holds unchanged, moved
away from its target, names its stale target (equiv.branch-target); a changed one
is compared by target (a correct re-encoding passes, a wrong one is named).
Block level (check_blocks, tests/test_verify_blocks.py's hand-built pieces): a
copied loop whose target piece moved elsewhere is named (equiv.block-instruction).
End to end: a gcc-built program holding each of them passes verify after relayout
(no false positive) and a corrupted copy is named."""

import subprocess
from types import SimpleNamespace

import numpy as np
import pytest

import helpers
from helpers import run_linepack
from insn_rows import ShiftMap, disassembly
from linepack.image import blockmap as bm
from linepack.verify.blocks import SplitFunction, check_blocks
from linepack.verify.code import compare_instructions

from test_verify_blocks import Memory, outside, rows_of

# (name, bytes before the rel field, rel width)
BRANCHES = [("loop", "e2", 1), ("loope", "e1", 1), ("loopne", "e0", 1), ("jecxz", "67e3", 1),
            ("loop ecx", "67e2", 1), ("xbegin", "c7f8", 4)]


def _enc(head, width, rel):
    return bytes.fromhex(head) + int(rel).to_bytes(width, "little", signed=True)


def _compare(old_rows, new_rows, amap):
    """compare_instructions over all of OLD's rows: {check: [addresses]}."""
    octx = SimpleNamespace(disasm=disassembly(old_rows), symbol_at=lambda a: f"{a:#x}")
    nctx = SimpleNamespace(disasm=disassembly(new_rows))
    findings, counter = [], {}
    compare_instructions(octx, nctx, amap, np.ones(len(old_rows), bool), False, findings,
                         counter)
    out = {}
    for f in findings:
        out.setdefault(f.check, []).append(f.address)
    return out


def test_other_branch_targets_decodes_each_form():
    from linepack.image.disasm import other_branch_targets
    rows = [(0x1000, _enc(h, w, 0x10)) for _, h, w in BRANCHES] + \
        [(0x1000, bytes.fromhex("e310")), (0x1000, bytes.fromhex("66c7f81000")),
         (0x1000, bytes.fromhex("2ee210"))]
    d = disassembly(rows)
    i, t, k = other_branch_targets(d.raw, d.addr, d.size)
    # jrcxz (E3 without 67) is branch_targets' own; xbegin rel16 is truncated to 16 bits
    assert i.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    assert t.tolist() == [0x1000 + len(b) + 0x10 for _, b in rows[:6]] + [0x1015, 0x1013]
    assert k.tolist() == [1, 1, 1, 1, 1, 4, 2, 1]


def test_other_branch_targets_reads_only_the_rows_that_can_hold_one():
    """other_branch_targets decodes the rows _other_branch_rows picks (first byte an
    opcode of the set or a prefix it skips): the same rows, targets and kinds as
    decoding every row (_other_branch_targets), on random rows with each form and
    prefixed variants spread among them."""
    from linepack.image.disasm import _other_branch_rows, _other_branch_targets, \
        other_branch_targets
    rng = np.random.default_rng(7)
    n = 20000
    raw = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    # first bytes mostly from the interesting set (opcodes, prefixes) and a few others
    raw[:, 0] = rng.choice([0xE0, 0xE1, 0xE2, 0xE3, 0xC7, 0x2E, 0x3E, 0x66, 0x67, 0x48, 0x0F,
                            0xE8, 0xF2], n)
    for r in rng.choice(n, 4000, replace=False).tolist():
        head = bytes.fromhex(BRANCHES[r % len(BRANCHES)][1])
        pre = bytes(rng.choice([0x2E, 0x3E, 0x66, 0x67, 0x48], r % 4).tolist())
        b = pre + head
        raw[r, :len(b)] = np.frombuffer(b, np.uint8)
    size = rng.integers(1, 16, n).astype(np.uint8)
    addr = np.arange(n, dtype=np.uint64) * 16 + 0x400000
    got = other_branch_targets(raw, addr, size)
    want = _other_branch_targets(raw, addr, size)
    assert len(want[0]) > 100 and set(want[2].tolist()) == {1, 2, 4}
    assert 0 < len(_other_branch_rows(raw)) < n
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.tolist() == w.tolist()


@pytest.mark.parametrize("name,head,width", BRANCHES)
def test_kept_bytes_moved_away_from_the_target_are_named(name, head, width):
    # 1000: the branch to 1040; 1040: ret. The branch moves by 0x20, its target stays.
    b = _enc(head, width, 0x40 - (len(head) // 2 + width))
    old = [(0x1000, b), (0x1040, b"\xc3")]
    amap = ShiftMap(0x1000, 0x1010, 0x20)
    assert _compare(old, [(0x1020, b), (0x1040, b"\xc3")], amap) == \
        {"equiv.branch-target": [0x1020]}
    # moved together with its target: nothing to name
    assert _compare(old, [(0x1020, b), (0x1060, b"\xc3")], ShiftMap(0x1000, 0x1041, 0x20)) == {}


@pytest.mark.parametrize("name,head,width", BRANCHES)
def test_changed_bytes_are_compared_by_target(name, head, width):
    n = len(head) // 2 + width
    old = [(0x1000, _enc(head, width, 0x40 - n)), (0x1040, b"\xc3")]
    amap = ShiftMap(0x1000, 0x1010, 0x20)
    # re-encoded to reach the target from the new place: passes
    right = [(0x1020, _enc(head, width, 0x40 - 0x20 - n)), (0x1040, b"\xc3")]
    assert _compare(old, right, amap) == {}
    # re-encoded wrongly (one byte off): named as a branch
    wrong = [(0x1020, _enc(head, width, 0x40 - 0x20 - n + 1)), (0x1040, b"\xc3")]
    assert _compare(old, wrong, amap) == {"equiv.branch-target": [0x1020]}


def test_changed_eip_operand_is_truncated_to_32_bits_like_a_kept_one():
    # mov eax, [eip + d] at 0x1_0000_1000 (above 4 GB): it reads (end + d) mod 2**32.
    a = 0x100001000
    d_old = 0x2000 - (a + 7) % 2**32                  # reads 0x2000
    old = [(a, bytes.fromhex("678b05") + d_old.to_bytes(4, "little", signed=True))]

    def new_reading(target):
        d = target - (a + 7) % 2**32
        return [(a, bytes.fromhex("678b05") + d.to_bytes(4, "little", signed=True))]
    # 0x2000 moved to 0x3000 and NEW reads 0x3000: right
    assert _compare(old, new_reading(0x3000), ShiftMap(0x2000, 0x2100, 0x1000)) == {}
    # what the operand would read without the truncation (0x1_0000_2000) moved, the
    # 32-bit target 0x2000 did not: NEW reading 0x3000 is wrong
    assert _compare(old, new_reading(0x3000), ShiftMap(0x100002000, 0x100002100, 0x1000)) == \
        {"equiv.instruction-bytes": [a]}


# -- block level: a split function whose copied branch's target is in another piece ----
#   1000: BR 1000+L+3; xor eax,eax; ret | 1000+L+3: mov eax,1; ret
#   hot piece [1000, +L+3) at 2000, the other [+L+3, +L+9) at 2010

def _split(head, width, fix):
    n = len(head) // 2 + width
    cut = 0x1000 + n + 3
    old = {0x1000: _enc(head, width, 3) + bytes.fromhex("31c0 c3 b801000000 c3")}
    rel = 0x2010 - (0x2000 + n) if fix else 3
    new = {0x2000: _enc(head, width, rel) + bytes.fromhex("31c0 c3"),
           0x2010: bytes.fromhex("b801000000 c3")}
    f = SplitFunction("f", 0x1000, cut + 6, [(bm.PART_HOT, 0x2000, 0x2000 + n + 3),
                                             (bm.PART_COLD, 0x2010, 0x2016)])
    rows = rows_of((0x1000, n + 3, 0x2000, n + 3, bm.KIND_COPIED, bm.PART_HOT),
                   (cut, 6, 0x2010, 6, bm.KIND_COPIED, bm.PART_COLD))
    return rows, [f], Memory(old), Memory(new)


@pytest.mark.parametrize("name,head,width", BRANCHES + [("jrcxz", "e3", 1)])
def test_block_copied_branch_must_follow_its_target(name, head, width):
    rows, funcs, old, new = _split(head, width, fix=True)
    found, stats = check_blocks(rows, funcs, old.read, new.read, outside)
    assert found == [] and stats["instructions"] == 5
    rows, funcs, old, new = _split(head, width, fix=False)     # bytes kept: stale target
    found, _ = check_blocks(rows, funcs, old.read, new.read, outside)
    assert [(f.check, f.address) for f in found] == [("equiv.block-instruction", 0x2000)]
    assert f"at {0x1000:#x} has no counterpart" in found[0].message


# -- end to end: gcc-built, relayout, verify, then one branch left stale ---------------
PROG = r'''
#include <stdio.h>
/* each asm block branches to a label of its own function (rel8 / rel32 forms
   the usual jmp/jcc/call decode does not cover) */
int __attribute__((noinline)) f(int n) {
    long c = n;
    int r = 0;
    asm volatile("1: addl $3, %0\n\tloop 1b\n\t"
                 "mov $2, %%ecx\n2: addl $5, %0\n\tloopne 2b\n\t"
                 "xor %%ecx, %%ecx\n\tjecxz 3f\n\taddl $1000, %0\n3:\n\t"
                 : "+r"(r), "+c"(c) :: "cc");
    return r;
}
int __attribute__((noinline)) g(int x) { return x * 7 + f(x); }
int main(int argc, char **argv) { printf("%d %d\n", f(argc + 3), g(argc)); return 0; }
'''

_requirements = helpers.requirements("gcc")


def test_end_to_end(tmp_path):
    exe, new = helpers.relaid_out_c(tmp_path, PROG)
    p = run_linepack("verify", "-q", new, "--against", exe)
    assert p.returncode == 0, p.stdout
    from linepack.image.context import ImageContext
    from linepack.image.elf import ElfImage
    o, n = ImageContext(ElfImage(str(exe))), ImageContext(ElfImage(str(new)))
    fo = int(o.functions.start[o.functions.index_of("f")])
    fn = int(n.functions.start[n.functions.index_of("f")])
    assert fo != fn                                  # f moved
    code = bytes(n.image.read(fn, 64))
    k = code.index(bytes.fromhex("67e3"))            # jecxz, its rel8 after it
    # point the jecxz one byte short of its label (into the addl it skips)
    bad = helpers.patched_copy(new, tmp_path / "bad",
                               {n.image.vaddr_to_offset(fn + k + 2): bytes([code[k + 2] - 1])})
    p = run_linepack("verify", "-q", bad, "--against", exe)
    assert p.returncode == 1 and "equiv.branch-target" in p.stdout and f"f+{k:#x}" in p.stdout, \
        p.stdout


@pytest.mark.parametrize("name,head,width", BRANCHES)
def test_relayout_does_not_split_a_function_holding_one(name, head, width):
    """The block split re-encodes only jmp/jcc terminators: a function holding one of
    these branches is moved whole (image/cfg.py R_OTHER_BRANCH), never split."""
    from linepack.image.cfg import CFG, R_OTHER_BRANCH, R_SPLIT
    n = len(head) // 2 + width
    # f: test; je +1; BR back to f; ret | g: test; je +1; nop; ret
    f = [(0x1000, bytes.fromhex("85ff")), (0x1002, bytes.fromhex("7400")),
         (0x1004, _enc(head, width, -(4 + n))), (0x1004 + n, b"\xc3")]
    g0 = 0x1005 + n
    g = [(g0, bytes.fromhex("85ff")), (g0 + 2, bytes.fromhex("7401")), (g0 + 4, b"\x90"),
         (g0 + 5, b"\xc3")]
    cfg = CFG(disassembly(f + g), np.array([0x1000, g0], np.uint64),
              np.array([g0, g0 + 6], np.uint64))
    assert cfg.reason.tolist() == [R_OTHER_BRANCH, R_SPLIT]


# -- across functions: relayout follows them, verify names them when it did not ---------
ASM_ACROSS = r'''
	.section .note.GNU-stack,"",@progbits
	.text
	.globl f
	.type f, @function
f:
	movl %edi, %ecx
	xorl %eax, %eax
	addl $3, %eax
	loop g_inner
	ret
	.size f, .-f
	.globl g
	.type g, @function
g:
	movl %edi, %ecx
	xorl %eax, %eax
g_inner:
	addl $5, %eax
	ret
	.size g, .-g
	.globl h
	.type h, @function
h:
	xbegin g_inner
	xend
	ret
	.size h, .-h
'''
MAIN_ACROSS = r'''
#include <stdio.h>
int f(int n);
int g(int n);
int main(int argc, char **argv) { printf("%d %d\n", f(argc + 3), g(argc)); return 0; }
'''


@pytest.fixture
def across(tmp_path):
    """f's loop goes into g, h's xbegin (never run: TSX may be missing) names g too."""
    (tmp_path / "a.s").write_text(ASM_ACROSS)
    (tmp_path / "m.c").write_text(MAIN_ACROSS)
    exe = tmp_path / "p"
    subprocess.run(["gcc", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(tmp_path / "m.c"), str(tmp_path / "a.s")], check=True)
    want = subprocess.run([str(exe)], stdout=subprocess.PIPE, text=True, check=True).stdout
    return exe, want


def test_relayout_keeps_loop_and_xbegin_across_functions(across, tmp_path):
    """relayout glues f to g (a rel8 loop between them) and fixes h's xbegin rel32:
    the output runs the same and verifies."""
    exe, want = across
    new = tmp_path / "p.lp"
    r = run_linepack("relayout", exe, "--strategy", "align-all 64", "-o", new)
    assert r.returncode == 0, r.stderr
    assert "1 rel32" in r.stdout, r.stdout
    assert subprocess.run([str(new)], stdout=subprocess.PIPE, text=True).stdout == want
    p = run_linepack("verify", "-q", new, "--against", exe)
    assert p.returncode == 0, p.stdout


def test_verify_names_loop_and_xbegin_left_behind(across, tmp_path, monkeypatch):
    """relayout made to ignore them (as before it knew them): f moves away from g with
    its loop's bytes, h's xbegin keeps its rel32; verify names both (kept bytes)."""
    from linepack.image.disasm import Disassembly
    from linepack.relayout.driver import relayout
    exe, _ = across
    new = tmp_path / "p.lp"
    monkeypatch.setattr(Disassembly, "pc_relative_branches",
                        lambda self: self.branch_targets())
    summary, _, _ = relayout(str(exe), str(new), "align-all 64")
    monkeypatch.undo()
    p = run_linepack("verify", "-q", new, "--against", exe)
    assert p.returncode == 1
    lines = [ln for ln in p.stdout.splitlines() if "error:" in ln]
    assert len(lines) == 2 and all("equiv.branch-target" in ln for ln in lines), p.stdout
    assert "branch at f+0x7 went to g+0x4" in lines[0] and \
        "branch at h+0x0 went to g+0x4" in lines[1], p.stdout


@pytest.mark.parametrize("old_head,new_head", [("74", "eb"), ("e2", "74"), ("e2", "e0"),
                                               ("e8", "e9"), ("0f84", "0f85")])
def test_a_branch_made_another_to_the_translated_target_is_named(old_head, new_head):
    """A changed branch passes only as the same branch (opcode and prefixes kept)
    whose displacement names the translated target: je made jmp, loop made je, call
    made jmp, je made jne (each to the right place) are named as changed bytes."""
    w = 4 if len(old_head) == 4 or old_head == "e8" else 1
    n = len(old_head) // 2 + w
    old = [(0x1000, _enc(old_head, w, 0x40 - n)), (0x1040, b"\xc3")]
    amap = ShiftMap(0x1000, 0x1010, 0x20)
    assert _compare(old, [(0x1020, _enc(old_head, w, 0x20 - n)), (0x1040, b"\xc3")], amap) == {}
    assert _compare(old, [(0x1020, _enc(new_head, w, 0x20 - n)), (0x1040, b"\xc3")], amap) == \
        {"equiv.instruction-bytes": [0x1000]}
