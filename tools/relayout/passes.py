"""relayout as an ordered list of passes over one context.

Each pass is a function ``pass_(run) -> stats`` (relayout/stats.py) that reads
and fills the ``RelayoutRun``; ``FUNCTION_PASSES`` lays out whole functions,
``BLOCK_PASSES`` splits hot functions into hot and cold parts first. What a
kernel and an executable do differently is asked of ``run.target``
(relayout/target.py), never of the image.

    function level: load, disassemble, plan, code, references, static keys,
                    metadata, symbols, DWARF, write, summary, maps
    block level:    load, disassemble, split, plan, parts, code, references,
                    static keys, metadata, symbols, DWARF, write, summary, maps
"""

import gc
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from .. import timings
from ..errors import BadInput
from ..image.elf import ET_DYN, ET_EXEC
from ..image.functions import text_size
from ..native import release_free_memory
from . import stats as S
from . import strategies
from .plan import LayoutError, make_plan


@dataclass
class RelayoutRun:
    """Everything the passes share: the inputs, then what each pass builds."""
    image_path: str
    out_path: str
    strategy: Any
    hotness: dict
    calls: Any = ()
    profile_build_id: Optional[str] = None
    blocks: Any = None
    log: Callable = lambda m: None
    debug: str = "rewrite"
    layout_map: Optional[str] = None
    system_map: Optional[str] = None
    allow_missing: bool = False
    vmlinuz: Optional[str] = None    # a kernel's boot image: references recovered from it
    # built by the passes
    recovered: Any = None            # image/references.py References (with --vmlinuz)
    image: Any = None
    target: Any = None               # KernelTarget or UserTarget
    functions: Any = None
    units: Any = None                # planning units (block level: hot and cold parts)
    orig_units: Any = None           # the image's units (before a split)
    dis: Any = None
    heat: Any = None
    orig_heat: Any = None            # block level: the heat of the image's units (before a split)
    split: Optional[dict] = None     # block level: cfg, splits, reasons, planning, ...
    split_stats: Optional[S.SplitStats] = None
    plan: Any = None
    rewriter: Any = None
    extra_sections: list = field(default_factory=list)
    alloc_sections: list = field(default_factory=list)
    phdr_updates: Any = None
    segment: Any = None              # userspace: the new segment the moved code went to
    drop: list = field(default_factory=list)
    stats: list = field(default_factory=list)   # [(pass name, stats)]


def run_passes(run, passes):
    for name, pass_ in passes:
        run.stats.append((name, pass_(run)))
    return S.RelayoutSummary(run.stats)


class _Counting:
    """The counters the lower layers add to (or change in) ``rw.stats`` while a
    pass runs: they become that pass's share of the summary JSON."""

    def __init__(self, rw):
        self.rw, self.before = rw, dict(rw.stats)

    def counters(self):
        return {k: v for k, v in self.rw.stats.items()
                if k not in self.before or self.before[k] != v}


# -- checks and planning helpers -----------------------------------------------

NO_RELOCS = ("{path}: no link relocations in its code; relink with -Wl,--emit-relocs "
             "(a kernel >= 6.5 strips them from vmlinux after writing vmlinux.relocs: give "
             "its boot image with --vmlinuz VMLINUZ to recover them, or run "
             "linepack inside the kernel build with its kbuild hook, `linepack kbuild` or "
             "make ARCH_POSTLINK=$(linepack kbuild --print-hook); or use Debian 6.1's "
             "linux-image-6.1.0-*-cloud-amd64-dbg vmlinux)")


# A profile of the same build names (almost) only functions the image has; more
# unknown names than this share means another build or a garbled profile.
MISSING_SHARE = 0.05


def check_profile(image, functions, hotness, build_id, allow_missing=False):
    """BadInput for a profile of another build: a build-id mismatch, or more than
    MISSING_SHARE of its named functions unknown (unless ``allow_missing``)."""
    if build_id and image.build_id and build_id.lower() != image.build_id.lower():
        raise BadInput(f"profile is for another build (build-id {build_id[:16]}..., "
                       f"image has {image.build_id[:16]}...)")
    names = [k for k in hotness if isinstance(k, str) and not k.startswith("0x")]
    if not names:
        return 0
    missing = [n for n in names if functions.index_of(n) is None]
    if missing and len(missing) > MISSING_SHARE * len(names) and not allow_missing:
        examples = ", ".join(sorted(missing)[:3])
        raise BadInput(f"profile names {len(missing)} of {len(names)} functions that are not in "
                       f"{image.path} (e.g. {examples}): another build? (--allow-missing to "
                       "use it anyway)")
    return len(missing)


