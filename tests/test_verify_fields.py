"""verify --against's fast paths (tools/verify/fields.py, tools/verify/forked.py).

- FieldLayouts (Capstone's field layout, decoded once per instruction header)
  gives exactly what Capstone's own detail decode gives, instruction by
  instruction, on a random sample of the real vmlinux's instructions, including
  instructions whose header was first seen on another instruction;
- blocks.py's lite decode asks for Capstone's detail on every instruction
  that is a direct branch or has a RIP-relative operand (same sample);
- field_values reads every field width and sign like int.from_bytes;
- the merged disassembly's carried-over branch targets equal a fresh decode;
- Forked returns what the call returns, re-raises the call's own exception in
  the parent, and a cancelled child is gone.
"""

import os
import subprocess

import numpy as np
import pytest

import capstone
from capstone import x86 as cx86

from linepack.verify.fields import FieldLayouts, field_values
from linepack.verify.forked import Forked

SAMPLE = 40_000


def _capstone_layout(cs, code, addr):
    ins = next(cs.disasm(code, addr, 1), None)
    if ins is None or ins.size != len(code):
        return (False, 0, 0, 0, 0, False)
    rip = any(op.type == cx86.X86_OP_MEM and op.mem.base == cx86.X86_REG_RIP for op in ins.operands)
    dsz = 4 if ins.disp_size == 2 else ins.disp_size
    return (True, ins.disp_offset if dsz else 0, dsz, ins.imm_offset if ins.imm_size else 0,
            ins.imm_size, rip)


@pytest.fixture(scope="module")
def vmlinux_insns(debian_vmlinux):
    from linepack.image.disasm import disassemble
    from linepack.image.elf import ElfImage
    from linepack.image.functions import FunctionTable
    image = ElfImage(debian_vmlinux)
    return disassemble(image, FunctionTable(image))


def test_layouts_match_capstone_on_the_real_vmlinux(vmlinux_insns):
    d = vmlinux_insns
    rng = np.random.default_rng(9)
    pick = np.sort(rng.choice(len(d), SAMPLE, replace=False))
    raw, size, addr = d.raw[pick], d.size[pick].astype(np.int64), d.addr[pick]
    fl = FieldLayouts()
    got = fl.layouts(raw, size, addr)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True
    want = [_capstone_layout(cs, bytes(raw[k][:size[k]]), int(addr[k])) for k in range(len(pick))]
    # blocks.py decodes operand detail only for mnemonics that may branch and
    # operand texts that name rip: every real direct branch and RIP operand is among them
    from linepack.verify.blocks import _direct_target, _maybe_branch, _rip_relative
    branches = rips = 0
    for k in range(len(pick)):
        ins = next(cs.disasm(bytes(raw[k][:size[k]]), int(addr[k]), 1), None)
        if ins is None:
            continue
        if _direct_target(ins) is not None:
            branches += 1
            assert _maybe_branch(ins.mnemonic), ins.mnemonic
        if _rip_relative(ins):
            rips += 1
            assert "rip" in ins.op_str, (ins.mnemonic, ins.op_str)
    assert branches > 1000 and rips > 500
    want = [np.array([w[c] for w in want]) for c in range(6)]
    for c, name in enumerate(("decoded", "disp offset", "disp size", "imm offset", "imm size",
                              "rip")):
        bad = np.nonzero(got[c] != want[c])[0]
        assert not len(bad), (name, [bytes(raw[k][:size[k]]).hex() for k in bad[:5]])
    # the memo did the work: far fewer headers than instructions, and with
    # RIP-relative displacements among them
    assert len(fl._by_header) < SAMPLE // 4
    assert got[5].sum() > 500 and (got[2] == 4).sum() > 1000 and (got[4] == 8).sum() > 0


def test_field_values_every_width_and_sign():
    rows = [(b"\x01\x80\xff\x7f\x00\x00\x00\x00", 0, 1), (b"\x01\x80\xff\x7f", 1, 1),
            (b"\x00\x34\x12\xf0\xff", 1, 4), (b"\x00\x34\x12\xf0\x7f", 1, 4),
            (b"\x48\xb8" + (0x8123456789abcdef).to_bytes(8, "little"), 2, 8),
            (b"\x90", 0, 0), (b"\x66\x05\x34\x82", 2, 2)]
    raw = np.zeros((len(rows), 16), np.uint8)
    for k, (b, _, _) in enumerate(rows):
        raw[k, :len(b)] = np.frombuffer(b, np.uint8)
    off = np.array([r[1] for r in rows])
    sz = np.array([r[2] for r in rows])
    got = field_values(raw, off, sz).tolist()
    want = [int.from_bytes(b[o:o + s], "little", signed=0 < s < 8) & (2**64 - 1) if s else 0
            for b, o, s in rows]
    assert got == want


def _square(x):
    return {"pid": os.getpid(), "value": np.arange(x) ** 2}


