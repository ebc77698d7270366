"""``linepack evaluate``: side-by-side simulated L1i results for kernels and layouts.

    linepack evaluate --kernel A [--kernel B ...]                    boot each image
    linepack evaluate --kernel BASE --layout stock --layout align-all:64 --layout pack
                      [--profile P] [--whatif]                        layouts of one image
    linepack evaluate --kernel BASE --sweep align-all:1,2,4,...,512 [--booted]
    linepack evaluate --kernel BASE --train W1,W2,... --test W1,W2,... [--strategy pack,blocks] [--weights ...]
                                                     generalization matrix (what-if replay)
    linepack evaluate --program ORIG --program [LABEL=]OTHER ... [-- ARGS...]
                                                     userspace programs under qemu-x86_64
    (--cache is repeatable; --json/--csv/--plot/--heatmap write files)
"""

import csv
import io
import json
import os
import re

from ..cli import verb
from ..errors import EXIT_FINDINGS, BadInput
from ..io import OutputSet, write_atomic
from ..progress import stderr_log
from ..profile.qemu import check_kernel_path


_log = stderr_log("evaluate")


def parse_sweep(spec):
    """'align-all:1,2,4,...,512' -> ('align-all', [1, 2, 4, ..., 512])."""
    name, sep, vals = str(spec).partition(":")
    name = name.strip().lower().replace("_", "-")
    if name != "align-all" or not sep:
        raise BadInput(f"--sweep {spec}: expected align-all:N,N,... (e.g. align-all:1,2,4,...,512)")
    items = [v.strip() for v in vals.split(",") if v.strip()]
    out = []
    for k, v in enumerate(items):
        if v in ("...", "…"):
            if not out or k + 1 >= len(items) or not items[k + 1].isdigit():
                raise BadInput(f"--sweep {spec}: '...' needs a number on each side")
            stop = int(items[k + 1])
            step = out[-1] // out[-2] if len(out) >= 2 and out[-2] and out[-1] % out[-2] == 0 else 2
            if step < 2:
                raise BadInput(f"--sweep {spec}: '...' continues a doubling (or other ratio) series")
            x = out[-1] * step
            while x < stop:
                out.append(x)
                x *= step
            continue
        if not re.fullmatch(r"\d+", v):
            raise BadInput(f"--sweep {spec}: '{v}' is not an alignment")
        a = int(v)
        if a < 1 or a > 512 or a & (a - 1):
            raise BadInput(f"--sweep {spec}: alignment {a} is not a power of two in 1..512")
        if a not in out:
            out.append(a)
    if not out:
        raise BadInput(f"--sweep {spec}: no alignments")
    return name, out


def _growth_cell(pct):
    """.text growth as relayout prints it (2 decimals); n/a for another build."""
    return "n/a" if pct is None else f"{pct:+.2f}%"


def format_rows(rows):
    """One table per cache model; the first layout of each is the baseline."""
    out = []
    several = len({r.get("workload") for r in rows}) > 1
    for wl, cache in dict.fromkeys((r.get("workload"), r["cache"]) for r in rows):
        rs = [r for r in rows if r["cache"] == cache and r.get("workload") == wl]
        base = rs[0]
        mode = ", ".join(dict.fromkeys(r["mode"] for r in rs)) + (f", {wl}" if several else "")
        hdr = (f"{'layout':<16} {'L1i misses':>12} {'vs base':>8} {'fetches':>12} {'miss rate':>9} "
               f"{'MPKI':>7} {'kernel insns':>14} {'hot lines':>9} {'.text':>8} {'time s':>7}")
        out += [f"kernel-mode L1i, {cache} ({mode})", hdr, "-" * len(hdr)]
        for r in rs:
            bm = base["misses"]
            sp = r.get("misses_spread")
            spread = f" ±{sp:.3%}" if sp else ""
            out.append(
                f"{r['layout']:<16} {r['misses']:>12,} {(r['misses'] - bm) / bm if bm else 0:>+8.2%} "
                f"{r['fetches']:>12,} {r['miss_rate']:>9.2%} "
                f"{1000.0 * r['misses'] / r['instructions'] if r['instructions'] else 0:>7.2f} "
                f"{r['instructions']:>14,} "
                f"{r['hot_lines']:>9,} {_growth_cell(r.get('text_growth_pct', 0.0)):>8} "
                f"{r['time_s']:>7.2f}{spread}")
            if r.get("booted_misses") is not None and r["mode"] == "whatif":
                d = r["misses"] - r["booted_misses"]
                out.append(f"{'':<16} booted {r['booted_misses']:,} ({d:+,} replay vs boot)")
        out.append("")
    return "\n".join(out).rstrip("\n")


