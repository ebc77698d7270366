"""C++ member functions stay 2-aligned under ``blocks`` (yaml-cpp's tests crashed).

A pointer to member function marks a virtual one by its low bit (Itanium C++
ABI), so gcc aligns every member function to 2 bytes. ``blocks`` lays hot parts
and hot functions moved whole out at any byte (``split_hot_align`` and
``whole_hot_align`` are 1): a method that landed at an odd address was called
as a virtual one, through a vtable slot read from a wrong address (yaml-cpp
0.7's gtest suite: SIGSEGV in gtest's ``HandleExceptionsInMethodIfSupported``
calling ``&Test::DeleteSelf_``, while ``verify --against`` said OK).

``member_pointers.cc`` built with g++'s defaults (``-O2``, ``-fPIE`` code) and
``-Wl,--emit-relocs``, linked ``-no-pie`` and ``-pie``, profiled under
qemu-x86_64, relaid out with ``blocks``: every mangled function that was at an
even address still is (while other hot code does land at odd ones), the output
prints what the original prints, ``verify --against`` passes, and an output
whose method symbol is moved to an odd address is named
(``equiv.member-function-parity``).
"""

import struct
import subprocess

import pytest
import helpers

from linepack.image.elf import ElfImage

_requirements = helpers.requirements("g++", "qemu-x86_64")

METHODS = ["_ZN3Acc3addEl", "_ZN3Acc3mulEl", "_ZN3Acc3mixEl", "_ZN3Acc3subEl",
           "_ZN3Acc3rotEl"]


def _run(path, *args):
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr)
    return p.stdout


def _starts(path):
    im = ElfImage(path)
    names, syms = im.symbol_table()
    return {n: int(v) for n, v, i in zip(names, syms["value"], syms["info"])
            if (int(i) & 0xF) == 2}


@pytest.fixture(scope="module", params=["-no-pie", "-pie"])
def case(request, tmp_path_factory):
    exe, prof = helpers.profiled_cxx(tmp_path_factory.mktemp("mp"), "member_pointers.cc",
                                     request.param)
    out = exe + ".blocks"
    p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", "blocks",
                        "-o", out], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return exe, out


def test_methods_stay_even_and_run(case):
    exe, out = case
    old, new = _starts(exe), _starts(out)
    assert all(old[m] % 2 == 0 for m in METHODS)
    moved = [m for m in METHODS if new[m] != old[m]]
    assert moved == METHODS
    assert [m for m in METHODS if new[m] % 2] == []
    # the layout does place hot code at odd addresses: the rule above is no accident
    hot_c = [n for n in ("c_one", "c_two", "c_three") if new[n] != old[n]]
    assert any(new[n] % 2 for n in hot_c) or any(
        v % 2 for n, v in new.items() if n.endswith(".cold") and n not in old)
    for args in ((), ("x",), ("x", "y")):
        assert _run(out, *args) == _run(exe, *args)


def test_verify_names_a_method_at_an_odd_address(case, tmp_path):
    exe, out = case
    p = subprocess.run(["linepack", "verify", out, "--against", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    im = ElfImage(out)
    names, syms = im.symbol_table()
    k = names.index("_ZN3Acc3mulEl")
    sec = im.section(".symtab")
    raw = bytearray(open(out, "rb").read())
    field = sec.offset + k * 24 + 8                       # Elf64_Sym.st_value
    assert struct.unpack_from("<Q", raw, field)[0] == int(syms["value"][k])
    struct.pack_into("<Q", raw, field, int(syms["value"][k]) + 1)
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    p = subprocess.run(["linepack", "verify", str(bad), "--against", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert "equiv.member-function-parity] _ZN3Acc3mulEl" in p.stdout + p.stderr