def _split_hot_ranges(orig_units, split, strat, blocks):
    """pack's per-unit hot byte ranges for the planning table: a split function's
    hot part is hot throughout (after its prefix); a unit moved whole keeps its blocks' ranges."""
    from .plan import unit_hot_ranges
    if not strat.use_blocks:
        return None
    orig = unit_hot_ranges(orig_units, blocks, strat.block_min)
    _, _, parent, part = split["planning"]
    hot = {sf.unit: (sf.head, sf.sizes[0]) for sf in split["splits"]}
    out = {}
    for k, (u, p) in enumerate(zip(parent.tolist(), part.tolist())):
        if p:
            continue
        if u in hot:
            out[k] = [hot[u]]         # from the entry: a prefix is padding, never run
        elif u in orig:
            out[k] = orig[u]
    return out


def _split_first_runs(orig_units, split, blocks):
    """{planning unit: earliest first execution of a block in it} for the hot units
    of a block-level plan, when the executed blocks carry their first executions
    (evaluate's traces); None otherwise."""
    first = getattr(blocks, "first", None)
    if first is None:
        return None
    addr = np.asarray(blocks[0], np.uint64)
    u = np.searchsorted(orig_units.start, addr, side="right").astype(np.int64) - 1
    ok = (u >= 0) & (addr < orig_units.end[np.maximum(u, 0)])
    earliest = np.full(len(orig_units), np.inf)
    np.minimum.at(earliest, u[ok], np.asarray(first, np.float64)[ok])
    _, _, parent, part = split["planning"]
    hot = np.nonzero((part == 0) & np.isfinite(earliest[parent]))[0]
    return dict(zip(hot.tolist(), earliest[parent[hot]].tolist()))


def _no_fit_message(err, strat, units, heat, calls, functions, log):
    """The planner's "does not fit" line; for ``align-all N`` also the largest
    alignment that does fit (found by planning smaller ones)."""
    msg = str(err)
    align = getattr(strat, "align", None)
    if not isinstance(align, int) or not strat.name.startswith("align-all"):
        return msg
    msg = getattr(err, "fact", msg)
    fits = None
    a = align // 2
    while a >= 1:
        log(f"align-all {align} does not fit; trying align-all {a}")
        try:
            make_plan(units, strategies.get(f"align-all {a}"), heat, calls=calls,
                      functions=functions)
        except LayoutError:
            a //= 2
            continue
        fits = a
        break
    hint = (f"the largest alignment that fits is align-all {fits}" if fits
            else "no alignment fits")
    return f"align-all {align} does not fit: {msg.removeprefix('layout does not fit: ')}; {hint}"


# -- the passes ------------------------------------------------------------------

def load(run):
    """Open the image, refuse what relayout cannot handle, check the profile."""
    from ..image.context import ImageContext
    from ..image.shared import elf_image
    from .target import target_for
    from .user.pie import is_pie
    timings.phase("load image, functions")
    path = run.image_path
    image = run.image = elf_image(path)      # shared: evaluate relays out one base many times
    pie = is_pie(image)
    if image.type == ET_DYN and not pie:
        raise BadInput(f"{path}: a shared library (ET_DYN without an interpreter); "
                       "relayout handles executables (PIE or not) and vmlinux")
    if image.type != ET_EXEC and not pie:
        raise BadInput(f"{path}: not an executable (ELF type {image.type}); "
                       "relayout handles linked executables and vmlinux")
    # where references come from: link relocations, or recovered from the vmlinuz
    if run.vmlinuz is not None:
        from ..image.elf import ElfImage
        from .kernel.recovered import use_vmlinuz
        image = run.image = ElfImage(path)     # its own object: its relocations are replaced
        run.recovered = use_vmlinuz(image, run.vmlinuz, run.log)
    if not image.has_link_relocations():
        raise BadInput(NO_RELOCS.format(path=path))
    functions = run.functions = ImageContext.of(image).functions
    if not len(functions):
        raise BadInput(f"{path}: no function symbols")
    missing = check_profile(image, functions, run.hotness, run.profile_build_id,
                            run.allow_missing)
    if missing:
        run.log(f"profile: {missing} named functions are not in the image (ignored)")
    run.target = target_for(image)
    return S.LoadStats(kind=run.target.kind, functions=int(len(functions)),
                       profile_names_missing=missing)


def disassemble(run):
    """Units (functions glued where code falls or rel8-branches between them), their
    disassembly and heat; the target's own data (a PIE's PIC switch tables)."""
    from .units import units_of
    from .plan import make_heat
    timings.phase("disassemble, units")
    run.units, run.functions, run.dis = units_of(run.image, run.log)
    run.orig_units = run.units
    extra = run.target.prepare(run)         # may pin units: before the heat
    run.heat = make_heat(run.units, run.functions, run.hotness)
    return S.DisassemblyStats(units=int(len(run.units)), hot_units=int((run.heat > 0).sum()),
                              **extra)


