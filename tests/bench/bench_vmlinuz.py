"""Benchmark: relayout from a vmlinuz (recovered references) on the kernels distributions ship.

    python3 tests/bench/bench_vmlinuz.py [--runs 3] [--series 6.1,6.12,7.3]
        [--profile SERIES=PATH ...] [--strategies pack,blocks] [--no-bolt] [--strip-debug]
        [--json FILE]

Each step is its own `linepack` process (as a packager runs it), timed with
bench_relayout's harness: wall time, CPU (with the waited-for children) and
peak memory (the larger of ru_maxrss and the sampled PSS of the process tree);
medians of ``--runs`` runs, every step of one run measured back to back, so a
ratio compares steps that saw the same load.

- 6.1 (Debian 12, keeps its link relocations): relayout from the link
  relocations against relayout of a relocation-stripped copy (objcopy
  --remove-relocations='*' --strip-debug, as tests/test_references_vmlinux.py
  makes it) with ``--vmlinuz``; both with ``--strip-debug``, so only the source
  of the references differs. Target: vmlinuz <= 1.3x link.
- 6.12 and 7.3 (as shipped, no relocations): relayout ``--vmlinuz`` of the -dbg
  vmlinux, then ``verify --against`` it. Target (7.3, blocks): together <= 30 s
  and <= 1.5 GB on 2 cores (read as 1.5e9 bytes, 1,430 MiB: the stricter of
  GB and GiB). The output keeps the DWARF, rewritten
  (relayout's default, for the -dbg package), and verify checks it;
  ``--strip-debug`` drops it instead (as a packager building only the boot
  image would).
- BOLT 19 (llvm-bolt-19, the in-place rewrite with its kernel guide's flags) on
  each series' vmlinux in the same run: its time and memory where it runs, its
  one-line refusal where it does not.

A step that linepack refuses (exit 2: e.g. 6.1 blocks from the vmlinuz when
kallsyms would have to grow past __end_rodata) is reported with its message,
not timed. Profiles: ``--profile 7.3=vfs-7.3.prof`` per series; a series
without one gets a VFS-mix profile recorded first (20 loops, not timed).
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_relayout import BOLT_KERNEL_FLAGS, _tree_pss_kb  # noqa: E402
from linepack import targets  # noqa: E402

RATIO_TARGET = 1.3          # 6.1: relayout from the vmlinuz / from the link relocations
WALL_TARGET_S = 30.0        # 7.3: relayout blocks + verify --against
MEM_TARGET_MIB = 1.5e9 / 2 ** 20      # 1.5 GB, decimal: 1,430.5 MiB


def measured(argv):
    """(exit status, wall s, peak MiB, CPU s, last stderr line) of one process."""
    t0 = time.monotonic()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.05):
            peak[0] = max(peak[0], _tree_pss_kb(p.pid))
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    err = p.stderr.read().decode(errors="replace")
    done.set()
    th.join()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    p.stderr.close()
    rc = os.waitstatus_to_exitcode(status)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    # the reason: linepack's one line, BOLT's last error, or the signal that killed it
    why = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "")
    if rc < 0:
        why = f"killed by signal {-rc} ({signal.Signals(-rc).name}) after {wall:.1f} s"
    return rc, wall, max(ru.ru_maxrss, peak[0]) / 1024.0, ru.ru_utime + ru.ru_stime, why


def linepack(*args):
    return [sys.executable, "-m", "linepack", *map(str, args)]


def bolt_path():
    return shutil.which("llvm-bolt-19") or next(
        (p for p in ("/usr/lib/llvm-19/bin/llvm-bolt",) if os.path.exists(p)), None)


class Steps:
    """Measurements per step name, in the order first seen."""

    def __init__(self):
        self.rows, self.failed = {}, {}

    def add(self, name, r):
        rc, wall, mem, cpu, last = r
        if rc not in (0, 1):        # 1: verify found something (reported, still timed)
            self.failed[name] = f"exit {rc}: {last}" if rc > 0 else last
            self.rows.setdefault(name, [])
            return None
        self.rows.setdefault(name, []).append((wall, mem, cpu, rc))
        return r

    def median(self, name, col):
        v = [r[col] for r in self.rows.get(name, [])]
        return statistics.median(v) if v else None

    def result(self):
        out = {}
        for name, rows in self.rows.items():
            if not rows:
                out[name] = {"refused": self.failed.get(name)}
                continue
            w, m, c = ([r[k] for r in rows] for k in range(3))
            out[name] = {"wall_s": round(statistics.median(w), 2), "wall_min": round(min(w), 2),
                         "wall_max": round(max(w), 2), "mem_mib": round(statistics.median(m)),
                         "mem_max_mib": round(max(m)), "cpu_s": round(statistics.median(c), 2),
                         "exit": rows[-1][3], "runs": len(rows)}
            if name in self.failed:
                out[name]["refused_in_some_runs"] = self.failed[name]
        return out


def get_profile(series, vmlinux, given, d):
    if series in given:
        return given[series]
    p = os.path.join(d, f"vfs-{series}.prof")
    print(f"recording a VFS-mix profile of {series} (not timed) ...", file=sys.stderr, flush=True)
    subprocess.run(linepack("profile", "--kernel", vmlinux, "--workload", "vfs-mix",
                            "--loops", 20, "-o", p), check=True, stdout=subprocess.DEVNULL)
    return p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--series", default="6.1,6.12,7.3")
    ap.add_argument("--strategies", default="pack,blocks")
    ap.add_argument("--profile", action="append", default=[], metavar="SERIES=PATH")
    ap.add_argument("--no-bolt", action="store_true")
    ap.add_argument("--strip-debug", action="store_true",
                    help="6.12/7.3: relayout --strip-debug (default: the DWARF is kept, rewritten)")
    ap.add_argument("--json", help="also write the results as JSON")
    a = ap.parse_args(argv)
    series = [s for s in a.series.split(",") if s]
    strategies = [s for s in a.strategies.split(",") if s]
    given = dict(p.split("=", 1) for p in a.profile)
    bolt = None if a.no_bolt else bolt_path()
    steps = Steps()
    loads = []
    with tempfile.TemporaryDirectory(prefix="bench-vmlinuz-") as d:
        kern = {}
        for s in series:
            vmlinux, vmlinuz = targets.debian_vmlinux(series=s), targets.debian_vmlinuz(series=s)
            kern[s] = (vmlinux, vmlinuz, get_profile(s, vmlinux, given, d))
        if "6.1" in kern:
            stripped = os.path.join(d, "vmlinux-6.1.norela")
            subprocess.run(["objcopy", "--remove-relocations=*", "--strip-debug", kern["6.1"][0],
                            stripped], check=True)
        for run in range(a.runs):
            loads.append(os.getloadavg()[0])
            for s, (vmlinux, vmlinuz, prof) in kern.items():
                for strat in strategies:
                    out = os.path.join(d, f"{s}.{strat}")
                    if s == "6.1":
                        steps.add(f"6.1 {strat}: link relocations", measured(linepack(
                            "relayout", vmlinux, "--profile", prof, "--strategy", strat,
                            "--strip-debug", "-q", "-o", out + ".link")))
                        steps.add(f"6.1 {strat}: --vmlinuz", measured(linepack(
                            "relayout", stripped, "--vmlinuz", vmlinuz, "--profile", prof,
                            "--strategy", strat, "--strip-debug", "-q", "-o", out)))
                        continue
                    r1 = steps.add(f"{s} {strat}: relayout --vmlinuz", measured(linepack(
                        "relayout", vmlinux, "--vmlinuz", vmlinuz, "--profile", prof,
                        "--strategy", strat, *(["--strip-debug"] if a.strip_debug else []),
                        "-q", "-o", out)))
                    if r1 is None:
                        continue
                    r2 = steps.add(f"{s} {strat}: verify --against", measured(linepack(
                        "verify", out, "--against", vmlinux, "-q")))
                    if r2 is not None:
                        steps.add(f"{s} {strat}: together",
                                  (r2[0], r1[1] + r2[1], max(r1[2], r2[2]), r1[3] + r2[3], ""))
                    os.unlink(out)
                if bolt:
                    bo = os.path.join(d, f"{s}.bolt")
                    r = measured([bolt, vmlinux, "-o", bo, *BOLT_KERNEL_FLAGS])
                    steps.add(f"{s}: BOLT 19 in place", r)
                    if os.path.exists(bo):
                        os.unlink(bo)
            print(f"run {run + 1} done, load average {os.getloadavg()[0]:.1f}", file=sys.stderr,
                  flush=True)
    res = steps.result()
    print(f"\nrelayout from a vmlinuz, median of {a.runs} (min..max); load average at the "
          f"runs' starts: {', '.join(f'{x:.1f}' for x in loads)}; {os.cpu_count()} cores; "
          f"6.12/7.3 DWARF {'dropped (--strip-debug)' if a.strip_debug else 'kept, rewritten'}")
    print(f"{'step':<34} {'wall s':>18} {'CPU s':>7} {'peak MiB':>9}")
    for name, r in res.items():
        if "wall_s" not in r:
            print(f"{name:<34} refused: {r['refused']}")
            continue
        print(f"{name:<34} {r['wall_s']:>7.1f} ({r['wall_min']:.1f}..{r['wall_max']:.1f})"
              f" {r['cpu_s']:>7.1f} {r['mem_max_mib']:>9.0f}"
              + (f"  (exit {r['exit']})" if r["exit"] else ""))
    verdict = {}
    for strat in strategies:
        link, rec = res.get(f"6.1 {strat}: link relocations"), res.get(f"6.1 {strat}: --vmlinuz")
        if link and rec and "wall_s" in link and "wall_s" in rec:
            ratio = rec["wall_s"] / link["wall_s"]
            verdict[f"6.1 {strat} vmlinuz/link"] = round(ratio, 2)
            print(f"6.1 {strat}: --vmlinuz / link relocations = {ratio:.2f}x wall, "
                  f"{rec['mem_max_mib'] / link['mem_max_mib']:.2f}x peak memory "
                  f"(target <= {RATIO_TARGET}x: {'met' if ratio <= RATIO_TARGET else 'NOT met'})")
    for s in series:
        if s == "6.1":
            continue
        for strat in strategies:
            t = res.get(f"{s} {strat}: together")
            if not t or "wall_s" not in t:
                continue
            ok = t["wall_s"] <= WALL_TARGET_S and t["mem_max_mib"] <= MEM_TARGET_MIB
            verdict[f"{s} {strat} together"] = ok
            print(f"{s} {strat}: relayout + verify --against {t['wall_s']:.1f} s, "
                  f"{t['mem_max_mib']:.0f} MiB (target <= {WALL_TARGET_S:.0f} s and "
                  f"<= {MEM_TARGET_MIB:.0f} MiB: {'met' if ok else 'NOT met'})")
            b = res.get(f"{s}: BOLT 19 in place")
            if b and "wall_s" in b:
                print(f"  vs BOLT 19 in place on the same vmlinux: "
                      f"{t['wall_s'] / b['wall_s']:.2f}x wall, "
                      f"{t['mem_max_mib'] / max(b['mem_max_mib'], 1):.2f}x peak memory")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": a.runs, "loadavg": loads, "steps": res, "verdict": verdict,
                       "strip_debug": a.strip_debug},
                      f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
