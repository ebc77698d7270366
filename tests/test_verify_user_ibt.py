"""IBT in executables built with -fcf-protection (found while trying GNU sed and
grep built with Debian's hardening flags): ``verify --against`` checks, for
userspace as for IBT kernels, that every function that began with ENDBR64 still
does, and that every ENDBR64 gcc put right after a call to a function that
returns twice (``setjmp``: ``longjmp`` comes back by an indirect jump to the
return address) is still right after that call.

tests/fixtures/c/setjmp_cet.c (setjmp in a hot loop and in a function whose
longjmp runs only with an argument) built at test time with -O2
-fcf-protection, marked IBT and SHSTK (``-z ibt -z shstk``: Debian 12's own crt
files carry no marking), -no-pie and -pie: profiled under qemu-x86_64, relaid
out with ``pack`` and ``blocks``; the outputs keep the marking, run as the
original with and without the longjmp paths, and verify with every entry and
landing counted. An output with ENDBR64 taken off a function entry or off a
setjmp landing is named (``equiv.ibt-entry``, ``equiv.ibt-landing``).
"""

import json
import os
import re
import shutil
import subprocess

import pytest

import helpers

_requirements = helpers.requirements("gcc", "qemu-x86_64", "objdump", "readelf")

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "c")
BUILDS = {"exec": "-no-pie", "pie": "-pie"}
ENDBR64 = bytes.fromhex("f30f1efa")
NOP4 = bytes.fromhex("0f1f4000")


def _run(path, *args):
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def _verify(out, exe, tmp):
    js = os.path.join(tmp, os.path.basename(out) + ".verify.json")
    p = subprocess.run(["linepack", "verify", out, "--against", exe, "--json", js],
                       capture_output=True, text=True, timeout=300)
    with open(js) as f:
        return p.returncode, json.load(f)


def _setjmp_landings(path):
    """Addresses of the ENDBR64s right after a call to setjmp (objdump)."""
    lines = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    found = []
    for prev, cur in zip(lines, lines[1:]):
        if re.search(r"\bcall\b.*setjmp", prev) and "endbr64" in cur:
            found.append(int(cur.split(":")[0], 16))
    return found


def _file_offset(path, addr):
    from elftools.elf.elffile import ELFFile
    with open(path, "rb") as f:
        for seg in ELFFile(f).iter_segments():
            if seg["p_type"] == "PT_LOAD" and \
                    seg["p_vaddr"] <= addr < seg["p_vaddr"] + seg["p_filesz"]:
                return addr - seg["p_vaddr"] + seg["p_offset"]
    raise AssertionError(f"{addr:#x} not in a loaded segment of {path}")


def _symbol(path, name):
    from elftools.elf.elffile import ELFFile
    with open(path, "rb") as f:
        syms = ELFFile(f).get_section_by_name(".symtab")
        return next(s["st_value"] for s in syms.iter_symbols() if s.name == name)


def _patch(src, dst, addr, old, new):
    shutil.copy(src, dst)
    off = _file_offset(dst, addr)
    with open(dst, "r+b") as f:
        f.seek(off)
        assert f.read(len(old)) == old
        f.seek(off)
        f.write(new)


@pytest.fixture(scope="module", params=list(BUILDS))
def built(request, tmp_path_factory):
    from linepack.profile.user import record_user
    d = str(tmp_path_factory.mktemp("ibt"))
    exe = os.path.join(d, "setjmp_cet")
    subprocess.run(["gcc", "-O2", "-fcf-protection", BUILDS[request.param],
                    "-Wl,--emit-relocs", "-Wl,-z,ibt", "-Wl,-z,shstk", "-o", exe,
                    os.path.join(FIX, "setjmp_cet.c")], check=True)
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    return d, exe, prof


@pytest.mark.parametrize("strategy", ("blocks", "pack"))
def test_ibt_entries_and_setjmp_landings_kept_and_checked(built, strategy):
    d, exe, prof = built
    landings = _setjmp_landings(exe)
    assert len(landings) == 2
    out = exe + "." + strategy
    p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", strategy,
                        "-o", out], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert _run(out) == _run(exe) and _run(out, "x") == _run(exe, "x")
    note = subprocess.run(["readelf", "-n", out], capture_output=True, text=True).stdout
    assert "x86 feature: IBT, SHSTK" in note
    # the layout moved them, each still right after its call
    assert len(_setjmp_landings(out)) == 2 and set(_setjmp_landings(out)).isdisjoint(landings)
    rc, rep = _verify(out, exe, d)
    assert rc == 0 and rep["ok"], rep.get("findings")
    assert rep["ibt_entries_checked"] >= 1          # main, at least (static ones have none)
    assert rep["ibt_landings_checked"] == 2


def test_lost_endbr_named(built):
    d, exe, prof = built
    out = exe + ".blocks-m"
    subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", "blocks",
                    "-o", out], check=True, capture_output=True, timeout=300)
    main = _symbol(out, "main")
    land = _setjmp_landings(out)[0]
    for addr, kind in ((main, "equiv.ibt-entry"), (land, "equiv.ibt-landing")):
        bad = out + "." + kind
        _patch(out, bad, addr, ENDBR64, NOP4)
        rc, rep = _verify(bad, exe, d)
        assert rc != 0 and not rep["ok"]
        assert rep["equivalence_counts"][kind] == 1
        assert any(f["check"] == kind and int(f["address"], 16) == addr for f in rep["findings"]), \
            rep["findings"]
