"""IRELATIVE relocations of an ET_EXEC and ld's `addr32 call` (found on bzip2 linked -static).

tests/fixtures/c/ifunc_exec.c (an ifunc of its own, called in the hot loop) with
ifunc_scale.c, built at test time with -O2 -fno-plt -Wl,--emit-relocs, three ways:

- ``exec``: -no-pie, dynamically linked: the ifunc's R_X86_64_IRELATIVE sits in
  the ET_EXEC's .rela.plt; ld.so calls the resolver its addend names. Before the
  fix only a PIE's dynamic relocations followed the layout: relayout exited 0,
  verify said OK, and the outputs called the resolver's old place (SIGTRAP on the
  int3 fill, SIGSEGV);
- ``static``: -static, libc's own ifuncs (25 IRELATIVE), its TLS, and _start's
  `addr32 call __libc_start_main` (ld's relaxed `call *...@GOTPCREL(%rip)`,
  which verify took for an unexplained changed immediate);
- ``static-pie``: -static-pie, the same as a PIE; its ``.rela.eh_frame`` holds
  R_X86_64_NONE rows ld left of dropped FDEs, inside other records, which the
  rebuilt ``.eh_frame`` refused (``a relocation ... is outside every record
  header``, exit 2) for ``blocks``.

Each is profiled under qemu-x86_64 and relaid out with ``pack`` and ``blocks``;
the outputs print what the original prints and pass verify --against. A stale
IRELATIVE addend in an ET_EXEC output (what relayout wrote before) is an
``equiv.dynamic-reloc`` finding.
"""

import os
import shutil
import subprocess

import numpy as np
import pytest

from linepack.image.elf import RELA, ElfImage
from linepack.relayout.user.pie import R_X86_64_IRELATIVE, dynamic_rela_sections

import helpers
from helpers import relayout_program, run_program, verify_against

_requirements = helpers.requirements("gcc", "qemu-x86_64")

FIX = os.path.join(helpers.FIXTURES, "c")
BUILDS = {"exec": ["-no-pie"], "static": ["-static"], "static-pie": ["-static-pie"]}
ARGS = ["20000"]


def _build(d, name):
    exe = os.path.join(d, name)
    p = subprocess.run(["gcc", "-O2", "-fno-plt", *BUILDS[name], "-Wl,--emit-relocs", "-o", exe,
                        os.path.join(FIX, "ifunc_exec.c"), os.path.join(FIX, "ifunc_scale.c")],
                       capture_output=True, text=True)
    if p.returncode and name != "exec":
        pytest.skip(f"no static libc here: {p.stderr.strip()[-200:]}")
    assert p.returncode == 0, p.stderr
    return exe


@pytest.fixture(scope="module", params=list(BUILDS))
def built(request, tmp_path_factory):
    from linepack.profile.user import record_user
    name = request.param
    d = str(tmp_path_factory.mktemp("ifunc-" + name))
    exe = _build(d, name)
    prof = exe + ".lpprof"
    record_user(exe, ARGS, output=prof)
    return name, exe, prof


def _irelative(exe):
    im = ElfImage(exe)
    out = []
    for sec in dynamic_rela_sections(im):
        rows = np.array(im.section_bytes(sec)).view(RELA)
        typ = (rows["info"] & 0xFFFFFFFF).astype(np.int64)
        out += [(sec, int(i)) for i in np.nonzero(typ == R_X86_64_IRELATIVE)[0]]
    return im, out


@pytest.mark.parametrize("strategy", ("pack", "blocks"))
def test_output_runs_as_the_original_and_verifies(built, strategy):
    name, exe, prof = built
    im, irel = _irelative(exe)
    assert irel and im.type == (2 if name != "static-pie" else 3)
    dis = subprocess.run(["objdump", "-d", exe], capture_output=True, text=True).stdout
    assert "addr32 call" in dis
    out = exe + "." + strategy
    p = relayout_program(exe, prof, strategy, out)
    assert p.returncode == 0, p.stderr
    for args in (ARGS, ARGS + ["tail"]):
        assert run_program(out, *args) == run_program(exe, *args), (name, strategy, args)
    rc, text = verify_against(out, exe)
    assert rc == 0, text


def test_a_stale_irelative_addend_is_a_verify_finding(built, tmp_path):
    """The output with one IRELATIVE addend set back to the resolver's old address,
    what relayout wrote for an ET_EXEC before."""
    name, exe, prof = built
    out = str(tmp_path / "out")
    assert relayout_program(exe, prof, "pack", out).returncode == 0
    im_old, irel = _irelative(exe)
    im_new = ElfImage(out)
    for sec, i in irel:
        old_add = int(np.array(im_old.section_bytes(sec)).view(RELA)["addend"][i])
        nsec = im_new.section(sec.name)
        new_add = int(np.array(im_new.section_bytes(nsec)).view(RELA)["addend"][i])
        if new_add != old_add:
            break
    else:
        raise AssertionError("no IRELATIVE addend followed the layout")
    bad = str(tmp_path / "bad")
    shutil.copy(out, bad)
    with open(bad, "r+b") as f:
        f.seek(nsec.offset + i * RELA.itemsize + 16)
        f.write(old_add.to_bytes(8, "little", signed=True))
    rc, text = verify_against(bad, exe)
    assert rc == 1 and "equiv.dynamic-reloc" in text and f"{old_add:#x}" in text, text
