"""Benchmark: the DWARF rewrite of Debian's 6.1 cloud vmlinux, with BOLT's DWARF
rewrite of a userspace binary (lua, built with -g) for scale.

    python3 tests/bench/bench_dwarf.py [--runs 3] [--no-bolt] [--json FILE]

The address map is the one `pack` makes for a synthetic hotness map over real
function names (as tests/test_dwarf_vmlinux.py; made once, not timed). Each run
is its own process: load the image, rewrite every .debug_* section for the map
(tools/dwarf/rewrite.py) and write the result with the unchanged code; wall
time and peak memory (ru_maxrss / sampled PSS, as bench_relayout.py) per run,
median of ``--runs``. The anchor, measured in the same run: llvm-bolt-19 on
lua with --update-debug-sections minus the same BOLT run without it (its
blocks reversed in every function, --lite=0, so every function's DWARF
changes). Target (issue 12): <= 120 s and <= 4 GB on 2 cores; aim 60 s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_relayout import VMLINUX, run_measured   # noqa: E402

CHILD = r'''
import sys, numpy as np
from linepack.image.elf import ElfImage
from linepack.image.addrmap import AddressMap
from linepack.image.writer import write_image
from linepack.dwarf.rewrite import rewrite_dwarf
img, mp, out = sys.argv[1:4]
z = np.load(mp)
amap = AddressMap(z["old_start"], z["old_end"], z["new_start"],
                  list(zip(z["ext_lo"].tolist(), z["ext_hi"].tolist())))
im = ElfImage(img)
patched, drop, stats = rewrite_dwarf(im, amap)
write_image(im, out, patched, drop=drop)
'''


def make_map(vmlinux, path):
    from linepack.image.addrmap import AddressMap
    from linepack.image.elf import ElfImage
    from linepack.image.functions import FunctionTable
    from linepack.relayout.driver import relayout
    ft = FunctionTable(ElfImage(vmlinux))
    names = [ft.name[i] for i in range(100, 40000, 50)]
    hot = {n: float(1000 - k % 900) for k, n in enumerate(names)}
    with tempfile.TemporaryDirectory() as d:
        _, plan, rw = relayout(vmlinux, os.path.join(d, "v"), "pack", hotness=hot, debug="strip")
    a = rw.amap
    import numpy as np
    np.savez(path, old_start=a.old_start, old_end=a.old_end, new_start=a.new_start,
             ext_lo=a.ext_lo, ext_hi=a.ext_hi)
    return len(a)


def bolt_anchor(work, runs):
    """(seconds with --update-debug-sections, without, lua DWARF bytes) — medians."""
    from bench_userspace_bolt import BOLT, CFLAGS, build_lua
    import bench_userspace_bolt as bub
    bub.CFLAGS = CFLAGS + ["-g"]
    exe = build_lua(os.path.join(work, "lua"), log=lambda m: None)
    base = [BOLT, exe, "--lite=0", "--reorder-blocks=reverse", "-o", os.path.join(work, "lua.b")]
    with_dbg = [run_measured(None, base + ["--update-debug-sections"])[1:3] for _ in range(runs)]
    without = [run_measured(None, base)[1:3] for _ in range(runs)]
    from linepack.image.elf import ElfImage
    im = ElfImage(exe)
    dbg = sum(s.size for s in im.sections if s.name.startswith(".debug_"))
    return with_dbg, without, dbg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vmlinux", default=VMLINUX)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-bolt", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    res = {}
    with tempfile.TemporaryDirectory(prefix="bench-dwarf-") as d:
        mp = os.path.join(d, "map.npz")
        print("making the pack address map (not timed) ...", file=sys.stderr, flush=True)
        res["pieces"] = make_map(a.vmlinux, mp)
        runs = []
        for _ in range(a.runs):
            _, wall, mib, _ = run_measured(None, [sys.executable, "-c", CHILD, a.vmlinux, mp,
                                               os.path.join(d, "out")])
            runs.append((wall, mib))
            print(f"  kernel DWARF rewrite: {wall:.1f} s, {mib:.0f} MiB", file=sys.stderr)
        res["kernel"] = runs
        if not a.no_bolt:
            w, wo, dbg = bolt_anchor(d, a.runs)
            res["bolt_with_debug"], res["bolt_without_debug"], res["lua_debug_bytes"] = w, wo, dbg
    im_dbg = _debug_bytes(a.vmlinux)
    med = lambda xs, k: statistics.median(x[k] for x in xs)   # noqa: E731
    print(f"{'what':44} {'wall s (median)':>16} {'min..max':>14} {'peak MiB':>9}")
    ks = res["kernel"]
    print(f"{'vmlinux DWARF rewrite (%.0f MB of .debug_*)' % (im_dbg / 1e6):44} "
          f"{med(ks, 0):16.1f} {min(x[0] for x in ks):6.1f}..{max(x[0] for x in ks):<6.1f} "
          f"{med(ks, 1):9.0f}")
    if "bolt_with_debug" in res:
        w, wo = res["bolt_with_debug"], res["bolt_without_debug"]
        print(f"{'BOLT lua, --update-debug-sections (%.1f MB)' % (res['lua_debug_bytes'] / 1e6):44} "
              f"{med(w, 0):16.2f} {'':14} {med(w, 1):9.0f}")
        print(f"{'BOLT lua, same without debug update':44} {med(wo, 0):16.2f} {'':14} "
              f"{med(wo, 1):9.0f}")
        dw = med(w, 0) - med(wo, 0)
        print(f"BOLT's DWARF update: {dw:.2f} s for {res['lua_debug_bytes'] / 1e6:.1f} MB "
              f"({res['lua_debug_bytes'] / 1e6 / max(dw, 1e-3):.1f} MB/s); linepack: "
              f"{im_dbg / 1e6 / med(ks, 0):.1f} MB/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def _debug_bytes(path):
    from linepack.image.elf import ElfImage
    im = ElfImage(path)
    return sum(s.size for s in im.sections if s.name.startswith(".debug_"))


if __name__ == "__main__":
    main()
