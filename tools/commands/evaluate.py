"""``linepack evaluate``: side-by-side simulated L1i results for kernels."""

import csv
import io
import json
import sys

from ..cli import verb
from ..errors import EXIT_FINDINGS, BadInput
from ..io import write_atomic


def _log(m):
    print(f"evaluate: {m}", file=sys.stderr, flush=True)


@verb("evaluate", "boot kernels under the L1i model and compare misses, instructions, text size")
class Evaluate:
    @staticmethod
    def add_arguments(p):
        p.add_argument("--kernel", action="append", required=True, metavar="VMLINUX",
                       help="a kernel image (repeat; the first is the baseline); LABEL=PATH names it")
        p.add_argument("--workload", default="vfs-mix")
        p.add_argument("--loops", type=int)
        p.add_argument("--cache", default="intel-32k-8w",
                       help="cache model: a name in configs/cache/ or a TOML path")
        p.add_argument("--repeat", type=int, default=1, help="runs per image (default 1)")
        p.add_argument("--json", metavar="FILE")
        p.add_argument("--csv", metavar="FILE")

    @staticmethod
    def run(args):
        from ..evaluate.booted import cross_check, format_table, measure

        if args.repeat < 1:
            raise BadInput("--repeat must be at least 1")
        ms = []
        for spec in args.kernel:
            label, _, path = spec.rpartition("=")
            ms.append(measure(path, label=label or None, workload=args.workload, loops=args.loops,
                              cache=args.cache, repeat=args.repeat, log=_log))
        print(format_table(ms, args.cache))
        problems = cross_check(ms)
        for p in problems:
            print(f"WARNING: {p}")
        rows = [m.as_dict() for m in ms]
        if args.json:
            write_atomic(args.json, (json.dumps({"cache": args.cache, "workload": args.workload,
                                                 "results": rows, "problems": problems},
                                                indent=2) + "\n").encode())
        if args.csv:
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
            write_atomic(args.csv, buf.getvalue().encode())
        return EXIT_FINDINGS if problems else 0
