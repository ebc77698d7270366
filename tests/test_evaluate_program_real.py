"""evaluate --program for real programs: volatile output masked or not compared, a crashing
program named in its own row (the others kept), a header over every column, and counts that
do not depend on the caller's environment. Small C programs compiled at test time."""

import json
import os
import subprocess
import sys

import pytest

import helpers
from helpers import run_linepack

_requirements = helpers.requirements("gcc", "qemu-x86_64")

PROG = r'''
#include <stdio.h>
#include <string.h>
#include <time.h>
extern char **environ;
static unsigned __attribute__((noinline)) mix(unsigned x) { return x * 2654435761u ^ (x >> 7); }
int main(int argc, char **argv) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    unsigned s = 0;
    for (int i = 0; i < 20000; i++) s += mix(i);
    /* work that grows with the environment: what qemu-x86_64 passes the program */
    unsigned long env = 0;
    for (char **e = environ; *e; e++) env += strlen(*e);
    for (unsigned long i = 0; i < env; i++) s += mix(s);
#ifdef CRASH
    if (argc > 0) *(volatile int *)(long)(argc - 1) = s;     /* NULL store: SIGSEGV */
#endif
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("result %u\nenvironment %lu bytes\n", s, env);
#ifndef STEADY
    printf("took %ld ns\n",
           (long)((t1.tv_sec - t0.tv_sec) * 1000000000L + (t1.tv_nsec - t0.tv_nsec)));
#endif
    return 0;
}
'''


@pytest.fixture(scope="module")
def exes(tmp_path_factory):
    d = tmp_path_factory.mktemp("evreal")
    src = d / "timed.c"
    src.write_text(PROG)
    out = {}
    for name, extra in (("timed", []), ("crashing", ["-DCRASH"]), ("steady", ["-DSTEADY"])):
        out[name] = str(d / name)
        subprocess.run(["gcc", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", *extra,
                        "-o", out[name], str(src)], check=True)
    return out


def _rows(path):
    return json.loads(path.read_text())["results"]


def test_volatile_output_masked_or_not_compared(exes, plugin, tmp_path):
    t = exes["timed"]
    two = ["--program", f"a={t}", "--program", f"b={t}"]
    p = run_linepack("evaluate", *two)
    # the nanoseconds differ from run to run: flagged unless masked
    assert p.returncode == 1 and "DIFF" in p.stdout, p.stdout + p.stderr
    assert "WARNING: b: stdout differs from a's" in p.stdout and "--mask" in p.stdout
    js = tmp_path / "m.json"
    p = run_linepack("evaluate", *two, "--mask", r"took \d+ ns", "--json", js)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "DIFF" not in p.stdout and "WARNING" not in p.stdout
    doc = json.loads(js.read_text())
    assert doc["masks"] == [r"took \d+ ns"] and all(r["same_output"] for r in doc["results"])
    # a whole line masked with ^...$ works as well
    p = run_linepack("evaluate", *two, "--mask", r"^took .*$")
    assert p.returncode == 0 and "DIFF" not in p.stdout, p.stdout + p.stderr
    # or only the exit status is compared
    p = run_linepack("evaluate", *two, "--compare", "exit")
    assert p.returncode == 0 and "DIFF" not in p.stdout, p.stdout + p.stderr
    p = run_linepack("evaluate", *two, "--mask", "took (")
    assert p.returncode == 2 and "--mask 'took (': not a regular expression" in p.stderr


def test_crash_named_in_its_row(exes, plugin, tmp_path):
    js = tmp_path / "c.json"
    p = run_linepack("evaluate", "--program", f"orig={exes['steady']}",
                     "--program", f"broken={exes['crashing']}",
                     "--program", f"again={exes['steady']}",
                     "--cache", "intel-32k-8w", "--cache", "amd-64k-2w", "--json", js)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    lines = p.stdout.splitlines()
    crash = [ln for ln in lines if ln.startswith("CRASH:")]
    assert crash == [next(ln for ln in crash)] and "broken: crashed (SIGSEGV)" in crash[0]
    broken = [ln for ln in lines if ln.startswith("broken ")]
    assert len(broken) == 2 and all("CRASHED (SIGSEGV)" in ln for ln in broken)
    rows = _rows(js)
    assert [(r["program"], r["crashed"]) for r in rows] == [
        ("orig", None), ("broken", "SIGSEGV"), ("again", None)] * 2
    for r in rows:
        if r["program"] == "broken":
            assert r["misses"] is None and r["instructions"] is None
        else:
            assert r["misses"] > 0 and r["same_output"] is True
    # the rows kept are real measurements of the same work
    ok = [r for r in rows if r["program"] != "broken"]
    assert len({r["instructions"] for r in ok}) == 1


