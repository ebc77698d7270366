"""Benchmark: do the layouts keep their ranking across cache models? (run by hand)

    python3 tests/bench/bench_cache_models.py --profile P [--workload vfs-mix] [--loops 500]

stock, align-all:64, hot64 and pack (from the given profile) booted once each with one
plugin instance per cache model: the L1i models (intel-32k-8w, amd-64k-2w), the L1i
with next-line prefetch, L2s of 1 and 2 MiB behind the L1i (instruction stream only)
and iTLBs for 4 KiB and 2 MiB pages. Prints misses, change vs stock and each model's
ranking of the layouts (Markdown on stdout, progress on stderr).
"""

import argparse
import os
import sys

from linepack.evaluate.run import evaluate_layouts
from linepack.profile.trace import cache_config

from linepack import targets as _targets  # noqa: E402
VMLINUX = os.environ.get("LINEPACK_VMLINUX") or _targets.debian_vmlinux()  # fetched once, cached
LAYOUTS = ["stock", "align-all:64", "hot64", "pack"]
CACHES = ["intel-32k-8w", "amd-64k-2w", "intel-32k-8w-nlp", "l2-1m-16w", "l2-2m-16w", "itlb-4k",
          "itlb-2m"]


def log(m):
    print(f"bench: {m}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default=VMLINUX)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--workload", default="vfs-mix")
    ap.add_argument("--loops", type=int, default=500)
    a = ap.parse_args()
    caches = [cache_config(c) for c in CACHES]
    rows, _ = evaluate_layouts(a.kernel, LAYOUTS, caches, workload=a.workload, loops=a.loops,
                               whatif=False, profile=a.profile, log=log)
    get = {(r["layout"], r["cache"]): r for r in rows}
    print(f"{a.workload}, {a.loops} loops, booted (one boot per layout, all models in it)\n")
    print("| model | kind | " + " | ".join(LAYOUTS) + " | ranking (fewest misses first) |")
    print("|---|---|" + "---:|" * len(LAYOUTS) + "---|")
    for c in caches:
        base = get[("stock", c["name"])]["misses"]
        cells = []
        for lay in LAYOUTS:
            m = get[(lay, c["name"])]["misses"]
            rel = f" ({100 * (m - base) / base:+.1f}%)" if base else ""
            cells.append(f"{m:,}" + ("" if lay == "stock" else rel))
        rank = sorted(LAYOUTS, key=lambda lay: (get[(lay, c["name"])]["misses"], lay))
        print(f"| {c['name']} | {c['kind']} | " + " | ".join(cells) + " | " + " < ".join(rank) + " |")
    ins = {lay: get[(lay, caches[0]["name"])]["instructions"] for lay in LAYOUTS}
    print("\nkernel instructions: " + ", ".join(f"{k} {v:,}" for k, v in ins.items()))


if __name__ == "__main__":
    main()
