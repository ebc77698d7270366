"""Thread-local storage in rewritten userspace code.

tests/fixtures/c/tls_main.c (hot code reading and writing __thread variables from
two threads) with tls_lib.c, built at test time with -O2 -Wl,--emit-relocs:

- ``pie-le`` / ``exec-le``: -fPIE code, tls_lib linked in, -pie / -no-pie: the
  accesses are local-exec (R_X86_64_TPOFF32) and relaxed initial-exec
  (R_X86_64_GOTTPOFF on a `mov $off,%reg`): constants;
- ``pie-ie``: -fPIE code against tls_lib as a shared library: R_X86_64_GOTTPOFF on
  `mov x@gottpoff(%rip),%reg`, a RIP-relative reach of a GOT slot;
- ``exec-gd`` / ``pie-gd``: -fPIC code (general/local-dynamic), tls_lib linked in
  or shared: ld rewrites the `lea x@tlsgd(%rip); call __tls_get_addr` sequences to
  local- or initial-exec but keeps their relocations, the call's R_X86_64_PLT32
  included, at the old offsets (its field is now a thread-pointer offset, a
  `%fs:0` or a GOT slot's displacement).

Before the fix relayout refused them all (`relocation types ['22', '23'] in moved
code`); taking the stale call relocations as calls writes outputs that crash
(which verify names). Each output runs with the original's output and
passes verify --against; a thread-pointer offset or GOT reach written wrong in an
output is a verify finding.
"""

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from linepack.image.elf import ElfImage
from linepack.image.relocs import (R_X86_64_GOTPCREL, R_X86_64_GOTTPOFF, R_X86_64_NONE,
                                   R_X86_64_PLT32, R_X86_64_TLSGD, R_X86_64_TPOFF32,
                                   tls_effective_types)

import helpers
from helpers import relayout_program, run_program, verify_against

_requirements = helpers.requirements("gcc", "qemu-x86_64")

FIX = os.path.join(helpers.FIXTURES, "c")
# name: (code model, link mode, tls_lib shared)
BUILDS = {"exec-le": ("-fPIE", "-no-pie", False), "pie-le": ("-fPIE", "-pie", False),
          "pie-ie": ("-fPIE", "-pie", True), "exec-gd": ("-fPIC", "-no-pie", False),
          "pie-gd": ("-fPIC", "-pie", True)}
STRATEGIES = ("pack", "blocks")
ARGS = ["30000"]


def _build(d, name):
    code, link, shared = BUILDS[name]
    exe = os.path.join(d, name)
    main_o, lib_o = exe + ".main.o", exe + ".lib.o"
    subprocess.run(["gcc", "-O2", code, "-c", os.path.join(FIX, "tls_main.c"), "-o", main_o],
                   check=True)
    subprocess.run(["gcc", "-O2", "-fPIC", "-c", os.path.join(FIX, "tls_lib.c"), "-o", lib_o],
                   check=True)
    if shared:
        lib = os.path.join(d, "lib" + name + ".so")
        subprocess.run(["gcc", "-shared", "-o", lib, lib_o], check=True)
        libs = [lib, "-Wl,-rpath," + d]
    else:
        libs = [lib_o]
    subprocess.run(["gcc", "-O2", link, "-Wl,--emit-relocs", "-o", exe, main_o, *libs,
                    "-pthread"], check=True)
    return exe


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from linepack.profile.user import record_user
    d = str(tmp_path_factory.mktemp("tls"))
    out = {}
    for name in BUILDS:
        exe = _build(d, name)
        prof = exe + ".lpprof"
        record_user(exe, ARGS, output=prof)
        out[name] = (exe, {s: (exe + "." + s, relayout_program(exe, prof, s, exe + "." + s))
                           for s in STRATEGIES})
    return out


def _text_types(exe):
    im = ElfImage(exe)
    rel = im.relocations[".text"]
    sec = rel.target
    eff, unrelaxed = tls_effective_types(rel.type, rel.offset, im.section_bytes(sec), sec.addr)
    return rel.type.astype(np.int64), eff, unrelaxed


