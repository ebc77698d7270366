"""Block-level equivalence (tools/verify/blocks.py) on small hand-assembled functions.

Each case is an original function, a block-level rewrite of it written byte by
byte here (hot part at the function's new address, cold part elsewhere), and the
block map that describes it. The correct rewrite must pass; each injected
breakage must be reported under its name.

Padding where a removed jmp was (its target not the next instruction) is also
injected end to end: a fixture built with gcc at test time, split by the real
``relayout --strategy blocks`` with a fault in the layout step, checked by the
``linepack verify --against`` command.
"""

import json
import signal
import subprocess

import numpy as np
import pytest

from helpers import run_linepack
import helpers

from linepack.image import blockmap as bm
from linepack.verify.blocks import (SplitFunction, _BlockCheck, _Found, blocks_in_halves,
                                    check_blocks)

C, B, I, R = bm.KIND_COPIED, bm.KIND_BRANCH, bm.KIND_JMP_INSERTED, bm.KIND_JMP_REMOVED
HOT, COLD = bm.PART_HOT, bm.PART_COLD


class Memory:
    """Bytes by address, from {base: bytes}."""

    def __init__(self, chunks):
        self.chunks = {a: bytearray(b) for a, b in chunks.items()}

    def read(self, addr, n):
        for base, data in self.chunks.items():
            if base <= addr < base + len(data):
                off = addr - base
                return bytes(data[off:off + n]).ljust(n, b"\xcc")
        return b"\xcc" * n

    def patch(self, addr, data):
        for base, chunk in self.chunks.items():
            if base <= addr < base + len(chunk):
                chunk[addr - base:addr - base + len(data)] = data
                return
        raise KeyError(hex(addr))


def outside(a):
    """Functions moved whole: everything at 0x5000.. moved up by 0x1000."""
    a = np.asarray(a, np.uint64)
    return np.where(a >= np.uint64(0x5000), a + np.uint64(0x1000), a)


def rows_of(*specs):
    old, old_len, new, new_len, kind, part = zip(*specs)
    return bm.make_rows(old, old_len, new, new_len, kind, part, [1] * len(specs))


def hx(s):
    return bytes.fromhex(s.replace(" ", ""))


# -- case A: the cold path split off, its jcc relaxed to rel32 ---------------------------
#   1000 test edi,edi; 1002 jne 1007; 1004 xor eax,eax; 1006 ret
#   1007 call 5000 (a function moved whole, to 6000); 100c mov eax,1; 1011 ret
OLD_A = {0x1000: hx("85ff 7503 31c0 c3 e8f43f0000 b801000000 c3")}
NEW_A = {0x2000: hx("85ff 0f85f80f0000 31c0 c3"),           # hot part 2000..200b
         0x3000: hx("e8fb2f0000 b801000000 c3")}            # cold part 3000..300b


def case_a():
    f = SplitFunction("f", 0x1000, 0x1012, [(HOT, 0x2000, 0x200b), (COLD, 0x3000, 0x300b)])
    rows = rows_of((0x1000, 2, 0x2000, 2, C, HOT), (0x1002, 2, 0x2002, 6, B, HOT),
                   (0x1004, 3, 0x2008, 3, C, HOT), (0x1007, 11, 0x3000, 11, C, COLD))
    orc_old = (np.array([0x1000, 0x1007], np.uint64), np.array([10, 20]))
    orc_new = (np.array([0x2000, 0x3000], np.uint64), np.array([10, 20]))
    return rows, [f], Memory(OLD_A), Memory(NEW_A), orc_old, orc_new


# -- case B: the fall-through goes cold (an inserted jmp), a jmp to the next block removed --
#   1100 test; 1102 je 110a; 1104 mov eax,1; 1109 ret (cold); 110a xor; 110c jmp 110e; 110e ret
OLD_B = {0x1100: hx("85ff 7406 b801000000 c3 31c0 eb00 c3")}
NEW_B = {0x2100: hx("85ff 7405 e9f70f0000 31c0 c3"),        # hot 2100..210c
         0x3100: hx("b801000000 c3")}                       # cold 3100..3106


def case_b():
    g = SplitFunction("g", 0x1100, 0x110f, [(HOT, 0x2100, 0x210c), (COLD, 0x3100, 0x3106)])
    rows = rows_of((0x1100, 2, 0x2100, 2, C, HOT), (0x1102, 2, 0x2102, 2, B, HOT),
                   (0x1104, 0, 0x2104, 5, I, HOT), (0x1104, 6, 0x3100, 6, C, COLD),
                   (0x110a, 2, 0x2109, 2, C, HOT), (0x110c, 2, 0x210b, 0, R, HOT),
                   (0x110e, 1, 0x210b, 1, C, HOT))
    orc_old = (np.array([0x1100], np.uint64), np.array([7]))
    orc_new = (np.array([0x2100, 0x3100], np.uint64), np.array([7, 7]))
    return rows, [g], Memory(OLD_B), Memory(NEW_B), orc_old, orc_new


def run(rows, funcs, old, new, orc_old=None, orc_new=None, **kw):
    findings, stats = check_blocks(rows, funcs, old.read, new.read, outside, orc_old, orc_new, **kw)
    return findings, stats


