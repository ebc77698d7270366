"""evaluate's modes: what a run of ``linepack evaluate`` does, chosen by its options.

    --report DIR              ReportMode    tables (and a chart) from saved result files
    --program P ...           ProgramsMode  userspace programs under qemu-x86_64
    --train W --test W        MatrixMode    the generalization matrix (what-if replay)
    --kernel BASE --layout S  LayoutsMode   strategies on one base image
    --kernel BASE --sweep ... SweepMode     the function-alignment sweep
    --kernel K [--kernel K]   KernelsMode   kernels side by side, each booted

Each mode declares the options it takes; any other option given is refused by
one generic check (``refuse``), with the mode's own reason where it has one.
The first mode (in that order) whose choosing option is given runs.
"""

import os
import re

from ..errors import EXIT_FINDINGS, BadInput
from . import table

# Every option of the verb (argparse dest -> how the user writes it), in the
# parser's order: the first refused option is the one named.
OPTIONS = {
    "kernel": "--kernel", "program": "--program", "program_args": "ARGS", "compare": "--compare",
    "mask": "--mask", "placements": "--placements", "layout": "--layout", "vmlinuz": "--vmlinuz",
    "sweep": "--sweep", "whatif": "--whatif", "booted": "--booted", "profile": "--profile",
    "workload": "--workload", "jobs": "--jobs", "scheduler": "--scheduler",
    "reuse_runs": "--reuse-runs", "loops": "--loops", "cache": "--cache", "train": "--train",
    "test": "--test", "strategy": "--strategy", "weights": "--weights", "repeat": "--repeat",
    "json": "--json", "csv": "--csv", "report": "--report", "plot": "--plot",
    "heatmap": "--heatmap", "sets": "--sets", "sets_plot": "--sets-plot",
}
# Defaults of options whose parser default is None (so that giving one is seen).
DEFAULTS = {"workload": "vfs-mix", "strategy": "pack", "repeat": 1, "compare": "output"}
# Counts that must be at least 1 wherever they are taken.
AT_LEAST_ONE = ("jobs", "loops", "repeat")
DEFAULT_CACHE = "intel-32k-8w"


def given(args, dest):
    """Whether the user gave the option (a flag set, a value, a non-empty list)."""
    v = getattr(args, dest, None)
    return v is not None and v is not False and v != []


def value(args, dest):
    """The option's value, or its default."""
    v = getattr(args, dest, None)
    return DEFAULTS.get(dest) if v is None else v


def caches_of(args):
    """The cache models of --cache (default intel-32k-8w), each given once."""
    from ..profile.trace import cache_config
    caches = [cache_config(c) for c in (args.cache or [DEFAULT_CACHE])]
    if len({c["name"] for c in caches}) != len(caches):
        raise BadInput("--cache: the same cache model is given twice")
    return caches


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


class Mode:
    """One mode of evaluate. ``chosen_by``: its choosing option(s), as messages name
    them; ``takes``: the options (argparse dests) it uses; ``refusals``: the reason
    it gives for refusing an option, where a plain "does not go with" would not
    say enough ({flag} and {value} are filled in); ``note``: added to the plain one."""

    name = ""
    chosen_by = ""
    takes = frozenset()
    refusals = {"program_args": "unexpected arguments {value!r} (program arguments go after "
                                "--program PATH --)"}
    note = ""

    def chosen(self, args):
        raise NotImplementedError

    def refuse(self, args):
        """The one check of which options go together: BadInput for the first option
        given that this mode does not take; then every count taken must be >= 1."""
        for dest, flag in OPTIONS.items():
            if given(args, dest) and dest not in self.takes:
                v = getattr(args, dest)
                why = self.refusals.get(dest, "{flag} does not go with " + self.chosen_by +
                                        self.note)
                raise BadInput(why.format(flag=flag, value=" ".join(v) if isinstance(v, list)
                                          else v))
        for dest in AT_LEAST_ONE:
            if dest in self.takes and given(args, dest) and value(args, dest) < 1:
                raise BadInput(f"{OPTIONS[dest]} must be at least 1")

    def run(self, args, log, echo):
        """Check the option values, do the work, print the table (``echo``); the exit status."""
        raise NotImplementedError


class ReportMode(Mode):
    name = "report"
    chosen_by = "--report"
    note = " (it runs nothing)"
    takes = frozenset({"report", "plot"})

    def chosen(self, args):
        return given(args, "report")

    def run(self, args, log, echo):
        from . import report
        loaded = report.load(args.report)          # every file read once
        echo(report.render(loaded))
        if args.plot:
            title = f"L1i misses, {os.path.basename(os.path.abspath(args.report))}"
            report.plot(loaded, args.plot, title)
            log(f"wrote {args.plot}")
        return 0


