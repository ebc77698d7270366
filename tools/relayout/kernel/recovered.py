"""References recovered from a vmlinuz, as relayout uses them: what depends on
its units (image/references.py recovers; this pins and keeps first).

- ``use_vmlinuz``: relayout's hook (relayout/passes.py), the recovered references
  in place of link relocations;
- label arithmetic and region-boundary labels (``pin_boundary_targets``) and
  data values that look like references into movable code but are none
  (``scan_unexplained``) pin the units concerned, never a move on a guess;
- ``pin_units`` / ``keep_first`` cut regions so the planner honours those pins,
  and ``check_plan`` proves the kept-first units stayed first.
"""

import numpy as np

from ...image.context import ImageContext
from ...image.intervals import containing, merge_overlapping
from ...image.elf import STT_SECTION
from ...image.references import (CODE_BRANCH, CODE_RIP, KASLR32, KASLR64, TABLE,
                                 _boundary_labels, _table_ranges, code_disassembly,
                                 in_sorted, install, read_kaslr, recover)
from ..units import Region


def recover_for_layout(image, kaslr, units, log=None, dis=None):
    """``recover`` over relayout's unit disassembly ``dis`` (the code sections it
    does not lay out are swept), then the pins the units need."""
    d = code_disassembly(image, units, dis) if dis is not None else None
    refs = recover(image, kaslr, log=log, dis=d)
    d = d if d is not None else ImageContext.of(image).disasm
    pin_boundary_targets(image, refs, units, d, log)
    scan_unexplained(image, refs, units, d, log)
    return refs


def check_named_symbols(image, refs, sym_new):
    """A recovered field named after a symbol (``refs.drag``: arithmetic on a
    boundary symbol or a label) moves with that symbol. Where other symbols
    share its address, the link may have named any of them: the layout must
    give them all one new value, else the field's move is not proven and
    relayout refuses (RewriteError)."""
    if not refs.drag:
        return
    from ..rewriter import RewriteError
    names, syms = image.symbol_table()
    typ = syms["info"] & 0xF
    nameable = (typ != STT_SECTION) & (typ != 4) & (syms["shndx"] > 0) & (syms["shndx"] < 0xFF00)
    for s in sorted(set(refs.drag.values())):
        same = np.nonzero(nameable & (syms["value"] == syms["value"][s]))[0]
        moved_to = np.unique(np.asarray(sym_new)[same])
        if len(moved_to) > 1:
            raise RewriteError(f"{image.path}: a field recovered from the vmlinuz is arithmetic "
                               f"on {names[s]} at {int(syms['value'][s]):#x}, but the symbols "
                               f"there move apart ({len(moved_to)} new values) and the vmlinuz "
                               "does not tell which one it means; nothing written")


def load_for_layout(image, vmlinuz_path, units, log=None, dis=None):
    """``recover_for_layout`` from the KASLR table of ``vmlinuz_path``."""
    return recover_for_layout(image, read_kaslr(image, vmlinuz_path), units, log=log, dis=dis)