def checks(findings):
    return sorted({f.check for f in findings})


def test_correct_rewrites_pass():
    rows, funcs, old, new, oo, on = case_a()
    findings, stats = run(rows, funcs, old, new, oo, on,
                          tables=[("__jump_table.code", [0x1002], [0x2002])])
    assert findings == []
    assert stats["instructions"] == 7 and stats["branches_reencoded"] == 1
    assert stats["orc_checked"] == 7
    rows, funcs, old, new, oo, on = case_b()
    findings, stats = run(rows, funcs, old, new, oo, on)
    assert findings == []
    assert (stats["jmps_inserted"], stats["jmps_removed"], stats["branches_reencoded"]) == (1, 1, 1)
    assert stats["edges"] == 4      # test, je, mov, xor fall through; ret/jmp do not


def test_edge_broken_when_the_inserted_jmp_is_missing_or_wrong():
    rows, funcs, old, new, oo, on = case_b()
    no_jmp = rows[rows["kind"] != I]
    found, _ = run(no_jmp, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.edge"]
    assert "fall-through from 'je" in found[0].message and found[0].address == 0x2104
    new.patch(0x2105, (0xff8).to_bytes(4, "little"))        # inserted jmp now goes to 3101
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.edge"] and "inserted jmp at 0x2104" in found[0].message


def test_removed_jmp_must_lead_to_its_target():
    rows, funcs, old, new, oo, on = case_b()
    rows["new"][(rows["kind"] == R)] = 0x2109
    found, _ = run(rows, funcs, old, new, oo, on)
    assert "equiv.edge" in checks(found)
    assert any("removed jmp at 0x110c went to 0x110e" in f.message for f in found)


def test_block_lost():
    rows, funcs, old, new, oo, on = case_b()
    lost = rows[~((rows["old"] == 0x1104) & (rows["kind"] == C))]
    found, _ = run(lost, funcs, old, new, oo, on)
    assert "equiv.block-lost" in checks(found)
    assert any(f.address == 0x1104 and "0x1104..0x110a" in f.message for f in found)


def test_block_placed_twice():
    rows, funcs, old, new, oo, on = case_a()
    dup = rows_of((0x1007, 11, 0x3000, 11, C, COLD))
    found, _ = run(bm.sort_rows(np.concatenate([rows, dup])), funcs, old, new, oo, on)
    assert "equiv.block-twice" in checks(found)


# -- case B inverted: the hot jcc's taken target follows it, its fall-through went cold:
#    je 110a becomes jne (cold 3100) and falls into the old target; no inserted jmp
NEW_B_INV = {0x2100: hx("85ff 0f85f80f0000 31c0 c3"),      # hot 2100..210b
             0x3100: hx("b801000000 c3")}                   # cold 3100..3106


def case_b_inverted():
    g = SplitFunction("g", 0x1100, 0x110f, [(HOT, 0x2100, 0x210b), (COLD, 0x3100, 0x3106)])
    rows = rows_of((0x1100, 2, 0x2100, 2, C, HOT), (0x1102, 2, 0x2102, 6, B, HOT),
                   (0x1104, 6, 0x3100, 6, C, COLD),
                   (0x110a, 2, 0x2108, 2, C, HOT), (0x110c, 2, 0x210a, 0, R, HOT),
                   (0x110e, 1, 0x210a, 1, C, HOT))
    orc_old = (np.array([0x1100], np.uint64), np.array([7]))
    orc_new = (np.array([0x2100, 0x3100], np.uint64), np.array([7, 7]))
    return rows, [g], Memory(OLD_B), Memory(NEW_B_INV), orc_old, orc_new


def test_inverted_jcc_keeps_both_edges():
    rows, funcs, old, new, oo, on = case_b_inverted()
    findings, stats = run(rows, funcs, old, new, oo, on)
    assert findings == []
    assert stats["jcc_inverted"] == 1 and stats["jmps_inserted"] == 0


def test_wrong_inversion_is_named():
    # jne to the cold block's second instruction (3105) instead of its start
    rows, funcs, old, new, oo, on = case_b_inverted()
    new.patch(0x2104, (0xffd).to_bytes(4, "little"))
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.jcc-inversion"]
    assert "original fall-through 0x1104 is now at 0x3100" in found[0].message
    # inverted, but what follows it is not the original target (xor and ret swapped away)
    rows, funcs, old, new, oo, on = case_b_inverted()
    rows = rows[rows["old"] != 0x110a]
    rows = np.concatenate([rows, rows_of((0x110a, 2, 0x2109, 2, C, HOT))])
    found, _ = run(rows, funcs, old, new, oo, on)
    assert "equiv.jcc-inversion" in checks(found)
    assert any("original target 0x110a is now at 0x2109" in f.message for f in found)


def test_relaxation_wrong_displacement_and_form():
    rows, funcs, old, new, oo, on = case_a()
    new.patch(0x2004, (0xff9).to_bytes(4, "little"))        # jne to 3001
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.relaxation"] and "displacement" in found[0].message
    rows, funcs, old, new, oo, on = case_a()
    new.patch(0x2003, b"\x84")                               # jne became je
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.relaxation"] and "'jne' became 'je'" in found[0].message
    rows, funcs, old, new, oo, on = case_a()
    rows["new_len"][rows["kind"] == B] = 2                   # map and bytes disagree on the form
    found, _ = run(rows, funcs, old, new, oo, on)
    assert "equiv.relaxation" in checks(found)
    assert any("form: 6 bytes where the map says 2" in f.message for f in found)


def test_copied_instruction_must_keep_its_meaning():
    rows, funcs, old, new, oo, on = case_a()
    new.patch(0x3001, (0x2ffc).to_bytes(4, "little"))       # call 6001 instead of 6000
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.block-instruction"]
    assert "'call 0x5000' at 0x1007" in found[0].message
    rows, funcs, old, new, oo, on = case_a()
    new.patch(0x3006, b"\x02")                               # mov eax,2
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.block-instruction"]
    # a copied plain branch is read from its bytes (no decode): another opcode with the
    # right target is still named (the wrong target: the first case above)
    rows, funcs, old, new, oo, on = case_a()
    new.patch(0x3000, b"\xe9")                               # call became jmp, same target
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.block-instruction"]
    assert "'call 0x5000' at 0x1007" in found[0].message and "found 'jmp" in found[0].message


@pytest.mark.parametrize("fork", [True, False])
def test_halves_give_the_whole_checks_answer(fork, monkeypatch):
    """blocks_in_halves (half 1 in a forked child) answers as one check_blocks call:
    findings in both halves, in the same order, and the same stats."""
    if not fork:
        monkeypatch.setenv("LINEPACK_VERIFY_NOFORK", "1")
    rows_a, (f,), old_a, new_a, _, _ = case_a()
    rows_b, (g,), old_b, new_b, _, _ = case_b()
    rows = np.concatenate([rows_a, rows_b])
    old, new = Memory({**OLD_A, **OLD_B}), Memory({**NEW_A, **NEW_B})
    new.patch(0x3006, b"\x02")                               # f: mov eax,2 (half 0)
    rows = rows[~((rows["kind"] == I) & (rows["old"] == 0x1104))]   # g: inserted jmp lost
    kw = dict(tables=[("__jump_table.code", [0x1002, 0x110c], [0x1002, 0x210b])])
    whole = check_blocks(rows, [g, f], old.read, new.read, outside, **kw)
    halves = blocks_in_halves(rows, [g, f], old.read, new.read, outside, **kw)
    assert checks(whole[0]) == ["equiv.block-instruction", "equiv.edge", "equiv.table-stale"]
    assert halves == whole
    # the first half (the parent's part): the map's checks and f, f's finding only
    check = _BlockCheck(rows, [g, f], old.read, new.read, outside, None, None, kw["tables"],
                        frozenset(), frozenset(), None, None)
    first = _Found(2)
    check.map_checks(first)
    check.functions(0, check.cut(), first)
    assert [x.check for x in first.findings] == ["equiv.block-instruction"]


def test_piece_outside_its_part():
    rows, funcs, old, new, oo, on = case_a()
    funcs[0].parts = [(HOT, 0x2000, 0x200b), (COLD, 0x3000, 0x3008)]   # .cold too small
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.block-outside"]
    funcs[0].parts = [(HOT, 0x2000, 0x200b)]                             # no .cold symbol
    found, _ = run(rows, funcs, old, new, oo, on)
    assert "no such symbol" in found[0].message


def test_stale_table_entry():
    rows, funcs, old, new, oo, on = case_a()
    found, _ = run(rows, funcs, old, new, oo, on,
                   tables=[("__jump_table.code", [0x1002, 0x5000], [0x1002, 0x6000])])
    assert checks(found) == ["equiv.table-stale"]
    assert found[0].address == 0x2002 and "__jump_table.code" in found[0].message


def test_orc_entry_missing_at_a_block_start():
    rows, funcs, old, new, oo, on = case_a()
    on = (np.array([0x2000], np.uint64), np.array([10]))     # nothing for the cold part
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.orc-block-start"]
    assert [f.address for f in found] == [0x3000]
    # an entry in the middle of a block that the original does not have
    rows, funcs, old, new, oo, on = case_a()
    on = (np.array([0x2000, 0x2008, 0x3000], np.uint64), np.array([10, 99, 20]))
    found, _ = run(rows, funcs, old, new, oo, on)
    assert "equiv.orc-block-start" in checks(found)             # 0x2008 starts a piece
    on = (np.array([0x2000, 0x2009, 0x3000], np.uint64), np.array([10, 99, 20]))
    found, _ = run(rows, funcs, old, new, oo, on)
    assert checks(found) == ["equiv.orc-block"] and found[0].address == 0x200a


def test_piece_boundary_inside_an_instruction():
    rows, funcs, old, new, oo, on = case_a()
    rows["old_len"][0], rows["new_len"][0] = 1, 1
    extra = rows_of((0x1001, 1, 0x2001, 1, C, HOT))
    found, _ = run(bm.sort_rows(np.concatenate([rows, extra])), funcs, old, new, oo, on)
    assert "equiv.block-map" in checks(found)


@pytest.mark.parametrize("noreturn", [False, True])
def test_noreturn_call_needs_no_fall_through(noreturn):
    # 1200 call 5000 (never returns); 1205 ret, placed cold and not after the call
    old = Memory({0x1200: hx("e8fb3d0000 c3")})
    new = Memory({0x2200: hx("e8fb3d0000"), 0x3200: hx("c3")})
    f = SplitFunction("h", 0x1200, 0x1206, [(HOT, 0x2200, 0x2205), (COLD, 0x3200, 0x3201)])
    rows = rows_of((0x1200, 5, 0x2200, 5, C, HOT), (0x1205, 1, 0x3200, 1, C, COLD))
    found, _ = run(rows, [f], old, new, noreturn=frozenset([0x5000]) if noreturn else frozenset())
    assert checks(found) == ([] if noreturn else ["equiv.edge"])


# -- case S: an instruction Capstone 5 does not decode (SERIALIZE, as in the kernel's
#    finish_task_switch) at the start of the hot part ---------------------------------
#   1000 serialize; 1003 test edi,edi; 1005 jne 100a; 1007 xor eax,eax; 1009 ret
#   100a call 5000 (moved whole, to 6000); 100f mov eax,1; 1014 ret
OLD_S = {0x1000: hx("0f01e8 85ff 7503 31c0 c3 e8f13f0000 b801000000 c3")}
NEW_S = {0x2000: hx("0f01e8 85ff 0f85f50f0000 31c0 c3"),    # hot part 2000..200e
         0x3000: hx("e8fb2f0000 b801000000 c3")}            # cold part 3000..300b


def case_serialize():
    f = SplitFunction("s", 0x1000, 0x1015, [(HOT, 0x2000, 0x200e), (COLD, 0x3000, 0x300b)])
    rows = rows_of((0x1000, 5, 0x2000, 5, C, HOT), (0x1005, 2, 0x2005, 6, B, HOT),
                   (0x1007, 3, 0x200b, 3, C, HOT), (0x100a, 11, 0x3000, 11, C, COLD))
    return rows, [f], Memory(OLD_S), Memory(NEW_S)


def test_instruction_capstone_does_not_know_is_checked_not_lost():
    rows, funcs, old, new = case_serialize()
    findings, stats = run(rows, funcs, old, new)
    assert findings == [], [f.message for f in findings]
    assert stats["instructions"] == 8 and stats["branches_reencoded"] == 1
    new.patch(0x2000, hx("909090"))                 # serialize lost in NEW
    findings, _ = run(rows, funcs, old, new)
    assert "equiv.block-instruction" in checks(findings)


# -- padding where a removed jmp was ------------------------------------------------------
# Case B's jmp 110e is removed because its target (ret) comes next. A rewriter that drops
# the jmp but leaves padding in its place (int3, or a multi-byte nop) puts the target
# after the padding; the block map says either where the target went (what
# relayout/blocks.py layout_rows writes for a removed jmp) or where the jmp was.
PADDING = {"int3": hx("cc"), "nop4": hx("0f1f4000")}
# what the finding says lies between the block's end and the jmp's target
PADDING_SAID = {"int3": "NEW has 1 byte of int3 padding (cc) in between",
                "nop4": "NEW has a 4-byte nop (0f 1f 40 00) in between"}


def case_b_padded(pad, row_at):
    k = len(pad)
    new = {0x2100: hx("85ff 7405 e9f70f0000 31c0") + pad + hx("c3"), 0x3100: NEW_B[0x3100]}
    g = SplitFunction("g", 0x1100, 0x110f, [(HOT, 0x2100, 0x210c + k), (COLD, 0x3100, 0x3106)])
    removed_at = 0x210b + k if row_at == "target" else 0x210b
    rows = rows_of((0x1100, 2, 0x2100, 2, C, HOT), (0x1102, 2, 0x2102, 2, B, HOT),
                   (0x1104, 0, 0x2104, 5, I, HOT), (0x1104, 6, 0x3100, 6, C, COLD),
                   (0x110a, 2, 0x2109, 2, C, HOT), (0x110c, 2, removed_at, 0, R, HOT),
                   (0x110e, 1, 0x210b + k, 1, C, HOT))
    orc_old = (np.array([0x1100], np.uint64), np.array([7]))
    orc_new = (np.array([0x2100, 0x3100], np.uint64), np.array([7, 7]))
    return rows, [g], Memory(OLD_B), Memory(new), orc_old, orc_new


@pytest.mark.parametrize("row_at", ["target", "jmp"])
@pytest.mark.parametrize("pad", sorted(PADDING))
def test_padding_where_a_jmp_was_removed(pad, row_at):
    rows, funcs, old, new, oo, on = case_b_padded(PADDING[pad], row_at)
    found, stats = run(rows, funcs, old, new, oo, on)
    assert stats["jmps_removed"] == 1
    assert checks(found) == ["equiv.edge"] and len(found) == 1, [f.message for f in found]
    k = len(PADDING[pad])
    if row_at == "target":
        # the xor before the jmp no longer falls into what the jmp led to
        assert found[0].address == 0x210b
        assert found[0].message.startswith("g: fall-through from 'xor eax, eax' at 0x110a to "
                                           "0x110c is broken: NEW continues at 0x210b")
        assert f"the successor is a removed jmp whose target is at {0x210b + k:#x}" in \
            found[0].message
    else:
        assert found[0].address == 0x210b
        assert found[0].message.startswith(f"g: removed jmp at 0x110c went to 0x110e (now "
                                           f"{0x210b + k:#x}), but its place leads to 0x210b: "
                                           "the target must be the next instruction")
    assert found[0].message.endswith(PADDING_SAID[pad])


# End to end: h's jmp over its cold block is removed by the split (the hot target
# block follows it); the fault makes the layout step leave padding in its place.
ASM_H = r"""
    .section .text.hot,"ax",@progbits
    .fill 4096, 1, 0xcc
    .p2align 4
    .globl h
    .type h, @function
h:
    mov %edi, %eax
    test %edi, %edi
    js .Lh_cold
    add $1, %eax
    {disp32} jmp .Lh_hot
.Lh_cold:
    neg %eax
    .rept 40
    add $3, %eax
    .endr
    ret
.Lh_hot:
    add $5, %eax
    ret
    .size h, .-h
    .globl h_cold, h_hot
    .set h_cold, .Lh_cold
    .set h_hot, .Lh_hot
    .section .note.GNU-stack,"",@progbits
"""
MAIN_H = r"""
#include <stdio.h>
int h(int);
int main(void) {
    long s = 0;
    for (int i = 0; i < 2000; i += 7) s += h(i);
    printf("s=%ld\n", s);
    return 0;
}
"""


@pytest.fixture(scope="module")
def prog_h(tmp_path_factory):
    helpers.require_tool("gcc")
    d = tmp_path_factory.mktemp("verify-pad")
    (d / "h.s").write_text(ASM_H)
    (d / "main.c").write_text(MAIN_H)
    exe = d / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(d / "main.c"), str(d / "h.s")], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return exe, out