class ProgramsMode(Mode):
    name = "programs"
    chosen_by = "--program"
    takes = frozenset({"program", "program_args", "compare", "mask", "placements", "cache",
                       "repeat", "json", "csv"})
    refusals = {}

    def chosen(self, args):
        return given(args, "program")

    def run(self, args, log, echo):
        from .user import evaluate_programs, format_rows
        caches = caches_of(args)
        rows, problems = evaluate_programs(args.program, caches, args.program_args or [],
                                           repeat=value(args, "repeat"), log=log,
                                           compare=value(args, "compare"), masks=args.mask or (),
                                           placements=args.placements)
        echo(format_rows(rows))
        for p in problems:
            echo(f"{'CRASH' if ': crashed (' in p else 'WARNING'}: {p}")
        flat = [{k: v for k, v in r.items() if k not in ("per_placement", "shift_pages")}
                for r in rows]                  # CSV: one value a cell (the JSON has them)
        table.write_results(args.json, args.csv, rows=flat,
                            doc={"programs": args.program, "args": args.program_args or [],
                                 "compare": value(args, "compare"), "masks": args.mask or [],
                                 "placements": rows[0]["placements"] if rows else None,
                                 "caches": caches, "results": rows, "problems": problems})
        return EXIT_FINDINGS if problems else 0


class MatrixMode(Mode):
    name = "matrix"
    chosen_by = "--train/--test"
    takes = frozenset({"kernel", "train", "test", "strategy", "weights", "loops", "cache", "jobs",
                       "scheduler", "booted", "json", "plot"})
    refusals = dict(Mode.refusals, csv="--csv does not go with --train/--test (the matrix is "
                                       "written by --json)")

    def chosen(self, args):
        return given(args, "train") or given(args, "test")

    def run(self, args, log, echo):
        from ..profile import workloads
        from .layouts import normalize_spec
        from .matrix import format_matrix, generalization_matrix, heatmap_png, matrix_json
        if not (args.train and args.test):
            raise BadInput("--train and --test go together (comma-separated workload names)")
        if not args.kernel or len(args.kernel) != 1:
            raise BadInput("--train/--test take exactly one --kernel (the base image)")
        base = args.kernel[0].rpartition("=")[2]
        if not os.path.isfile(base):
            raise BadInput(f"--kernel {base}: no such file")
        train = [w.strip() for w in args.train.split(",") if w.strip()]
        test = [w.strip() for w in args.test.split(",") if w.strip()]
        for w in train + test:
            workloads.load(w)                  # unknown names: one clear error before any boot
        weights = None
        if args.weights:
            try:
                weights = [float(x) for x in args.weights.split(",")]
            except ValueError:
                raise BadInput(f"--weights {args.weights!r}: expected comma-separated "
                               "numbers") from None
        strategy = [normalize_spec(x) for x in value(args, "strategy").split(",") if x.strip()]
        if not strategy:
            raise BadInput("--strategy: expected one or more strategy names, comma-separated")
        caches = caches_of(args)
        loops = {w: args.loops for w in train + test} if args.loops else None
        m = generalization_matrix(base, train, test, strategy=strategy, caches=caches, loops=loops,
                                  weights=weights, log=log, parallel=args.jobs,
                                  scheduler=args.scheduler, booted=args.booted)
        echo(format_matrix(m))
        table.write_results(args.json, doc=matrix_json(m), indent=1, sort_keys=True)
        if args.plot:
            heatmap_png(m, args.plot)
            log(f"wrote {args.plot}")
        return EXIT_FINDINGS if m.get("problems") else 0


