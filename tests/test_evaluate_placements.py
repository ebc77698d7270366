"""evaluate --program --placements: libc moved by whole pages, the table's mean and spread.

Fixtures are C programs compiled at test time: one prints where libc is mapped (its
/proc/self/maps line, as qemu-x86_64 shows the guest's), so the shift is read, not assumed;
one whose hot loop fills one 4 KiB page of code and calls into libc each iteration, so
that on a direct-mapped cache with a 32 KiB way libc's code meets that page in some
placements and not in others.
"""

import hashlib
import json
import statistics

import pytest

import helpers
from helpers import run_linepack

_requirements = helpers.requirements("gcc", "qemu-x86_64")

MAPS = r'''
#include <stdio.h>
#include <string.h>
int main(void) {
    char line[512];
    FILE *f = fopen("/proc/self/maps", "r");
    while (fgets(line, sizeof line, f))
        if (strstr(line, "/libc.so")) { unsigned long a; sscanf(line, "%lx", &a);
                                       printf("libc %lx\n", a); break; }
    return 0;
}
'''

# 1,000 nops: one page of hot code, 20,000 times, each time a call into libc
CONFLICT = r'''
#include <string.h>
static char buf[64] = "placements";
size_t (*volatile len)(const char *) = strlen;
int main(void) {
    size_t n = 0;
    for (int i = 0; i < 20000; i++) {
        __asm__ volatile(".rept 1000\n nop; nop; nop; nop\n .endr");
        n += len(buf);
    }
    return n == 200000 ? 0 : 1;
}
'''

DIRECT = 'name = "dm-32k"\nsize = 32768\nways = 1\nline = 64\npolicy = "lru"\n'


def _build(d, name, src, pie=False):
    import subprocess
    (d / f"{name}.c").write_text(src)
    flags = ["-pie", "-fpie"] if pie else ["-no-pie", "-fno-pie"]
    subprocess.run(["gcc", "-O2", *flags, "-o", str(d / name), str(d / f"{name}.c")],
                   check=True)
    return d / name


def _libc(exe, preload):
    from linepack.evaluate.user import run_program
    from linepack.profile.trace import cache_config
    _, res = run_program(str(exe), [], [cache_config("intel-32k-8w")], preload=preload)
    assert res["returncode"] == 0, res["stderr"]
    return int(res["stdout"].split()[1], 16)


@pytest.mark.parametrize("pie", [False, True], ids=["nopie", "pie"])
def test_placement_moves_libc_by_its_pages(tmp_path, plugin, pie):
    from linepack.evaluate import placements
    exe = _build(tmp_path, "maps", MAPS, pie=pie)
    none = _libc(exe, None)
    n = 8
    for k in (0, 1, 5):
        pre = placements.preload(k, n, directory=str(tmp_path / "pads"))
        shift = placements.shift_pages(k, n)
        assert _libc(exe, pre) - none == shift * placements.PAGE, (k, shift)
        # and so libc's offset within a 32 KiB way is k pages on from the unshifted one
        assert (_libc(exe, pre) - none) // placements.PAGE % 8 == k
    assert placements.preload(0, 1) is None                  # one placement: no preload


def test_pad_library_exact_and_reproducible(tmp_path):
    from linepack.evaluate import placements
    a = placements.pad_library(67, directory=str(tmp_path / "a"))
    b = placements.pad_library(67, directory=str(tmp_path / "b"))
    assert placements._span(a) == 67 * placements.PAGE
    assert hashlib.sha256(open(a, "rb").read()).digest() == \
        hashlib.sha256(open(b, "rb").read()).digest()
    # a file of another size under that name is rebuilt, not trusted
    with open(a, "wb") as f:
        f.write(open(placements.pad_library(65, directory=str(tmp_path / "a")), "rb").read())
    assert placements._span(placements.pad_library(67, directory=str(tmp_path / "a"))) == \
        67 * placements.PAGE


def test_default_count_follows_the_way():
    from linepack.evaluate.placements import default_count
    from linepack.profile.trace import cache_config
    eight, two = cache_config("intel-32k-8w"), cache_config("amd-64k-2w")
    assert default_count([eight]) == 1                  # 4 KiB way: every shift maps alike
    assert default_count([eight, two]) == 8             # 32 KiB way: 8 pages
    assert default_count([cache_config("l2-2m-16w")]) == 8     # 32 pages, at most 8