def split(run):
    """Block level: the CFG of every unit, block counts from the profile, which hot
    functions split into a hot and a cold part, and the planning units (relayout/blocks.py)."""
    from ..image.cfg import CFG, NORETURN, block_counts
    from .blocks import choose_splits, planning_for, prefix_heads, reason_summary
    timings.phase("CFG, block counts, split")
    image, units, dis, heat, strat, log = (run.image, run.units, run.dis, run.heat,
                                           run.strategy, run.log)
    if run.blocks is None:
        raise BadInput(f"strategy {strat.name} needs a profile with executed blocks "
                       "(QEMU, perf LBR or BOLT fdata), not function counts only")
    ctx = run.target.ctx                   # the image's one context, shared with the rewriter
    if ctx._disasm is None:
        ctx._disasm = dis
    sites, indirect_ok = run.target.table_sites(run)
    # a function's entry after its prefix padding starts a block (the prefix stays
    # before it in the hot part)
    heads = prefix_heads(units, run.functions)
    if heads.any():
        import copy
        sites = copy.copy(sites)
        entries = (units.start + heads.astype(np.uint64))[heads > 0]
        sites.leaders = np.unique(np.concatenate([sites.leaders, entries]))
    noret = [a for a in (image.symbol_address(n) for n in NORETURN) if a is not None]
    reloc_insn = np.zeros(len(dis), bool)
    for r in image.relocations.values():
        if r.target.is_code and len(r):
            i = dis.containing(r.offset.astype(np.uint64))
            reloc_insn[i[i >= 0]] = True
    icalls = None
    if run.target.kind == "userspace":
        from ..image.noreturn import indirect_noreturn_calls
        icalls = indirect_noreturn_calls(image, dis)
    cfg = CFG(dis, units.start, units.end, sites, noret, reloc_insn, indirect_ok=indirect_ok,
              noreturn_icalls=icalls)
    eh_split = run.target.unwind_split(run, cfg, heat, strat)
    counts = block_counts(cfg, *run.blocks)
    splits, reason = choose_splits(cfg, units, heat, counts, strat.block_min_count,
                                   run.functions, run.target.short_static_keys(), strat.cold_min,
                                   strat.invert_jcc, strat.block_order,
                                   getattr(run.blocks, "edges", None), log, heads=heads,
                                   split_noinstr=getattr(strat, "split_noinstr", False),
                                   order_whole=getattr(strat, "order_whole", False) and
                                   run.target.kind == "userspace",
                                   inline_cold_max=getattr(strat, "inline_cold_max", 0),
                                   prefix_keep=_prefix_keep(run, heads, log))
    if eh_split is not None:
        n = len(splits)
        kept = eh_split.accept(splits, units.start, heat, reason)
        if len(kept) < n and run.segment is None:
            # no room in place: the unwind tables (and the moved code) may go to a
            # new segment (userspace), where every split fits
            run.segment = run.target.new_segment(run)
            if run.segment is not None:
                log(f".eh_frame: room for {len(kept)} of {n} cold-part FDEs in place; the "
                    f"moved code and unwind tables go to a new segment at "
                    f"{run.segment.vaddr:#x}")
                for sf in splits:
                    reason[sf.unit] = 0
                eh_split.use_segment(run.segment)
                kept = eh_split.accept(splits, units.start, heat, reason)
        splits = kept
        if len(splits) < n:
            log(f".eh_frame: room for {len(splits)} of {n} cold-part FDEs; "
                f"{n - len(splits)} functions moved whole")
    n_whole = sum(sf.whole for sf in splits)
    log(f"CFG: {len(cfg)} blocks in {len(units)} units; {len(splits) - n_whole} hot functions "
        f"split, {int(((heat >= strat.min_count) & (reason != 0)).sum())} hot ones moved whole"
        + (f" ({n_whole} in one part: reordered, or their prefix trimmed)" if n_whole else ""))
    run.split = {"cfg": cfg, "splits": splits, "reason": reason, "block_count": counts,
                 "eh_split": eh_split, "reasons": reason_summary(reason, heat, strat.min_count,
                                                       userspace=run.target.kind == "userspace"),
                 "planning": planning_for(units, heat, splits, strat)}
    run.orig_heat = heat
    run.units, run.heat, _, _ = run.split["planning"]
    run.split_stats = st = _split_stats(run.split, run.orig_units)
    return st


NO_PADDING_WARNING = ("linepack: warning: prefix_padding = \"none\": hot functions lost "
                      "the padding where call-depth tracking writes its thunk; do not boot "
                      "this output with retbleed=stuff or indirect_target_selection=stuff "
                      "(docs/relayout.md)")