def _split_h(exe, out):
    """relayout --strategy blocks of h with its entry and target blocks hot."""
    from linepack.image.elf import ElfImage
    from linepack.image.functions import FunctionTable
    from linepack.relayout.driver import relayout
    im = ElfImage(str(exe))
    h, cold, hot = (im.symbol_address(n) for n in ("h", "h_cold", "h_hot"))
    fn = FunctionTable(im)
    end = int(fn.end[fn.index_of("h")])
    im.close()
    ranges = (np.array([h, hot], np.uint64), np.array([cold - h, end - hot], np.uint64),
              np.array([100.0, 100.0]))
    summary, _, rw = relayout(str(exe), str(out), "blocks", hotness={"h": 100.0, "main": 100.0},
                              blocks=ranges)
    assert not summary["problems"]
    # h, and main when .eh_frame has no room for its cold FDE in place (a new segment)
    assert summary["split"]["functions_split"] == 1 + ("new_segment" in summary)
    from linepack.relayout import blocks as B
    sf = next(sf for sf in rw.block_split["splits"] if sf.name == "h")
    assert sum(p.kind == B.REMOVED for part in sf.parts for p in part) == 1
    return summary


def _leave_padding(monkeypatch, pad, row_at):
    """The fault: the layout step drops a removed jmp's bytes but leaves ``pad`` in
    their place, the jmp's target after it. Everything else (branch displacements,
    symbols, sizes, the rest of the block map) is computed for that layout by the
    real code, so only the removed jmp's edge is wrong."""
    from linepack.image import blockmap as bm
    from linepack.relayout import blocks as B
    real_relax, real_rows = B._relax, B.layout_rows
    padded = []                                 # (split function, part, offset of the pad)

    def relax(sf):
        real_relax(sf)
        for part in (0, 1):
            off, first = 0, {}
            for p in sf.parts[part]:
                p.off = off
                first.setdefault(p.block, off)
                if p.kind == B.REMOVED:
                    padded.append((sf, part, off))
                    off += len(pad)
                else:
                    off += p.size
            sf.sizes[part], sf.first[part] = off, first

    def layout_rows(splits, plan, parent, part, image):
        rows, part_bytes, cold = real_rows(splits, plan, parent, part, image)
        index = {(int(parent[k]), int(part[k])): k for k in range(len(parent))}
        for sf, p_, off in padded:
            k = index[(sf.unit, p_)]
            buf = bytearray(part_bytes[k])
            buf[off:off + len(pad)] = pad
            part_bytes[k] = bytes(buf)
        if row_at == "jmp":                     # the row names the jmp's place, not its target
            rows["new"][rows["kind"] == bm.KIND_JMP_REMOVED] -= np.uint64(len(pad))
        return rows, part_bytes, cold

    monkeypatch.setattr(B, "_relax", relax)
    monkeypatch.setattr(B, "layout_rows", layout_rows)
    return padded


