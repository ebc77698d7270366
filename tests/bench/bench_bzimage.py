#!/usr/bin/env python3
"""Benchmark: `linepack bzimage` cold (empty cache: download the source package and
the image package, extract, olddefconfig, prepare, boot inputs, bzImage) and warm
(the prepared tree reused: relocs, compression, boot objects), with an anchor from
the same run: `lz4 -l -12 --favor-decSpeed` of the same vmlinux's code bytes (the
payload compression, Debian's CONFIG_KERNEL_LZ4, the one step no tree can cache).

Usage: python3 tests/bench/bench_bzimage.py [--warm-runs N] [--vmlinux PATH]
The cold run uses a fresh LINEPACK_CACHE under /tmp (about 2 GB while it runs).
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def timed(cmd, env=None):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        sys.exit(f"bench: {' '.join(cmd)} failed: {p.stderr.strip()[-500:]}")
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm-runs", type=int, default=3)
    ap.add_argument("--vmlinux")
    a = ap.parse_args()
    vmlinux = a.vmlinux
    if not vmlinux:
        from linepack import targets
        vmlinux = targets.debian_vmlinux()
    work = tempfile.mkdtemp(prefix="bench-bzimage-")
    try:
        env = dict(os.environ, LINEPACK_CACHE=os.path.join(work, "cache"))
        out = os.path.join(work, "bzImage")
        cmd = [sys.executable, "-m", "linepack", "bzimage", "-q", vmlinux, "-o", out]
        cold = timed(cmd, env)
        warm = [timed(cmd, env) for _ in range(a.warm_runs)]
        binfile = os.path.join(work, "vmlinux.bin")
        subprocess.run(["objcopy", "-O", "binary", "-R", ".comment", "-S", vmlinux, binfile],
                       check=True)
        anchor = timed(["lz4", "-q", "-f", "-l", "-12", "--favor-decSpeed", binfile,
                        binfile + ".lz4"])
        print(f"{'run':<12} {'wall s':>8}")
        print(f"{'cold':<12} {cold:8.1f}")
        for i, w in enumerate(warm):
            print(f"{'warm ' + str(i + 1):<12} {w:8.1f}")
        med = statistics.median(warm)
        print(f"warm median {med:.1f} s; anchor lz4 -12 of vmlinux.bin {anchor:.1f} s "
              f"(warm = {med / anchor:.1f}x the anchor); cold = {cold / med:.1f}x warm")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
