"""Share of each workload's loop spent in emulation-attributable kernel code
(configs/emulation.toml), with the guest's RNG unseeded ("before": QEMU's default
qemu64 CPU without RDRAND, as configs/kernel.toml had it) and seeded ("after":
trusted RDRAND, configs/kernel.toml now).

    python3 tests/bench/bench_emulation.py --out DIR            # record + report
    python3 tests/bench/bench_emulation.py --out DIR --report   # report existing DIR/{before,after}-W.prof

Every profile is one QEMU -icount boot with linepack's plugin (deterministic);
prints a Markdown table: loop instructions per iteration, emulation share and the
RNG share, before and after, and the functions the loop ran (>= once / iteration).
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, ".pyroot"))

# Loop counts: a few seconds of guest work each.
LOOPS = {"vfs-mix": 500, "vfs-mix-ext4": 300, "vfs-mix-nvme": 300, "pipe": 2000, "fork-exec": 100,
         "tcp-loopback": 300, "epoll": 1000, "dirwalk": 5, "fsync": 100, "slab-bulk": 500}
# What configs/kernel.toml adds for the seeded RNG (removed for "before").
SEEDED_APPEND = ["random.trust_cpu=on"]
SEEDED_QEMU = ["-cpu", "qemu64,+rdrand", "-seed", "1"]


def unseeded_configs(dest):
    """A copy of configs/ whose kernel.toml boots without the trusted RDRAND."""
    from linepack.io import load_toml
    shutil.copytree(os.path.join(ROOT, "configs"), dest, dirs_exist_ok=True)
    d = load_toml(os.path.join(ROOT, "configs", "kernel.toml"))
    append = " ".join(w for w in d["boot"]["append"].split() if w not in SEEDED_APPEND)
    args = list(d["boot"]["qemu_args"])
    for i in range(len(args) - 1, -1, -1):     # drop each flag together with its value
        if args[i] in ("-cpu", "-seed"):
            del args[i:i + 2]
    ic = d["icount"]["qemu_args"]
    q = lambda xs: "[" + ", ".join(f'"{x}"' for x in xs) + "]"   # noqa: E731
    with open(os.path.join(dest, "kernel.toml"), "w") as f:
        f.write(f'[boot]\nappend = "{append}"\nmemory = "{d["boot"]["memory"]}"\n'
                f"qemu_args = {q(args)}\n\n[icount]\nqemu_args = {q(ic)}\n")


def record(out, names):
    kernel = subprocess.run([sys.executable, "-m", "linepack", "fetch"], stdout=subprocess.PIPE,
                            text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        unseeded_configs(tmp)
        for tag, cfg in (("before", tmp), ("after", None)):
            env = dict(os.environ)
            if cfg:
                env["LINEPACK_CONFIGS"] = cfg
            for w in names:
                dest = os.path.join(out, f"{tag}-{w}.prof")
                subprocess.run([sys.executable, "-m", "linepack", "profile", "--kernel", kernel,
                                "--workload", w, "--loops", str(LOOPS[w]), "-o", dest],
                               env=env, check=True)


def report(out, names):
    from linepack.profile.emulation import emulation_shares
    from linepack.profile.model import Profile
    print("| workload | kernel insns / iteration (before → after) | emulation share before | "
          "after | RNG before | RNG after | kernel functions run (≥1 / iteration) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for w in names:
        row = {}
        for tag in ("before", "after"):
            p = Profile.load(os.path.join(out, f"{tag}-{w}.prof"))
            s = emulation_shares(p)
            row[tag] = (p, s)
        pb, sb = row["before"]
        pa, sa = row["after"]
        per = lambda p: p.meta["instructions"] / p.meta["loops"]   # noqa: E731
        nfun = len(pa.hot_functions(1, metric="entries", per_loop=True))
        print(f"| {w} | {per(pb):,.0f} → {per(pa):,.0f} | {100 * sb.share():.2f}% | "
              f"{100 * sa.share():.2f}% | {100 * sb.share('rng'):.2f}% | "
              f"{100 * sa.share('rng'):.2f}% | {len(pa.func_addr):,} ({nfun:,}) |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", action="store_true", help="only report existing profiles")
    ap.add_argument("--workloads", default=",".join(LOOPS))
    a = ap.parse_args()
    names = a.workloads.split(",")
    os.makedirs(a.out, exist_ok=True)
    if not a.report:
        record(a.out, names)
    report(a.out, names)


if __name__ == "__main__":
    main()
