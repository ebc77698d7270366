"""A tiny program for block-level tests: ``g(x)`` jumps over a cold block (taken
for x < 0, which the driver never passes after its first calls) to a hot one.
With ``prefix=True`` g has a kernel-style ``__pfx_g`` (16 NOP bytes, an ENDBR
at the entry). Built with gcc at test time: -no-pie, --emit-relocs."""

import subprocess

import numpy as np

from linepack.image.functions import FunctionTable

_PREFIX = r"""
    .type __pfx_g, @function
__pfx_g:
    .fill 16, 1, 0x90
    .size __pfx_g, 16
"""

_G = r"""
    .section .text.hot,"ax",@progbits
    .fill 4096, 1, 0xcc
    .p2align 4
{prefix}    .globl g
    .type g, @function
g:
{endbr}    mov %edi, %eax
    test %edi, %edi
    jns .Lg_hot
.Lg_cold:
    neg %eax
    .rept 20
    add $3, %eax
    .endr
    ret
.Lg_hot:
    add $7, %eax
    ret
    .size g, .-g
    .globl g_cold, g_hot
    .set g_cold, .Lg_cold
    .set g_hot, .Lg_hot
    .section .note.GNU-stack,"",@progbits
"""

MAIN = r"""
#include <stdio.h>
int g(int);
int main(void) {
    long s = 0;
    for (int i = -5; i < 2000; i += 7) s += g(i);
    printf("s=%ld\n", s);
    return 0;
}
"""


def g_asm(prefix=False, extra=""):
    """g's assembly; ``extra``: more assembly in the same file."""
    s = _G.format(prefix=_PREFIX if prefix else "", endbr="    endbr64\n" if prefix else "")
    return s.replace("    .section .note.GNU-stack", extra + "    .section .note.GNU-stack")


def build(d, prefix=False, extra=""):
    """(executable, its output) of the program built in folder ``d``."""
    (d / "g.s").write_text(g_asm(prefix, extra))
    (d / "main.c").write_text(MAIN)
    exe = d / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(d / "main.c"), str(d / "g.s")], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return exe, out


def hot_ranges(im):
    """Executed ranges: g's entry block and its hot block (100 times each)."""
    g, cold, hot = (im.symbol_address(n) for n in ("g", "g_cold", "g_hot"))
    fn = FunctionTable(im)
    end = int(fn.end[fn.index_of("g")])
    return (np.array([g, hot], np.uint64), np.array([cold - g, end - hot], np.uint64),
            np.array([100.0, 100.0]))
