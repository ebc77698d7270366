"""relayout(): load, plan, rewrite, write — the one function the verb calls."""

import json
import os

import numpy as np

from ..errors import BadInput
from ..image.elf import ET_DYN, ET_EXEC, ElfImage
from ..image.functions import FunctionTable, text_size
from ..image.writer import write_image
from .. import timings
from ..io import write_atomic
from . import strategies
from .plan import LayoutError, block_line_metric, line_metric, make_heat, make_plan
from .rewriter import Rewriter
from .units import build_units

NO_RELOCS = ("{path}: no link relocations in its code; relink with -Wl,--emit-relocs "
             "(a kernel >= 6.5 strips them from vmlinux after writing vmlinux.relocs: give "
             "its boot image with --vmlinuz VMLINUZ to recover them, or run "
             "linepack inside the kernel build with its kbuild hook, `linepack kbuild` or "
             "make ARCH_POSTLINK=$(linepack kbuild --print-hook); or use Debian 6.1's "
             "linux-image-6.1.0-*-cloud-amd64-dbg vmlinux)")


def _read_profile(path):
    """(JSON document, None) for the simple form, (None, Profile) for the model."""
    if not os.path.exists(path):
        raise BadInput(f"{path}: no such profile")
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("functions"), dict):
        return doc, None
    try:   # the project's profile model
        from ..profile.model import Profile
        return None, Profile.load(path)
    except Exception as e:   # noqa: BLE001
        why = str(e)
        why = why[len(path) + 2:] if why.startswith(f"{path}: ") else why
        raise BadInput(f"{path}: not a profile (expected the profile model or "
                       f"{{\"functions\": {{name: count}}}}): {why}") from None


def _hotness(doc, prof, per_loop):
    """(hotness {name: count}, build_id, calls by name) from either form."""
    if prof is None:
        return ({k: float(v) for k, v in doc["functions"].items()}, doc.get("build_id"),
                doc.get("calls") or [])
    counts = prof.function_counts()
    loops = prof.meta.get("loops")
    if per_loop and loops:
        # Counts per workload iteration: min_count 1 = "runs once per iteration".
        counts = {k: v / float(loops) for k, v in counts.items()}
    return counts, prof.meta.get("build_id"), []


def load_profile(path, per_loop=True):
    """{function name or address: count}, build-id and call edges from a profile file.

    Accepts the simple JSON form ``{"functions": {"name": count}}`` (optionally
    ``"build_id"``, ``"calls": [[caller, callee, count], ...]``), or the
    project's profile model.
    """
    return _hotness(*_read_profile(path), per_loop)


class LoadedProfile:
    """What a layout needs from a profile: hotness, call edges, executed blocks."""

    def __init__(self, hotness, build_id=None, calls=(), blocks=None, profile=None):
        self.hotness, self.build_id = hotness, build_id
        self.calls, self.blocks, self.profile = list(calls or ()), blocks, profile


def load_profile_full(path, image=None, per_loop=True):
    """load_profile plus, for the profile model, call edges and blocks.

    Call edges need the image's functions (``image``: a path or ElfImage); the
    pack strategy uses them for affinity ordering and the blocks to place small
    functions by their executed bytes.
    """
    doc, prof = _read_profile(path)
    hot, build_id, calls = _hotness(doc, prof, per_loop)
    if prof is None:          # the simple JSON form has no blocks or edges
        return LoadedProfile(hot, build_id, calls)
    from .plan import profile_blocks, profile_calls
    if image is not None:
        from ..image.shared import elf_image, function_table
        # the shared object: relayout() opens the same path next (parsed once)
        im = image if isinstance(image, ElfImage) else elf_image(image)
        calls = profile_calls(prof, function_table(im), per_loop=per_loop)
    from .block_order import executed_blocks
    return LoadedProfile(hot, build_id, calls, executed_blocks(prof, profile_blocks(prof)), prof)


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