def _prefix_keep(run, heads, log):
    """Bytes of a hot prefixed function's padding its hot part keeps, or None to keep
    them all (``prefix_padding = "full"``, or no prefixes): ``"template"`` (the
    default) keeps the call-depth thunk's size (kernel/prefixes.py); ``"none"``
    (opt-in) keeps none, with one warning line: not to be booted with retbleed=stuff."""
    mode = getattr(run.strategy, "prefix_padding", "full")
    if mode == "full" or not heads.any():
        return None
    from ..kernel.prefixes import thunk_template_size
    keep = thunk_template_size(run.image) or 0
    if not keep or keep >= int(heads.max()):
        return None
    if mode == "none":
        # one line even with --quiet: the output is unsafe in one boot configuration
        import sys
        print(NO_PADDING_WARNING, file=sys.stderr, flush=True)
        log(f"prefixes: hot functions keep none of their {int(heads.max())} padding bytes "
            "(prefix_padding = \"none\") and lose their alignment")
        return 0
    log(f"prefixes: split functions keep {keep} of their {int(heads.max())} padding "
        "bytes (the call-depth thunk's size) and lose their alignment")
    return keep


def _split_stats(split, orig_units):
    from ..image import blockmap as bm
    sp, cfg = split["splits"], split["cfg"]
    kinds = {}
    for s in sp:
        for part in s.parts:
            for p in part:
                if p.kind == bm.KIND_BRANCH:
                    key = "long" if p.long else "short"
                    kinds[key] = kinds.get(key, 0) + 1
    scored = [s.order_score for s in sp if s.order_score is not None]
    ext_tsp = None
    if scored:      # ext-TSP objective of the hot parts, original order -> chosen order
        ext_tsp = {"original": round(sum(b for b, _ in scored), 3),
                   "ordered": round(sum(a for _, a in scored), 3),
                   "functions_reordered": sum(a > b for b, a in scored)}
    # patch-site jmps (CFG.patched_jmp) inside the split functions
    c = np.concatenate([[0], np.cumsum(cfg.patched_jmp)])
    return S.SplitStats(
        functions_split=len(sp), functions_reordered_whole=sum(s.whole for s in sp),
        hot_functions_by_reason=split["reasons"], blocks=int(len(cfg)),
        patch_site_jmps=int(cfg.patched_jmp.sum()),
        patch_site_jmps_split=int(sum(c[z] - c[a] for a, z in (cfg.blocks_of(s.func)
                                                               for s in sp))),
        hot_part_bytes=int(sum(s.sizes[0] for s in sp)),
        cold_part_bytes=int(sum(s.sizes[1] for s in sp)),
        split_growth_bytes=int(sum(s.sizes[0] + s.sizes[1] for s in sp) -
                               sum(int(orig_units.size[s.unit]) for s in sp)),
        branches_reencoded=kinds,
        jcc_inverted=sum(p.inverted for s in sp for part in s.parts for p in part),
        ext_tsp_score=ext_tsp)


def plan(run):
    """Place every unit per the strategy."""
    strat, units, heat = run.strategy, run.units, run.heat
    run.log(f"planning layout '{strat.name}' for {len(units)} units "
            f"({int((heat > 0).sum())} hot) in {len(units.regions)} regions")
    timings.phase("plan")
    block_level = run.split is not None

    def plan_(relocate=None):
        if block_level:
            # the order hot units first ran in (pack's order = "first"; None: no such data)
            strat.first_run = _split_first_runs(run.orig_units, run.split, run.blocks)
        hot_ranges = _split_hot_ranges(run.orig_units, run.split, strat,
                                       run.blocks) if block_level else None
        return make_plan(run.units, strat, run.heat, calls=run.calls, functions=run.functions,
                         blocks=None if block_level else run.blocks, hot_ranges=hot_ranges,
                         log=run.log, relocate=relocate)
    while run.segment is None:
        try:
            run.plan = plan_()
            break
        except LayoutError as e:
            # a kernel at block level: split functions that grew before pinned code move
            # whole instead (userspace gets a new segment below)
            if block_level and run.target.kind == "kernel" and \
                    _unsplit_before(run, getattr(e, "pinned_regions", None),
                                    getattr(e, "shortfalls", None)):
                continue
            # the target may offer room elsewhere (userspace: a new segment)
            run.segment = run.target.new_segment(run)
            if run.segment is None:
                raise LayoutError(_no_fit_message(e, strat, run.units, run.heat, run.calls,
                                                  run.functions, run.log)) from None
            # the planner's advice is for a layout that must fit: this one need not
            run.log(f"{e.fact}: the moved code goes to a new segment "
                    f"at {run.segment.vaddr:#x}")
    if run.segment is not None:
        run.plan = plan_(run.segment.relocate)
    if run.recovered is not None:
        from .kernel.recovered import check_plan
        check_plan(run.recovered, run.plan)     # units kept first in their region stayed first
    return S.PlanStats(**run.plan.summary())