def _measurement_rows(ms_by_cache, label, text_growth_pct=0.0):
    rows = []
    for cache, m in ms_by_cache.items():
        rows.append({"layout": label, "cache": cache, "mode": "booted",
                     "misses": m.median("misses"), "fetches": m.median("fetches"),
                     "miss_rate": m.median("miss_rate"), "instructions": m.median("instructions"),
                     "hot_lines": m.median("hot_lines"), "text_size": m.median("text_size"),
                     "text_growth_pct": text_growth_pct, "time_s": m.median("wall"),
                     "repeats": len(m.runs), "misses_spread": m.spread("misses"),
                     "instructions_spread": m.spread("instructions"),
                     "result_line": m.runs[0]["result_line"], "image": m.path})
    return rows


def cross_check_rows(rows):
    """Problems: different kernel work (instructions) or workload results across layouts."""
    problems = []
    for wl in dict.fromkeys(r.get("workload") for r in rows):
        problems += _cross_check_workload([r for r in rows if r.get("workload") == wl])
    return problems


def _cross_check_workload(rows):
    from ..evaluate.booted import instruction_tolerance
    problems = []
    for cache in dict.fromkeys(r["cache"] for r in rows):
        rs = [r for r in rows if r["cache"] == cache and r["mode"] == "booted"]
        if not rs:
            continue
        b = rs[0]
        for r in rs[1:]:
            bi, mi = b["instructions"], r["instructions"]
            tol = instruction_tolerance(r["layout"])
            if bi and abs(mi - bi) / bi > tol:
                problems.append(f"{r['layout']}: {mi:,} kernel instructions vs {bi:,} for "
                                f"{b['layout']} ({(mi - bi) / bi:+.3%}): not exactly the same work")
            if r.get("result_line") != b.get("result_line"):
                problems.append(f"{r['layout']}: workload result differs: {r.get('result_line')!r}")
        break       # one cache model is enough: all come from the same boots
    return problems