def _fails(x):
    raise ValueError(f"bad {x}")


def test_forked_returns_the_child_result():
    job = Forked(_square, 100_000)
    got = job.result()
    assert got["pid"] != os.getpid()                    # really computed in the child
    assert np.array_equal(got["value"], np.arange(100_000) ** 2)


def test_forked_failure_is_raised_in_the_parent():
    job = Forked(_fails, 7)
    with pytest.raises(ValueError, match="bad 7"):
        job.result()


def test_forked_cancel_reaps_the_child():
    job = Forked(_square, 10_000_000)       # a result larger than the pipe: the child blocks
    pid = job.pid
    assert pid
    job.cancel()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


def test_merged_disassembly_carries_the_branch_targets(debian_vmlinux):
    """coverage.merge hands the parts' decoded branch targets to the merged
    disassembly: they equal a fresh decode of the merged rows."""
    from linepack.image.disasm import Disassembly
    from linepack.image.elf import ElfImage
    from linepack.kernel.base import ImageContext
    d = ImageContext(ElfImage(debian_vmlinux)).disasm
    carried = d._branch_targets
    fresh = Disassembly(d.addr, d.size, d.func, d.raw, []).branch_targets()
    assert len(carried[0]) > 500_000
    for a, b in zip(carried, fresh):
        assert a.dtype == b.dtype and np.array_equal(a, b)



def test_parts_of_one_function_count_as_its_own_code():
    """A table entry's target may lie in the site's own function's parts: gcc's foo.cold
    or clones, and a block-level split's foo.cold beside gcc's foo.cold (a static-key
    site the split moved to the cold part still jumps to gcc's cold part); two
    functions that merely share a name (statics of two files) are not one."""
    from linepack.kernel.base import same_function_parts
    assert same_function_parts("foo", "foo.cold") and same_function_parts("foo.cold", "foo")
    assert same_function_parts("foo", "foo.part.0")
    assert same_function_parts("foo.cold", "foo.cold")            # linepack's and gcc's
    assert same_function_parts("foo.part.0.cold", "foo.part.0")
    assert not same_function_parts("foo.cold", "foo.part.0")         # as before
    assert not same_function_parts("foo", "foo")                   # two statics named foo
    assert not same_function_parts("foo", "foobar.cold")
    assert not same_function_parts("foo.cold", "bar.cold")


# instructions with a 32-bit immediate (0xffffffff8241104c sign-extended, a kernel
# address in the top 2 GB): 64-bit operations (REX.W, push) and others
IMM32 = """cmp $-0x7dbeefb4, %eax
cmp $-0x7dbeefb4, %rax
cmpl $-0x7dbeefb4, 8(%rbx)
cmpq $-0x7dbeefb4, 8(%rbx)
mov $-0x7dbeefb4, %ecx
movq $-0x7dbeefb4, %rcx
movl $-0x7dbeefb4, 0x10(%rsp)
movq $-0x7dbeefb4, 0x10(%rsp)
push $-0x7dbeefb4
and $-0x7dbeefb4, %r9d
and $-0x7dbeefb4, %r9
lock orl $-0x7dbeefb4, (%rdi)
lock orq $-0x7dbeefb4, (%rdi)
imul $-0x7dbeefb4, %edx, %eax
imul $-0x7dbeefb4, %rdx, %rax
test $-0x7dbeefb4, %esi
test $-0x7dbeefb4, %rsi
cmpl $-0x7dbeefb4, %fs:0x28
cmpq $-0x7dbeefb4, %gs:0x28
"""


def test_imm_sign_extended_as_capstone_sizes_the_operand(tmp_path):
    """verify/data.py's imm_sign_extended (a kernel address can only be the immediate
    of a 64-bit operation) agrees with Capstone's size of the immediate operand, on
    gas's encodings of each form."""
    from linepack.image.elf import ElfImage
    from linepack.verify.data import imm_sign_extended
    src = tmp_path / "imm.s"
    src.write_text(".text\n" + "".join(f"{line}\n" for line in IMM32.splitlines()))
    subprocess.run(["as", "--64", "-o", str(tmp_path / "imm.o"), str(src)], check=True)
    im = ElfImage(str(tmp_path / "imm.o"))
    code = bytes(im.section_bytes(im.section(".text")))
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True
    rows, want = [], []
    for ins in cs.disasm(code, 0):
        imm = [op for op in ins.operands if op.type == cx86.X86_OP_IMM]
        assert len(imm) == 1 and ins.imm_size == 4, ins.mnemonic
        want.append(imm[0].size == 8)
        rows.append(np.frombuffer(bytes(ins.bytes).ljust(16, b"\0"), np.uint8))
    assert len(rows) == len(IMM32.splitlines())
    assert sum(want) == 10
    assert imm_sign_extended(np.stack(rows)).tolist() == want
