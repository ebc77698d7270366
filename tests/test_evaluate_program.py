"""evaluate --program: userspace programs under qemu-x86_64 (the original and its relayout).

A small C program compiled at test time (-no-pie, --emit-relocs), relaid out with ``linepack relayout --strategy
align-all 64``, then both measured by ``evaluate --program``. Correctness only: no timings,
no assertions on miss counts beyond being counted.
"""

import csv
import json
import os
import subprocess

import pytest

from helpers import run_linepack
import helpers
from linepack.errors import BadInput

_requirements = helpers.requirements("gcc", "qemu-x86_64")

PROG = r'''
#include <stdio.h>
#include <string.h>
static int __attribute__((noinline)) f(int x) { return x * 3 + 1; }
static int __attribute__((noinline)) g(int x) { return x ^ 0x55; }
static unsigned __attribute__((noinline)) h(const char *s) {
    unsigned v = 5381; while (*s) v = v * 33 + (unsigned char)*s++; return v;
}
int main(int argc, char **argv) {
    long a = 0;
    for (int i = 0; i < 20000; i++) a += (i % 3) ? f(i) : g(i);
    printf("%s a=%ld h=%u argc=%d\n", TAG, a, h(argc > 1 ? argv[1] : ""), argc);
    return 0;
}
'''


def _build(d, name, tag="ok", pie=False, shared=False):
    src, exe = d / f"{name}.c", d / name
    src.write_text(f'#define TAG "{tag}"\n' + PROG)
    flags = ["-pie", "-fpie"] if pie else ["-no-pie", "-fno-pie", "-Wl,--emit-relocs"]
    if shared:
        flags = ["-shared", "-fpic"]
    subprocess.run(["gcc", "-O2", *flags, "-o", str(exe), str(src)], check=True)
    return exe


@pytest.fixture(scope="module")
def progs(tmp_path_factory):
    d = tmp_path_factory.mktemp("evprog")
    exe = _build(d, "prog")
    lp = d / "prog.lp"
    p = run_linepack("relayout", exe, "--strategy", "align-all 64", "-q", "-o", lp)
    assert p.returncode == 0, p.stderr
    other = _build(d, "other", tag="different")
    return d, exe, lp, other


def test_original_and_relayout(progs, plugin, tmp_path):
    d, exe, lp, _ = progs
    js, cs = tmp_path / "r.json", tmp_path / "r.csv"
    p = run_linepack("evaluate", "--program", exe, "--program", f"align64={lp}",
                     "--cache", "intel-32k-8w", "--cache", "amd-64k-2w",
                     "--json", js, "--csv", cs, "--", "hello")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "user-mode L1i, intel-32k-8w" in out and "user-mode L1i, amd-64k-2w" in out
    for col in ("L1i misses", "vs base", "fetches", "miss rate", "MPKI", "instructions",
                "code bytes", "time s"):
        assert col in out
    assert "align64" in out and "WARNING" not in out and "DIFF" not in out
    doc = json.loads(js.read_text())
    assert doc["problems"] == [] and doc["args"] == ["hello"]
    rows = doc["results"]
    assert [(r["program"], r["cache"]) for r in rows] == [
        ("prog", "intel-32k-8w"), ("align64", "intel-32k-8w"),
        ("prog", "amd-64k-2w"), ("align64", "amd-64k-2w")]
    assert all(r["same_output"] and r["exit_status"] == 0 for r in rows)
    for r in rows:
        assert r["fetches"] > 0 and 0 < r["misses"] <= r["fetches"]
        assert 0 < r["program_instructions"] < r["instructions"]
    # Exactly the same work: a deterministic C program executes the same instructions
    # (the loader's walk over the relayout's one more program header aside: its
    # code went to a new segment)
    assert len({r["program_instructions"] for r in rows}) == 1
    assert max(r["instructions"] for r in rows) - min(r["instructions"] for r in rows) < 200
    with open(cs) as f:
        assert len(list(csv.DictReader(f))) == 4


def test_different_output_flagged(progs, plugin):
    d, exe, _, other = progs
    p = run_linepack("evaluate", "--program", exe, "--program", other, "--repeat", "2")
    assert p.returncode == 1, p.stderr
    assert "DIFF" in p.stdout and "WARNING: other: stdout differs from prog's" in p.stdout
    assert "median of 2 runs" in p.stdout


@pytest.mark.parametrize("case,needle", [
    ("missing", "no such file"),
    ("so", "a shared library"),
    ("notelf", "not an ELF"),
    ("kernel+program", "--kernel does not go with --program"),
    ("layout+program", "--layout does not go with --program"),
    ("same-label", "given twice"),
    ("neither", "--program PATH"),
    ("stray-args", "unexpected arguments"),
    ("repeat0", "--repeat"),
])
def test_bad_inputs(progs, tmp_path, case, needle):
    d, exe, lp, _ = progs
    args = {
        "missing": ["--program", exe, "--program", tmp_path / "nope"],
        "so": ["--program", exe, "--program", _build(tmp_path, "lib.so", shared=True)],
        "notelf": ["--program", exe, "--program", d / "prog.c"],
        "kernel+program": ["--program", exe, "--kernel", exe],
        "layout+program": ["--program", exe, "--layout", "stock"],
        "same-label": ["--program", exe, "--program", f"prog={lp}"],
        "neither": [],
        "stray-args": ["--kernel", exe, "--", "x"],
        "repeat0": ["--program", exe, "--repeat", "0"],
    }[case]
    p = run_linepack("evaluate", *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in p.stderr, p.stderr


def test_qemu_user_missing(progs, tmp_path):
    d, exe, lp, _ = progs
    env = dict(os.environ, PATH=str(tmp_path))         # no qemu-x86_64 (nor anything else)
    p = subprocess.run([__import__("sys").executable, "-m", "linepack", "evaluate",
                        "--program", exe, "--program", lp], env=env, capture_output=True,
                       text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 3 and len(lines) == 1, p.stderr
    assert "qemu-x86_64 is not installed" in lines[0] and "qemu-user" in lines[0]


def test_parse_and_cross_check():
    from linepack.evaluate.user import INSTRUCTION_TOLERANCE, cross_check, parse_program
    assert parse_program("/x/prog") == ("prog", "/x/prog")
    assert parse_program("bolt=/x/prog.bolt") == ("bolt", "/x/prog.bolt")

    def row(name, insns):
        return {"program": name, "cache": "c", "instructions": insns}
    progs = [("a", "/a"), ("b", "/b"), ("c", "/c")]
    outputs = {"a": [(0, b"x\n")], "b": [(0, b"x\n")], "c": [(1, b"x\n")]}
    n = 1_000_000
    rows = [row("a", n), row("b", n * (1 + INSTRUCTION_TOLERANCE / 2)),
            row("c", n * (1 + 2 * INSTRUCTION_TOLERANCE))]
    problems = cross_check(rows, outputs, progs)
    assert [r["same_output"] for r in rows] == [True, True, False]
    assert any(p.startswith("c: exit status 1 vs 0") for p in problems)
    assert any(p.startswith("c: ") and "user-mode instructions" in p and "tolerance" in p
               for p in problems)
    assert not any(p.startswith("b:") for p in problems)


def test_check_programs_in_process(tmp_path):
    from linepack.evaluate.user import check_programs
    with pytest.raises(BadInput, match="no such file"):
        check_programs([str(tmp_path / "nope")])