def test_every_column_has_a_header(exes, plugin):
    p = run_linepack("evaluate", "--program", f"a={exes['timed']}", "--program",
                     f"b={exes['timed']}", "--mask", r"took \d+ ns", "--repeat", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    hdr = next(ln for ln in lines if ln.startswith("program "))
    for col in ("L1i misses", "vs base", "prog misses", "fetches", "miss rate", "MPKI",
                "instructions", "code bytes", "output", "time s", "misses ±"):
        assert col in hdr
    rows = [ln for ln in lines if ln.startswith(("a ", "b "))]
    assert len(rows) == 2
    for r in rows:
        # every value ends under the end of a header (right-aligned columns), none after the last
        assert len(r.rstrip()) == len(hdr.rstrip())
        ends = {i + 1 for i, ch in enumerate(r) if ch != " " and (i + 1 == len(r) or r[i + 1] == " ")}
        hends = {i + 1 for i, ch in enumerate(hdr) if ch != " " and (i + 1 == len(hdr) or hdr[i + 1] == " ")}
        assert ends - {len(r.split()[0])} <= hends, (hdr, r)
        assert r.split()[-1].endswith("%")          # the spread of 2 runs, under "misses ±"


def test_counts_do_not_depend_on_the_callers_environment(exes, plugin, tmp_path):
    """qemu-x86_64 hands its environment to the program: evaluate runs it with a fixed one,
    so two callers with very different environments (and TMPDIRs) see identical counts
    (the program prints no timing: the digits of one would move printf's count)."""
    results = []
    for k, extra in enumerate(({"PYTHONPATH_PAD": "x" * 10, "OLDPWD": "/"},
                               {"PYTHONPATH_PAD": "y" * 5000, "OLDPWD": "/" + "z" * 300,
                                "TMPDIR": str(tmp_path)})):
        js = tmp_path / f"e{k}.json"
        env = dict(os.environ, **extra)
        p = subprocess.run([sys.executable, "-m", "linepack", "evaluate", "--program",
                            exes["steady"], "--cache", "intel-32k-8w",
                            "--cache", "amd-64k-2w", "--json", str(js)],
                           capture_output=True, text=True, env=env, timeout=900)
        assert p.returncode == 0, p.stdout + p.stderr
        results.append([(r["cache"], r["misses"], r["instructions"], r["program_misses"],
                         r["program_instructions"], r["stdout_bytes"]) for r in _rows(js)])
    assert results[0] == results[1]
    # the program saw the fixed environment, not the caller's
    from linepack.evaluate.user import PROGRAM_ENV, run_program
    from linepack.profile.trace import cache_config
    _, res = run_program(exes["steady"], [], [cache_config("intel-32k-8w")])
    env_bytes = sum(len(f"{k}={v}") for k, v in PROGRAM_ENV.items())
    assert f"environment {env_bytes} bytes".encode() in res["stdout"]


def test_crashed_base_compares_nothing(exes, plugin, tmp_path):
    """The first program crashing: the others are measured, compared with nothing."""
    js = tmp_path / "b.json"
    p = run_linepack("evaluate", "--program", f"broken={exes['crashing']}",
                     "--program", f"fine={exes['steady']}", "--json", js)
    assert p.returncode == 1 and "CRASH: broken: crashed (SIGSEGV)" in p.stdout, p.stderr
    assert "DIFF" not in p.stdout and "Traceback" not in p.stderr
    rows = {r["program"]: r for r in _rows(js)}
    assert rows["broken"]["crashed"] == "SIGSEGV" and rows["fine"]["crashed"] is None
    assert rows["fine"]["misses"] > 0 and rows["fine"]["same_output"] is None
