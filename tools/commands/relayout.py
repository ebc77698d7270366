"""``linepack relayout``: move functions per a layout strategy and rewrite the image."""

import argparse
import json
import os
import sys
import time

from ..cli import verb
from ..errors import BadInput
from ..io import load_toml, write_atomic


def _log_fn(quiet):
    t0 = time.time()

    def log(msg):
        if not quiet:
            print(f"linepack: [{time.time() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)
    return log


@verb("relayout", "re-lay out functions of an ELF image (vmlinux) per a profile and a strategy")
class Relayout:
    @staticmethod
    def add_arguments(p):
        p.add_argument("image", help="input ELF (vmlinux linked with --emit-relocs)")
        p.add_argument("-o", "--output", required=True, help="output image (written atomically)")
        p.add_argument("--profile", help="profile (linepack profile model, or JSON "
                       "{\"functions\": {name: count}})")
        p.add_argument("--config", help="strategy config (configs/relayout/*.toml)")
        p.add_argument("--strategy", help="stock | align-all N | hot64 | pack (overrides --config)")
        p.add_argument("--min-count", type=float, help="hotness threshold (per workload iteration)")
        p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
        p.add_argument("--system-map", metavar="FILE", help="write the new System.map")
        p.add_argument("--layout-map", metavar="FILE", help="write old -> new address per function")
        p.add_argument("--strip-debug", action="store_true",
                       help="drop the DWARF instead of rewriting it for the new layout")
        p.add_argument("--keep-debug", action="store_true", help=argparse.SUPPRESS)
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    @staticmethod
    def run(args):
        from ..relayout import strategies
        from ..relayout.driver import load_profile_full, relayout

        if args.keep_debug:
            raise BadInput("--keep-debug is gone: relayout now rewrites the DWARF for the new "
                           "layout by default (--strip-debug drops it)")
        log = _log_fn(args.quiet)
        cfg = load_toml(args.config) if args.config else {"strategy": "pack"}
        if args.strategy:
            cfg = {"strategy": args.strategy}
        if args.min_count is not None:
            cfg["min_count"] = args.min_count
        strat = strategies.get(dict(cfg))
        if os.path.exists(args.output) and os.path.exists(args.image) and \
                os.path.samefile(args.image, args.output):
            raise BadInput(f"{args.output}: output is the input; linepack never modifies its input")
        hot, build_id, calls, blocks = ({}, None, [], None)
        if args.profile:
            lp = load_profile_full(args.profile, args.image)
            hot, build_id, calls, blocks = lp.hotness, lp.build_id, lp.calls, lp.blocks
        elif strat.name not in ("stock",) and not strat.name.startswith("align-all"):
            raise BadInput(f"strategy {strat.name} needs --profile")
        summary, plan, rw = relayout(args.image, args.output, strat, hotness=hot, calls=calls,
                                     profile_build_id=build_id, log=log, blocks=blocks,
                                     debug="strip" if args.strip_debug else "rewrite",
                                     layout_map=args.layout_map, system_map=args.system_map)
        s = summary
        print(f"relayout {args.image} -> {args.output} ({s['strategy']})")
        print(f"  functions moved:   {s['functions_moved']} ({s['units_moved']} units of "
              f"{s['units']})")
        print(f"  hot text:          {s['hot_text_bytes']} bytes in {s['hot_units']} units")
        print(f"  padding:           {s['padding_bytes']} bytes; .text growth "
              f"{s['text_growth_bytes']:+d} bytes")
        print(f"  hot 64 B lines:    {s['hot_lines_before']} -> {s['hot_lines_after']} "
              f"({s['hot_functions']} hot functions, whole functions)")
        if "block_lines_before" in s:
            b0, b1 = s["block_lines_before"], s["block_lines_after"]
            print(f"  executed lines:    {b0} -> {b1} ({(b1 - b0) / b0 if b0 else 0:+.1%}; 64 B lines "
                  f"holding blocks run at least once per iteration, {s['blocks']} blocks)")
        print(f"  references fixed:  {s.get('relocations.fields_changed', 0)} relocated fields, "
              f"{s.get('branches.rel32_fixed', 0)} rel32 + {s.get('branches.rel8_fixed', 0)} rel8 "
              f"branches, {s.get('rip_relative.fixed', 0)} RIP-relative")
        tables = [k.split('.', 1)[1] for k in s if k.startswith("table.")]
        if tables:
            print(f"  kernel tables:     {', '.join(tables)}")
        if "static_keys.sites_rechecked" in s:
            print(f"  static keys:       {s['static_keys.sites_rechecked']} sites re-checked "
                  f"({s['static_keys.two_byte']} 2-byte still in rel8 reach, "
                  f"{s['static_keys.five_byte_in_rel8_reach']} 5-byte could be 2-byte)")
        if "orc_unwind.padding_runs" in s:
            print(f"  ORC padding:       {s['orc_unwind.padding_runs']} padding runs, "
                  f"{s['orc_unwind.padding_runs_covered']} already covered, "
                  f"{s['orc_unwind.padding_entries_added']} entries added "
                  f"({s['orc_unwind.dropped_shadowed']} shadowed + "
                  f"{s['orc_unwind.dropped_unmapped']} dead entries reused), "
                  f"{s['orc_unwind.padding_runs_without_entry']} without room")
        print(f"  DWARF:             {s['dwarf']}" + (
            f" ({s.get('dwarf_line_sequences_out', 0)} line sequences, "
            f"{s.get('dwarf_units_relisted', 0) + s.get('dwarf_units_converted_to_ranges', 0)} "
            f"unit range lists rebuilt)" if s['dwarf'] == 'rewritten' else ""))
        for p in s["problems"][:10]:
            print(f"  problem: {p['kind']} at {p['address']}: {p['message']}")
        if args.json:
            write_atomic(args.json, json.dumps(s, indent=1, sort_keys=True) + "\n")
        return 0