def test_table_is_the_mean_over_placements(tmp_path, plugin):
    exe = _build(tmp_path, "conflict", CONFLICT)
    model = tmp_path / "dm-32k.toml"
    model.write_text(DIRECT)
    js = tmp_path / "r.json"
    p = run_linepack("evaluate", "--program", f"a={exe}", "--program", f"b={exe}",
                     "--cache", model, "--json", js)
    assert p.returncode == 0, p.stderr
    doc = json.loads(js.read_text())
    assert doc["placements"] == 8                       # the default for a 32 KiB way
    rows = doc["results"]
    for r in rows:
        per = [x["misses"] for x in r["per_placement"]]
        assert len(per) == 8 and r["placements"] == 8
        assert [x["shift_pages"] for x in r["per_placement"]] == r["shift_pages"]
        assert r["misses"] == pytest.approx(statistics.fmean(per))
        assert (r["misses_min"], r["misses_max"]) == (min(per), max(per))
        # the fixture's page of nops meets libc's strlen in some placements only
        assert len(set(per)) > 1, per
    a = rows[0]
    assert "mean over 8 libc placements" in p.stdout
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("a "))
    assert f"{a['misses']:,.0f}" in line
    assert f"{a['misses_min']:,.0f}" in line and f"{a['misses_max']:,.0f}" in line
    assert "fewer" in p.stdout


def test_one_placement_is_the_unshifted_run(tmp_path, plugin, monkeypatch):
    from linepack.evaluate import user
    exe = _build(tmp_path, "conflict", CONFLICT)
    js = tmp_path / "r.json"
    p = run_linepack("evaluate", "--program", exe, "--cache", "amd-64k-2w",
                     "--placements", "1", "--json", js)
    assert p.returncode == 0, p.stderr
    row = json.loads(js.read_text())["results"][0]
    assert row["placements"] == 1 and row["shift_pages"] == [0]
    assert "placements" not in p.stdout.splitlines()[0]
    # nothing preloaded (evaluate before placements), and with more than one placement
    # every placement preloads (the same loader work in each)
    seen = []
    real = user.run_program

    def spy(*a, **kw):
        seen.append(kw.get("preload"))
        return real(*a, **kw)
    monkeypatch.setattr(user, "run_program", spy)
    rows, _ = user.evaluate_programs([str(exe)], ["amd-64k-2w"], placements=1)
    assert seen == [None] and rows[0]["misses"] == row["misses"]
    seen.clear()
    user.evaluate_programs([str(exe)], ["amd-64k-2w"], placements=2)
    assert len(seen) == 2 and all(seen) and seen[0] != seen[1]


@pytest.mark.parametrize("n", ["0", "65"])
def test_bad_placements(tmp_path, n):
    exe = _build(tmp_path, "maps", MAPS)
    p = run_linepack("evaluate", "--program", exe, "--placements", n)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--placements" in lines[0] and "Traceback" not in p.stderr


def test_placements_only_with_program(tmp_path):
    p = run_linepack("evaluate", "--kernel", tmp_path / "k", "--placements", "2")
    assert p.returncode == 2
    assert "--placements" in p.stderr and "Traceback" not in p.stderr


def test_format_counts_placements_with_fewer_misses():
    from linepack.evaluate.user import format_rows

    def row(name, per):
        return {"program": name, "cache": "c", "misses": statistics.fmean(per),
                "fetches": 1000, "miss_rate": 0.1, "instructions": 5000,
                "program_misses": 1, "program_instructions": 1, "code_bytes": 10,
                "repeats": 1, "placements": len(per), "shift_pages": [64, 65, 66],
                "misses_min": min(per), "misses_max": max(per), "same_output": True,
                "per_placement": [{"misses": m} for m in per], "time_s": 0.1}
    text = format_rows([row("base", [100, 200, 300]), row("other", [50, 250, 299])])
    other = next(ln for ln in text.splitlines() if ln.startswith("other"))
    assert " 2/3 " in other and "mean over 3 libc placements (+64..+66 pages)" in text


def test_static_program_noted(tmp_path, plugin):
    import subprocess
    (tmp_path / "s.c").write_text(
        'void _start(void) { __asm__ volatile("mov $60, %eax; xor %edi, %edi; syscall"); }\n')
    subprocess.run(["gcc", "-O2", "-static", "-nostdlib", "-o", str(tmp_path / "s"),
                    str(tmp_path / "s.c")], check=True)
    p = run_linepack("evaluate", "--program", tmp_path / "s", "--placements", "2")
    assert p.returncode == 0, p.stderr
    assert "statically linked: nothing to move" in p.stderr


def test_pad_path_with_colon_refused(tmp_path):
    from linepack.errors import ExternalToolError
    from linepack.evaluate import placements
    with pytest.raises(ExternalToolError, match="colon"):
        placements.pad_library(65, directory=str(tmp_path / "a:b"))
