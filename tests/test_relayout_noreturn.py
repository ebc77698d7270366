"""blocks splits a program's function whose last instruction is a call that never
returns through a GOT slot (``call *abort@GOTPCREL(%rip)``: gcc -fno-plt, and
how rustc calls its panics), not only through a direct call.

Fixture tests/fixtures/c/noreturn_tail.c, built at test time -O2 -fno-plt
--emit-relocs, -no-pie and -pie: five functions with a hot loop, each ending in
its failing path (abort, exit, errx, __assert_fail through GOT slots; a noreturn
function of the program by a direct call). Profiled with no argument (no failing
path runs), split, then each failing path run on the original and the output.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import helpers

from linepack.image.elf import ElfImage
from linepack.relayout.driver import load_profile_full, relayout

_requirements = helpers.requirements("gcc", "qemu-x86_64")

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "fixtures", "c", "noreturn_tail.c")
GOT_ENDED = ("w_abort", "w_exit", "w_errx", "w_assert")
MODES = {"": 0, "1": -6, "2": 3, "3": 4, "4": 7, "5": -6}   # argument -> exit status


@pytest.fixture(scope="module", params=["no-pie", "pie"])
def case(request, tmp_path_factory):
    from linepack.profile.user import record_user
    d = str(tmp_path_factory.mktemp("noret"))
    exe = os.path.join(d, "noreturn_tail")
    pic = ["-fno-pie", "-no-pie"] if request.param == "no-pie" else ["-fpie", "-pie"]
    subprocess.run(["gcc", "-O2", "-fno-plt", *pic, "-fno-reorder-blocks-and-partition",
                    "-Wl,--emit-relocs", "-o", exe, SRC], check=True)
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    out = exe + ".blocks"
    lp = load_profile_full(prof, exe)
    relayout(exe, out, "blocks", hotness=lp.hotness, calls=lp.calls, blocks=lp.blocks,
             profile_build_id=lp.build_id)
    return exe, out


def _last_is_got_call(image, name):
    import capstone
    a = image.symbol_address(name)
    names, syms = image.symbol_table()
    size = int(syms["size"][names.index(name)])
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    last = list(cs.disasm_lite(bytes(image.read(a, size)), a))[-1]
    return last[2] == "call" and "rip" in last[3]


def test_functions_ending_in_a_got_call_to_a_noreturn_function_split(case):
    exe, out = case
    old, new = ElfImage(exe), ElfImage(out)
    for f in GOT_ENDED:
        # the premise: the function's last instruction is the call through its GOT slot
        assert _last_is_got_call(old, f), f
        assert new.symbol_address(f + ".cold") is not None, f"{f} was not split"
    assert new.symbol_address("w_die.cold") is not None       # a direct call, as before


@pytest.mark.parametrize("arg", sorted(MODES))
def test_output_runs_as_the_original_on_every_path(case, arg):
    exe, out = case
    runs = [subprocess.run([p] + ([arg] if arg else []), capture_output=True, text=True,
                           timeout=60) for p in (exe, out)]
    assert runs[0].returncode == MODES[arg]
    assert runs[1].returncode == runs[0].returncode
    assert runs[1].stdout == runs[0].stdout
    # errx and assert name the program: the output's file name
    assert runs[1].stderr.replace(os.path.basename(out), os.path.basename(exe)) == \
        runs[0].stderr


def _verify(exe, out, reject=None):
    code = ("import sys\n"
            "import linepack.image.noreturn as N\n"
            f"reject = {reject!r}\n"
            "if reject:\n"
            "    keep = N.is_program_noreturn\n"
            "    N.is_program_noreturn = lambda n: n.split('@')[0] != reject and keep(n)\n"
            "    import linepack.verify.split as S\n"
            "    S.NORETURN = tuple(x for x in S.NORETURN if x != reject)\n"
            "from linepack.cli import main\n"
            f"sys.exit(main(['verify', {out!r}, '--against', {exe!r}]))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)


def test_verify_against_is_clean(case):
    exe, out = case
    p = _verify(exe, out)
    assert p.returncode == 0, p.stdout + p.stderr


def test_verify_names_a_split_after_a_call_that_may_return(case):
    """The claim without its evidence: verify taking abort() as a function that
    returns sees w_abort's fall-through (the next function) moved away."""
    exe, out = case
    p = _verify(exe, out, reject="abort")
    text = p.stdout + p.stderr
    assert p.returncode == 1, text
    lines = [ln for ln in text.splitlines() if "[equiv.fall-off]" in ln]
    assert len(lines) == 1 and "w_abort:" in lines[0] and "abort" in lines[0], text