def pin_boundary_targets(image, refs, units, d, log=None):
    """A region-boundary label (``__sched_text_start``, ``__lock_text_end``...)
    that is also the start of a function is one address with two meanings: the
    link names which (the label stays at the region boundary, the function may
    move); a recovered absolute or RIP-relative reference does not. The unit
    starting there is pinned, so both meanings stay the same address.
    (Branches mean the function: they are left out.)"""
    b = _boundary_labels(image, units)[0]
    # kernel tables list code (a ksymtab entry means the function): no ambiguity
    t = refs.target[(refs.origin != CODE_BRANCH) & (refs.origin != TABLE)]
    t = np.unique(t[in_sorted(t, b)])           # targets exactly at a boundary label
    u = units.find(t)
    u = np.unique(u[u >= 0])
    u = u[np.isin(units.start[u], t)]           # a unit starts right there
    u = u[~units.pinned[u]]
    # an absolute or RIP-relative target inside movable code but at no
    # instruction start or end is arithmetic on a label (``PFN_ALIGN(_text)``
    # is ``_text + 0xfff``), not a code address: the link's symbol says it
    # stays with the label; recovered, its unit stays where it is instead.
    # The same for a target at no symbol at all (``core_restore_code + 4084``,
    # 6.1's hibernation code; a symbol there is what the link would name, and
    # mapping it is right). References from inside the target's own unit move
    # with it either way; known tables list code.
    m = np.isin(refs.origin, (KASLR64, KASLR32, CODE_RIP))
    ridx = np.nonzero(m)[0]
    t, f = refs.target[m], refs.field[m]
    k = units.find(t)
    uf = units.find(f)
    tlo, thi = _table_ranges(ImageContext.of(image))
    keep = (k >= 0) & (uf != k) & (containing(tlo, thi, f) < 0)
    t, k, kf, ridx = t[keep], k[keep], uf[keep], ridx[keep]
    at = d.is_boundary(t)
    prev = d.containing(t - np.uint64(1))
    pc = np.maximum(prev, 0)
    at |= (prev >= 0) & (d.addr[pc] + d.size[pc].astype(np.uint64) == t)
    names, syms = image.symbol_table()
    styp = syms["info"] & 0xF
    sym_ok = (styp != STT_SECTION) & (styp != 4) & (syms["shndx"] > 0) & (syms["shndx"] < 0xFF00)
    sv = syms["value"][sym_ok].astype(np.uint64)
    si = np.nonzero(sym_ok)[0]
    o = np.argsort(sv, kind="stable")
    sv, si = sv[o], si[o]
    at &= in_sorted(t, sv)
    # The base of the arithmetic is, as the compiler wrote it, a symbol the
    # same code names elsewhere (``__memcpy(dst, core_restore_code, PAGE_SIZE)``
    # reads the page's last 8 bytes at core_restore_code + 4088 and starts at
    # core_restore_code): the nearest such target at or below, within 64 KiB,
    # names the reference, which then moves with that symbol as the link's
    # does. With no base in sight, the target's unit stays.
    drag = refs.drag
    arith = np.nonzero(~at)[0]
    if len(arith):
        # the targets of the non-branch references of each unit, grouped by unit
        nb = np.nonzero(refs.origin != CODE_BRANCH)[0]
        src_u = units.find(refs.field[nb])
        o = np.argsort(src_u, kind="stable")
        src_u, nb_target = src_u[o], refs.target[nb][o]
        for j in arith[kf[arith] >= 0].tolist():        # from code only
            tt = nb_target[np.searchsorted(src_u, kf[j]):np.searchsorted(src_u, kf[j], "right")]
            cand = np.unique(tt[(tt <= t[j]) & (tt + np.uint64(1 << 16) > t[j])])
            cand = cand[in_sorted(cand, sv)]
            if len(cand):
                base = cand[-1]
                drag[int(ridx[j])] = int(si[np.searchsorted(sv, base)])
    refs.drag = drag
    based = np.isin(ridx, np.array(list(drag), np.int64))
    mid = np.unique(k[~at & ~based])
    mid = mid[~units.pinned[mid]]
    mid = np.setdiff1d(mid, u).astype(np.int64)
    pin_units(units, mid)
    refs.pinned_units = _add_units(refs.pinned_units, units, mid)
    # a unit at a region start may still move with its region, as long as it
    # stays first: then the label and the function are one address again
    first = [int(i) for i in u.tolist()
             if units.start[i] == units.regions[int(units.region[i])].start]
    keep_first(units, first)
    refs.kept_first = _add_units(refs.kept_first, units, first)
    rest = np.setdiff1d(u, np.array(first, np.int64)).astype(np.int64)
    pin_units(units, rest)
    refs.pinned_units = _add_units(refs.pinned_units, units, rest)
    refs.stats["references.boundary_units_kept_first"] = len(first)
    refs.stats["references.boundary_units_pinned"] = int(len(rest))
    refs.stats["references.label_arithmetic_units_pinned"] = int(len(mid))
    refs.stats["references.label_arithmetic_based"] = int(based.sum())
    if (len(u) or len(mid)) and log:
        log(f"{len(u)} units at a region boundary that references name (kept first in their "
            f"region) and {len(mid)} holding a target inside an instruction (label "
            "arithmetic, pinned)")


