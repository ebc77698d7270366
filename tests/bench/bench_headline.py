"""Benchmark: the project's headline table on Debian's 6.1 cloud vmlinux (run by hand).

    python3 tests/bench/bench_headline.py [--loops N] [--whatif-only] [--workload W ...]

stock vs align-all:64 vs hot64 vs pack, for VFS-mix and pipe, 32 KiB 8-way and
64 KiB 2-way L1i models: booted measurement of the rewritten kernels (one boot
per layout and workload, both cache models in that boot) next to the what-if
replay of the stock trace. hot64/pack use a profile derived from the stock run
of the same workload. Markdown on stdout, progress on stderr.
"""

import argparse
import os
import sys
import time

from linepack.evaluate.run import evaluate_layouts
from linepack.profile.trace import cache_config

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
    ap.add_argument("--workload", action="append")
    ap.add_argument("--whatif-only", action="store_true")
    a = ap.parse_args()
    caches = [cache_config(c) for c in CACHES]
    out = ["| workload | layout | " + " | ".join(
        f"{c} misses (booted) | Δ | what-if Δ" for c in CACHES) +
        " | kernel insns (booted) | .text growth |",
        "|---|---|" + "---:|---:|---:|" * len(CACHES) + "---:|---:|"]
    t0 = time.time()
    for wl in a.workload or ["vfs-mix", "pipe"]:
        wi, _ = evaluate_layouts(a.kernel, LAYOUTS, caches, workload=wl, loops=a.loops,
                                 whatif=True, log=log)
        bo = [] if a.whatif_only else evaluate_layouts(a.kernel, LAYOUTS, caches, workload=wl,
                                                       loops=a.loops, whatif=False, log=log)[0]
        get_w = {(r["layout"], r["cache"]): r for r in wi}
        get_b = {(r["layout"], r["cache"]): r for r in bo}
        for lay in LAYOUTS:
            cells = []
            for c in CACHES:
                w, b = get_w[(lay, c)], get_b.get((lay, c))
                wb = get_w[("stock", c)]["misses"]
                if b:
                    bb = get_b[("stock", c)]["misses"]
                    cells += [f"{b['misses']:,}", f"{(b['misses'] - bb) / bb:+.1%}"]
                else:
                    cells += [f"({w['misses']:,})", ""]
                cells.append(f"{(w['misses'] - wb) / wb:+.1%}")
            ref = get_b.get((lay, CACHES[0])) or get_w[(lay, CACHES[0])]
            out.append(f"| {wl} | {lay} | " + " | ".join(cells) +
                       f" | {ref['instructions']:,} | {ref['text_growth_pct']:+.2f}% |")
    print(f"Debian 6.1 cloud vmlinux, {a.loops} loops, kernel-mode L1i misses inside the "
          f"workload loop (QEMU TCG + linepack plugin, -icount); what-if = replay of the stock "
          f"block trace under each layout. {time.time() - t0:.0f} s.\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
