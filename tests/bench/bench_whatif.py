"""Benchmark: what-if replay against booted measurement, per layout (run by hand).

    python3 tests/bench/bench_whatif.py [--loops N] [--workload W]

For stock, align-all:64, hot64 and pack: misses replayed vs booted (both cache
models), their difference, and the time per layout of each method (what-if:
plan + translation + replay; booted: rewrite (cached after the first run) +
boot). Markdown on stdout.
"""

import argparse
import os
import sys
import time

from linepack.evaluate import whatif as wi
from linepack.evaluate.booted import measure_caches
from linepack.evaluate.layouts import Layouts, hotness_from_trace

from linepack import targets as _targets  # noqa: E402
VMLINUX = os.environ.get("LINEPACK_VMLINUX") or _targets.debian_vmlinux()  # fetched once, cached
LAYOUTS = ["stock", "align-all:64", "hot64", "pack"]
CACHES = ["intel-32k-8w", "amd-64k-2w"]


def log(m):
    print(f"bench: {m}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default=VMLINUX)
    ap.add_argument("--loops", type=int, default=500)
    ap.add_argument("--workload", default="vfs-mix")
    a = ap.parse_args()
    t = time.time()
    bt = wi.record_trace(a.kernel, a.workload, a.loops, CACHES, log=log, cache=False)
    rec = time.time() - t
    L = Layouts(a.kernel, hotness=hotness_from_trace(bt, a.kernel), log=log)
    t = time.time()
    L._build_units()
    units_s = time.time() - t
    print(f"{a.workload}, {a.loops} loops: trace {bt.executions:,} block executions "
          f"(+{len(bt.warm):,} warm-up), recorded in {rec:.1f} s (one boot); "
          f"units built once in {units_s:.1f} s\n")
    print("| layout | cache | what-if misses | booted misses | diff | what-if s | booted s "
          "(rewrite + boot) | speedup |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for spec in LAYOUTS:
        t = time.time()
        pm = L.plan(spec)
        rs = wi.whatif(bt, pm.amap if pm else None, CACHES, spec)
        tw = time.time() - t
        t = time.time()
        img = L.image_path(spec)
        trw = time.time() - t
        t = time.time()
        ms = measure_caches(img, spec, a.workload, a.loops, CACHES)
        tb = time.time() - t
        for r in rs:
            b = ms[r["cache"]].median("misses")
            print(f"| {spec} | {r['cache']} | {r['misses']:,} | {b:,} | "
                  f"{(r['misses'] - b) / b:+.3%} | {tw:.2f} | {trw + tb:.1f} ({trw:.1f} + {tb:.1f}) "
                  f"| {(trw + tb) / tw:.0f}x ({tb / tw:.0f}x boot only) |")


if __name__ == "__main__":
    main()