def _add_units(have, units, idx):
    """``have`` plus "name@0xstart" of units ``idx`` (names repeat: statics)."""
    return sorted(set(have) | {f"{units.name[i]}@{int(units.start[i]):#x}"
                               for i in np.asarray(idx, np.int64).tolist()})


def units_named(units, keys):
    """Indices of the units listed as "name@0xstart"."""
    want = {int(k.rsplit("@", 1)[1], 16) for k in keys}
    return np.array([i for i, a in enumerate(units.start.tolist()) if a in want], np.int64)


def keep_first(units, idx):
    """Give each unit of ``idx`` (the first of its region) a region of its own
    at its region's start: the planner places a region's units from the
    region's new start, so the unit and the region's label stay one address
    while both shift (``check_plan`` proves it for the plan made)."""
    if not len(idx):
        return
    idx = set(int(i) for i in idx)
    regions, region = [], units.region.copy()
    for ri, reg in enumerate(units.regions):
        members = np.nonzero(units.region == ri)[0]
        members = members[np.argsort(units.start[members], kind="stable")]
        if len(members) < 2 or int(members[0]) not in idx or reg.pinned:
            region[members] = len(regions)
            regions.append(reg)
            continue
        head = int(members[0])
        region[head] = len(regions)
        regions.append(Region(reg.name, reg.start, int(units.end[head]), reg.section, False,
                              label_at_first=True))
        region[members[1:]] = len(regions)
        regions.append(Region(f"{reg.name}+rest", int(units.end[head]), reg.end, reg.section,
                              False))
    units.regions[:] = regions
    units.region[:] = region


def check_plan(refs, plan):
    """LayoutError unless every kept-first unit starts its region in ``plan``."""
    from ..plan import LayoutError
    keys = getattr(refs, "kept_first", ())
    if not keys:
        return
    u = plan.units
    for i in units_named(u, keys).tolist():
        n = u.name[i]
        if int(plan.new_start[i]) != int(plan.region_new_start[int(u.region[i])]):
            raise LayoutError(f"{n} must stay first in its region (a recovered reference to "
                              f"the region's label may mean it) but the layout put it at "
                              f"{int(plan.new_start[i]):#x}, after "
                              f"{int(plan.region_new_start[int(u.region[i])]):#x}")


def movable_ranges(units):
    m = ~np.asarray(units.pinned, bool)
    return units.start[m], units.end[m], np.nonzero(m)[0]


def pin_units(units, idx):
    """Pin units ``idx`` where they are. The planner keeps pinned code only as
    a region's prefix, so a region with pinned units after movable ones is cut
    into runs: each pinned run becomes a pinned region of its own, and the code
    around it is laid out on either side, never across it."""
    if not len(idx):
        return
    units.pinned[np.asarray(idx, np.int64)] = True
    regions, region = [], units.region.copy()
    for ri, reg in enumerate(units.regions):
        members = np.nonzero(units.region == ri)[0]
        members = members[np.argsort(units.start[members], kind="stable")]
        pinned = units.pinned[members]
        if reg.pinned or not len(members) or not pinned.any() or \
                not pinned[int(np.argmin(pinned)):].any():
            region[members] = len(regions)
            regions.append(reg)
            continue
        cut = np.nonzero(pinned[1:] != pinned[:-1])[0] + 1
        runs = np.split(np.arange(len(members)), cut)
        for k, run in enumerate(runs):
            first, last = members[run[0]], members[run[-1]]
            start = reg.start if k == 0 else int(units.start[first])
            end = reg.end if k == len(runs) - 1 else int(units.start[members[runs[k + 1][0]]])
            if pinned[run[0]]:
                end = int(units.end[last]) if k < len(runs) - 1 else end
            region[members[run]] = len(regions)
            regions.append(Region(f"{reg.name}+{k}" if k else reg.name, start, end,
                                  reg.section, bool(pinned[run[0]])))
    # a pinned run's end and the next run's start: the gap (padding) goes with the next
    for k in range(len(regions) - 1):
        if regions[k].pinned and regions[k + 1].section == regions[k].section and \
                regions[k + 1].start > regions[k].end:
            regions[k + 1].start = regions[k].end
    units.regions[:] = regions
    units.region[:] = region