@verb("evaluate", "compare kernels or layouts: simulated kernel L1i misses, instructions, .text")
class Evaluate:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--kernel", action="append", metavar="VMLINUX",
                       help="a kernel image (repeat; the first is the baseline); LABEL=PATH names "
                       "it. With --layout/--sweep: the one base image")
        p.add_argument("--program", action="append", metavar="[LABEL=]PATH",
                       help="instead of --kernel: a userspace program (PIE or not) run under "
                       "qemu-x86_64 (repeat; the first is the baseline); its arguments go "
                       "after --")
        p.add_argument("program_args", nargs="*", metavar="ARGS",
                       help="with --program: the programs' arguments (after '--')")
        p.add_argument("--layout", action="append", metavar="STRATEGY",
                       help="a layout of the base image: stock, align-all:N, hot64, pack, blocks "
                       "(repeat)")
        p.add_argument("--sweep", metavar="align-all:1,2,4,...,512",
                       help="function alignment sweep (what-if unless --booted)")
        p.add_argument("--whatif", action="store_true",
                       help="replay a block trace recorded once on the base instead of booting")
        p.add_argument("--booted", action="store_true", help="--sweep: boot every point; "
                       "--train/--test: also rewrite and boot every layout on every test workload")
        p.add_argument("--profile", help="profile for hot64/pack/blocks (default: derived from the "
                       "recorded workload run on the base image)")
        p.add_argument("--workload", default="vfs-mix", metavar="W[,W...]",
                       help="workload (comma-separated: several, one table each; default vfs-mix)")
        p.add_argument("-j", "--jobs", type=int, metavar="N",
                       help="boots (and trace recordings) at once on a local process pool "
                       "(default: the cores); the numbers do not depend on it")
        p.add_argument("--scheduler", metavar="ADDRESS",
                       help="run the boots on a Dask distributed cluster (tcp://host:8786) "
                       "instead of this machine")
        p.add_argument("--reuse-runs", action="store_true",
                       help="reuse stored results of boots with the same inputs (content hash) "
                       "instead of booting again")
        p.add_argument("--loops", type=int)
        p.add_argument("--cache", action="append", metavar="MODEL",
                       help="cache model: a name in configs/cache/ or a TOML path (repeat; "
                       "default intel-32k-8w)")
        p.add_argument("--train", metavar="W1,W2,...",
                       help="generalization matrix: a layout per training workload, one from "
                            "their merged profile (and leave-one-out ones), replayed on --test")
        p.add_argument("--test", metavar="W1,W2,...", help="with --train: the workloads to test on")
        p.add_argument("--strategy", default="pack", metavar="S1,S2,...",
                       help="with --train: the layout strategies, comma-separated (default pack; "
                            "pack,blocks for function- and block-level rows)")
        p.add_argument("--weights", metavar="W1,W2,...",
                       help="with --train: weights of the training workloads in the merged profile")
        p.add_argument("--repeat", type=int, default=1, help="boots per image (default 1)")
        p.add_argument("--json", metavar="FILE",
                       help="write the table as JSON (one row per layout/workload/cache model)")
        p.add_argument("--csv", metavar="FILE", help="write the table as CSV (the same rows)")
        p.add_argument("--report", metavar="DIR",
                       help="no run: print the tables of the --json/--csv files in DIR "
                       "(and --plot their bar chart)")
        p.add_argument("--plot", metavar="PNG", help="bar chart of misses per layout (sweep: curve)")
        p.add_argument("--heatmap", metavar="PNG",
                       help="executed text lines of the first and last layout (needs --layout)")

    @staticmethod
    def run(args):
        # Every output checked before any boot; all written together at the end or none.
        inputs = [spec.rpartition("=")[2] for spec in (args.kernel or []) + (args.program or [])]
        if args.report and os.path.isdir(args.report):
            # --report reads every result file there: --plot may not be one of them
            inputs += [os.path.join(args.report, n) for n in sorted(os.listdir(args.report))
                       if n.endswith((".json", ".csv"))]
        with OutputSet(inputs=inputs + [args.profile],
                       outputs={"--json": args.json, "--csv": args.csv, "--plot": args.plot,
                                "--heatmap": args.heatmap}):
            return Evaluate._run(args)

    @staticmethod
    def _run(args):
        from ..profile.trace import cache_config
        if args.repeat < 1:
            raise BadInput("--repeat must be at least 1")
        if args.report:
            return _run_report(args)
        if args.program:
            return _run_programs(args)
        if args.train or args.test:
            return _run_matrix(args)
        if args.weights:
            raise BadInput("--weights goes with --train")
        if not args.kernel:
            raise BadInput("give --kernel VMLINUX (kernels) or --program PATH (userspace programs)")
        if args.program_args:
            raise BadInput(f"unexpected arguments {' '.join(args.program_args)!r} "
                           "(program arguments go after --program PATH --)")
        if args.loops is not None and args.loops < 1:
            raise BadInput("--loops must be at least 1")
        caches = [cache_config(c) for c in (args.cache or ["intel-32k-8w"])]
        if len({c["name"] for c in caches}) != len(caches):
            raise BadInput("--cache: the same cache model is given twice")
        wls = _workloads(args)
        if args.layout and args.sweep:
            raise BadInput("--layout and --sweep do not go together")
        if (args.layout or args.sweep) and len(args.kernel) != 1:
            raise BadInput("--layout/--sweep take exactly one --kernel (the base image)")
        if args.whatif and not (args.layout or args.sweep):
            raise BadInput("--whatif replays layouts of one image: give --layout or --sweep")
        if args.booted and not args.sweep:
            raise BadInput("--booted goes with --sweep (booting is the default otherwise)")
        if args.heatmap and not args.layout:
            raise BadInput("--heatmap needs --layout (it compares the first and last layout)")
        if args.profile and not (args.layout or args.sweep):
            raise BadInput("--profile is for --layout/--sweep strategies")
        sweep = parse_sweep(args.sweep) if args.sweep else None
        if args.layout:
            from ..evaluate.layouts import normalize_spec
            specs = [normalize_spec(s) for s in args.layout]
            if len(set(specs)) != len(specs):
                raise BadInput("--layout: the same layout is given twice")
        for spec in args.kernel:
            check_kernel_path(spec.rpartition("=")[2])

        if args.layout or sweep:
            from ..evaluate.run import evaluate_layouts
            specs = specs if args.layout else ["stock"] + [f"align-all:{a}" for a in sweep[1]]
            rows, extra = evaluate_layouts(
                args.kernel[0].rpartition("=")[2], specs, caches, workload=wls[0],
                loops=args.loops, whatif=(args.whatif or (sweep is not None and not args.booted)),
                profile=args.profile, repeat=args.repeat, heatmap=args.heatmap,
                skip_unfit=sweep is not None, log=_log, workloads=wls, parallel=args.jobs,
                scheduler=args.scheduler, reuse=args.reuse_runs)
        else:
            from ..evaluate.booted import measure_many
            rows, extra = [], {}
            images = [(spec.rpartition("=")[2], spec.rpartition("=")[0] or None)
                      for spec in args.kernel]
            ms = measure_many(images, wls, loops=args.loops, caches=caches, repeat=args.repeat,
                              log=_log, parallel=args.jobs, scheduler=args.scheduler,
                              reuse=args.reuse_runs)
            for path, label in images:
                for w in wls:
                    rs = _measurement_rows(ms[(path, label, w)], label or os.path.basename(path))
                    for r in rs:
                        r["workload"] = w
                    rows += rs
            # .text growth as relayout reports it: how far each region's code end moved
            # (the section sizes never change), in % of the base's _stext.._etext
            from ..evaluate.booted import code_growth
            base_ts, base_path = rows[0]["text_size"], rows[0]["image"]
            growth = {}
            for r in rows:
                if r["image"] not in growth:
                    growth[r["image"]] = code_growth(base_path, r["image"])
                g = r["text_growth_bytes"] = growth[r["image"]]
                r["text_growth_pct"] = None if g is None else 100.0 * g / base_ts if base_ts else 0
        rows.sort(key=lambda r: [c["name"] for c in caches].index(r["cache"]))
        print(format_rows(rows))
        problems = cross_check_rows(rows) + extra.get("problems", [])
        for p in problems:
            print(f"WARNING: {p}")
        for n in extra.get("notes", []):
            print(f"note: {n}")
        if sweep:
            for r in rows:
                r["align"] = int(r["layout"].rstrip("*").split(":")[1]) \
                    if r["layout"].startswith("align-all") \
                    else 0
        if args.plot:
            from ..evaluate import plots
            if sweep:
                plots.sweep_plot(rows, args.plot, title=f"align-all sweep, {args.workload} "
                                 f"({'booted' if args.booted else 'what-if replay'})")
            else:
                plots.bar_chart(rows, args.plot, title=f"kernel-mode L1i misses, {args.workload}")
            _log(f"wrote {args.plot}")
        clean = [{k: v for k, v in r.items() if not k.startswith("block_")} for r in rows]
        if args.json:
            write_atomic(args.json, (json.dumps({"workload": args.workload, "loops": args.loops,
                                                 "caches": caches, "results": clean,
                                                 "problems": problems, "notes": extra.get("notes", []),
                                                 **extra.get("json", {})},
                                                indent=2, default=str) + "\n").encode())
        if args.csv:
            keys = list(dict.fromkeys(k for r in clean for k in r))
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=keys)
            w.writeheader()
            w.writerows(clean)
            write_atomic(args.csv, buf.getvalue().encode())
        return EXIT_FINDINGS if problems else 0


