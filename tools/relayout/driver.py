"""relayout(): load, plan, rewrite, write — the one function the verb calls."""

import json
import os

import numpy as np

from ..errors import BadInput
from ..image.disasm import disassemble
from ..image.elf import ET_EXEC, ElfImage
from ..image.functions import FunctionTable
from ..image.writer import write_image
from ..io import write_atomic
from . import strategies
from .plan import LayoutError, block_line_metric, line_metric, make_heat, make_plan
from .rewriter import Rewriter
from .units import build_units

NO_RELOCS = ("{path}: no link relocations in its code; relink with -Wl,--emit-relocs "
             "(for a kernel: use the unstripped vmlinux linked with --emit-relocs, e.g. "
             "Debian's linux-image-6.1.0-*-cloud-amd64-dbg)")


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
        im = image if isinstance(image, ElfImage) else ElfImage(image)
        calls = profile_calls(prof, FunctionTable(im), per_loop=per_loop)
    return LoadedProfile(hot, build_id, calls, profile_blocks(prof), prof)


def check_profile(image, functions, hotness, build_id):
    if build_id and image.build_id and build_id.lower() != image.build_id.lower():
        raise BadInput(f"profile is for another build (build-id {build_id[:16]}..., "
                       f"image has {image.build_id[:16]}...)")
    names = [k for k in hotness if isinstance(k, str) and not k.startswith("0x")]
    if names:
        missing = sum(1 for n in names if functions.index_of(n) is None)
        if missing > max(10, len(names) // 2):
            raise BadInput(f"profile is for another build: {missing} of {len(names)} profiled "
                           "functions are not in the image")


def relayout(image_path, out_path, strategy="pack", hotness=None, calls=(), profile_build_id=None,
             log=None, debug="rewrite", layout_map=None, system_map=None, blocks=None):
    """``debug``: "rewrite" the DWARF for the new layout (default) or "strip" it."""
    log = log or (lambda m: None)
    if debug not in ("rewrite", "strip"):
        raise ValueError(f"debug={debug!r}: expected 'rewrite' or 'strip'")
    if os.path.exists(out_path) and os.path.samefile(image_path, out_path):
        raise BadInput(f"{out_path}: output is the input; linepack never modifies its input")
    strat = strategies.get(strategy) if not hasattr(strategy, "layout") else strategy
    image = ElfImage(image_path)
    if image.type != ET_EXEC:
        raise BadInput(f"{image_path}: not an ET_EXEC executable (type {image.type}); "
                       "relayout handles linked executables and vmlinux")
    if not image.has_link_relocations():
        raise BadInput(NO_RELOCS.format(path=image_path))
    functions = FunctionTable(image)
    if not len(functions):
        raise BadInput(f"{image_path}: no function symbols")
    hotness = hotness or {}
    check_profile(image, functions, hotness, profile_build_id)
    log(f"disassembling {len(functions)} functions")
    units, dis = build_units(image, functions, lambda u: disassemble(image, u), log=log)
    heat = make_heat(units, functions, hotness)
    log(f"planning layout '{strat.name}' for {len(units)} units "
        f"({int((heat > 0).sum())} hot) in {len(units.regions)} regions")
    try:
        plan = make_plan(units, strat, heat, calls=calls, functions=functions, blocks=blocks)
    except LayoutError as e:
        raise LayoutError(_no_fit_message(e, strat, units, heat, calls, functions, log)) from None
    rw = Rewriter(image, units, plan, dis, log=log)
    log("rewriting code, relocations and symbols")
    rw.run()
    from .kernel_tables import update_kernel_tables
    update_kernel_tables(rw, log)
    from .eh_frame import update_eh_frame
    update_eh_frame(rw, log)
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
        from ..dwarf.rewrite import rewrite_dwarf
        log("rewriting DWARF for the new layout")
        try:
            dw_patched, drop, dwarf_stats = rewrite_dwarf(image, rw.amap, log)
        except (ValueError, IndexError, KeyError) as e:
            raise BadInput(f"{image_path}: cannot rewrite its DWARF ({e}); "
                           "--strip-debug drops it instead") from None
        rw.patched.update(dw_patched)
    log(f"writing {out_path}")
    write_image(image, out_path, rw.patched, drop=drop, entry=rw.new_entry())
    summary = plan.summary()
    summary.update(rw.stats)
    summary.update(line_metric(plan, functions, hotness))
    if blocks is not None:
        # lines holding code that runs at least once per iteration: what the cache sees
        summary.update(block_line_metric(plan, blocks, min_count=1.0))
    summary["padding_bytes"] = int(_padding(plan))
    summary["text_growth_bytes"] = int(_growth(plan))
    summary["dwarf"] = ("dropped" if debug == "strip" and is_debug else
                        "rewritten" if is_debug else "none")
    summary.update(dwarf_stats)
    summary["problems"] = [{"kind": k, "address": f"{a:#x}", "message": m}
                           for k, a, m in rw.problems]
    if layout_map:
        write_layout_map(layout_map, plan, functions)
    if system_map:
        write_system_map(system_map, image, rw)
    return summary, plan, rw


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
    """System.map of the new image, in the format and order of the kernel's own."""
    write_atomic(path, system_map_lines(image, rw.sym_new))