def relayout(image_path, out_path, strategy="pack", hotness=None, calls=(), profile_build_id=None,
             log=None, debug="rewrite", layout_map=None, system_map=None, blocks=None,
             allow_missing=False, vmlinuz=None):
    """``debug``: "rewrite" the DWARF for the new layout (default) or "strip" it.
    ``vmlinuz``: the kernel's boot image; references are recovered from it
    (image/references.py) instead of read from link relocations."""
    log = log or (lambda m: None)
    if debug not in ("rewrite", "strip"):
        raise ValueError(f"debug={debug!r}: expected 'rewrite' or 'strip'")
    if os.path.exists(out_path) and os.path.samefile(image_path, out_path):
        raise BadInput(f"{out_path}: output is the input; linepack never modifies its input")
    strat = strategies.get(strategy) if not hasattr(strategy, "layout") else strategy
    timings.phase("load image, functions")
    from ..image.shared import elf_image, function_units
    image = elf_image(image_path)          # shared: evaluate relays out one base many times
    from .pie import is_pie
    pie = is_pie(image)
    if image.type == ET_DYN and not pie:
        raise BadInput(f"{image_path}: a shared library (ET_DYN without an interpreter); "
                       "relayout handles executables (PIE or not) and vmlinux")
    if image.type != ET_EXEC and not pie:
        raise BadInput(f"{image_path}: not an executable (ELF type {image.type}); "
                       "relayout handles linked executables and vmlinux")
    # -- where references come from: link relocations, or recovered from the vmlinuz
    recovered = None
    if vmlinuz is not None:
        from ..image.references import use_vmlinuz
        image = ElfImage(image_path)       # its own object: relocations are replaced
        recovered = use_vmlinuz(image, vmlinuz, log)
    if not image.has_link_relocations():
        raise BadInput(NO_RELOCS.format(path=image_path))
    from ..image.shared import function_table
    functions = function_table(image)
    if not len(functions):
        raise BadInput(f"{image_path}: no function symbols")
    hotness = hotness or {}
    missing = check_profile(image, functions, hotness, profile_build_id, allow_missing)
    if missing:
        log(f"profile: {missing} named functions are not in the image (ignored)")
    timings.phase("disassemble, units")
    units, functions, dis = function_units(image, log)
    heat = make_heat(units, functions, hotness)
    pic = None
    if pie:
        from .pie import pic_table_entries
        pic = pic_table_entries(image, dis)
        log(f"PIE: {len(pic)} PIC switch-table entries"
            + (f", {pic.unexplained} other PC-relative data fields into code"
               if pic.unexplained else ""))
    split = None
    if getattr(strat, "block_level", False):
        timings.phase("CFG, block counts, split")
        split = _split_functions(image, units, dis, functions, heat, blocks, strat, log, pic)
        orig_units = units
        units, heat, parent, part = split["planning"]
    log(f"planning layout '{strat.name}' for {len(units)} units "
        f"({int((heat > 0).sum())} hot) in {len(units.regions)} regions")
    timings.phase("plan")
    try:
        plan = make_plan(units, strat, heat, calls=calls, functions=functions,
                         blocks=None if split else blocks,
                         hot_ranges=_split_hot_ranges(orig_units, split, strat, blocks)
                         if split else None, log=log)
    except LayoutError as e:
        raise LayoutError(_no_fit_message(e, strat, units, heat, calls, functions, log)) from None
    if recovered is not None:
        from ..image.references import check_plan
        check_plan(recovered, plan)
    timings.phase("rewrite: parts, code, relocations")
    if split:
        from .block_rewriter import BlockRewriter
        from .blocks import layout_rows
        rows, part_bytes, cold_syms = layout_rows(split["splits"], plan, parent, part, image)
        split_mask = np.isin(parent, [sf.unit for sf in split["splits"]])
        rw = BlockRewriter(image, units, plan, dis, rows, part_bytes, split_mask, log=log)
        rw.block_split = dict(split, rows=rows, cold_syms=cold_syms, orig_units=orig_units)
    else:
        rw = Rewriter(image, units, plan, dis, log=log)
    rw.pic_tables = pic
    if pic is not None:
        rw.stats["pie.pic_table_entries"] = len(pic)
        # PC-relative data fields into code that are no switch-table entry: taken as
        # relative to themselves (right for ``.long sym - .``)
        rw.stats["pie.pcrel_data_unexplained"] = pic.unexplained
    log("rewriting code, relocations and symbols")
    rw.run()
    timings.phase("kernel tables, eh_frame, symbols")
    from .kernel_tables import update_kernel_tables
    # a block-level layout rebuilds kallsyms with its .cold parts (after the symbols)
    update_kernel_tables(rw, log, skip=("kallsyms",) if split else ())
    if split and split.get("eh_split") is not None:
        st = split["eh_split"].rebuild(rw, split["splits"], orig_units.start)
        rw.stats.update(st)
        log(f"rebuilt .eh_frame: {st['eh_frame.cold_fdes']} cold-part FDEs added, "
            f".eh_frame_hdr table re-sorted ({st['eh_frame_hdr.entries']} entries)")
    else:
        from .eh_frame import update_eh_frame
        update_eh_frame(rw, log)
    from .dynsym import update_dynsym
    update_dynsym(rw, image, log)
    if pie:
        from .pie import update_dynamic
        update_dynamic(rw, image, log)
    extra_sections, alloc_sections, phdr_updates = [], [], None
    if split:
        from .block_symbols import cold_symbols
        cold_symbols(rw, image, log)
        from .eh_frame_split import fix_section_symbols
        fix_section_symbols(rw, image)
        from .kallsyms_cold import NoRoom, add_cold_kallsyms
        try:
            grown = add_cold_kallsyms(rw, image, log)
        except NoRoom as e:
            grown = None
            rw.problems.append(("kallsyms-cold", 0, f"no kallsyms entries for the .cold parts: {e}"))
            log(f"warning: no kallsyms entries for the .cold parts: {e}")
            update_kernel_tables(rw, log, only=("kallsyms",))
        if grown and grown[0]:
            alloc_sections.append(grown[0])
            phdr_updates = grown[1]
        from ..image import blockmap as bm
        extra_sections.append((bm.SECTION_NAME, bm.to_bytes(rw.block_split["rows"])))
    else:
        idx, symtab = rw.symtab_bytes()
        rw.patched[idx] = symtab
    drop, dwarf_stats = [], {}
    is_debug = [s.index for s in image.sections if not s.is_alloc and
                (s.name.startswith(".debug_") or s.name.startswith(".rela.debug_"))]
    if debug == "strip" and is_debug:
        drop = is_debug
        log(f"dropping DWARF ({len(drop)} .debug_* sections), as asked")
    elif is_debug and not _has_debug_relocations(image):
        # the addresses to patch are found through .rela.debug_* (a relayout output
        # has none: its DWARF was already rewritten once)
        drop = is_debug
        debug = "strip"
        log("dropping DWARF: no .rela.debug_* relocations to find its addresses "
            "(an image relaid out before?)")
    elif is_debug:
        timings.phase("DWARF rewrite")
        from ..dwarf.rewrite import rewrite_dwarf
        log("rewriting DWARF for the new layout")
        try:
            dw_patched, drop, dwarf_stats = rewrite_dwarf(image, rw.amap, log)
        except (ValueError, IndexError, KeyError) as e:
            raise BadInput(f"{image_path}: cannot rewrite its DWARF ({e}); "
                           "--strip-debug drops it instead") from None
        rw.patched.update(dw_patched)
    log(f"writing {out_path}")
    timings.phase("write image")
    write_image(image, out_path, rw.patched, drop=drop, entry=rw.new_entry(),
                extra_sections=extra_sections, header_updates=getattr(rw, "header_updates", None),
                section_moves=getattr(rw, "section_moves", None),
                alloc_sections=alloc_sections, phdr_updates=phdr_updates)
    timings.phase("summary, maps")
    summary = plan.summary()
    summary.update(rw.stats)
    summary.update(line_metric(plan, functions, hotness))
    if split:
        from .plan import block_line_metric_amap
        cfg = split["cfg"]
        summary.update(block_line_metric_amap(rw.amap, cfg.start, cfg.end, split["block_count"]))
    elif blocks is not None:
        # lines holding code that runs at least once per iteration: what the cache sees
        summary.update(block_line_metric(plan, blocks, min_count=1.0))
    # regions that kept their original layout (no room before pinned code)
    summary["kept_regions"] = list(getattr(plan, "kept_regions", []))
    summary["padding_bytes"] = int(_padding(plan))
    summary["text_growth_bytes"] = int(_growth(plan))
    tsize = text_size(image)
    summary["text_growth_pct"] = round(100.0 * summary["text_growth_bytes"] / tsize, 4) \
        if tsize else 0.0
    summary["dwarf"] = ("dropped" if debug == "strip" and is_debug else
                        "rewritten" if is_debug else "none in the input")
    summary.update(dwarf_stats)
    if split:
        summary.update(_split_summary(rw, split, heat))
    if recovered is not None:
        from ..image.references import summary_of
        summary.update(summary_of(recovered))
    summary["problems"] = [{"kind": k, "address": f"{a:#x}", "message": m}
                           for k, a, m in rw.problems]
    if layout_map:
        write_layout_map(layout_map, plan, functions)
    if system_map:
        write_system_map(system_map, image, rw)
    return summary, plan, rw