def test_blocks_output_with_a_removed_jmp_verifies(prog_h, tmp_path):
    exe, expected = prog_h
    out = tmp_path / "split"
    _split_h(exe, out)
    assert subprocess.run([str(out)], capture_output=True, text=True).stdout == expected
    p = run_linepack("verify", out, "--against", exe, "--json", tmp_path / "r.json", timeout=120)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert p.returncode == 0 and rep["findings"] == [], p.stdout + p.stderr
    assert rep["equivalence_blocks"]["jmps_removed"] == 1


@pytest.mark.parametrize("row_at", ["target", "jmp"])
@pytest.mark.parametrize("pad", sorted(PADDING))
def test_verify_against_names_padding_where_a_jmp_was_removed(prog_h, tmp_path, monkeypatch,
                                                              pad, row_at):
    from linepack.image import blockmap as bm
    from linepack.image.elf import ElfImage
    exe, expected = prog_h
    bad = tmp_path / "split.bad"
    padded = _leave_padding(monkeypatch, PADDING[pad], row_at)
    _split_h(exe, bad)
    assert len(padded) == 1
    monkeypatch.undo()
    # the fault is real: int3 traps; a nop runs the same (only the proof can tell)
    run = subprocess.run([str(bad)], capture_output=True, text=True, timeout=20)
    if pad == "int3":
        assert run.returncode == -signal.SIGTRAP
    else:
        assert run.returncode == 0 and run.stdout == expected

    old_im, new_im = ElfImage(str(exe)), ElfImage(str(bad))
    jmp_old = old_im.symbol_address("h_cold") - 5          # the {disp32} jmp before .Lh_cold
    target_old, target_new = old_im.symbol_address("h_hot"), new_im.symbol_address("h_hot")
    rows = bm.read_blockmap(new_im)
    old_im.close()
    new_im.close()
    (removed,) = rows[rows["kind"] == bm.KIND_JMP_REMOVED]
    assert int(removed["old"]) == jmp_old
    pad_at = target_new - len(PADDING[pad])                # where the jmp was

    p = run_linepack("verify", bad, "--against", exe, "--json", tmp_path / "r.json", timeout=120)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert p.returncode == 1, p.stdout + p.stderr
    assert [(f["check"], f["address"]) for f in rep["findings"]] == \
        [("equiv.edge", f"{pad_at:#x}")], rep["findings"]
    msg = rep["findings"][0]["message"]
    if row_at == "target":
        assert msg.startswith(f"h: fall-through from 'add eax, 1' at {jmp_old - 3:#x} to "
                              f"{jmp_old:#x} is broken: NEW continues at {pad_at:#x}")
        assert f"the successor is a removed jmp whose target is at {target_new:#x}" in msg
    else:
        assert msg.startswith(f"h: removed jmp at {jmp_old:#x} went to {target_old:#x} (now "
                              f"{target_new:#x}), but its place leads to {pad_at:#x}: the "
                              "target must be the next instruction")
    assert msg.endswith(PADDING_SAID[pad])
    assert f"error: [equiv.edge] {msg}" in p.stdout


