#!/usr/bin/env python3
"""Benchmark: import 1 M LBR branch records from `perf script -F ip,brstack` text.

Target: <= 10 s for the whole import (parse, shift detection, symbolize,
fall-through ranges -> blocks incl. disassembly of the touched functions,
aggregate, save). The samples follow plausible paths, so most consecutive
records form valid fall-through ranges. Run by hand:

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
from linepack import targets as _targets  # noqa: E402
VMLINUX = os.environ.get("LINEPACK_VMLINUX") or _targets.debian_vmlinux()  # fetched once, cached
FLAGS = {"5.x": "/P/-/-/0", "6.1": "/P/-/-/0/COND", "6.12": "/P/-/-/3/COND/-"}


def generate(path, image, records, style, shift, seed=1):
    """Synthetic brstack text whose samples follow plausible paths (newest branch first).

    Execution order within a sample: branch k lands on an instruction of function g_k
    (the same function as branch k-1's target with probability 0.8, else a Zipf-hot
    one: a call), runs 0-15 instructions (a fall-through range), and branch k+1 leaves
    from there. So most consecutive records form valid fall-through ranges, like real
    LBR stacks, and the import exercises the range -> block path on ~3000 functions.
    """
    from linepack.image.disasm import disassemble
    from linepack.image.elf import ElfImage
    from linepack.image.functions import FunctionTable
    import types
    img = ElfImage(image)
    ft = FunctionTable(img)
    rng = np.random.default_rng(seed)
    nf = min(len(ft), 3000)
    pick = np.sort(rng.choice(len(ft), nf, replace=False))
    dis = disassemble(img, types.SimpleNamespace(start=ft.start[pick], size=ft.size[pick]))
    first = np.searchsorted(dis.addr, ft.start[pick])                  # first insn per pick
    last = np.searchsorted(dis.addr, ft.start[pick] + ft.size[pick]) - 1
    w = 1.0 / np.arange(1, nf + 1) ** 1.1
    w /= w.sum()
    w = w[rng.permutation(nf)]
    # Target function of each branch (in execution order), forward-filled "same as before".
    new_f = rng.random(records) >= 0.8
    new_f[::32] = True
    draw = rng.choice(nf, records, p=w)
    src = np.maximum.accumulate(np.where(new_f, np.arange(records), 0))
    g = draw[src]
    n_ins = np.maximum(last[g] - first[g] + 1, 1)
    t_idx = first[g] + rng.integers(0, 1 << 30, records) % n_ins        # landing insn
    run = rng.integers(0, 16, records)
    f_idx = np.minimum(t_idx + run, last[g])                             # branch insn ending the run
    a_to = dis.addr[t_idx]
    # from of branch k+1 = end of the run after branch k's landing; the first of a line: anywhere.
    a_from = np.empty(records, np.uint64)
    a_from[1:] = dis.addr[f_idx[:-1]]
    a_from[::32] = dis.addr[f_idx[::32]]
    sh = np.uint64(shift)
    a_from, a_to = a_from + sh, a_to + sh
    mis = rng.random(records) < 0.03
    flags = FLAGS[style]
    mflags = flags.replace("/P/", "/M/", 1)
    with open(path, "w") as f:
        for i in range(0, records, 32):
            ents = [f"0x{a:x}/0x{b:x}{mflags if m else flags}" for a, b, m in
                    zip(a_from[i:i + 32].tolist(), a_to[i:i + 32].tolist(), mis[i:i + 32].tolist())]
            f.write(f" {a_to[min(i + 31, records - 1)]:x}  " + "  ".join(reversed(ents)) + "\n")


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