def _split_functions(image, units, dis, functions, heat, blocks, strat, log, pic=None):
    """CFG of every unit, block hotness from the profile, the split decision and
    the planning unit table (see relayout/blocks.py)."""
    from ..image.cfg import CFG, NORETURN, TableSites, block_counts
    from ..kernel.base import ImageContext
    from ..kernel.jump_table import SHORT_SITES_SINCE
    from .blocks import choose_splits, planning_units, reason_summary
    if blocks is None:
        raise BadInput(f"strategy {strat.name} needs a profile with executed blocks "
                       "(QEMU, perf LBR or BOLT fdata), not function counts only")
    ctx = ImageContext.of(image)           # the image's one context, shared with the rewriter
    if ctx._disasm is None:
        ctx._disasm = dis
    indirect_ok = False
    if ctx.is_kernel:
        sites = TableSites.from_kernel(ctx)
    else:
        from .user_blocks import user_table_sites
        sites, indirect_ok, note = user_table_sites(image, pic)
        log(note)
    noret = [a for a in (image.symbol_address(n) for n in NORETURN) if a is not None]
    reloc_insn = np.zeros(len(dis), bool)
    for r in image.relocations.values():
        if r.target.is_code and len(r):
            i = dis.containing(r.offset.astype(np.uint64))
            reloc_insn[i[i >= 0]] = True
    cfg = CFG(dis, units.start, units.end, sites, noret, reloc_insn, indirect_ok=indirect_ok)
    eh = image.section(".eh_frame")
    eh_split = None
    if not ctx.is_kernel and eh is not None and eh.size:
        eh_split = _user_unwind_reasons(image, units, cfg, heat, strat, log)
    counts = block_counts(cfg, *blocks)
    short_keys = ctx.version is None or ctx.version[:2] >= SHORT_SITES_SINCE
    splits, reason = choose_splits(cfg, units, heat, counts, strat.block_min_count, functions,
                                   short_keys, strat.cold_min,
                                   getattr(strat, "invert_jcc", False),
                                   getattr(strat, "block_order", "original"),
                                   getattr(blocks, "edges", None), log)
    if eh_split is not None:
        n = len(splits)
        splits = eh_split.accept(splits, units.start, heat, reason)
        if len(splits) < n:
            log(f".eh_frame: room for {len(splits)} of {n} cold-part FDEs; "
                f"{n - len(splits)} functions moved whole")
    log(f"CFG: {len(cfg)} blocks in {len(units)} units; {len(splits)} hot functions split, "
        f"{int(((heat >= strat.min_count) & (reason != 0)).sum())} hot ones moved whole")
    return {"cfg": cfg, "splits": splits, "reason": reason, "block_count": counts,
            "eh_split": eh_split,
            "reasons": reason_summary(reason, heat, strat.min_count),
            "planning": planning_units(units, heat, splits)}