# -- a jmp that is a whole alternative site (static_cpu_has: "jmp 6f" into .altinstr_aux,
#    patched into NOPs when the CPU has the feature): it also falls through ---------------
#   1200 jmp 8000 (aux; moved whole to 9000); 1205 xor eax,eax; 1207 ret
OLD_P = {0x1200: hx("e9fb6d0000 31c0 c3")}


@pytest.mark.parametrize("with_jmp", [False, True])
def test_jmp_ending_a_patch_site_keeps_its_fall_through(with_jmp):
    hot = hx("e9fb6d0000") + (hx("e9f60f0000") if with_jmp else b"")   # + jmp 3200
    new = Memory({0x2200: hot, 0x3200: hx("31c0 c3")})
    f = SplitFunction("p", 0x1200, 0x1208, [(HOT, 0x2200, 0x2200 + len(hot)),
                                            (COLD, 0x3200, 0x3203)])
    specs = [(0x1200, 5, 0x2200, 5, C, HOT), (0x1205, 3, 0x3200, 3, C, COLD)]
    if with_jmp:
        specs.insert(1, (0x1205, 0, 0x2205, 5, I, HOT))
    rows = rows_of(*specs)
    # without the alternatives table the jmp is an ordinary one: nothing to fall into
    found, _ = run(rows, [f], Memory(OLD_P), new)
    assert found == []
    found, stats = run(rows, [f], Memory(OLD_P), new, patch_sites={0x1205: 0x1200})
    if with_jmp:
        assert found == [] and stats["jmps_inserted"] == 1
    else:
        assert checks(found) == ["equiv.edge"] and found[0].address == 0x2205
        assert "fall-through from 'jmp" in found[0].message