def scan_unexplained(image, refs, units, d, log=None, examples=10):
    """Every allocated non-code section: 8-byte values (8-aligned) inside
    movable code, and s32 values (4-aligned) whose field + value lands there at
    an instruction boundary, that no reference explains and that lie in no
    kernel table of known layout: their units are pinned (``pin_units``)."""
    log = log or (lambda m: None)
    mlo, mhi, midx = movable_ranges(units)
    tlo, thi = _table_ranges(ImageContext.of(image))
    olo, ohi = _c_objects(image)
    dropped = {"crc_table": 0, "c_object": 0}
    hits_field, hits_target, hits_kind = [], [], []
    for s in image.sections:
        if not s.is_alloc or s.is_code or s.type == 8 or s.size < 4:
            continue
        crcs = s.name in _CRC_SECTIONS
        data = image.section_bytes(s)
        base = s.addr
        for width in (8, 4):
            if width == 4 and s.addr == 0:
                continue             # per-CPU: its run-time address is not its ELF one
            first = (-base) % width
            n = (len(data) - first) // width
            if n <= 0:
                continue
            vals = data[first:first + n * width].view("<u8" if width == 8 else "<i4")
            addr = np.uint64(base + first) + np.arange(n, dtype=np.uint64) * np.uint64(width)
            if width == 8:
                t = vals.astype(np.uint64)
            else:
                t = (addr.astype(np.int64) + vals.astype(np.int64)).astype(np.uint64)
            k = _containing_near(mlo, mhi, t)
            if width == 4:
                # a PC-relative reference reaches an instruction (or the end of
                # one: ``foo + size``); random data mostly lands inside one
                hit = np.nonzero(k >= 0)[0]
                at = d.is_boundary(t[hit])
                prev = d.containing(t[hit] - np.uint64(1))
                pc = np.maximum(prev, 0)
                at |= (prev >= 0) & (d.addr[pc] + d.size[pc].astype(np.uint64)
                                     == t[hit])
                k[hit[~at]] = -1
            sel = np.nonzero(k >= 0)[0]
            if not len(sel):
                continue
            a = addr[sel]
            known = refs.contains(a)
            if width == 4:          # the s32 half of an 8-byte field is that field
                known |= refs.contains(a - np.uint64(4))
            if len(tlo):
                j = containing(tlo, thi, a)
                known |= j >= 0
            if width == 4:
                # no PC-relative field can be here (see _c_objects, _CRC_SECTIONS)
                crc = np.full(len(a), crcs)
                dropped["crc_table"] += int((crc & ~known).sum())
                known |= crc
                if len(olo):
                    j = containing(olo, ohi, a)
                    jc = np.maximum(j, 0)
                    obj = (j >= 0) & (a + np.uint64(4) <= ohi[jc])
                    dropped["c_object"] += int((obj & ~known).sum())
                    known |= obj
            sel = sel[~known]
            hits_field.append(addr[sel])
            hits_target.append(t[sel])
            hits_kind.append(np.full(len(sel), width, np.uint8))
    f = np.concatenate(hits_field) if hits_field else np.zeros(0, np.uint64)
    t = np.concatenate(hits_target) if hits_target else np.zeros(0, np.uint64)
    w = np.concatenate(hits_kind) if hits_kind else np.zeros(0, np.uint8)
    u = units.find(t)
    newly = np.unique(u[(u >= 0)])
    newly = newly[~units.pinned[newly]]
    pin_units(units, newly)
    refs.pinned_units = _add_units(refs.pinned_units, units, newly)
    ex = []
    for i in range(min(examples, len(f))):
        ui = int(u[i])
        ex.append({"field": f"{int(f[i]):#x}",
                   "section": getattr(image.section_at(int(f[i])), "name", "?"),
                   "kind": "abs64" if w[i] == 8 else "pc32",
                   "target": f"{int(t[i]):#x}",
                   "function": units.name[ui] if ui >= 0 else None})
    refs.unexplained = {"fields": int(len(f)), "functions_pinned": int(len(newly)),
                        "examples": ex}
    refs.stats["references.unexplained_fields"] = int(len(f))
    refs.stats["references.not_pc32_crc_table"] = dropped["crc_table"]
    refs.stats["references.not_pc32_c_object"] = dropped["c_object"]
    refs.stats["references.unexplained_pinned_units"] = int(len(newly))
    if len(f):
        log(f"{len(f)} data values look like references into movable code and are no known "
            f"reference: {len(newly)} units pinned (reason: unexplained reference)")
    return refs.unexplained


