"""Instructions 7.3 uses that Capstone 5 does not decode (WRMSRNS, INVLPGB,
TLBSYNC, UDB) or decodes too short (UD1 with its ModRM byte, __WARN_trap):
function decoding keeps every boundary."""

import shutil
import subprocess

import pytest

from linepack.image.disasm import disassemble, ud1_length
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

ASM = """
    .section .note.GNU-stack,"",@progbits
    .text
    .globl f
    .type f, @function
f:  .byte 0x67, 0x48, 0x0f, 0xb9, 0x3a      # ud1 (%edx), %rdi
    jmp g
    .byte 0x0f, 0x01, 0xc6                  # wrmsrns
    .byte 0x0f, 0x01, 0xfe                  # invlpgb
    .byte 0x0f, 0x01, 0xff                  # tlbsync
    ret
    .byte 0xd6                              # udb
    .size f, .-f
    .globl g
    .type g, @function
g:  ret
    .size g, .-g
"""


def test_ud1_length():
    assert ud1_length(bytes.fromhex("67480fb93a")) == 5
    assert ud1_length(bytes.fromhex("0fb9c0")) == 3            # register operand
    assert ud1_length(bytes.fromhex("0fb9442408")) == 5        # SIB + disp8
    assert ud1_length(bytes.fromhex("0fb90501000000")) == 7    # RIP-relative
    assert ud1_length(bytes.fromhex("0f0b")) == 0


def test_function_boundaries(tmp_path):
    (tmp_path / "f.s").write_text(ASM)
    (tmp_path / "m.c").write_text("void f(void); int main(void) { return 0; }\n")
    exe = tmp_path / "prog"
    subprocess.run(["gcc", "-no-pie", "-o", str(exe), str(tmp_path / "m.c"), str(tmp_path / "f.s")],
                   check=True)
    im = ElfImage(str(exe))
    fn = FunctionTable(im)
    d = disassemble(im, fn)
    f = im.symbol_address("f")
    i = fn.index_of("f")
    got = [(int(a) - f, int(s)) for a, s, k in zip(d.addr, d.size, d.func) if k == i]
    assert got == [(0, 5), (5, 2), (7, 3), (10, 3), (13, 3), (16, 1), (17, 1)]
    assert not d.undecodable


def test_embedded_code_range(tmp_path):
    """Code inside a writable+executable section, bounded by the kernel's
    __relocate_kernel_start/_end (7.3's .data): decoded as code, the rest of the
    section is data."""
    from linepack.image.elf import code_sections
    from linepack.kernel.base import ImageContext
    (tmp_path / "d.s").write_text("""
    .section .note.GNU-stack,"",@progbits
    .section .wxdata,"awx",@progbits
    .quad 0x1122334455667788
    .globl __relocate_kernel_start
__relocate_kernel_start:
    mov $1, %eax
    ret
    .globl __relocate_kernel_end
__relocate_kernel_end:
    .quad 0x8877665544332211
""")
    (tmp_path / "m.c").write_text("int main(void) { return 0; }\n")
    exe = tmp_path / "prog"
    subprocess.run(["gcc", "-no-pie", "-o", str(exe), str(tmp_path / "m.c"), str(tmp_path / "d.s")],
                   check=True)
    im = ElfImage(str(exe))
    sec = im.section(".wxdata")
    assert not sec.is_code
    lo, hi = im.symbol_address("__relocate_kernel_start"), im.symbol_address("__relocate_kernel_end")
    pieces = [s for s in code_sections(im) if s.name == ".wxdata"]
    assert [(p.addr, p.size) for p in pieces] == [(lo, hi - lo)]
    ctx = ImageContext(im)
    assert ctx.in_code([lo, lo + 5]).all() and not ctx.in_code([sec.addr, hi]).any()
    assert ctx.disasm.is_boundary([lo, lo + 5]).all()


def test_rows_with_0f_b9_as_a_per_row_scan():
    """The rows _redecode_ud1 looks at again (a search over all rows' bytes end to
    end) are those where a row holds 0F B9 side by side, never a pair that runs
    from one row into the next."""
    import numpy as np
    from linepack.image.disasm import _rows_with_0f_b9
    rng = np.random.default_rng(3)
    for n in (0, 1, 7, 5000):
        raw = rng.choice(np.array([0x0F, 0xB9, 0x00, 0x48], np.uint8), (n, 16))
        if n > 1:
            raw[0, 15], raw[1, 0] = 0x0F, 0xB9        # across rows: not a match
            raw[0, :15] = 0
        want = np.nonzero(((raw[:, :-1] == 0x0F) & (raw[:, 1:] == 0xB9)).any(axis=1))[0]
        assert _rows_with_0f_b9(raw).tolist() == want.tolist()
        if n > 1:
            assert 0 not in _rows_with_0f_b9(raw).tolist()


def test_no_undecodable_bytes_left_from_the_short_ud1(tmp_path):
    """7.3's __WARN_trap: Capstone reads UD1 without its ModRM byte, so what follows
    misdecodes and may stop on a byte it rejects (here the jmp's displacement, 06).
    The second decode of that function has no such byte: none is reported (verify
    named `__WARN_trap+0x9` of the stock 7.3 kernel as undecodable)."""
    (tmp_path / "f.s").write_text("""
    .section .note.GNU-stack,"",@progbits
    .text
    .globl f
    .type f, @function
f:  .byte 0x67, 0x48, 0x0f, 0xb9, 0x3a      # ud1 (%edx), %rdi
    .byte 0xe9, 0x06, 0x00, 0x00, 0x00      # jmp over the six nops
    .fill 6, 1, 0x90
    ret
    .size f, .-f
""")
    (tmp_path / "m.c").write_text("void f(void); int main(void) { return 0; }\n")
    exe = tmp_path / "prog"
    subprocess.run(["gcc", "-no-pie", "-o", str(exe), str(tmp_path / "m.c"), str(tmp_path / "f.s")],
                   check=True)
    im = ElfImage(str(exe))
    fn = FunctionTable(im)
    d = disassemble(im, fn)
    f, i = im.symbol_address("f"), fn.index_of("f")
    got = [(int(a) - f, int(s)) for a, s, k in zip(d.addr, d.size, d.func) if k == i]
    assert got == [(0, 5), (5, 5)] + [(10 + k, 1) for k in range(6)] + [(16, 1)]
    assert d.undecodable == []
