"""BOLT at its best in the benches: its own instrumentation profile (llvm-bolt -instrument,
run natively) and its best flags, on a small C program built at test time. Correctness
only (BOLT accepts the profile and the optimized binary prints what the original prints)."""

import os
import re
import subprocess


import helpers

_requirements = helpers.requirements("llvm-bolt-19", "gcc")

PROG = r'''
#include <stdio.h>
#include <stdlib.h>
static int __attribute__((noinline)) rare(int x) { if (x < 0) abort(); return x / 3; }
static int __attribute__((noinline)) step(int x) { return (x & 7) == 7 ? rare(x) : x * 5 + 1; }
int main(int argc, char **argv) {
    long s = 0;
    for (int i = 0; i < 200000; i++) s += step(i + argc);
    printf("%ld\n", s);
    return 0;
}
'''


_bench = helpers.bench_module


def test_bolt_instrumentation_profile_and_best_flags(tmp_path):
    b = _bench()
    rt = b.bolt_runtime_lib()
    # Debian's bolt-19 resolves the runtime under /usr/lib: a path relative to it
    assert not rt.startswith("/") and os.path.isfile(os.path.join("/usr/lib", rt))
    src, exe = tmp_path / "p.c", str(tmp_path / "p")
    src.write_text(PROG)
    subprocess.run(["gcc", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", "-o", exe,
                    str(src)], check=True)
    expected = subprocess.run([exe], capture_output=True, check=True).stdout
    fdata, out, secs = b.bolt_instrument_profile(exe, [], str(tmp_path), log=lambda m: None)
    assert out == expected and secs > 0
    recs = [ln.split() for ln in open(fdata) if ln.strip()]
    # branch records naming step (a local: step/1) and main, counts from the native run
    assert any(r[1].split("/")[0] == "step" for r in recs)
    assert sum(int(r[-1]) for r in recs if r[1] == "main") >= 200000
    for flags in (b.BOLT_FULL, b.BOLT_FUNCS):
        assert "-reorder-functions=cdsort" in flags
        opt = str(tmp_path / "p.bolt")
        p = subprocess.run([b.BOLT, exe, "-o", opt, f"-data={fdata}", *flags],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        m = re.search(r"(\d+) out of \d+ functions in the binary .* have non-empty execution "
                      r"profile", p.stdout)
        assert m and int(m.group(1)) >= 2, p.stdout[-2000:]
        assert subprocess.run([opt], capture_output=True, check=True).stdout == expected
    assert {"-split-functions", "-split-all-cold", "-split-eh", "-reorder-blocks=ext-tsp"} \
        <= set(b.BOLT_FULL)