class _KernelMode(Mode):
    """The modes that boot (or replay) kernel images: what they share."""

    chosen_by = "--kernel"
    takes = frozenset({"kernel", "workload", "jobs", "scheduler", "reuse_runs", "loops", "cache",
                       "repeat", "json", "csv", "plot"})
    refusals = dict(
        Mode.refusals,
        whatif="--whatif replays layouts of one image: give --layout or --sweep",
        booted="--booted goes with --sweep (booting is the default otherwise)",
        heatmap="--heatmap needs --layout (it compares the first and last layout)",
        profile="--profile is for --layout/--sweep strategies",
        weights="--weights goes with --train",
        strategy="--strategy goes with --train/--test (layouts of one image: --layout)",
        sets="--sets goes with --layout ... --whatif (the per-set load of replayed layouts)",
        sets_plot="--sets-plot goes with --layout ... --whatif (the per-set load of replayed "
                  "layouts)",
        vmlinuz="--vmlinuz goes with --layout/--sweep (the base image's references; kernels "
                "are booted as they are)")

    def check_kernels(self, args):
        if not args.kernel:
            raise BadInput("give --kernel VMLINUX (kernels) or --program PATH (userspace programs)")

    def workloads(self, args):
        """--workload W1,W2: names checked (one clear error before any boot), in order."""
        from ..profile import workloads
        spec = value(args, "workload")
        wls = [w.strip() for w in str(spec).split(",") if w.strip()]
        if not wls or len(set(wls)) != len(wls):
            raise BadInput(f"--workload {spec}: give each workload once")
        for w in wls:
            workloads.load(w)
        return wls

    def run(self, args, log, echo):
        from ..profile.qemu import check_kernel_path
        self.check_kernels(args)
        caches = caches_of(args)
        wls = self.workloads(args)
        specs = self.specs(args)
        for spec in args.kernel:
            check_kernel_path(spec.rpartition("=")[2])
        rows, extra = self.measure(args, specs, caches, wls, log)
        rows.sort(key=lambda r: [c["name"] for c in caches].index(r["cache"]))
        echo(table.format_rows(rows))
        problems = table.cross_check_rows(rows) + extra.get("problems", [])
        for p in problems:
            echo(f"WARNING: {p}")
        for n in extra.get("notes", []):
            echo(f"note: {n}")
        sets = extra.get("sets") or []
        if sets:
            from .dense import format_set_summary
            echo("")
            echo(format_set_summary([(s["layout"] + (f" {s['workload']}" if len(wls) > 1 else ""),
                                      s["cache"], s["ways"], s) for s in sets]))
        self.add_columns(rows)
        if args.plot:
            self.plot(args, rows)
            log(f"wrote {args.plot}")
        if getattr(args, "sets_plot", None):
            from . import plots
            plots.set_load_plot(sets, args.sets_plot,
                                title=f"per-set load, {value(args, 'workload')}")
            log(f"wrote {args.sets_plot}")
        clean = [{k: v for k, v in r.items() if not k.startswith("block_")} for r in rows]
        table.write_results(args.json, args.csv, rows=clean,
                            doc={"workload": value(args, "workload"), "loops": args.loops,
                                 "caches": caches, "results": clean, "problems": problems,
                                 "notes": extra.get("notes", []), **extra.get("json", {}),
                                 **({"sets": sets} if sets else {})})
        return EXIT_FINDINGS if problems else 0

    def specs(self, args):
        """The layouts to measure (None: the images as they are)."""
        return None

    def add_columns(self, rows):
        """Columns of this mode added to the rows before they are written."""

    def plot(self, args, rows):
        from . import plots
        plots.bar_chart(rows, args.plot, title=f"kernel-mode L1i misses, {value(args, 'workload')}")


class KernelsMode(_KernelMode):
    """Each --kernel booted; .text growth as relayout reports it."""

    name = "kernels"

    def chosen(self, args):
        return True

    def measure(self, args, specs, caches, wls, log):
        from .booted import code_growth, measure_many
        rows = []
        images = [(spec.rpartition("=")[2], spec.rpartition("=")[0] or None)
                  for spec in args.kernel]
        ms = measure_many(images, wls, loops=args.loops, caches=caches,
                          repeat=value(args, "repeat"), log=log, parallel=args.jobs,
                          scheduler=args.scheduler, reuse=args.reuse_runs)
        for path, label in images:
            for w in wls:
                rs = table.measurement_rows(ms[(path, label, w)], label or os.path.basename(path))
                for r in rs:
                    r["workload"] = w
                rows += rs
        # Kernels of several builds (say 6.12 and 7.3, each stock and rewritten) share one
        # table: each row's baseline is the first image of its own build (build-id), which
        # the change, the cross-checks and the .text growth are measured against.
        base_of = _baselines([path for path, _ in images])
        by_image = {}
        for r in rows:
            by_image.setdefault((r["image"], r["workload"], r["cache"]), r)
        for r in rows:
            b = by_image[(base_of[r["image"]], r["workload"], r["cache"])]
            if len(set(base_of.values())) > 1:
                r["baseline"] = b["layout"]
        # .text growth as relayout reports it: how far each region's code end moved
        # (the section sizes never change), in % of the baseline's _stext.._etext
        growth = {}
        for r in rows:
            base_path = base_of[r["image"]]
            base_ts = by_image[(base_path, r["workload"], r["cache"])]["text_size"]
            if r["image"] not in growth:
                growth[r["image"]] = code_growth(base_path, r["image"])
            g = r["text_growth_bytes"] = growth[r["image"]]
            r["text_growth_pct"] = None if g is None else 100.0 * g / base_ts if base_ts else 0
        return rows, {}


