#!/usr/bin/env python3
"""Wall-time cost of linepack's TCG plugin on a real boot + workload.

Boots Debian's 6.1 cloud vmlinux with a workload as /init (VFS-mix by default,
through linepack.profile.qemu) under TCG with -icount, in these variants:

    none     plain TCG, no plugin
    counts   plugin: per-block inline execution counters only
    cache    + L1i simulation (one helper call per executed block)
    edges    + block-to-block transitions (one helper call per executed block)
    all      cache + edges

Each variant runs --repeat times (default 3), interleaved; the median wall time
and its ratio to 'none' are printed.  Target: counts-only <= 2x plain TCG.

    python3 tests/bench/bench_plugin_overhead.py [--loops N] [--repeat 3] [--no-icount]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

from linepack import targets
from linepack.profile import plugin_build, trace

VARIANTS = {
    "none": None,
    "counts": {},
    "cache": {"cache": "on", "size": 32768, "ways": 8, "line": 64},
    "edges": {"edges": "on"},
    "all": {"cache": "on", "size": 32768, "ways": 8, "line": 64, "edges": "on"},
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="vfs-mix")
    ap.add_argument("--loops", type=int, default=None, help="workload loops (default: its own)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-icount", action="store_true", help="plain TCG timing (no -icount)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    a = ap.parse_args(argv)
    from linepack.profile.qemu import run_workload

    kernel = targets.debian_vmlinux()
    so = plugin_build.build_plugin(log=lambda m: None)
    stop = trace.reboot_marker(kernel)      # counts end at reboot(): repeatable totals
    names = [v for v in a.variants.split(",") if v]
    times = {n: [] for n in names}
    info = {}
    with tempfile.TemporaryDirectory(prefix="lp-bench-") as tmp:
        # one warm-up run builds and caches the workload's initramfs
        run_workload(kernel, a.workload, loops=a.loops, icount=not a.no_icount)
        for r in range(a.repeat):
            for n in names:
                pa = VARIANTS[n]
                args = None if pa is None else dict(pa, out=os.path.join(tmp, f"{n}.bin"),
                                                     stop=hex(stop))
                t0 = time.monotonic()
                run_workload(kernel, a.workload, loops=a.loops, icount=not a.no_icount,
                             plugin=so if args is not None else None, plugin_args=args)
                times[n].append(time.monotonic() - t0)
                if args is not None:
                    t = trace.read_plugin_output(args["out"])
                    info[n] = (t.kernel_instructions, t.fetches, t.misses, len(t.edge_src))
                print(f"  run {r + 1}/{a.repeat} {n:7s} {times[n][-1]:7.2f} s", file=sys.stderr,
                      flush=True)
    base = statistics.median(times["none"]) if "none" in times else None
    print(f"\nplugin overhead: {a.workload}, loops={a.loops or 'default'}, "
          f"{'plain TCG' if a.no_icount else '-icount shift=0'}, median of {a.repeat}, "
          f"{os.cpu_count()} host cores")
    print(f"{'variant':8s} {'median s':>9s} {'min s':>7s} {'max s':>7s} {'ratio':>6s} "
          f"{'kernel insns':>14s} {'fetches':>12s} {'misses':>10s} {'edges':>8s}")
    for n in names:
        med = statistics.median(times[n])
        ki, fe, mi, ed = info.get(n, ("-", "-", "-", "-"))
        ratio = f"{med / base:.2f}x" if base else "-"
        print(f"{n:8s} {med:9.2f} {min(times[n]):7.2f} {max(times[n]):7.2f} {ratio:>6s} "
              f"{ki:>14} {fe:>12} {mi:>10} {ed:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
