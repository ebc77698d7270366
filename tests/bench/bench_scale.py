"""Benchmark: a booted evaluate sweep, one boot at a time vs a process pool vs a Dask cluster.

    python3 tests/bench/bench_scale.py [--loops N] [--rounds R] [--kernel VMLINUX]

4 layouts (stock, align-all:64, hot64, pack) x 3 workloads (vfs-mix, pipe,
fork-exec) x 3 cache models (intel-32k-8w, amd-64k-2w, zen-32k-8w) on Debian's
6.1 cloud vmlinux, every layout booted (12 boots, the three cache models in
each boot). First one untimed warm-up sweep on the cluster (rewrites the
layouts and records the profile once, both cached; ships the inputs to the
workers), then per round: ``-j 1``, ``-j 2`` and ``--scheduler`` on the
2-worker LocalCluster. Each sweep is the ``linepack evaluate`` command a user
runs. The anchor is one plain boot (``linepack boot``, same loops) timed in the same
run; the load average is printed before and after (other users of the
machine slow everything down). Every table must equal the -j 1 table
(timing columns aside). Markdown on stdout.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from linepack import targets as _targets  # noqa: E402
VMLINUX = os.environ.get("LINEPACK_VMLINUX") or _targets.debian_vmlinux()  # fetched once, cached
LAYOUTS = ["stock", "align-all:64", "hot64", "pack"]
WORKLOADS = "vfs-mix,pipe,fork-exec"
CACHES = ["intel-32k-8w", "amd-64k-2w", "zen-32k-8w"]
TIMING = ("time_s", "wall", "wall_spread")


def log(m):
    print(f"bench: {m}", file=sys.stderr, flush=True)


def sweep(kernel, loops, out, *extra):
    cmd = [sys.executable, "-m", "linepack", "evaluate", "--kernel", kernel,
           *[x for s in LAYOUTS for x in ("--layout", s)], "--workload", WORKLOADS,
           "--loops", str(loops), *[x for c in CACHES for x in ("--cache", c)],
           "--json", out, *extra]
    t = time.monotonic()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.monotonic() - t
    if p.returncode not in (0, 1):
        sys.exit(f"bench: {' '.join(extra)} failed: {p.stderr.strip().splitlines()[-1:]}")
    rows = json.load(open(out))["results"]
    return wall, [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default=VMLINUX)
    ap.add_argument("--loops", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1)
    a = ap.parse_args()
    from distributed import LocalCluster
    tmp = tempfile.mkdtemp(prefix="bench-scale-")
    os.environ.setdefault("LINEPACK_WORKER_INPUTS", os.path.join(tmp, "worker-inputs"))
    load0 = os.getloadavg()
    log(f"load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    t = time.monotonic()
    subprocess.run([sys.executable, "-m", "linepack", "boot", "--kernel", a.kernel, "--workload",
                    "vfs-mix", "--loops", str(a.loops)], check=True, stdout=subprocess.DEVNULL)
    anchor = time.monotonic() - t
    log(f"anchor: one vfs-mix boot {anchor:.1f} s")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        addr = cluster.scheduler_address
        # untimed: rewrites the layouts (cached) and ships the inputs to the workers
        warm, ref = sweep(a.kernel, a.loops, os.path.join(tmp, "warm.json"), "--scheduler", addr)
        log(f"warm-up sweep {warm:.1f} s ({len(ref)} rows)")
        walls = {"-j 1": [], "-j 2": [], "LocalCluster (2 workers)": []}
        same = {k: True for k in walls}
        for r in range(a.rounds):
            tables = {}
            for name, extra in (("-j 1", ["-j", "1"]), ("-j 2", ["-j", "2"]),
                                ("LocalCluster (2 workers)", ["--scheduler", addr])):
                w, tables[name] = sweep(a.kernel, a.loops, os.path.join(tmp, f"r{r}.json"), *extra)
                walls[name].append(w)
                ok = tables[name] == tables["-j 1"] == ref
                same[name] &= ok
                log(f"round {r + 1}: {name} {w:.1f} s, table {'equal' if ok else 'DIFFERENT'}")
    load1 = os.getloadavg()
    j1 = statistics.median(walls["-j 1"])
    print(f"{len(LAYOUTS)} layouts x 3 workloads x {len(CACHES)} cache models, {a.loops} loops, "
          f"{len(ref)} rows, 12 boots per sweep; median of {a.rounds} round(s); anchor: one "
          f"plain vfs-mix boot {anchor:.1f} s; load average {load0[0]:.2f} before, "
          f"{load1[0]:.2f} after (2 cores)\n")
    print("| run | wall s | vs -j 1 | table equal to -j 1 |")
    print("|---|---:|---:|---|")
    for name, ws in walls.items():
        m = statistics.median(ws)
        print(f"| {name} | {m:.1f} | {m / j1:.2f}x | {'yes' if same[name] else 'NO'} |")


if __name__ == "__main__":
    main()