def _user_unwind_reasons(image, units, cfg, heat, strat, log):
    """Userspace: mark the functions whose unwind information cannot be split
    (relayout/eh_frame_split.py); returns the EhSplit, or None when the image's
    unwind sections cannot be rebuilt (then no function with an FDE is split)."""
    from ..image.cfg import R_EH_FRAME
    from .eh_frame import EhFrameError, parse_eh_frame
    from .eh_frame_split import EhSplit
    import struct
    try:
        eh_split = EhSplit(image)
    except (EhFrameError, ValueError, IndexError, KeyError, struct.error) as e:
        log(f"not splitting functions with unwind information: {e}")
        eh = image.section(".eh_frame")
        fde = parse_eh_frame(image.section_bytes(eh), eh.addr)
        covered = units.find(fde.pc_begin[fde.pc_range > 0])
        cfg._mark(np.unique(covered[covered >= 0]), R_EH_FRAME)
        return None
    cand = np.nonzero((np.asarray(cfg.reason) == 0) & (heat >= strat.min_count))[0]
    for u in cand.tolist():
        if len(units.members[u]) != 1:
            continue              # several functions in one unit: choose_splits names that
        r = eh_split.reason(int(units.start[u]), int(units.end[u]))
        if r:
            cfg._mark(np.array([u]), r)
    return eh_split