def _unsplit_before(run, pinned_regions, shortfalls=None):
    """Block level, when the code before pinned regions ``pinned_regions`` does not
    fit even with its regions at their original layout (the split functions there
    grew: re-encoded branches, appended jmps): some of those functions move whole
    instead (reason R_NO_ROOM) and the plan is made again. ``shortfalls``:
    {pinned region: bytes short} with every region before it at its original
    layout, which is then the growth of its splits less the slack they found:
    the splits with the least heat per byte of growth that cover it move
    whole, the others stay split (without it, all of them). make_plan names every such region of one
    plan (each run between pinned regions is laid out on its own), so they are
    all handled in one re-plan; a run still short in the next plan loses its
    next least hot splits. False when none is left to unsplit."""
    from ..image.cfg import R_NO_ROOM
    from .blocks import planning_for, reason_summary
    if not pinned_regions:
        return False
    regs, orig = run.orig_units.regions, run.orig_units
    sp = run.split
    drop, short = set(), 0
    for pinned_region in pinned_regions:
        run_regions = []
        for i in range(pinned_region - 1, -1, -1):
            if regs[i].section != regs[pinned_region].section or regs[i].pinned:
                break
            run_regions.append(i)
        inside = np.isin(orig.region, run_regions)
        cands = [sf for sf in sp["splits"] if inside[sf.unit]]
        need = (shortfalls or {}).get(pinned_region)
        if need is None:
            drop.update(sf.unit for sf in cands)
            continue
        short += need
        # the least heat per byte of growth first (a split that did not grow frees
        # nothing: it stays), ties in address order
        growth = {sf.unit: int(sf.sizes[0] + sf.sizes[1]) - int(orig.size[sf.unit])
                  for sf in cands}
        covered = 0
        for sf in sorted((sf for sf in cands if growth[sf.unit] > 0),
                         key=lambda sf: (float(run.orig_heat[sf.unit]) / growth[sf.unit],
                                         sf.unit)):
            if covered >= need:
                break
            drop.add(sf.unit)
            covered += growth[sf.unit]
        if covered < need:          # growth is not all there is (alignment): all of them
            drop.update(sf.unit for sf in cands)
    if not drop:
        return False
    sp["reason"][sorted(drop)] = R_NO_ROOM
    sp["splits"] = [sf for sf in sp["splits"] if sf.unit not in drop]
    sp["reasons"] = reason_summary(sp["reason"], run.orig_heat, run.strategy.min_count,
                                   userspace=run.target.kind == "userspace")
    sp["planning"] = planning_for(orig, run.orig_heat, sp["splits"], run.strategy)
    run.units, run.heat, _, _ = sp["planning"]
    run.split_stats.__dict__.update(_split_stats(sp, orig).__dict__)   # the split pass's stats
    where = regs[pinned_regions[0]].name if len(pinned_regions) == 1 else \
        f"{len(pinned_regions)} pinned regions"
    run.log(f"{len(drop)} split functions before {where} moved whole "
            "(their growth does not fit there" +
            (f": {short} bytes short)" if short else ")"))
    return True


def _start_rewrite(run, rw):
    run.rewriter = rw
    if run.segment is not None:
        seg = run.segment
        rw.relocated = {seg.text.index: (seg.text_base, seg.text_size(run.plan))}
    rw.pic_tables = pic = run.target.pic
    if pic is not None:
        rw.stats["pie.pic_table_entries"] = len(pic)
        rw.stats["pie.pcrel_data_unexplained"] = pic.unexplained
        rw.stats["pcrel_data.self_relative"] = pic.self_relative
        rw.stats["pcrel_data.pinned_units"] = pic.pinned_units


def rewriter(run):
    """Function level: the rewriter over the plan's address map."""
    from .rewriter import Rewriter
    timings.phase("rewrite: parts, code, relocations")
    _start_rewrite(run, Rewriter(run.image, run.units, run.plan, run.dis, log=run.log))
    return S.PassStats()


def parts(run):
    """Block level: emit the hot and cold parts at their planned addresses (block
    map rows, part bytes) and the rewriter over the block map."""
    from ..image import blockmap as bm
    from .block_rewriter import BlockRewriter
    from .blocks import layout_rows
    timings.phase("rewrite: parts, code, relocations")
    split = run.split
    _, _, parent, part = split["planning"]
    rows, part_bytes, cold_syms = layout_rows(split["splits"], run.plan, parent, part, run.image)
    split_mask = np.isin(parent, [sf.unit for sf in split["splits"]])
    rw = BlockRewriter(run.image, run.units, run.plan, run.dis, rows, part_bytes, split_mask,
                       log=run.log)
    rw.block_split = dict(split, rows=rows, cold_syms=cold_syms, orig_units=run.orig_units)
    _start_rewrite(run, rw)
    st = run.split_stats
    st.block_map = bm.summary(rows)
    branch = rows["kind"] == bm.KIND_BRANCH
    st.branch_bytes_saved = int((rows["old_len"][branch].astype(np.int64) -
                                 rows["new_len"][branch].astype(np.int64)).sum())
    return S.PassStats()


