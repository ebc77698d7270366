#!/usr/bin/env python3
"""Benchmark: wall time and peak RSS of `linepack verify` on the real vmlinux.

Runs the CLI N times (default 3) in fresh processes, reports each run and the
median, and the targets from issue 2 (<= 20 s, <= 1 GB on 2-core machines).
Usage: python3 tests/bench/bench_verify.py [--runs N] [--image PATH] [--anchor DIR]

``--anchor DIR``: a PYTHONPATH holding another ``linepack`` (e.g. a ``git
archive`` of an older commit's tools/ as DIR/linepack), run alternately with
this one in the same session, so a loaded machine slows both alike.
"""

import argparse
import os
import statistics
import sys
import time


def run_once(image, pythonpath=None):
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        if pythonpath:
            os.environ["PYTHONPATH"] = pythonpath
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        os.execv(sys.executable, [sys.executable, "-m", "linepack", "verify", "-q", image])
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    # ru_maxrss from wait4 (KiB on Linux) is the max over the child and the
    # descendants it reaped (its disassembly worker pool).
    return wall, usage.ru_maxrss / 1024.0, os.waitstatus_to_exitcode(status)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--image")
    ap.add_argument("--anchor", help="PYTHONPATH of another linepack to time alternately")
    a = ap.parse_args()
    image = a.image
    if not image:
        from linepack import targets
        image = targets.debian_vmlinux()
    rows, anchor = [], []
    for k in range(a.runs):
        wall, rss, rc = run_once(image)
        rows.append((wall, rss, rc))
        print(f"run {k + 1}: {wall:6.2f} s  peak RSS {rss:7.1f} MiB  exit {rc}", flush=True)
        if a.anchor:
            aw, ar, arc = run_once(image, a.anchor)
            anchor.append((aw, ar, arc))
            print(f"  anchor {k + 1}: {aw:6.2f} s  peak RSS {ar:7.1f} MiB  exit {arc}", flush=True)
    walls = [r[0] for r in rows]
    rsss = [r[1] for r in rows]
    print(f"\n| metric | median of {a.runs} | target |\n|---|---|---|")
    print(f"| wall time | {statistics.median(walls):.2f} s | <= 20 s |")
    print(f"| peak RSS (largest process) | {statistics.median(rsss):.0f} MiB | <= 1024 MiB |")
    if anchor:
        aw = statistics.median(r[0] for r in anchor)
        print(f"| anchor wall time ({a.anchor}) | {aw:.2f} s | ratio {statistics.median(walls) / aw:.2f} |")
        print(f"| anchor peak RSS | {statistics.median(r[1] for r in anchor):.0f} MiB | |")
    print(f"\nimage: {image}\ncores: {os.cpu_count()}")


if __name__ == "__main__":
    main()