def _split_hot_ranges(orig_units, split, strat, blocks):
    """pack's per-unit hot byte ranges for the planning table: a split function's
    hot part is hot throughout; a unit moved whole keeps its blocks' ranges."""
    from .plan import unit_hot_ranges
    if not getattr(strat, "use_blocks", False):
        return None
    orig = unit_hot_ranges(orig_units, blocks, getattr(strat, "block_min", 0.0))
    _, _, parent, part = split["planning"]
    sizes = {sf.unit: sf.sizes[0] for sf in split["splits"]}
    out = {}
    for k, (u, p) in enumerate(zip(parent.tolist(), part.tolist())):
        if p:
            continue
        if u in sizes:
            out[k] = [(0, sizes[u])]
        elif u in orig:
            out[k] = orig[u]
    return out


def _patched_in(cfg, splits):
    """Patch-site jmps (CFG.patched_jmp) inside the split functions."""
    c = np.concatenate([[0], np.cumsum(cfg.patched_jmp)])
    return int(sum(c[z] - c[a] for a, z in (cfg.blocks_of(s.func) for s in splits)))


def _split_summary(rw, split, heat):
    from ..image import blockmap as bm
    rows = rw.block_split["rows"]
    out = {"split": bm.summary(rows)}

    sp = split["splits"]
    out["split"].update({
        "functions_split": len(sp),
        "hot_functions_by_reason": split["reasons"],
        "blocks": int(len(split["cfg"])),
        # jmps that end an alternative site (may become NOPs at boot): they fall through
        "patch_site_jmps": int(split["cfg"].patched_jmp.sum()),
        "patch_site_jmps_split": _patched_in(split["cfg"], sp),
        "hot_part_bytes": int(sum(s.sizes[0] for s in sp)),
        "cold_part_bytes": int(sum(s.sizes[1] for s in sp)),
        "split_growth_bytes": int(sum(s.sizes[0] + s.sizes[1] for s in sp) -
                                  sum(int(rw.block_split["orig_units"].size[s.unit]) for s in sp)),
    })
    kinds = {}
    for s in sp:
        for part in s.parts:
            for p in part:
                if p.kind == bm.KIND_BRANCH:
                    key = f"{'long' if p.long else 'short'}"
                    kinds[key] = kinds.get(key, 0) + 1
    out["split"]["branches_reencoded"] = kinds
    out["split"]["jcc_inverted"] = sum(p.inverted for s in sp for part in s.parts for p in part)
    scored = [s.order_score for s in sp if s.order_score is not None]
    if scored:      # ext-TSP objective of the hot parts, original order -> chosen order
        out["split"]["ext_tsp_score"] = {"original": round(sum(b for b, _ in scored), 3),
                                         "ordered": round(sum(a for _, a in scored), 3),
                                         "functions_reordered": sum(a > b for b, a in scored)}
    out["split"]["branch_bytes_saved"] = int(
        (rows["old_len"][rows["kind"] == bm.KIND_BRANCH].astype(np.int64) -
         rows["new_len"][rows["kind"] == bm.KIND_BRANCH].astype(np.int64)).sum())
    return out


