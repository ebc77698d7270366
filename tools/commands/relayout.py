"""``linepack relayout``: move functions per a layout strategy and rewrite the image."""

import argparse
import json
import sys
import time

from ..cli import verb, wall_seconds
from ..errors import BadInput
from .. import timings
from ..io import OutputSet, load_toml, write_atomic


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
        p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")

    @staticmethod
    def run(args):
        from ..relayout import strategies
        from ..relayout.driver import load_profile_full, relayout

        if args.keep_debug:
            raise BadInput("--keep-debug is gone: relayout now rewrites the DWARF for the new "
                           "layout by default (--strip-debug drops it)")
        log = _log_fn(args.quiet)
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
        s = summary
        print(f"relayout {args.image} -> {args.output} ({s['strategy']})")
        print(f"  functions moved:   {s['functions_moved']} ({s['units_moved']} units of "
              f"{s['units']})")
        print(f"  hot text:          {s['hot_text_bytes']} bytes in {s['hot_units']} units")
        print(f"  padding:           {s['padding_bytes']:,} bytes; .text growth "
              f"{s['text_growth_bytes']:+,} bytes ({s['text_growth_pct']:+.2f}% of .text)")
        print(f"  hot 64 B lines:    {s['hot_lines_before']} -> {s['hot_lines_after']} "
              f"({s['hot_functions']} hot functions, whole functions)")
        if "block_lines_before" in s:
            b0, b1 = s["block_lines_before"], s["block_lines_after"]
            print(f"  executed lines:    {b0} -> {b1} ({(b1 - b0) / b0 if b0 else 0:+.1%}; 64 B lines "
                  f"holding blocks run at least once per iteration, {s['blocks']} blocks)")
        print(f"  references fixed:  {s.get('relocations.fields_changed', 0)} relocated fields, "
              f"{s.get('branches.rel32_fixed', 0)} rel32 + {s.get('branches.rel8_fixed', 0)} rel8 "
              f"branches, {s.get('rip_relative.fixed', 0)} RIP-relative")
        if "references" in s:
            r = s["references"]
            un = r.get("unexplained") or {}
            print(f"  references:        recovered from the vmlinuz: {r['recovered']} fields; "
                  f"{un.get('fields', 0)} unexplained data values pinned "
                  f"{un.get('functions_pinned', 0)} units")
        tables = [k.split('.', 1)[1] for k in s if k.startswith("table.")]
        if tables:
            print(f"  kernel tables:     {', '.join(tables)}")
        if "static_keys.sites_rechecked" in s:
            print(f"  static keys:       {s['static_keys.sites_rechecked']} sites re-checked "
                  f"({s['static_keys.two_byte']} 2-byte still in rel8 reach, "
                  f"{s['static_keys.five_byte_in_rel8_reach']} 5-byte could be 2-byte)")
        if "split" in s:
            sp = s["split"]
            print(f"  block split:       {sp['functions_split']} functions split "
                  f"({sp['hot_part_bytes']} hot + {sp['cold_part_bytes']} cold bytes, "
                  f"{sp['split_growth_bytes']:+d}); {sp['copied']} blocks copied, "
                  f"{sp['branch']} branches re-encoded, {sp['jmp_inserted']} jmps inserted, "
                  f"{sp['jmp_removed']} removed")
            if "ext_tsp_score" in sp:
                e = sp["ext_tsp_score"]
                print(f"  hot block order:   ext-TSP, {e['functions_reordered']} functions "
                      f"reordered; objective {e['original']:,.1f} -> {e['ordered']:,.1f} "
                      "(original order -> chosen)")
            for why, n in sorted(sp["hot_functions_by_reason"].items(), key=lambda x: -x[1]):
                print(f"    hot functions {'split' if why == 'split' else 'whole: ' + why}: {n}")
        if "static_keys.made_short" in s:
            print(f"  static keys:       {s['static_keys.made_short']} made short, "
                  f"{s['static_keys.made_long']} made long, {s['static_keys.unchanged']} unchanged")
        if "orc_unwind.entries_after" in s:
            print(f"  ORC:               {s['orc_unwind.block_entries_wanted']} block entries wanted, "
                  f"{s['orc_unwind.entries_after']} of {s['orc_unwind.entries_before']} slots used "
                  "after compaction")
        if "orc_unwind.padding_runs_covered" in s:
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
        print(f"  wall time:         {wall_seconds():.1f} s (the whole command)")
        return 0