def _run_report(args):
    """--report DIR: tables (and --plot) from result files; nothing runs."""
    from ..evaluate import report
    other = [f for f, on in (("--kernel", args.kernel), ("--program", args.program),
                             ("--layout", args.layout), ("--sweep", args.sweep),
                             ("--train", args.train), ("--json", args.json), ("--csv", args.csv),
                             ("--heatmap", args.heatmap)) if on]
    if other:
        raise BadInput(f"{other[0]} does not go with --report (it runs nothing)")
    loaded = report.load(args.report)          # every file read once
    print(report.render(loaded))
    if args.plot:
        title = f"L1i misses, {os.path.basename(os.path.abspath(args.report))}"
        report.plot(loaded, args.plot, title)
        _log(f"wrote {args.plot}")
    return 0


def _workloads(args):
    """--workload W1,W2: names checked (one clear error before any boot), in order."""
    from ..profile import workloads
    wls = [w.strip() for w in str(args.workload).split(",") if w.strip()]
    if not wls or len(set(wls)) != len(wls):
        raise BadInput(f"--workload {args.workload}: give each workload once")
    for w in wls:
        workloads.load(w)
    if args.jobs is not None and args.jobs < 1:
        raise BadInput("--jobs must be at least 1")
    return wls


def _run_matrix(args):
    from ..evaluate.matrix import format_matrix, generalization_matrix, heatmap_png, matrix_json
    from ..evaluate.layouts import normalize_spec
    from ..profile import workloads
    from ..profile.trace import cache_config
    if not (args.train and args.test):
        raise BadInput("--train and --test go together (comma-separated workload names)")
    if not args.kernel or len(args.kernel) != 1:
        raise BadInput("--train/--test take exactly one --kernel (the base image)")
    if args.layout or args.sweep or args.profile or args.heatmap:
        raise BadInput("--train/--test do not go with --layout, --sweep, --profile or --heatmap")
    base = args.kernel[0].rpartition("=")[2]
    if not os.path.isfile(base):
        raise BadInput(f"--kernel {base}: no such file")
    train = [w.strip() for w in args.train.split(",") if w.strip()]
    test = [w.strip() for w in args.test.split(",") if w.strip()]
    for w in train + test:
        workloads.load(w)                      # unknown names: one clear error before any boot
    weights = None
    if args.weights:
        try:
            weights = [float(x) for x in args.weights.split(",")]
        except ValueError:
            raise BadInput(f"--weights {args.weights!r}: expected comma-separated numbers") from None
    if args.loops is not None and args.loops < 1:
        raise BadInput("--loops must be at least 1")
    strategy = [normalize_spec(x) for x in args.strategy.split(",") if x.strip()]
    if not strategy:
        raise BadInput("--strategy: expected one or more strategy names, comma-separated")
    caches = [cache_config(c) for c in (args.cache or ["intel-32k-8w"])]
    loops = {w: args.loops for w in train + test} if args.loops else None
    m = generalization_matrix(base, train, test, strategy=strategy, caches=caches, loops=loops,
                              weights=weights, log=_log, parallel=args.jobs,
                              scheduler=args.scheduler, booted=args.booted)
    print(format_matrix(m))
    if args.json:
        write_atomic(args.json, json.dumps(matrix_json(m), indent=1, sort_keys=True) + "\n")
    if args.plot:
        heatmap_png(m, args.plot)
        _log(f"wrote {args.plot}")
    return EXIT_FINDINGS if m.get("problems") else 0


