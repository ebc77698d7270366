"""What each relayout pass reports: one small dataclass per pass.

Each object serialises to its part of the summary JSON (``to_json``: flat keys,
as the summary has always had them) and prints its lines of the human summary
(``lines``). ``counters`` hold the detail figures the lower layers (rewriter,
kernel tables, unwind rebuild, ...) count: they go to the JSON as they are.
"""

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class PassStats:
    """Base: nothing in the JSON, nothing printed."""

    def to_json(self):
        return {}

    def lines(self):
        return []


@dataclass
class LoadStats(PassStats):
    """Input checks: what kind of image, how many functions, unknown profile names.
    (Not in the summary JSON: its keys predate the passes and stay as they were.)"""
    kind: str = ""
    functions: int = 0
    profile_names_missing: int = 0


@dataclass
class DisassemblyStats(PassStats):
    """Units and their heat; an executable's PC-relative data fields into code
    (switch-table entries, self-relative pointers, loose fields: relayout/user/pie.py)."""
    units: int = 0
    hot_units: int = 0
    pic_table_entries: Optional[int] = None
    pcrel_data_unexplained: Optional[int] = None
    pcrel_self_relative: int = 0
    pcrel_pinned_units: int = 0
    pcrel_examples: list = field(default_factory=list)

    def to_json(self):
        if self.pic_table_entries is None:
            return {}
        # loose fields (no switch-table entry, no self-relative pointer to a
        # function) are kept as they are and the functions they may designate pinned
        out = {"pie.pic_table_entries": self.pic_table_entries,
               "pie.pcrel_data_unexplained": self.pcrel_data_unexplained,
               "pcrel_data.self_relative": self.pcrel_self_relative,
               "pcrel_data.pinned_units": self.pcrel_pinned_units}
        if self.pcrel_data_unexplained:
            out["pcrel_data.unexplained_examples"] = self.pcrel_examples
        return out

    def lines(self):
        if self.pic_table_entries is None:
            return []
        out = [f"  PC-relative data:  {self.pic_table_entries} switch-table entries, "
               f"{self.pcrel_self_relative} self-relative fields into code, "
               f"{self.pcrel_data_unexplained} not explained (left as they are; "
               f"{self.pcrel_pinned_units} functions they may designate pinned)"]
        for e in self.pcrel_examples:
            out.append(f"    not explained: {e['field']} in {e['section']} (value {e['value']}, "
                       f"relative to itself: {e['relative_to_itself']})")
        return out


@dataclass
class SplitStats(PassStats):
    """The block-level split: which hot functions were split, why the others were
    not, and (filled when the parts are emitted) the block map's figures."""
    functions_split: int = 0
    functions_reordered_whole: int = 0     # of functions_split: one part, nothing cold
    hot_functions_by_reason: dict = field(default_factory=dict)
    blocks: int = 0
    patch_site_jmps: int = 0
    patch_site_jmps_split: int = 0
    hot_part_bytes: int = 0
    cold_part_bytes: int = 0
    split_growth_bytes: int = 0
    branches_reencoded: dict = field(default_factory=dict)
    jcc_inverted: int = 0
    ext_tsp_score: Optional[dict] = None
    block_map: dict = field(default_factory=dict)      # blockmap.summary of the rows
    branch_bytes_saved: int = 0

    def to_json(self):
        out = dict(self.block_map)
        out.update({
            "functions_split": self.functions_split,
            "hot_functions_by_reason": self.hot_functions_by_reason,
            "blocks": self.blocks,
            # jmps that end an alternative site (may become NOPs at boot): they fall through
            "patch_site_jmps": self.patch_site_jmps,
            "patch_site_jmps_split": self.patch_site_jmps_split,
            "hot_part_bytes": self.hot_part_bytes,
            "cold_part_bytes": self.cold_part_bytes,
            "split_growth_bytes": self.split_growth_bytes,
            "branches_reencoded": self.branches_reencoded,
            "jcc_inverted": self.jcc_inverted})
        if self.functions_reordered_whole:
            out["functions_reordered_whole"] = self.functions_reordered_whole
        if self.ext_tsp_score is not None:
            out["ext_tsp_score"] = self.ext_tsp_score
        out["branch_bytes_saved"] = self.branch_bytes_saved
        return {"split": out}

    def lines(self):
        m = self.block_map
        out = [f"  block split:       {self.functions_split} functions split "
               f"({self.hot_part_bytes} hot + {self.cold_part_bytes} cold bytes, "
               f"{self.split_growth_bytes:+d});"
               + (f" {self.functions_reordered_whole} of them reordered whole (nothing cold);"
                  if self.functions_reordered_whole else "") +
               f" {m['copied']} blocks copied, "
               f"{m['branch']} branches re-encoded, {m['jmp_inserted']} jmps inserted, "
               f"{m['jmp_removed']} removed"]
        if self.ext_tsp_score is not None:
            e = self.ext_tsp_score
            out.append(f"  hot block order:   ext-TSP, {e['functions_reordered']} functions "
                       f"reordered; objective {e['original']:,.1f} -> {e['ordered']:,.1f} "
                       "(original order -> chosen)")
        for why, n in sorted(self.hot_functions_by_reason.items(), key=lambda x: -x[1]):
            out.append(f"    hot functions {'split' if why == 'split' else 'whole: ' + why}: {n}")
        return out


