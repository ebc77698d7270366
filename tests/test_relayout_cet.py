"""Code built with -fcf-protection (CET: endbr64, `notrack jmp *%reg` through
switch tables), found on bzip2 built -O3 -fcf-protection -pie.

tests/fixtures/c/switch_tables.c (dense switches in a hot loop) built at test time
with -O2 -fcf-protection -Wl,--emit-relocs, -pie and -no-pie; profiled under
qemu-x86_64, relaid out with ``blocks`` (every hot function's blocks ordered, so
the blocks after a `notrack jmp` move away from it) and ``pack``: the outputs
run as the original and verify --against passes. Before the fix verify named
every such jump as a broken fall-through (``equiv.edge``: Capstone spells it
`notrack jmp`, which the no-fall-through set did not hold) on outputs that ran
correctly.
"""

import os
import subprocess

import pytest

import helpers

_requirements = helpers.requirements("gcc", "qemu-x86_64")

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "c")
BUILDS = {"pie": "-pie", "exec": "-no-pie"}


def _run(path, *args):
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module", params=list(BUILDS))
def built(request, tmp_path_factory):
    from linepack.profile.user import record_user
    d = str(tmp_path_factory.mktemp("cet"))
    exe = os.path.join(d, "switch_cet")
    subprocess.run(["gcc", "-O2", "-fcf-protection", BUILDS[request.param],
                    "-Wl,--emit-relocs", "-o", exe, os.path.join(FIX, "switch_tables.c")],
                   check=True)
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    return exe, prof


@pytest.mark.parametrize("strategy", ("blocks", "pack"))
def test_notrack_jumps_relaid_out_and_verified(built, strategy):
    exe, prof = built
    dis = subprocess.run(["objdump", "-d", exe], capture_output=True, text=True).stdout
    assert "notrack jmp" in dis and "endbr64" in dis
    out = exe + "." + strategy
    p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", strategy,
                        "-o", out], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert _run(out) == _run(exe) and _run(out, "x") == _run(exe, "x")
    v = subprocess.run(["linepack", "verify", out, "--against", exe], capture_output=True,
                       text=True, timeout=300)
    assert v.returncode == 0, v.stdout + v.stderr
