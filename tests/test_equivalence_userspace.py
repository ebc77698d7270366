"""verify NEW --against OLD on a userspace program (C, --emit-relocs), including
its unwind tables."""

import json
import subprocess

import numpy as np

import pytest

from helpers import run_linepack
import helpers

_requirements = helpers.requirements("gcc")

PROG = r'''
#include <stdio.h>
static volatile int calls;
static int __attribute__((noinline)) g(int x) { return x ^ 0x55; }
/* f calls g in the same section: gas resolves that call, no relocation names it */
static int __attribute__((noinline)) f(int x) { calls++; return g(x) * 3 + 1; }
int main(void) {
    long a = 0;
    for (int i = 0; i < 1000; i++) a += (i % 3) ? f(i) : g(i);
    printf("a=%ld\n", a);
    return 0;
}
'''


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("equs")
    (d / "p.c").write_text(PROG)
    exe = d / "p"
    subprocess.run(["gcc", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(d / "p.c")], check=True)
    new = d / "p.lp"
    r = run_linepack("relayout", exe, "--strategy", "align-all 64", "-q", "-o", new)
    assert r.returncode == 0, r.stderr
    return exe, new


def _against(new, old, tmp_path):
    out = tmp_path / "eq.json"
    p = run_linepack("verify", "-q", new, "--against", old, "--json", out)
    return p, json.loads(out.read_text())


def test_relaid_program_is_equivalent_and_runs(pair, tmp_path):
    exe, new = pair
    want = subprocess.run([str(exe)], stdout=subprocess.PIPE, text=True).stdout
    assert subprocess.run([str(new)], stdout=subprocess.PIPE, text=True).stdout == want
    p, rep = _against(new, exe, tmp_path)
    assert p.returncode == 0, p.stdout
    assert rep["equivalence_moved_functions"] >= 1
    assert rep["tables"][".eh_frame"]["ok"]


def test_untranslated_fde_is_named(pair, tmp_path):
    exe, new = pair
    from linepack.image.elf import ElfImage
    from linepack.relayout.user.eh_frame import parse_eh_frame
    im = ElfImage(str(new))
    sec = im.section(".eh_frame")
    eh = parse_eh_frame(im.section_bytes(sec), sec.addr)
    assert (eh.fde_enc[0] & 0x0F) == 0x0B                    # sdata4 (pc-relative)
    data = bytearray(open(new, "rb").read())
    pos = sec.offset + int(eh.fde_field[0])
    v = int.from_bytes(data[pos:pos + 4], "little", signed=True)
    data[pos:pos + 4] = (v + 1).to_bytes(4, "little", signed=True)
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(data))
    p, rep = _against(bad, exe, tmp_path)
    assert p.returncode == 1
    assert any(f["check"] == "equiv.eh_frame" for f in rep["findings"])


def _kept_bytes_copy(pair, tmp_path, want):
    """NEW with one moved instruction of kind ``want`` ("call" to a static function
    of the same section, whose call gas resolved without a relocation, or "rip" to
    data) given back its OLD bytes: the instruction moved, its field did not."""
    exe, new = pair
    from linepack.image.context import ImageContext
    from linepack.image.elf import ElfImage
    from linepack.image.operands import rip_relative
    o, n = ImageContext(ElfImage(str(exe))), ImageContext(ElfImage(str(new)))
    od, nd = o.disasm, n.disasm
    for name in ("f", "main"):
        i, j = o.functions.index_of(name), n.functions.index_of(name)
        rows = np.nonzero(od.func == i)[0]
        delta = int(n.functions.start[j]) - int(o.functions.start[i])
        assert delta, name
        if want == "call":
            rows = rows[(od.raw[rows, 0] == 0xE8) & (od.size[rows] == 5)]
        else:
            rows = rows[rip_relative(od.raw[rows], od.size[rows].astype(np.int64))[0]]
        for k in rows.tolist():
            a = int(od.addr[k])
            m = int(np.searchsorted(nd.addr, a + delta))
            if bytes(nd.raw[m, :od.size[k]]) != bytes(od.raw[k, :od.size[k]]):
                bad = helpers.patched_copy(new, tmp_path / "bad", {
                    n.image.vaddr_to_offset(a + delta): bytes(od.raw[k, :od.size[k]])})
                return bad, a
    raise AssertionError(f"no moved {want} with new bytes")


@pytest.mark.parametrize("want, check", [("call", "equiv.branch-target"),
                                         ("rip", "equiv.operand-target")])
def test_moved_instruction_with_its_old_bytes_is_named(pair, tmp_path, want, check):
    """The same bytes at a new address are not the same instruction when a field is
    PC-relative: a call or a RIP-relative operand then designates another place."""
    exe, _ = pair
    bad, at = _kept_bytes_copy(pair, tmp_path, want)
    p, rep = _against(bad, exe, tmp_path)
    assert p.returncode == 1, p.stdout
    hits = {f["check"] for f in rep["findings"] if f["check"].startswith("equiv.")}
    # f's call to g has no relocation: this check alone sees it; the operand's field
    # (data in another section) also disagrees with its relocation
    assert hits == ({check} if want == "call" else {check, "equiv.relocation"}), hits
