"""Benchmark: relayout (pack) + verify --against on the real vmlinux (run by hand or CI).

    python3 tests/bench/bench_relayout.py [--profile P] [--strategy S] [--runs 3] [--json FILE]

Each step runs as its own `linepack` process (as a packager runs it); wall time
and peak memory (the larger of the process's ru_maxrss and the sampled peak PSS
of its process tree, forked workers included) are taken per run and the
median of ``--runs`` runs is reported, with min..max. Without ``--profile`` a
VFS-mix profile is recorded first under QEMU (not timed). Target from the
relayout issue: relayout + verify together <= 60 s and <= 2 GB.
"""

import argparse
import json
import shutil
import os
import statistics
import subprocess
import sys
import tempfile
import time

from linepack import targets as _targets  # noqa: E402
VMLINUX = os.environ.get("LINEPACK_VMLINUX") or _targets.debian_vmlinux()  # fetched once, cached
TARGET_WALL_S = 60.0
TARGET_RSS_MB = 2048.0


def _tree_pss_kb(pid):
    """Proportional set size (KiB) of pid and its descendants (forked disassembly
    workers share pages with their parent: PSS counts them once)."""
    todo, total = [pid], 0
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        break
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


# BOLT 19 on the same vmlinux, with the flags of its kernel guide (it rewrites
# functions in place; it cannot move or align them in a kernel): the anchor.
BOLT_KERNEL_FLAGS = ["--eliminate-unreachable=0", "--simplify-conditional-tail-calls=0",
                     "--skip-funcs=__entry_text_start,irq_entries_start"]


def run_measured(args, argv=None):
    """(exit status, wall seconds, peak memory MiB, CPU seconds) of one `python -m linepack ARGS`
    process (or of ``argv``): the larger of its own ru_maxrss and the sampled
    peak PSS of its process tree (every 50 ms)."""
    import threading
    t0 = time.monotonic()
    p = subprocess.Popen(argv or [sys.executable, "-m", "linepack", *map(str, args)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.05):
            peak[0] = max(peak[0], _tree_pss_kb(p.pid))
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    err = p.stderr.read()
    done.set()
    th.join()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    p.stderr.close()
    if p.returncode not in (0, 1):
        sys.stderr.write(err.decode(errors="replace")[-2000:])
        raise SystemExit(f"{(argv or ['linepack', args[0]])[:2]} failed with exit status "
                         f"{p.returncode}")
    # CPU: the process and its waited-for descendants (the forked disassemblers)
    cpu = ru.ru_utime + ru.ru_stime
    return p.returncode, wall, max(ru.ru_maxrss, peak[0]) / 1024.0, cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vmlinux", default=VMLINUX)
    ap.add_argument("--profile", help="profile to use (default: record VFS-mix, 200 loops)")
    ap.add_argument("--strategy", default="pack")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", help="also write the results as JSON")
    ap.add_argument("--no-bolt", action="store_true",
                    help="skip the anchor (llvm-bolt-19 rewriting the same vmlinux in place)")
    a = ap.parse_args(argv)
    if not os.path.exists(a.vmlinux):
        raise SystemExit(f"{a.vmlinux}: not found (run `linepack fetch`)")
    with tempfile.TemporaryDirectory(prefix="bench-relayout-") as d:
        prof = a.profile
        if not prof:
            prof = os.path.join(d, "vfs.prof")
            print("recording a VFS-mix profile (not timed) ...", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "linepack", "profile", "--kernel", a.vmlinux,
                            "--workload", "vfs-mix", "--loops", "200", "-o", prof], check=True,
                           stdout=subprocess.DEVNULL)
        out = os.path.join(d, "vmlinux.new")
        rows = {"relayout": [], "verify --against": [], "together": []}
        bolt = None if a.no_bolt else (shutil.which("llvm-bolt-19") or
                                      ("/usr/lib/llvm-19/bin/llvm-bolt"
                                       if os.path.exists("/usr/lib/llvm-19/bin/llvm-bolt") else None))
        if bolt:
            rows["anchor: BOLT 19 in place"] = []
        status = {}
        for i in range(a.runs):
            r1 = run_measured(["relayout", a.vmlinux, "--profile", prof, "--strategy", a.strategy,
                               "-o", out, "-q"])
            r2 = run_measured(["verify", out, "--against", a.vmlinux, "-q"])
            rows["relayout"].append(r1[1:])
            rows["verify --against"].append(r2[1:])
            rows["together"].append((r1[1] + r2[1], max(r1[2], r2[2]), r1[3] + r2[3]))
            status = {"relayout": r1[0], "verify --against": r2[0]}
            if bolt:
                rb = run_measured(None, [bolt, a.vmlinux, "-o", os.path.join(d, "vmlinux.bolt"),
                                         *BOLT_KERNEL_FLAGS])
                rows["anchor: BOLT 19 in place"].append(rb[1:])
                status["anchor: BOLT 19 in place"] = rb[0]
            print(f"run {i + 1}: relayout {r1[1]:.1f} s ({r1[3]:.1f} s CPU) {r1[2]:.0f} MiB, "
                  f"verify {r2[1]:.1f} s ({r2[3]:.1f} s CPU) {r2[2]:.0f} MiB (exit {r2[0]})"
                  + (f", BOLT {rb[1]:.1f} s ({rb[3]:.1f} s CPU) {rb[2]:.0f} MiB" if bolt else "")
                  + f", load average {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
    result = {}
    print(f"\nrelayout ({a.strategy}) + verify --against on {os.path.basename(a.vmlinux)}, "
          f"median of {a.runs} (min..max)")
    print(f"{'step':<18} {'wall s':>20} {'CPU s':>20} {'peak mem MiB':>24}  exit")
    for step, vals in rows.items():
        w = [v[0] for v in vals]
        m = [v[1] for v in vals]
        c = [v[2] for v in vals]
        result[step] = {"wall_s": round(statistics.median(w), 2), "wall_min": round(min(w), 2),
                        "wall_max": round(max(w), 2), "rss_mb": round(statistics.median(m)),
                        "rss_max_mb": round(max(m)), "cpu_s": round(statistics.median(c), 2),
                        "cpu_min": round(min(c), 2), "cpu_max": round(max(c), 2)}
        ex = status.get(step, "")
        print(f"{step:<18} {statistics.median(w):>8.1f} ({min(w):.1f}..{max(w):.1f})"
              f"{statistics.median(c):>8.1f} ({min(c):.1f}..{max(c):.1f})"
              f"{statistics.median(m):>12.0f} ({min(m):.0f}..{max(m):.0f})  {ex}")
    if "anchor: BOLT 19 in place" in result:
        b = result["anchor: BOLT 19 in place"]
        for step in ("relayout", "together"):
            r = result[step]
            print(f"{step} vs BOLT (same run): {r['wall_s'] / b['wall_s']:.2f}x wall, "
                  f"{r['cpu_s'] / max(b['cpu_s'], 1e-9):.2f}x CPU, "
                  f"{r['rss_max_mb'] / max(b['rss_max_mb'], 1):.2f}x peak memory")
    tog = result["together"]
    ok = tog["wall_s"] <= TARGET_WALL_S and tog["rss_max_mb"] <= TARGET_RSS_MB
    print(f"target <= {TARGET_WALL_S:.0f} s and <= {TARGET_RSS_MB:.0f} MiB together: "
          f"{'met' if ok else 'NOT met'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"strategy": a.strategy, "runs": a.runs, "steps": result,
                       "exit": status, "target_met": ok}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