@dataclass
class PlanStats(PassStats):
    """The layout plan: units and functions moved, hot text."""
    strategy: str = ""
    units: int = 0
    units_moved: int = 0
    functions_moved: int = 0
    hot_units: int = 0
    hot_text_bytes: int = 0

    def to_json(self):
        return {"strategy": self.strategy, "units": self.units, "units_moved": self.units_moved,
                "functions_moved": self.functions_moved, "hot_units": self.hot_units,
                "hot_text_bytes": self.hot_text_bytes}

    def lines(self):
        return [f"  functions moved:   {self.functions_moved} ({self.units_moved} units of "
                f"{self.units})",
                f"  hot text:          {self.hot_text_bytes} bytes in {self.hot_units} units"]


@dataclass
class CounterStats(PassStats):
    """A pass whose figures are the lower layers' counters (flat JSON keys)."""
    counters: dict = field(default_factory=dict)

    def to_json(self):
        return dict(self.counters)

    def get(self, key, default=0):
        return self.counters.get(key, default)


@dataclass
class CodeStats(CounterStats):
    """Code copied to its new place (``units_moved``)."""


@dataclass
class ReferenceStats(CounterStats):
    """Relocated fields, assembler-resolved branches, RIP-relative operands, symbols."""

    def lines(self):
        return [f"  references fixed:  {self.get('relocations.fields_changed')} relocated fields, "
                f"{self.get('branches.rel32_fixed')} rel32 + {self.get('branches.rel8_fixed')} rel8 "
                f"branches, {self.get('rip_relative.fixed')} RIP-relative"]


@dataclass
class StaticKeyStats(CounterStats):
    """``__jump_table`` sites after the rewrite. Function level: every site keeps its
    size; block level: the split re-encoded some (``made_short``/``made_long``)."""

    def lines(self):
        c = self.counters
        if "static_keys.sites_rechecked" not in c:
            return []
        n, two, five = (c["static_keys.sites_rechecked"], c["static_keys.two_byte"],
                        c["static_keys.five_byte"])
        near = c["static_keys.five_byte_in_rel8_reach"]
        after = (f"{two} 2-byte (all reach their target), {five} 5-byte "
                 f"({near} of them within rel8 reach)")
        if "static_keys.made_short" not in c:
            return [f"  static keys:       {n} sites, sizes kept (functions move whole): "
                    + after]
        short, long_ = c["static_keys.made_short"], c["static_keys.made_long"]
        before_two = two - short + long_
        return [f"  static keys:       {n} sites: {before_two} 2-byte + {n - before_two} 5-byte "
                f"before; relayout made {short} short, {long_} long, kept "
                f"{c['static_keys.unchanged']}; after: " + after]


@dataclass
class TargetStats(CounterStats):
    """The target's tables or metadata (kernel tables; eh_frame, dynsym, dynamic).
    ``tables``: kernel table name -> entries written."""
    tables: list = field(default_factory=list)

    def lines(self):
        c = self.counters
        out = []
        if self.tables:
            out.append(f"  kernel tables:     {', '.join(self.tables)}")
        if "orc_unwind.entries_after" in c:
            out.append(f"  ORC:               {c['orc_unwind.block_entries_wanted']} block entries "
                       f"wanted, {c['orc_unwind.entries_after']} of {c['orc_unwind.entries_before']} "
                       "slots used after compaction")
        if "orc_unwind.padding_runs_covered" in c:
            out.append(f"  ORC padding:       {c['orc_unwind.padding_runs']} padding runs, "
                       f"{c['orc_unwind.padding_runs_covered']} already covered, "
                       f"{c['orc_unwind.padding_entries_added']} entries added "
                       f"({c['orc_unwind.dropped_shadowed']} shadowed + "
                       f"{c['orc_unwind.dropped_unmapped']} dead entries reused), "
                       f"{c['orc_unwind.padding_runs_without_entry']} without room")
        return out


@dataclass
class SymbolStats(CounterStats):
    """The symbol table (block level: ``.cold`` parts, kallsyms grown for them)."""

    def lines(self):
        if "kallsyms.cold_entries" in self.counters:
            return [f"  kallsyms:          {self.counters['kallsyms.cold_entries']} .cold entries "
                    f"added ({self.counters['kallsyms.symbols']} symbols)"]
        return []


