"""Code outside functions longer than 64 KiB (Debian 7.3's .text has such a
stretch): the coverage sweep decodes it instead of failing on its memo key."""

import shutil
import subprocess

import pytest

from linepack.image.elf import ElfImage
from linepack.kernel.base import ImageContext

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

ASM = """
    .section .note.GNU-stack,"",@progbits
    .text
    .globl f
    .type f, @function
f:  ret
    .size f, .-f
    .rept 14000
    mov $1, %eax
    .endr
    ret
"""


def test_long_code_outside_functions(tmp_path):
    (tmp_path / "big.s").write_text(ASM)
    (tmp_path / "m.c").write_text("int f(void); int main(void) { return f(); }\n")
    exe = tmp_path / "big"
    subprocess.run(["gcc", "-O2", "-no-pie", "-o", str(exe), str(tmp_path / "m.c"),
                    str(tmp_path / "big.s")], check=True)
    ctx = ImageContext(ElfImage(str(exe)))
    text = [r for r in ctx.coverage.table() if r["section"] == ".text"][0]
    assert text["unexplained"] == 0 and text["decoded"] >= 14000 * 5
    d = ctx.disasm
    f = ctx.image.symbol_address("f")
    # every one of the 14,000 movs after f is an instruction start
    starts = set(d.addr.tolist())
    assert all(f + 1 + 5 * k in starts for k in range(0, 14000, 997))