def _has_debug_relocations(image):
    rel = image.relocations.get(".debug_info")
    return rel is not None and len(rel) > 0


def _no_fit_message(err, strat, units, heat, calls, functions, log):
    """The planner's "does not fit" line; for ``align-all N`` also the largest
    alignment that does fit (found by planning smaller ones)."""
    msg = str(err)
    align = getattr(strat, "align", None)
    if not isinstance(align, int) or not strat.name.startswith("align-all"):
        return msg
    msg = msg.replace("; use a strategy with less padding", "")
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


def plan_between(base_path, new_path):
    """The LayoutPlan that turned ``base_path`` into ``new_path`` (a relayout output,
    which keeps the symbol table's order), read back from the two symbol tables: each
    unit of the base starts where its first function starts in the new image."""
    from .plan import LayoutPlan
    base, new = ElfImage(base_path), ElfImage(new_path)
    fa, fb = FunctionTable(base), FunctionTable(new)
    units, _ = build_units(base, fa)
    b_by_sym = dict(zip(fb.sym_index.tolist(), fb.start.tolist()))
    a_sym = fa.sym_index.tolist()
    new_start = units.start.copy()
    for ui in range(len(units)):
        if not units.members[ui]:
            continue          # code outside any function: no symbol tells where it went
        fi, off = units.members[ui][0]
        b = b_by_sym.get(a_sym[fi])
        if b is not None:
            new_start[ui] = b - off
    return LayoutPlan(units, new_start, [r.start for r in units.regions], None, None)


def text_growth_between(base_path, new_path):
    """relayout's ".text growth" (bytes) of ``new_path`` over its original, measured
    from the two images alone (evaluate uses it for kernels given by path)."""
    return int(_growth(plan_between(base_path, new_path)))


def _growth(plan):
    """How far the end of laid-out code moved, summed over sections' movable runs."""
    u = plan.units
    g = 0
    for lo, hi in zip(*_runs(plan)):
        m = (u.start >= np.uint64(lo)) & (u.start < np.uint64(hi)) & ~u.pinned
        if m.any():
            g += int(plan.new_end[m].max()) - int(u.end[m].max())
    return g


def _runs(plan):
    from ..image.addrmap import plan_extents
    ext, _ = plan_extents(plan)
    return [a for a, _ in ext], [b for _, b in ext]


def _padding(plan):
    u = plan.units
    tot = 0
    for lo, hi in zip(*_runs(plan)):
        m = (u.start >= np.uint64(lo)) & (u.start < np.uint64(hi)) & ~u.pinned
        if m.any():
            span = int(plan.new_end[m].max()) - int(plan.new_start[m].min())
            tot += span - int(u.size[m].sum())
    return tot