# -- case C: RIP-relative copies (their displacement changes with the move) -------------
#   1200 mov eax,[rip] -> 5100 (moved whole to 6100); 1206 cmp dword [rip] -> 4000, 5
#   (stays); 120d ret. Copied to 2300.
OLD_C = {0x1200: hx("8b05fa3e0000 833df32d000005 c3")}
NEW_C = {0x2300: hx("8b05fa3d0000 833df31c000005 c3")}


def case_c():
    h = SplitFunction("h", 0x1200, 0x120e, [(HOT, 0x2300, 0x230e)])
    rows = rows_of((0x1200, 14, 0x2300, 14, C, HOT))
    return rows, [h], Memory(OLD_C), Memory(NEW_C)


def test_rip_relative_copies_checked_from_their_bytes(monkeypatch):
    """A copied RIP-relative instruction whose bytes differ only in the displacement,
    which names the translated target, passes without a decode of NEW; any other
    change still gets the full check and is named."""
    from linepack.verify import blocks as vb
    decodes = []
    real_decode_one = vb._decode_one
    monkeypatch.setattr(vb, "_decode_one", lambda *a: decodes.append(a[2]) or real_decode_one(*a))
    rows, funcs, old, new = case_c()
    found, stats = run(rows, funcs, old, new)
    assert found == [] and stats["instructions"] == 3 and decodes == []
    for at, patch, where in ((0x2302, b"\xfb", 0x1200),     # mov from 6101: wrong target
                             (0x230c, b"\x06", 0x1206),     # cmp with 6: an immediate changed
                             (0x2301, b"\x0d", 0x1200)):    # mov ecx: the register changed
        rows, funcs, old, new = case_c()
        new.patch(at, patch)
        found, _ = run(rows, funcs, old, new)
        assert checks(found) == ["equiv.block-instruction"], hex(at)
        assert f"at {where:#x} has no counterpart" in found[0].message


