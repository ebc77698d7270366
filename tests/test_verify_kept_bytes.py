"""verify --against: instructions NEW holds with OLD's bytes (verify/code.py
kept_pc_relative). Moved or not, a direct branch or a RIP/EIP-relative operand
with unchanged bytes designates its old target plus the distance moved: that must
be where the map puts the target."""

import numpy as np

import helpers
from helpers import run_linepack
from insn_rows import ShiftMap, disassembly
from linepack.verify.code import kept_pc_relative

_requirements = helpers.requirements("gcc")


# 1000 call 2000; 1005 lea 2000(%rip), %rax; 100c cmpl $7, 2000(%rip) (an immediate
# after the displacement: the target is the instruction's end plus it);
# 1013 mov eax, [eip + 0xfe6] (67 prefix: reads 2000); 101a xor eax, eax
CODE = [(0x1000, bytes.fromhex("e8fb0f0000")), (0x1005, bytes.fromhex("488d05f40f0000")),
        (0x100C, bytes.fromhex("833ded0f000007")), (0x1013, bytes.fromhex("678b05e60f0000")),
        (0x101A, bytes.fromhex("31c0"))]


def _kept(old_rows, new_rows, amap):
    od, nd = disassembly(old_rows), disassembly(new_rows)
    ob_i, ob_t, _ = od.branch_targets()
    wrong, stale = [], []
    idx = np.arange(len(old_rows))
    kept_pc_relative(od, nd, amap, idx, idx, ob_i, ob_t, False, lambda *a: False, wrong, stale)
    return wrong, stale


def test_targets_are_where_the_code_reads():
    # the instructions and their target stay: nothing to name
    assert _kept(CODE, CODE, ShiftMap(0, 0, 0)) == ([], [])
    # everything moves by the same distance, the target with it: still nothing
    moved = [(a + 0x100, b) for a, b in CODE]
    assert _kept(CODE, moved, ShiftMap(0x1000, 0x2100, 0x100)) == ([], [])


def test_instructions_that_stayed_while_their_target_moved_are_named():
    wrong, stale = _kept(CODE, CODE, ShiftMap(0x2000, 0x2100, 0x1000))
    assert wrong == [(0x1000, 0x1000, 0x2000, 0x2000)]
    assert [(s[0], s[2], s[3], s[4]) for s in stale] == [
        (0x1005, 0x2000, 0x2000, False), (0x100C, 0x2000, 0x2000, False),
        (0x1013, 0x2000, 0x2000, True)]


def test_instructions_that_moved_away_from_their_target_are_named():
    moved = [(a + 0x100, b) for a, b in CODE]
    wrong, stale = _kept(CODE, moved, ShiftMap(0x1000, 0x1100, 0x100))
    assert wrong == [(0x1000, 0x1100, 0x2000, 0x2100)]
    assert [(s[0], s[3]) for s in stale] == [(0x1005, 0x2100), (0x100C, 0x2100), (0x1013, 0x2100)]


PROG = r'''
#include <stdio.h>
static int __attribute__((noinline, used)) g(int x) { return x ^ 0x55; }
/* a relocated immediate (R_X86_64_32S) beside a RIP displacement to a static
   function of the same section, which has no relocation */
int __attribute__((noinline)) h(void) {
    int r;
    asm volatile("xor %0,%0\n\tcmpq $g, g(%%rip)\n\tsete %b0" : "=r"(r) :: "cc");
    return r;
}
int main(int argc, char **argv) { printf("%d %d\n", g(argc), h()); return 0; }
'''


def test_a_relocated_immediate_does_not_hide_the_displacement(tmp_path):
    """relayout fixes the RIP displacement of an instruction whose immediate is
    relocated; verify names it when it is left as it was (another field changed)."""
    exe, new = helpers.relaid_out_c(tmp_path, PROG)
    assert run_linepack("verify", "-q", new, "--against", exe).returncode == 0
    from linepack.image.context import ImageContext
    from linepack.image.elf import ElfImage
    o, n = ImageContext(ElfImage(str(exe))), ImageContext(ElfImage(str(new)))
    a_old = o.functions.start[o.functions.index_of("h")] + 2       # after the xor
    a_new = n.functions.start[n.functions.index_of("h")] + 2
    old_b = bytes(o.image.read(int(a_old), 11))                    # 48 81 3d disp32 imm32
    new_b = bytes(n.image.read(int(a_new), 11))
    assert new_b[:3] == old_b[:3] == bytes.fromhex("48813d") and new_b[3:7] != old_b[3:7]
    bad = helpers.patched_copy(new, tmp_path / "bad",
                               {n.image.vaddr_to_offset(int(a_new) + 3): old_b[3:7]})
    p = run_linepack("verify", "-q", bad, "--against", exe)
    assert p.returncode == 1 and "h+0x2" in p.stdout, p.stdout