def code(run):
    """Copy every unit (or emitted part) to its new place; int3 in between."""
    rw = run.rewriter
    run.log("rewriting code, relocations and symbols")
    count = _Counting(rw)
    rw.other_dis = rw._other_code_disasm()
    rw.move_code()
    return S.CodeStats(count.counters())


def references(run):
    """Symbols' new values, relocated fields, assembler-resolved branches,
    RIP-relative operands."""
    rw = run.rewriter
    count = _Counting(rw)
    rw.new_symbols()
    if run.recovered is not None:
        from .kernel.recovered import check_named_symbols
        check_named_symbols(run.image, run.recovered, rw.sym_new)
    refuse_unchecked_branches(run)
    rw.fix_relocations()
    rw.fix_branches()
    rw.fix_rip_relative()
    rw.refresh_leftover_relocations()
    return S.ReferenceStats(count.counters())


def static_keys(run):
    """Every ``__jump_table`` site still reaches its target (function level: sizes
    kept; block level: the split's re-encoded forms)."""
    rw = run.rewriter
    count = _Counting(rw)
    rw.check_static_keys()
    return S.StaticKeyStats(count.counters())


def metadata(run):
    """The target's tables or metadata (relayout/target.py)."""
    timings.phase("kernel tables, eh_frame, symbols")
    count = _Counting(run.rewriter)
    tables = run.target.update_metadata(run, block_level=run.split is not None)
    return S.TargetStats(count.counters(), tables=tables)


def symbols(run):
    """Function level: the symbol table with the rewriter's new values."""
    rw = run.rewriter
    count = _Counting(rw)
    idx, symtab = rw.symtab_bytes()
    rw.patched[idx] = symtab
    return S.SymbolStats(count.counters())


def block_symbols(run):
    """Block level: ``name.cold`` symbols, what the target adds for them (kallsyms
    entries; moved unwind sections' symbols), the block map section."""
    from ..image import blockmap as bm
    from .block_symbols import cold_symbols
    rw = run.rewriter
    count = _Counting(rw)
    cold_symbols(rw, run.image, run.log)
    alloc, run.phdr_updates = run.target.block_symbols(run)
    run.alloc_sections += alloc
    flags = bm.FLAG_NO_PADDING if getattr(run.strategy, "prefix_padding", None) == "none" \
        and any(sf.prefix_trimmed for sf in rw.block_split["splits"]) else 0
    run.extra_sections.append((bm.SECTION_NAME, bm.to_bytes(rw.block_split["rows"], flags)))
    return S.SymbolStats(count.counters())


SHF_COMPRESSED = 0x800


def _debug_sections(image):
    """Indices of the image's DWARF sections (and their relocations)."""
    return [s.index for s in image.sections if not s.is_alloc and
            (s.name.startswith(".debug_") or s.name.startswith(".rela.debug_"))]


def release_instructions(run):
    """Release the per-instruction tables before the DWARF rewrite: the code,
    references and kernel tables are rewritten, and the passes left (DWARF,
    write, summary, maps) read blocks and the address map only. On 7.3 the
    disassembly and the CFG's instruction arrays are ~360 MB, and the DWARF
    rewrite's copies come on top of what is still alive: this is the peak.
    Only before a DWARF rewrite: without one there is no such peak, and a
    caller that lays out several layouts of one image (evaluate's shared
    context) keeps its disassembly. (``passes_for(..., keep_instructions=True)``
    leaves this pass out.)"""
    if run.debug != "rewrite" or not _debug_sections(run.image):
        return S.PassStats()
    run.dis = None
    run.rewriter.dis = run.rewriter.other_dis = None
    if run.split is not None:
        run.split["cfg"].drop_instructions()
    ctx = getattr(run.image, "context", None)
    if ctx is not None:
        ctx.drop_instructions()
    gc.collect()          # the arrays sit in reference cycles (cfg <-> split tables)
    release_free_memory()
    return S.PassStats()