def test_reencoded_plain_branch_checked_from_its_bytes(monkeypatch):
    """A jcc relaxed to rel32 with the same condition and the translated target passes
    without a decode of NEW (the wrong ones: test_relaxation_wrong_displacement_and_form)."""
    from linepack.verify import blocks as vb
    decodes = []
    real_decode_one = vb._decode_one
    monkeypatch.setattr(vb, "_decode_one", lambda *a: decodes.append(a[2]) or real_decode_one(*a))
    rows, funcs, old, new, oo, on = case_a()
    found, stats = run(rows, funcs, old, new, oo, on)
    assert found == [] and stats["branches_reencoded"] == 1 and decodes == []


def test_the_function_maps_one_address_form_is_its_array_form():
    """FunctionMap.map1 (what the block check asks per branch target) gives map()'s
    answer for every address: inside functions and at their ends, code labels
    between functions (kernels), the fixed section ends (userspace), kernel
    addresses and the extremes; and the block check uses it."""
    from linepack.verify.addrmap import FunctionMap
    from linepack.verify.addrmap import BlockMap
    rng = np.random.default_rng(7)
    base = np.uint64(0xFFFFFFFF81000000)
    old_start = base + np.sort(rng.choice(1 << 20, 400, replace=False).astype(np.uint64) * 16)
    old_end = np.concatenate([old_start[1:], [old_start[-1] + np.uint64(64)]])
    new_start = old_start[rng.permutation(len(old_start))] + np.uint64(1 << 24)
    lab = np.sort(rng.choice(len(old_start) - 1, 30, replace=False))
    old_end[lab] = old_end[lab] - np.uint64(8)        # a gap after those functions
    label_old = old_end[lab] + np.uint64(2)           # a code label in the gap
    label_end = label_old + np.uint64(4)
    label_new = label_old + np.uint64(0x1000)
    for fixed in (np.zeros(0, np.uint64), old_start[::37].copy(), old_end[::41].copy()):
        fm = FunctionMap(old_start, old_end, new_start, label_old, label_new, label_end)
        fm.fixed = fixed
        a = np.concatenate([old_start, old_end, label_old, label_end, label_end - np.uint64(1),
                            fixed, old_start + np.uint64(3),
                            rng.integers(int(base) - 4096, int(old_end[-1]) + 4096, 5000,
                                         dtype=np.uint64),
                            np.array([0, 1, 1 << 63, (1 << 64) - 1], np.uint64)])
        assert [fm.map1(x) for x in a.tolist()] == fm.map(a).tolist()
    assert BlockMap(np.zeros(0, bm.BLOCKMAP_ROW), fm.map)._outside1 == fm.map1


