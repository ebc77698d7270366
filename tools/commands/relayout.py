"""``linepack relayout``: move functions per a layout strategy and rewrite the image."""

import argparse
import json

from ..cli import verb, wall_seconds
from ..errors import BadInput
from .. import timings
from ..io import OutputSet, load_toml, write_atomic
from ..progress import stderr_log


@verb("relayout", "re-lay out functions of an ELF image (vmlinux) per a profile and a strategy")
class Relayout:
    @staticmethod
    def add_arguments(p):
        p.add_argument("image", help="input ELF (vmlinux linked with --emit-relocs)")
        p.add_argument("-o", "--output", required=True, help="output image (written atomically)")
        p.add_argument("--profile", help="profile (linepack profile model, or JSON "
                       "{\"functions\": {name: count}})")
        p.add_argument("--config", help="strategy config (configs/relayout/*.toml)")
        p.add_argument("--strategy", help="stock | align-all N | hot64 | pack | blocks (overrides --config)")
        p.add_argument("--min-count", type=float, help="hotness threshold (per workload iteration)")
        p.add_argument("--allow-missing", action="store_true",
                       help="accept a profile naming many functions the image does not have "
                       "(by default more than 5%% unknown names is an error)")
        p.add_argument("--vmlinuz", metavar="VMLINUZ",
                       help="the kernel's boot image (same build): recover the references from "
                       "its KASLR table, the code and the kernel tables instead of reading link "
                       "relocations (kernels >= 6.5 ship without them)")
        p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
        p.add_argument("--system-map", metavar="FILE", help="write the new System.map")
        p.add_argument("--layout-map", metavar="FILE", help="write old -> new address per function")
        p.add_argument("--strip-debug", action="store_true",
                       help="drop the DWARF instead of rewriting it for the new layout")
        p.add_argument("--keep-debug", action="store_true", help=argparse.SUPPRESS)
        p.add_argument("--verify", action="store_true",
                       help="then run `verify OUTPUT --against IMAGE` in the same process (the "
                       "same checks and report, with --layout-map the map too; exit 1 on "
                       "findings)")
        p.add_argument("--verify-json", metavar="FILE",
                       help="with --verify: write verify's report to FILE ('-' = stdout)")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    @staticmethod
    def run(args):
        from ..relayout import strategies

        if args.keep_debug:
            raise BadInput("--keep-debug is gone: relayout now rewrites the DWARF for the new "
                           "layout by default (--strip-debug drops it)")
        log = stderr_log("linepack", args.quiet, clock=True)
        if args.min_count is not None and not args.min_count >= 0:
            raise BadInput(f"--min-count {args.min_count:g}: must be >= 0")
        cfg = load_toml(args.config) if args.config else {"strategy": "pack"}
        if args.strategy:
            cfg = {"strategy": args.strategy}
        if args.min_count is not None:
            cfg["min_count"] = args.min_count
        strat = strategies.get(dict(cfg))
        # Every output checked before any work; written all together or not at all.
        outs = OutputSet(inputs=[args.image, args.profile, args.config, args.vmlinuz],
                         outputs={"-o": args.output, "--json": args.json,
                                  "--system-map": args.system_map,
                                  "--layout-map": args.layout_map})
        if args.verify_json and not args.verify:
            raise BadInput("--verify-json needs --verify")
        if args.verify:
            return _relayout_then_verify(args, strat, outs, log)
        return _run_relayout(args, strat, outs, log)


def _run_relayout(args, strat, outs, log):
    summary = _relayout(args, strat, outs, log)
    print(f"relayout {args.image} -> {args.output} ({summary['strategy']})")
    for line in summary.lines():       # each pass's stats print themselves
        print(line)
    print(f"  wall time:         {wall_seconds():.1f} s (the whole command)")
    return 0


def _relayout_then_verify(args, strat, outs, log):
    """``relayout ... --verify``: the rewrite in a forked child (its memory goes with it),
    the original decoded for verify meanwhile in this process, then, when the child wrote
    the outputs, ``verify OUTPUT --against IMAGE`` here (commands/verify.py ``check``:
    the same checks and report as the separate command)."""
    import importlib
    import os
    import signal
    import sys
    from ..cli import run_handled
    # numpy's unique() imports numpy.ma at its first call (numpy 2.x): once, before
    # the fork, rather than in both processes
    importlib.import_module("numpy.ma")
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                          # child: the relayout command
        status = 1
        try:
            status = run_handled(lambda a: _run_relayout(a, strat, outs, log), args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    try:
        # verify's modules imported here, while the child rewrites (it needs none of them)
        from ..verify.equivalence import _decoded_old
        from ..verify.forked import Computed
        from .verify import check
        try:
            old_decode = Computed(_decoded_old, args.image)
        except Exception:
            old_decode = None      # verify decodes it again and says what is wrong with it
        _, wstatus = os.waitpid(pid, 0)
    except BaseException:          # interrupted: the rewrite stops too (it removes its temps)
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
        raise
    status = os.waitstatus_to_exitcode(wstatus)
    if status != 0:
        return status if status > 0 else 128 - status    # it said why (or was killed)
    # the layout map relayout wrote is checked too, as `verify --layout-map` does
    return check(args.output, args.image, layout_map=args.layout_map, json_path=args.verify_json,
                 quiet=args.quiet, old_decode=old_decode)


def _relayout(args, strat, outs, log):
    """Profile loaded, layout made, outputs written; the summary."""
    from ..relayout.driver import load_profile_full, relayout
    hot, build_id, calls, blocks = ({}, None, [], None)
    if args.profile:
        timings.phase("load profile")
        lp = load_profile_full(args.profile, args.image)
        hot, build_id, calls, blocks = lp.hotness, lp.build_id, lp.calls, lp.blocks
    elif strat.name not in ("stock",) and not strat.name.startswith("align-all"):
        raise BadInput(f"strategy {strat.name} needs --profile")
    with outs:
        summary, plan, rw = relayout(args.image, args.output, strat, hotness=hot, calls=calls,
                                     profile_build_id=build_id, log=log, blocks=blocks,
                                     debug="strip" if args.strip_debug else "rewrite",
                                     layout_map=args.layout_map, system_map=args.system_map,
                                     allow_missing=args.allow_missing,
                                     vmlinuz=args.vmlinuz)
        if args.json:
            write_atomic(args.json, json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return summary