def _baselines(paths):
    """{path: the first of ``paths`` with its build-id} (a path whose build-id cannot be
    read is its own baseline only when it comes first: the first path otherwise)."""
    from ..errors import LinepackError
    from ..image.elf import ElfImage
    first, out = {}, {}
    for p in paths:
        try:
            bid = ElfImage(p).build_id
        except LinepackError:
            bid = None
        out[p] = first.setdefault(bid, p) if bid else paths[0]
    return out


class LayoutsMode(_KernelMode):
    """Strategies (--layout) on one base image, rewritten and booted, or replayed."""

    name = "layouts"
    chosen_by = "--layout"
    takes = _KernelMode.takes | {"layout", "vmlinuz", "whatif", "profile", "heatmap", "sets",
                                 "sets_plot"}
    refusals = dict(_KernelMode.refusals, sweep="--layout and --sweep do not go together")

    def chosen(self, args):
        return given(args, "layout")

    def check_kernels(self, args):
        super().check_kernels(args)
        if len(args.kernel) != 1:
            raise BadInput("--layout/--sweep take exactly one --kernel (the base image)")

    def specs(self, args):
        from . import dense
        from .layouts import normalize_spec
        specs = []
        for s in args.layout:
            d = dense.parse(s)
            if d and not args.whatif:
                raise BadInput(f"--layout {s} is what-if only (the packing cannot boot): add "
                               "--whatif")
            specs.append(d[0] if d else normalize_spec(s))
        if len(set(specs)) != len(specs):
            raise BadInput("--layout: the same layout is given twice")
        if (args.sets or args.sets_plot) and not args.whatif:
            raise BadInput("--sets/--sets-plot need --whatif (the per-set load comes from the "
                           "replayed trace)")
        return specs

    def measure(self, args, specs, caches, wls, log, whatif=None, skip_unfit=False):
        from .run import evaluate_layouts
        return evaluate_layouts(
            args.kernel[0].rpartition("=")[2], specs, caches, workload=wls[0], loops=args.loops,
            whatif=args.whatif if whatif is None else whatif, profile=args.profile,
            repeat=value(args, "repeat"), heatmap=args.heatmap, skip_unfit=skip_unfit, log=log,
            workloads=wls, parallel=args.jobs, scheduler=args.scheduler, reuse=args.reuse_runs,
            sets=bool(getattr(args, "sets", False) or getattr(args, "sets_plot", None)),
            vmlinuz=args.vmlinuz)


class SweepMode(LayoutsMode):
    """The function-alignment sweep: stock and align-all:N for each N, what-if
    unless --booted; a layout the rewriter cannot produce is left out with a note."""

    name = "sweep"
    chosen_by = "--sweep"
    takes = _KernelMode.takes | {"sweep", "vmlinuz", "whatif", "booted", "profile"}
    refusals = _KernelMode.refusals

    def chosen(self, args):
        return given(args, "sweep")

    def specs(self, args):
        return ["stock"] + [f"align-all:{a}" for a in parse_sweep(args.sweep)[1]]

    def measure(self, args, specs, caches, wls, log):
        return super().measure(args, specs, caches, wls, log,
                               whatif=args.whatif or not args.booted, skip_unfit=True)

    def add_columns(self, rows):
        for r in rows:
            r["align"] = int(r["layout"].rstrip("*").split(":")[1]) \
                if r["layout"].startswith("align-all") \
                else 0

    def plot(self, args, rows):
        from . import plots
        plots.sweep_plot(rows, args.plot, title=f"align-all sweep, {value(args, 'workload')} "
                         f"({'booted' if args.booted else 'what-if replay'})")


MODES = (ReportMode(), ProgramsMode(), MatrixMode(), LayoutsMode(), SweepMode(), KernelsMode())


def choose(args):
    """The mode the options choose (see the module's docstring)."""
    return next(m for m in MODES if m.chosen(args))


def run(args, log=None, echo=print):
    """Run ``linepack evaluate`` with parsed ``args``: the exit status."""
    log = log or (lambda m: None)
    mode = choose(args)
    mode.refuse(args)
    return mode.run(args, log, echo)