@dataclass
class DwarfStats(PassStats):
    """``mode``: "rewritten", "dropped" or "none in the input"."""
    mode: str = "none in the input"
    counters: dict = field(default_factory=dict)

    def to_json(self):
        return {"dwarf": self.mode, **self.counters}

    def lines(self):
        c = self.counters
        return [f"  DWARF:             {self.mode}" + (
            f" ({c.get('dwarf_line_sequences_out', 0)} line sequences, "
            f"{c.get('dwarf_units_relisted', 0) + c.get('dwarf_units_converted_to_ranges', 0)} "
            f"unit range lists rebuilt; address fields from "
            f"{c.get('dwarf_fields_from', 'relocations')})" if self.mode == "rewritten" else "")]


@dataclass
class WriteStats(PassStats):
    """The output image (not in the JSON)."""
    path: str = ""
    sections_added: int = 0


@dataclass
class MetricsStats(PassStats):
    """The layout's figures: cache lines, padding, .text growth, problems."""
    hot_functions: int = 0
    hot_lines_before: int = 0
    hot_lines_after: int = 0
    blocks: Optional[int] = None
    block_lines_before: Optional[int] = None
    block_lines_after: Optional[int] = None
    kept_regions: list = field(default_factory=list)
    compact_regions: list = field(default_factory=list)
    padding_bytes: int = 0
    text_growth_bytes: int = 0
    text_growth_pct: float = 0.0
    new_segment: Optional[dict] = None   # userspace code moved to a new segment
    problems: list = field(default_factory=list)        # (kind, address, message)
    counted: str = "per iteration"       # what "at least once" counts over

    def to_json(self):
        out = {"hot_functions": self.hot_functions, "hot_lines_before": self.hot_lines_before,
               "hot_lines_after": self.hot_lines_after}
        if self.blocks is not None:
            out.update({"blocks": self.blocks, "block_lines_before": self.block_lines_before,
                        "block_lines_after": self.block_lines_after})
        # regions that kept their original layout, or got the strategy's order without
        # its alignment padding (no room for the padding before pinned code)
        out.update({"kept_regions": list(self.kept_regions),
                    "compact_regions": list(self.compact_regions),
                    "padding_bytes": self.padding_bytes,
                    "text_growth_bytes": self.text_growth_bytes,
                    "text_growth_pct": self.text_growth_pct})
        if self.new_segment is not None:
            out["new_segment"] = dict(self.new_segment)
        return out

    def problems_json(self):
        return [{"kind": k, "address": f"{a:#x}", "message": m} for k, a, m in self.problems]

    def lines(self):
        out = [f"  padding:           {self.padding_bytes:,} bytes; .text growth "
               f"{self.text_growth_bytes:+,} bytes ({self.text_growth_pct:+.2f}% of .text)",
               f"  hot 64 B lines:    {self.hot_lines_before} -> {self.hot_lines_after} "
               f"({self.hot_functions} hot functions, whole functions)"]
        if self.new_segment is not None:
            g = self.new_segment
            out.insert(1, f"  new segment:       at {g['address']}, {g['size']:,} bytes "
                       f"({g['text_bytes']:,} of code, {g['eh_bytes']:,} of unwind tables)")
        if self.block_lines_before is not None:
            b0, b1 = self.block_lines_before, self.block_lines_after
            out.append(f"  executed lines:    {b0} -> {b1} ({(b1 - b0) / b0 if b0 else 0:+.1%}; "
                       f"64 B lines holding blocks run at least once {self.counted}, "
                       f"{self.blocks} blocks)")
        return out

    def problem_lines(self, limit=10):
        return [f"  problem: {k} at {a:#x}: {m}" for k, a, m in self.problems[:limit]]


class RelayoutSummary(dict):
    """The summary JSON (a dict, as relayout() has always returned) plus the
    pass stats it was built from (``stats``: [(pass name, stats)])."""

    def __init__(self, stats):
        super().__init__()
        self.stats = list(stats)
        by_type = {type(s): s for _, s in self.stats}
        for _, s in self.stats:
            for k, v in s.to_json().items():
                if isinstance(v, dict) and isinstance(self.get(k), dict):
                    self[k].update(v)
                else:
                    self[k] = v
        metrics = by_type.get(MetricsStats)
        self["problems"] = metrics.problems_json() if metrics else []

    def of(self, cls):
        return next((s for _, s in self.stats if isinstance(s, cls)), None)

    def lines(self):
        """The human summary: the layout's figures first, then each pass's lines
        in pass order, then the problems."""
        plan, metrics = self.of(PlanStats), self.of(MetricsStats)
        out = (plan.lines() if plan else []) + (metrics.lines() if metrics else [])
        for _, s in self.stats:
            if s is not plan and s is not metrics:
                out += s.lines()
        return out + (metrics.problem_lines() if metrics else [])


@dataclass
class RecoveredReferencesStats(PassStats):
    """relayout --vmlinuz: references recovered instead of read from link relocations."""
    references: dict = field(default_factory=dict)

    def to_json(self):
        return {"references": self.references}

    def lines(self):
        r = self.references
        un = r.get("unexplained") or {}
        return [f"  references:        recovered from the vmlinuz: {r.get('recovered', 0)} fields; "
                f"{un.get('fields', 0)} unexplained data values pinned "
                f"{un.get('functions_pinned', 0)} units"]