def _run_programs(args):
    """--program: userspace programs under qemu-x86_64 (tools/evaluate/user.py)."""
    from ..evaluate.user import evaluate_programs, format_rows
    from ..profile.trace import cache_config
    other = [f for f, on in (("--kernel", args.kernel), ("--layout", args.layout),
                             ("--sweep", args.sweep), ("--whatif", args.whatif),
                             ("--booted", args.booted), ("--profile", args.profile),
                             ("--loops", args.loops is not None), ("--plot", args.plot),
                             ("--heatmap", args.heatmap)) if on]
    if other:
        raise BadInput(f"{other[0]} does not go with --program")
    caches = [cache_config(c) for c in (args.cache or ["intel-32k-8w"])]
    if len({c["name"] for c in caches}) != len(caches):
        raise BadInput("--cache: the same cache model is given twice")
    rows, problems = evaluate_programs(args.program, caches, args.program_args or [],
                                       repeat=args.repeat, log=_log)
    print(format_rows(rows))
    for p in problems:
        print(f"WARNING: {p}")
    if args.json:
        write_atomic(args.json, (json.dumps({"programs": args.program,
                                             "args": args.program_args or [],
                                             "caches": caches, "results": rows,
                                             "problems": problems},
                                            indent=2, default=str) + "\n").encode())
    if args.csv:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
        write_atomic(args.csv, buf.getvalue().encode())
    return EXIT_FINDINGS if problems else 0
