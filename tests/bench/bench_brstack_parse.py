#!/usr/bin/env python3
"""Benchmark: import 1 M LBR branch records from `perf script -F ip,brstack` text.

Target: <= 10 s for the whole import (parse, shift detection, symbolize,
aggregate, save). Run by hand:

    python3 tests/bench/bench_brstack_parse.py [--records N] [--image ELF] [--style 6.1|6.12|5.x]

Without --image it uses Debian's 6.1 cloud vmlinux when cached (addresses are
KASLR-shifted by 0x1e000000 and imported with --kaslr-offset auto), else it
compiles tests/fixtures/c/hotloop.c. Exit status 1 when over the budget.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
VMLINUX = "/root/.cache/linepack/kernels/6.1.0-56-cloud-amd64/vmlinux"
FLAGS = {"5.x": "/P/-/-/0", "6.1": "/P/-/-/0/COND", "6.12": "/P/-/-/3/COND/-"}


def generate(path, image, records, style, shift, seed=1):
    from linepack.image.elf import ElfImage
    from linepack.image.functions import FunctionTable
    ft = FunctionTable(ElfImage(image))
    rng = np.random.default_rng(seed)
    # A skewed workload: a few thousand hot functions, Zipf-like.
    nf = min(len(ft), 3000)
    pick = rng.choice(len(ft), nf, replace=False)
    w = 1.0 / np.arange(1, nf + 1) ** 1.1
    w /= w.sum()
    f1 = pick[rng.choice(nf, records, p=w)]
    f2 = np.where(rng.random(records) < 0.8, f1, pick[rng.choice(nf, records, p=w)])
    start, size = ft.start.astype(np.uint64), np.maximum(ft.size.astype(np.uint64), 1)
    sh = np.uint64(shift)
    r1 = rng.integers(0, 1 << 30, records).astype(np.uint64)
    r2 = rng.integers(0, 1 << 30, records).astype(np.uint64)
    a_from = start[f1] + r1 % size[f1] + sh
    a_to = np.where(f2 == f1, start[f2] + r2 % size[f2], start[f2]) + sh
    mis = rng.random(records) < 0.03
    flags = FLAGS[style]
    mflags = flags.replace("/P/", "/M/", 1)
    with open(path, "w") as f:
        for i in range(0, records, 32):
            ents = [f"0x{a:x}/0x{b:x}{mflags if m else flags}" for a, b, m in
                    zip(a_from[i:i + 32].tolist(), a_to[i:i + 32].tolist(), mis[i:i + 32].tolist())]
            f.write(f" {a_from[i]:x}  " + "  ".join(ents) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--image")
    ap.add_argument("--style", default="6.12", choices=sorted(FLAGS))
    ap.add_argument("--budget", type=float, default=10.0)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="lp-bench-")
    image, shift, offset = args.image, 0, None
    if image is None and os.path.exists(VMLINUX):
        image, shift, offset = VMLINUX, 0x1e000000, "auto"
    if image is None:
        image = os.path.join(tmp, "hotloop")
        subprocess.run(["gcc", "-O2", "-Wl,--emit-relocs", "-no-pie", "-o", image,
                        os.path.join(HERE, "..", "fixtures", "c", "hotloop.c")], check=True)
    text = os.path.join(tmp, "brstack.txt")
    t0 = time.perf_counter()
    generate(text, image, args.records, args.style, shift)
    gen = time.perf_counter() - t0
    size = os.path.getsize(text)
    from linepack.cli import main as cli
    argv = ["profile", "--perf-script", text, "--image", image, "-o", os.path.join(tmp, "p.lpprof")]
    if offset:
        argv += ["--kaslr-offset", offset]
    t0 = time.perf_counter()
    rc = cli(argv)
    wall = time.perf_counter() - t0
    print(f"bench_brstack_parse: {args.records:,} branch records ({args.style} style, {size / 1e6:.0f} MB "
          f"text, image {os.path.basename(image)}): import {wall:.2f} s (generate {gen:.1f} s), "
          f"budget {args.budget:.0f} s, rc {rc}")
    return 0 if rc == 0 and wall <= args.budget else 1


if __name__ == "__main__":
    sys.exit(main())
