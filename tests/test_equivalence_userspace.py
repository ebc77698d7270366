"""verify NEW --against OLD on a userspace program (C, --emit-relocs), including
its unwind tables."""

import json
import subprocess

import pytest

from helpers import run_linepack
import helpers

_requirements = helpers.requirements("gcc")

PROG = r'''
#include <stdio.h>
static int __attribute__((noinline)) f(int x) { return x * 3 + 1; }
static int __attribute__((noinline)) g(int x) { return x ^ 0x55; }
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