def _containing_near(lo, hi, t):
    """containing(lo, hi, t), asked only of the values within [lo[0], max(hi)):
    most data values are nowhere near the code."""
    k = np.full(len(t), -1, np.int64)
    if len(lo):
        near = np.nonzero((t >= lo[0]) & (t < hi.max()))[0]
        k[near] = containing(lo, hi, t[near])
    return k


# Sections of symbol CRCs (genksyms: ``.long`` checksums, one per export): no
# references at all.
_CRC_SECTIONS = ("__kcrctab", "__kcrctab_gpl")


def _c_objects(image):
    """[start], [end) (sorted, disjoint) of the sized STT_OBJECT symbols of
    allocated data when GCC built the kernel (``.comment``), else nothing.

    A 4-byte value inside one is no PC-relative field: GCC refuses a
    PC-relative value in a C initializer ("initializer element is not
    constant" for ``(int)((long)&f - (long)&x)``, GCC 12), so the kernel's
    PC-relative data is written by the assembler (``.long sym - .``), in the
    tables it iterates between start/stop labels (kernel/, each known by
    layout, or still scanned), which carry no object symbols. On Debian 6.1
    every PC32/PLT32 link relocation in .rodata is in such a table, none in
    an object. Absolute fields in objects are the KASLR table's, not this
    scan's. Clang folds such differences, so a kernel it built keeps the
    scan as it is."""
    sec = image.section(".comment")
    text = bytes(image.section_bytes(sec)) if sec is not None else b""
    if b"GCC:" not in text or b"clang" in text.lower():
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    names, syms = image.symbol_table()
    data = np.array([x.index for x in image.sections if x.is_alloc and not x.is_code
                     and x.addr], np.int64)
    m = ((syms["info"] & 0xF) == 1) & (syms["size"] > 0) & \
        np.isin(syms["shndx"].astype(np.int64), data)
    lo = syms["value"][m].astype(np.uint64)
    hi = lo + syms["size"][m].astype(np.uint64)
    return merge_overlapping(lo, hi)        # nested or overlapping objects: containing()


def use_vmlinuz(image, vmlinuz_path, log=None):
    """relayout's hook: recover ``image``'s references from ``vmlinuz_path``,
    pin the units of unexplained references, and make ``image.relocations``
    serve the recovered ones (link relocations the image may have are ignored).
    Returns the References (``summary()`` for relayout's report)."""
    from ..units import units_of
    units, functions, dis = units_of(image, log)
    refs = load_for_layout(image, vmlinuz_path, units, log=log, dis=dis)
    install(image, refs, functions=functions, units=units)
    if log:
        log(f"references recovered from {vmlinuz_path}: {len(refs)} fields "
            f"({refs.stats['references.kaslr-64']} + {refs.stats['references.kaslr-32']} "
            f"absolute, {refs.stats['references.table']} in kernel tables, "
            f"{refs.stats['references.code-branch'] + refs.stats['references.code-rip']} "
            "in code)")
    return refs