def write_layout_map(path, plan, functions):
    """TSV: name, old address, new address, size — one line per function."""
    u = plan.units
    lines = ["# linepack layout map: function\told\tnew\tsize\n"]
    for ui in range(len(u)):
        for fi, off in u.members[ui]:
            old = int(functions.start[fi])
            new = int(plan.new_start[ui]) + old - int(u.start[ui])
            lines.append(f"{functions.name[fi]}\t{old:#x}\t{new:#x}\t{int(functions.size[fi])}\n")
    write_atomic(path, "".join(lines))


# scripts/mksysmap (Debian 6.1): nm -n output without these lines.
_SYSMAP_DROP_TYPES = set("aNUw")
_SYSMAP_DROP_PREFIXES = ("$a", "$d", "$t", ".L", "__crc_", "__kstrtab_", "__kstrtabns_")
def _nm_section_letter(sec):
    """The letter ``nm`` gives a symbol of ELF section ``sec`` (lower case), from
    the section flags as BFD sees them (a writable .rodata is data: 'd')."""
    flags, typ = int(sec.flags), int(sec.type)
    if flags & 0x4:                                   # SHF_EXECINSTR -> SEC_CODE
        return "t"
    alloc, nobits = bool(flags & 0x2), typ == 8
    if alloc and not nobits:                          # SEC_DATA
        return "d" if flags & 0x1 else "r"
    if nobits:                                        # no contents
        return "b"
    if sec.name.startswith((".debug", ".zdebug", ".gnu.linkonce.wi.", ".line", ".stab")):
        return "N"
    if not flags & 0x1:
        return "n"
    return "?"


def system_map_lines(image, values):
    """System.map text of ``image`` with symbol ``values``: what
    ``nm -n vmlinux | scripts/mksysmap's filter`` prints (address, type, name;
    sorted by address, then by name)."""
    names, syms = image.symbol_table()
    info = syms["info"].tolist()
    shndx = syms["shndx"].tolist()
    vals = np.asarray(values, dtype=np.uint64).tolist()
    secs = image.sections
    letters = {}
    rows = []
    for i, n in enumerate(names):
        if i == 0 or not n:
            continue
        t, bind, sx = info[i] & 0xF, info[i] >> 4, shndx[i]
        if t in (3, 4):                                # SECTION, FILE: nm hides them
            continue
        if sx == 0:
            c = ("v" if t == 1 else "w") if bind == 2 else "U"
        elif bind == 2:
            c = "V" if t == 1 else "W"
        elif bind == 10:                               # STB_GNU_UNIQUE
            c = "u"
        else:
            if sx == 0xFFF1:
                c = "a"
            elif sx == 0xFFF2:
                c = "C"
            elif sx >= 0xFF00:
                c = "?"
            else:
                c = letters.get(sx)
                if c is None:
                    c = letters[sx] = _nm_section_letter(secs[sx])
            if t == 10:                                # STT_GNU_IFUNC
                c = "i"
            elif bind == 1:
                c = c.upper()
        if c in _SYSMAP_DROP_TYPES or n.startswith(_SYSMAP_DROP_PREFIXES) or n == "L0":
            continue
        rows.append((vals[i], n.encode("latin-1", "replace"), c, n))
    rows.sort(key=lambda r: (r[0], r[1]))
    return "".join(f"{v:016x} {c} {n}\n" for v, _, c, n in rows)


def write_system_map(path, image, rw):
    """System.map of the new image, in the format and order of the kernel's own
    (block-level layouts: with the ``name.cold`` parts, type 't')."""
    text = system_map_lines(image, rw.sym_new)
    split = getattr(rw, "block_split", None)
    if split and split.get("cold_syms"):
        names, _ = image.symbol_table()
        rows = [line for line in text.splitlines(True)]
        rows += [f"{int(addr):016x} t {names[sf.sym]}.cold\n" for sf, addr, _ in split["cold_syms"]]
        rows.sort(key=lambda r: (r[:16], r[19:].encode("latin-1", "replace")))
        text = "".join(rows)
    write_atomic(path, text)