@pytest.mark.parametrize("name,noreturn", [
    ("abort@GLIBC_2.2.5", True), ("__assert_fail", True), ("_Unwind_Resume", True),
    ("_RNvNtCsgEmfK2I1SDS_4core9panicking18panic_bounds_check", True),
    ("_RNvNtCsgEmfK2I1SDS_4core9panicking16panic_in_cleanup", True),
    ("_RINvNtCsgEmfK2I1SDS_4core9panicking13assert_failedjjEB4_", True),
    ("_RNvNtCslNYArtu3iFV_5alloc7raw_vec12handle_error", True),
    ("_RNvNtNtCsgEmfK2I1SDS_4core5slice5index16slice_index_fail", True),
    ("_RNvNtCsgEmfK2I1SDS_4core6option13unwrap_failed", True),
    ("_ZN4core6result13unwrap_failed17h0123456789abcdefE", True),
    ("_RNvCsfLfy6EI15iL_7___rustc14___rust_dealloc", False),
    ("_RNvNtCsgEmfK2I1SDS_4core3fmt5write", False),
    ("_RNvXs_NtCsgEmfK2I1SDS_4core9panickingNtB4_10AssertKindNtNtB6_3fmt5Debug3fmt", False),
    ("memcpy", False), ("", False)])
def test_noreturn_names(name, noreturn):
    from linepack.image.noreturn import is_program_noreturn
    assert is_program_noreturn(name) is noreturn


def test_glue_stops_at_an_indirect_call_that_never_returns():
    """Two adjacent units, the first ending in ``call *slot(%rip)``: glued (it may
    return into the second) unless that call is known not to return."""
    from insn_rows import disassembly
    from linepack.relayout.units import Region, UnitTable, glue
    rows = [(0x1000, b"\x48\x89\xf8"),                      # mov %rdi, %rax
            (0x1003, b"\xff\x15\x00\x10\x00\x00"),          # call *0x1000(%rip)
            (0x1009, b"\xc3")]                              # ret (the second unit)
    dis = disassembly(rows)

    def units():
        return UnitTable([0x1000, 0x1009], [9, 1], [0, 0], [Region("r", 0x1000, 0x100a, 1)])
    assert len(glue(units(), dis)) == 1
    assert len(glue(units(), dis, noreturn_icalls=[1])) == 2
    assert len(glue(units(), dis, noreturn_icalls=[0])) == 1


def test_cfg_ends_a_function_at_a_trailing_noreturn_indirect_call():
    from insn_rows import disassembly
    from linepack.image.cfg import CFG, R_FALLS_OFF, TERM_STOP
    rows = [(0x1000, b"\x85\xff"),                          # test %edi, %edi
            (0x1002, b"\x74\x01"),                          # je 0x1005
            (0x1004, b"\xc3"),                              # ret
            (0x1005, b"\xff\x15\x00\x10\x00\x00")]          # call *0x1000(%rip)
    dis = disassembly(rows)
    f = (np.array([0x1000], np.uint64), np.array([0x100b], np.uint64))
    assert CFG(dis, *f).reason[0] == R_FALLS_OFF
    cfg = CFG(dis, *f, noreturn_icalls=np.array([3]))
    assert cfg.reason[0] != R_FALLS_OFF
    assert cfg.term[-1] == TERM_STOP
