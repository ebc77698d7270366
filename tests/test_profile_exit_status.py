"""profile --program --exit-status: which runs a profile may come from.

A program that exits non-zero is refused by default (one line naming the status and the
option that keeps it), kept with --exit-status N or any, and a program killed by a signal
is refused whatever --exit-status says. A small C program built at test time.
"""

import subprocess

import pytest

import helpers
from helpers import run_linepack
from linepack.errors import EXIT_EXTERNAL, EXIT_USAGE
from linepack.profile.model import Profile

_requirements = helpers.requirements("gcc", "qemu-x86_64")

PROG = r'''
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
static int __attribute__((noinline)) f(int x) { return x * 3 + 1; }
int main(int argc, char **argv) {
    long a = 0;
    for (int i = 0; i < 1000; i++) a += f(i);
    printf("a=%ld\n", a);
    if (argc > 1 && argv[1][0] == 'k') raise(SIGABRT);
    return argc > 1 ? atoi(argv[1]) : 0;
}
'''


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("exitst")
    (d / "p.c").write_text(PROG)
    subprocess.run(["gcc", "-O2", "-no-pie", "-Wl,--emit-relocs", "-o", str(d / "p"),
                    str(d / "p.c")], check=True)
    return d, d / "p"


def _profile(prog, arg, *opts):
    d, exe = prog
    out = d / f"p-{arg}.lpprof"
    if out.exists():
        out.unlink()
    return run_linepack("profile", "--program", exe, "-o", out, *opts, "--", arg), out


def test_zero_exit_is_kept(prog):
    p, out = _profile(prog, "0")
    assert p.returncode == 0, p.stderr
    assert Profile.load(str(out)).meta["exit_status"] == 0


def test_non_zero_exit_refused_by_default(prog):
    p, out = _profile(prog, "1")
    assert p.returncode == EXIT_EXTERNAL
    assert p.stderr.strip().splitlines()[-1] == (
        "linepack: error: p exited with status 1 (to keep such a run: --exit-status 1) under "
        "qemu-x86_64: no message")
    assert "Traceback" not in p.stderr
    assert not out.exists()


@pytest.mark.parametrize("arg,opt", [("1", "1"), ("3", "1,3"), ("7", "any"), ("7", "ANY")])
def test_exit_status_keeps_the_run(prog, arg, opt):
    p, out = _profile(prog, arg, "--exit-status", opt)
    assert p.returncode == 0, p.stderr
    assert f"exit status {arg}" in p.stdout
    prof = Profile.load(str(out))
    assert prof.meta["exit_status"] == int(arg)
    assert "f" in {h[0] for h in prof.hot_functions(1)}


def test_status_not_listed_is_refused(prog):
    p, out = _profile(prog, "3", "--exit-status", "1,2")
    assert p.returncode == EXIT_EXTERNAL
    assert "exited with status 3" in p.stderr and not out.exists()


def test_signal_is_never_kept(prog):
    p, out = _profile(prog, "k", "--exit-status", "any")
    assert p.returncode == EXIT_EXTERNAL
    assert "was killed by signal 6" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


@pytest.mark.parametrize("opt", ["x", "256", "-1", "", "1,,2"])
def test_bad_exit_status(prog, opt):
    p, out = _profile(prog, "0", "--exit-status", opt)
    assert p.returncode == EXIT_USAGE
    assert p.stderr.strip().splitlines() == [
        f"linepack: error: --exit-status {opt!r}: exit statuses 0-255, comma-separated, or 'any'"]


def test_exit_status_needs_program(prog, tmp_path):
    p = run_linepack("profile", "--show", tmp_path / "none.lpprof", "--exit-status", "1")
    assert p.returncode == EXIT_USAGE
    assert p.stderr.strip() == "linepack: error: --exit-status applies to --program"