def dwarf(run):
    """Rewrite the DWARF for the new layout (its address fields from the link's
    ``.rela.debug_*``, or found by parsing it when the image has none), or drop
    it when asked."""
    image, log = run.image, run.log
    is_debug = _debug_sections(image)
    if not is_debug:
        return S.DwarfStats("none in the input")
    if run.debug == "strip":
        run.drop = is_debug
        log(f"dropping DWARF ({len(is_debug)} .debug_* sections), as asked")
        return S.DwarfStats("dropped")
    # -gz / --compress-debug-sections: the sections hold a zlib or zstd stream
    # (SHF_COMPRESSED), which the rewrite would read as DWARF
    compressed = [image.sections[i].name for i in is_debug
                  if image.sections[i].flags & SHF_COMPRESSED]
    if compressed:
        raise BadInput(f"{run.image_path}: its DWARF is compressed ({', '.join(compressed[:3])}"
                       f"{', ...' if len(compressed) > 3 else ''}: -gz or "
                       "--compress-debug-sections), which relayout does not rewrite; "
                       "decompress it first (objcopy --decompress-debug-sections IN OUT) "
                       "or drop it (--strip-debug)")
    timings.phase("DWARF rewrite")
    from ..dwarf.fields import has_debug_relocations
    from ..dwarf.rewrite import rewrite_dwarf
    if has_debug_relocations(image):
        log("rewriting DWARF for the new layout")
    else:
        # a vmlinux since 6.5 (or a relayout output, or --vmlinuz: the image's
        # relocations are the recovered ones) has no .rela.debug_*
        log("rewriting DWARF for the new layout (address fields found by parsing it: "
            "no .rela.debug_*)")
    try:
        patched, run.drop, counters = rewrite_dwarf(image, run.rewriter.amap, log)
    except (ValueError, IndexError, KeyError) as e:
        raise BadInput(f"{run.image_path}: cannot rewrite its DWARF ({e}); "
                       "--strip-debug drops it instead") from None
    run.rewriter.patched.update(patched)
    return S.DwarfStats("rewritten", dict(counters))


# Rewriter problems (``rw.problems`` kinds) that mean the output would not run
# as the original: relayout stops and writes nothing. Every other kind is a
# note (the output runs the same; docs/userspace.md lists them all).
BROKEN_OUTPUT = frozenset((
    "target-in-padding", "reloc-field-in-padding", "pc32-overflow", "branch-into-padding",
    "rip-into-padding", "dynamic-reloc-in-padding", "dynsym-in-padding", "table-parse",
    "table-not-updated"))


def refuse_unchecked_branches(run):
    """Stop when the layout would change the displacement of a direct branch
    behind prefixes no branch decoder reads (image/disasm.py unchecked_branches:
    a REX, segment, 66 or F3 prefix on jmp, jcc or call): relayout would copy it
    unfixed and verify could not see it. One that keeps its displacement (it
    moves with its target, or neither moves) is left as it is; with 66 (its
    target depends on the CPU) only one that does not move, nor its target.
    Real kernels hold a few where 32-bit code is read as 64-bit (the PVH entry's
    `dec %ecx; jne` reads as `rex.WB jne`): they stay in place."""
    from ..image.disasm import has_operand_size_prefix, unchecked_branch_targets
    rw = run.rewriter
    for dis in (rw.dis, rw.other_dis):
        if dis is None or not len(dis):
            continue
        rows = dis.unchecked_branches()
        if not len(rows):
            continue
        addr = dis.addr[rows]
        target = unchecked_branch_targets(dis.raw, dis.addr, dis.size, rows)
        addr_n, ok_a = rw.amap.map(addr)
        target_n, ok_t = rw.amap.map(target)
        moved_by = addr_n - addr                       # uint64: wraps like the CPU
        bad = ~ok_a | ~ok_t | (target_n - target != moved_by)
        wide = has_operand_size_prefix(dis.raw, rows)
        bad |= wide & ((addr_n != addr) | (target_n != target))
        if not bad.any():
            continue
        from ..image.context import ImageContext
        from .rewriter import RewriteError
        first = int(rows[np.nonzero(bad)[0][0]])
        where = ImageContext.of(run.image).symbol_at(int(dis.addr[first]))
        code = bytes(dis.raw[first, :int(dis.size[first])]).hex(" ")
        n = int(bad.sum())
        raise RewriteError(f"{run.image_path}: the layout moves {n} direct branch"
                           f"{'es' if n > 1 else ''} (or their targets) behind prefixes linepack "
                           f"does not decode, or data among the code that reads as such (first "
                           f"at {int(dis.addr[first]):#x} in {where}: {code}); it cannot fix or "
                           "prove them; nothing written")


def _refuse_broken(run):
    rw = run.rewriter
    broken = [p for p in rw.problems if p[0] in BROKEN_OUTPUT]
    if broken:
        from .rewriter import RewriteError
        k, a, m = broken[0]
        n = sum(rw.stats.get(f"problem.{kind}", sum(q[0] == kind for q in broken))
                for kind in {q[0] for q in broken})
        raise RewriteError(f"{run.image_path}: the output would be broken ({n} error "
                           f"problem{'s' if n > 1 else ''}; first: {k} at {a:#x}: {m}); "
                           "nothing written")