def test_builds_have_the_tls_forms_they_claim(built):
    typ, eff, unrelaxed = _text_types(built["exec-le"][0])
    assert (typ == R_X86_64_TPOFF32).sum() >= 4 and (typ == R_X86_64_GOTTPOFF).any()
    assert not np.isin(eff, (R_X86_64_TPOFF32, R_X86_64_GOTTPOFF)).any() and not len(unrelaxed)
    # a GOT slot's reach: GOTTPOFF left initial-exec
    typ, eff, _ = _text_types(built["pie-ie"][0])
    assert (eff[typ == R_X86_64_GOTTPOFF] == R_X86_64_GOTPCREL).all()
    # relaxed __tls_get_addr sequences: the stale call relocations are not calls any more
    for name, want in (("exec-gd", R_X86_64_NONE), ("pie-gd", R_X86_64_GOTPCREL)):
        exe = built[name][0]
        typ, eff, unrelaxed = _text_types(exe)
        assert (typ == R_X86_64_TLSGD).any() and not len(unrelaxed), name
        im = ElfImage(exe)
        rel = im.relocations[".text"]
        all_names = im.symbol_names()
        tls_get_addr = np.array([all_names[int(s)].split("@")[0] == "__tls_get_addr"
                                 for s in rel.sym])
        call = (typ == R_X86_64_PLT32) & tls_get_addr
        assert call.any() and (eff[call] != R_X86_64_PLT32).all(), name
        # pie-gd: tls_other's sequence became initial-exec (a GOT reach)
        assert (want in eff[call]), name


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(BUILDS))
def test_output_runs_as_the_original_and_verifies(built, name, strategy):
    exe, outs = built[name]
    out, p = outs[strategy]
    assert p.returncode == 0, p.stderr
    for args in (ARGS, ARGS + ["rare"]):
        assert run_program(out, *args) == run_program(exe, *args), (name, strategy, args)
    rc, text = verify_against(out, exe)
    assert rc == 0, text


def _tamper(path, dst, want):
    """Copy ``path`` to ``dst`` with the 4-byte field ending the first instruction
    whose objdump text matches ``want`` increased by 8; returns that text."""
    dis = subprocess.run(["objdump", "-d", "-w", path], capture_output=True, text=True).stdout
    for line in dis.splitlines():
        m = re.match(r"\s*([0-9a-f]+):\s+((?:[0-9a-f]{2} )+)\s*(.*)", line)
        if m and re.search(want, m.group(3)):
            break
    else:
        raise AssertionError(f"no {want!r} in {path}")
    addr, length = int(m.group(1), 16), len(m.group(2).split())
    im = ElfImage(path)
    seg = next(h for h in im.phdrs if h["type"] == 1 and
               h["vaddr"] <= addr < h["vaddr"] + h["filesz"])
    pos = int(seg["offset"]) + addr - int(seg["vaddr"]) + length - 4
    shutil.copy(path, dst)
    with open(dst, "r+b") as f:
        f.seek(pos)
        v = int.from_bytes(f.read(4), "little", signed=True) + 8
        f.seek(pos)
        f.write(v.to_bytes(4, "little", signed=True))
    return m.group(3)


@pytest.mark.parametrize("name,want", [("exec-le", r"mov +\$0xf+[0-9a-f]+,%r"),
                                       ("pie-ie", r"<tls_other"),
                                       ("exec-gd", r"lea +-0x[0-9a-f]+\(%rax\),%rax")])
def test_a_wrong_tls_field_is_a_verify_finding(built, name, want, tmp_path):
    exe, outs = built[name]
    bad = str(tmp_path / "bad")
    _tamper(outs["blocks"][0], bad, want)
    rc, text = verify_against(bad, exe)
    # named as a changed instruction (of a moved function, or of a split one's block)
    assert rc == 1 and re.search(r"equiv\.(instruction-bytes|block-instruction) 1\b", text), text