# -- the C scan (blocks.c) against the Python loop, on a real program's rewrite -------------
@pytest.fixture(scope="module")
def lua_split(tmp_path_factory):
    """lua 5.4 (Debian's source, as the userspace bench builds it: non-PIE, nobody tuned
    it for us), profiled on the bench's script and split by ``relayout --strategy
    blocks``."""
    import os
    import sys
    from linepack.profile.user import record_user
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench"))
    import bench_userspace_bolt as bench
    d = tmp_path_factory.mktemp("bc")
    exe = bench.build_lua(str(d), log=lambda m: None)
    script = d / "work.lua"
    script.write_text(bench.LUA_SCRIPT)
    prof = exe + ".lpprof"
    record_user(exe, [str(script)], output=prof)
    out = d / "lua.blocks"
    p = run_linepack("relayout", exe, "--profile", prof, "--strategy", "blocks", "-q", "-o", out,
                     timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return exe, str(out)


def _block_check_both_ways(monkeypatch, exe, out):
    """verify --against ``out`` in this process (no forked children), its block check run
    by the Python loop alone and with the C scan: [(findings, stats, C scans that ran)]
    for each."""
    from linepack.cli import main
    monkeypatch.setenv("LINEPACK_VERIFY_NOFORK", "1")
    from linepack.verify import blocks as vb
    from linepack.verify import split as vsplit
    got = []
    scans = []
    real_scan = vb._BlockCheck.scan

    def scan(self, lo, hi, codes):
        r = real_scan(self, lo, hi, codes)
        scans.append(r is not None)
        return r
    monkeypatch.setattr(vb._BlockCheck, "scan", scan)

    def both(*a, **k):
        for lib in (None, False):               # None: no C core; False: build/load it
            monkeypatch.setattr(vb, "_lib", lib)
            scans.clear()
            found, stats = check_blocks(*a, **k)
            got.append(([(f.check, f.address, f.message) for f in found], stats, list(scans)))
        return found, stats
    monkeypatch.setattr(vsplit, "blocks_in_halves", both)
    main(["verify", "-q", out, "--against", exe])
    return got


def test_the_c_scan_finds_what_the_python_loop_finds(lua_split, monkeypatch):
    """blocks.c decides the common copied instruction; on a real rewrite (lua's split
    functions) the findings and every count are the Python loop's, and C ran."""
    exe, out = lua_split
    (f_py, s_py, c_py), (f_c, s_c, c_c) = _block_check_both_ways(monkeypatch, exe, out)
    assert s_py["split_functions"] > 30 and s_py["instructions"] > 5000, s_py
    assert f_py == f_c == [] and s_py == s_c
    assert c_py == [False] and c_c == [True]
    # a first output too small for the rows and for the text: scanned again, the same
    from linepack.verify import blocks as vb
    monkeypatch.setattr(vb, "_BYTES_PER_ROW", 10 ** 6)
    monkeypatch.setattr(vb, "_TEXT_PER_ROW", 0)
    (_, _, _), (f_small, s_small, c_small) = _block_check_both_ways(monkeypatch, exe, out)
    assert (f_small, s_small, c_small) == (f_c, s_c, c_c)


@pytest.mark.parametrize("what", ["push", "rip", "jcc"])
def test_a_change_the_c_scan_would_pass_is_named(lua_split, monkeypatch, tmp_path, what):
    """One bit flipped where C passes what it finds unchanged: a one-byte push whose
    register changed in a copied piece, a copied RIP-relative lea whose displacement no
    longer names the translated target (equiv.block-instruction), a re-encoded jcc
    whose rel32 no longer does (equiv.relaxation). Both ways name it, the same."""
    import capstone
    from linepack.image.elf import ElfImage
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    exe, out = lua_split
    old_im, new_im = ElfImage(exe), ElfImage(out)
    rows = bm.read_blockmap(new_im)
    at = None
    if what == "push":
        for r in rows[rows["kind"] == bm.KIND_COPIED]:
            o, n = int(r["old"]), int(r["old_len"])
            code = bytes(old_im.read(o, n))
            k = next((a - o for a, size, m, _ in cs.disasm_lite(code[:-1], o)
                      if size == 1 and m == "push" and a > o), None)    # push rbx/rbp/...
            if k is not None and bytes(new_im.read(int(r["new"]), n)) == code:
                at, old_at, flip = int(r["new"]) + k, o + k, 0
                break
        want = ("equiv.block-instruction", f"at {old_at:#x} has no counterpart")
    elif what == "rip":
        from linepack.image.operands import rip_relative
        for r in rows[rows["kind"] == bm.KIND_COPIED]:
            o, n = int(r["old"]), int(r["old_len"])
            code = bytes(old_im.read(o, n))
            lea = next(((a, size) for a, size, m, ops in cs.disasm_lite(code, o)
                        if m == "lea" and "rip" in ops), None)
            if lea is not None and bytes(new_im.read(int(r["new"]), n)) != code:
                raw = np.zeros((1, 16), np.uint8)
                raw[0, :lea[1]] = np.frombuffer(code[lea[0] - o:lea[0] - o + lea[1]], np.uint8)
                has, disp = rip_relative(raw, [lea[1]])
                assert has[0] and disp[0] > 0
                at, old_at, flip = int(r["new"]) + lea[0] - o, lea[0], int(disp[0])
                break
        want = ("equiv.block-instruction", f"at {old_at:#x} has no counterpart")
    else:
        r = next(r for r in rows[rows["kind"] == bm.KIND_BRANCH] if int(r["new_len"]) == 6)
        at, old_at, flip = int(r["new"]), int(r["old"]), 2             # the rel32's low byte
        want = ("equiv.relaxation", f"branch at {old_at:#x} re-encoded wrongly: displacement")
    assert at is not None
    off = new_im.vaddr_to_offset(at + flip)
    old_im.close()
    new_im.close()
    bad = tmp_path / "bad"
    data = bytearray(open(out, "rb").read())
    data[off] ^= 1
    bad.write_bytes(bytes(data))
    bad.chmod(0o755)
    (f_py, _, _), (f_c, _, c_c) = _block_check_both_ways(monkeypatch, exe, str(bad))
    assert c_c == [True] and f_py == f_c
    assert [(c, a) for c, a, _ in f_c] == [(want[0], at)], f_c
    assert want[1] in f_c[0][2]