def write(run):
    """The new image (atomically: tools/io.py through write_image), unless a
    problem means it would be broken (BROKEN_OUTPUT)."""
    from ..image.writer import write_image
    _refuse_broken(run)
    rw = run.rewriter
    run.log(f"writing {run.out_path}")
    timings.phase("write image")
    segment = None
    if run.segment is not None:
        segment = run.segment.finish(rw, len(run.image.sections) + len(run.alloc_sections))
        run.log(f"new segment at {run.segment.vaddr:#x}: {run.segment.summary['size']:,} bytes "
                f"({run.segment.summary['text_bytes']:,} of code)")
    write_image(run.image, run.out_path, rw.patched, drop=run.drop, entry=rw.new_entry(),
                extra_sections=run.extra_sections, header_updates=rw.header_updates,
                section_moves=rw.section_moves, alloc_sections=run.alloc_sections,
                phdr_updates=run.phdr_updates, segment=segment)
    return S.WriteStats(path=run.out_path,
                        sections_added=len(run.extra_sections) + len(run.alloc_sections) +
                        (segment is not None))


def summary(run):
    """The layout's figures: hot lines and executed lines before and after,
    padding, .text growth; the problems met on the way."""
    from .plan import block_line_metric, block_line_metric_amap, line_metric, padding, text_growth
    timings.phase("summary, maps")
    plan_, rw = run.plan, run.rewriter
    lines = line_metric(plan_, run.functions, run.hotness)
    blocks = {}
    if run.split is not None:
        cfg = run.split["cfg"]
        blocks = block_line_metric_amap(rw.amap, cfg.start, cfg.end, run.split["block_count"])
    elif run.blocks is not None:
        # lines holding code that runs at least once per iteration: what the cache sees
        blocks = block_line_metric(plan_, run.blocks, min_count=1.0)
    growth = int(text_growth(plan_))
    seg = dict(run.segment.summary) if run.segment is not None else None
    tsize = text_size(run.image)
    return S.MetricsStats(
        **lines, **blocks, kept_regions=list(plan_.kept_regions),
        compact_regions=list(plan_.compact_regions),
        # a program's profile counts the whole run (a workload's counts are per iteration)
        counted=("in the profiled run" if run.target.kind == "userspace"
                 else "per iteration"),
        padding_bytes=int(padding(plan_)), text_growth_bytes=growth, new_segment=seg,
        text_growth_pct=round(100.0 * growth / tsize, 4) if tsize else 0.0,
        problems=list(rw.problems))


def reference_source(run):
    """Where the references came from: with --vmlinuz, what was recovered and
    what was pinned for want of an explanation (relayout/kernel/recovered.py)."""
    if run.recovered is None:
        return S.PassStats()
    from ..image.references import summary_of
    return S.RecoveredReferencesStats(summary_of(run.recovered)["references"])


def maps(run):
    """``--layout-map`` and ``--system-map``."""
    from .maps import write_layout_map, write_system_map
    if run.layout_map:
        moved = {}
        for sf in run.split["splits"] if run.split is not None else ():
            if sf.prefix_trimmed:
                # a trimmed prefix: the entry is sf.head bytes into the hot part
                fi = run.orig_units.members[sf.unit][-1][0]
                moved[fi] = sf.new_start[0] + sf.head
        write_layout_map(run.layout_map, run.plan, run.functions, moved)
    if run.system_map:
        write_system_map(run.system_map, run.image, run.rewriter)
    return S.PassStats()


FUNCTION_PASSES = [("load", load), ("disassemble", disassemble), ("plan", plan),
                   ("rewriter", rewriter), ("code", code), ("references", references),
                   ("static keys", static_keys), ("metadata", metadata), ("symbols", symbols),
                   ("release instructions", release_instructions), ("DWARF", dwarf),
                   ("write", write), ("summary", summary),
                   ("reference source", reference_source), ("maps", maps)]

BLOCK_PASSES = [("load", load), ("disassemble", disassemble), ("split", split), ("plan", plan),
                ("parts", parts), ("code", code), ("references", references),
                ("static keys", static_keys), ("metadata", metadata),
                ("symbols", block_symbols), ("release instructions", release_instructions),
                ("DWARF", dwarf), ("write", write),
                ("summary", summary), ("reference source", reference_source), ("maps", maps)]


def passes_for(strategy, keep_instructions=False):
    """The strategy's passes; ``keep_instructions``: without the release of the
    per-instruction tables (for callers that read the rewriter's disassembly or
    CFG afterwards)."""
    passes = BLOCK_PASSES if strategy.block_level else FUNCTION_PASSES
    if keep_instructions:
        passes = [p for p in passes if p[1] is not release_instructions]
    return passes


def check_paths(image_path, out_path):
    if os.path.exists(out_path) and os.path.samefile(image_path, out_path):
        raise BadInput(f"{out_path}: output is the input; linepack never modifies its input")
