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

The modes, the options each takes and the work: tools/evaluate/modes.py.
"""

import os

from ..cli import verb
from ..evaluate import modes
from ..io import OutputSet
from ..progress import stderr_log


_log = stderr_log("evaluate")


@verb("evaluate", "compare kernels or layouts: simulated kernel L1i misses, instructions, .text")
class Evaluate:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--kernel", action="append", metavar="VMLINUX",
                       help="a kernel image (repeat; the first is the baseline, the first of "
                       "each build when they are of several builds, e.g. 6.12 and 7.3); "
                       "LABEL=PATH names it. With --layout/--sweep: the one base image")
        p.add_argument("--program", action="append", metavar="[LABEL=]PATH",
                       help="instead of --kernel: a userspace program (PIE or not) run under "
                       "qemu-x86_64 (repeat; the first is the baseline); its arguments go "
                       "after --")
        p.add_argument("program_args", nargs="*", metavar="ARGS",
                       help="with --program: the programs' arguments (after '--')")
        p.add_argument("--compare", choices=["output", "exit"],
                       help="with --program: what must match the first program's: stdout and "
                       "exit status (output, the default) or the exit status only (exit)")
        p.add_argument("--mask", action="append", metavar="REGEX",
                       help="with --program: text of stdout that may differ (timings...), "
                       "replaced before comparing; ^ and $ match at lines (repeat)")
        p.add_argument("--placements", type=int, metavar="N",
                       help="with --program: run every program with libc at N placements (page "
                       "shifts, as ASLR gives) and report the mean and the spread (default: "
                       "the distinct ones of the largest cache way, at most 8: 8 for "
                       "amd-64k-2w, 1 for intel-32k-8w)")
        p.add_argument("--layout", action="append", metavar="STRATEGY",
                       help="a layout of the base image: stock, align-all:N, hot64, pack, blocks "
                       "(repeat); with --whatif also the dense reference dense[:N], "
                       "dense-hot[:N], dense-first[:N] (docs/evaluate.md)")
        p.add_argument("--vmlinuz", metavar="VMLINUZ",
                       help="with --layout/--sweep: the base kernel's boot image, for a vmlinux "
                       "without link relocations (6.5 and later): references recovered from it, "
                       "as relayout --vmlinuz does")
        p.add_argument("--sweep", metavar="align-all:1,2,4,...,512",
                       help="function alignment sweep (what-if unless --booted)")
        p.add_argument("--whatif", action="store_true",
                       help="replay a block trace recorded once on the base instead of booting")
        p.add_argument("--booted", action="store_true", help="--sweep: boot every point; "
                       "--train/--test: also rewrite and boot every layout on every test workload")
        p.add_argument("--profile", help="profile for hot64/pack/blocks (default: derived from the "
                       "recorded workload run on the base image)")
        p.add_argument("--workload", metavar="W[,W...]",
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
        p.add_argument("--strategy", metavar="S1,S2,...",
                       help="with --train: the layout strategies, comma-separated (default pack; "
                            "pack,blocks for function- and block-level rows)")
        p.add_argument("--weights", metavar="W1,W2,...",
                       help="with --train: weights of the training workloads in the merged profile")
        p.add_argument("--repeat", type=int, help="boots per image (default 1)")
        p.add_argument("--json", metavar="FILE",
                       help="write the table as JSON (one row per layout/workload/cache model)")
        p.add_argument("--csv", metavar="FILE", help="write the table as CSV (the same rows)")
        p.add_argument("--report", metavar="DIR",
                       help="no run: print the tables of the --json/--csv files in DIR "
                       "(and --plot their bar chart)")
        p.add_argument("--plot", metavar="PNG", help="bar chart of misses per layout (sweep: curve)")
        p.add_argument("--heatmap", metavar="PNG",
                       help="executed text lines of the first and last layout (needs --layout)")
        p.add_argument("--sets", action="store_true",
                       help="with --layout ... --whatif: print each layout's per-set load (loop "
                       "lines and accesses per cache set)")
        p.add_argument("--sets-plot", metavar="PNG",
                       help="with --layout ... --whatif: plot each layout's per-set load")

    @staticmethod
    def run(args):
        # Every output checked before any boot; all written together at the end or none.
        inputs = [spec.rpartition("=")[2] for spec in (args.kernel or []) + (args.program or [])]
        if args.report and os.path.isdir(args.report):
            # --report reads every result file there: --plot may not be one of them
            inputs += [os.path.join(args.report, n) for n in sorted(os.listdir(args.report))
                       if n.endswith((".json", ".csv"))]
        with OutputSet(inputs=inputs + [args.profile, args.vmlinuz],
                       outputs={"--json": args.json, "--csv": args.csv, "--plot": args.plot,
                                "--heatmap": args.heatmap, "--sets-plot": args.sets_plot}):
            return modes.run(args, log=_log)
