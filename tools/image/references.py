"""References into and out of code, from link relocations or recovered without them.

relayout moves code by fixing every field that refers to moved code or lies in
it. A vmlinux linked with ``--emit-relocs`` lists those fields in its
``.rela.*`` sections. Kernels >= 6.5 strip them; what they ship is enough to
find them again:

- absolute 64- and 32-bit fields: the KASLR relocation table at the end of the
  vmlinuz payload (``arch/x86/tools/relocs.c`` writes every R_X86_64_64, 32 and
  32S of the link but those to per-CPU symbols); the field's value is its target;
- PC-relative fields in code: every rel32 branch and RIP-relative operand, by
  disassembly (the per-CPU inverse group of the table lists the PC32 fields to
  per-CPU symbols: they must be among them, and are counted);
- PC-relative fields in data: each kernel table's own ``references()``
  (linepack.kernel.REFERENCE_TABLES);
- anything else in data that looks like a reference into movable code (an
  8-byte value there, or an s32 whose field + value lands there) is
  *unexplained*: the function it points at is pinned, never moved on a guess.

One code path: ``install`` turns the recovered references into relocation
arrays of the shape ``ElfImage.relocations`` returns (a SECTION symbol and the
addend, R_X86_64_64/32S/32/PC32/PC64), so the rewriter, the kernel tables and
verify read them exactly as they read link relocations. The rewriter takes a
field's current bytes as the truth for its target anyway; the SECTION symbol
tells it to map that target through the layout. A recovered branch inside one
function is left out of the arrays, as the assembler leaves it out of the
link's: the rewriter's branch pass fixes it, and the block-level CFG reads a
relocation there as "do not split".
"""

import numpy as np

from .elf import RELA, STT_SECTION, Relocations
from .relocs import (R_X86_64_32, R_X86_64_32S, R_X86_64_64, R_X86_64_PC32, R_X86_64_PC64,
                     R_X86_64_PLT32)
from .intervals import containing

START_KERNEL_MAP = 0xFFFFFFFF80000000

# where a reference came from (References.origin)
LINK, KASLR64, KASLR32, CODE_BRANCH, CODE_RIP, TABLE = range(6)
ORIGIN_NAMES = ("link", "kaslr-64", "kaslr-32", "code-branch", "code-rip", "table")

_WIDTH = {R_X86_64_64: 8, R_X86_64_32S: 4, R_X86_64_32: 4, R_X86_64_PC32: 4,
          R_X86_64_PLT32: 4, R_X86_64_PC64: 8}
_PC = (R_X86_64_PC32, R_X86_64_PLT32, R_X86_64_PC64)


class References:
    """Fields as arrays sorted by address: ``field`` (ELF address), ``rtype``
    (ELF relocation type), ``end`` (PC-relative: end of the instruction, or
    the field itself in data), ``target`` (what the field reaches today),
    ``origin`` (ORIGIN_NAMES index), ``table`` (index into ``table_names``
    for TABLE, else -1)."""

    def __init__(self, field, rtype, end, target, origin, table=None, table_names=()):
        order = np.argsort(np.asarray(field, np.uint64), kind="stable")
        self.field = np.asarray(field, np.uint64)[order]
        self.rtype = np.asarray(rtype, np.uint32)[order]
        self.end = np.asarray(end, np.uint64)[order]
        self.target = np.asarray(target, np.uint64)[order]
        self.origin = np.asarray(origin, np.uint8)[order]
        self.table = (np.full(len(order), -1, np.int16) if table is None
                      else np.asarray(table, np.int16)[order])
        self.table_names = list(table_names)
        self.stats = {}
        self.unexplained = None
        self.pinned_units = []       # names of the units pinned for these references
        self.kept_first = []         # names of units kept first in their region
        self.drag = {}               # reference index -> symbol its target moves with

    def __len__(self):
        return len(self.field)

    def contains(self, addrs):
        """True where an address is the field of one of these references."""
        a = np.asarray(addrs, np.uint64)
        i = np.searchsorted(self.field, a)
        ic = np.minimum(i, max(len(self.field) - 1, 0))
        return (i < len(self.field)) & (self.field[ic] == a) if len(self.field) else \
            np.zeros(a.shape, bool)


# -- reading fields ------------------------------------------------------------
def _section_spans(image):
    """(starts, ends, sections) of every allocated section with contents,
    .data..percpu included at its ELF address (0)."""
    secs = sorted((s for s in image.sections if s.is_alloc and s.size and s.type != 8),
                  key=lambda s: s.addr)
    return (np.array([s.addr for s in secs], np.uint64),
            np.array([s.end for s in secs], np.uint64), secs)


def read_fields(image, addrs, width):
    """Little-endian unsigned values of ``width`` bytes at ELF addresses
    (0 where the field is not in a file-backed section)."""
    addrs = np.asarray(addrs, np.uint64)
    lo, hi, secs = _section_spans(image)
    k = containing(lo, hi, addrs)
    ok = (k >= 0)
    kc = np.maximum(k, 0)
    ok &= addrs + np.uint64(width) <= hi[kc]
    offs = np.array([s.offset for s in secs], np.int64)
    pos = offs[kc] + (addrs - lo[kc]).astype(np.int64)
    pos = np.where(ok, pos, 0)
    raw = image.data[pos[:, None] + np.arange(width)[None, :]]
    val = raw.copy().view("<u8" if width == 8 else "<u4").ravel().astype(np.uint64)
    return np.where(ok, val, np.uint64(0))


def _sext32(v):
    return np.asarray(v, np.uint64).astype(np.uint32).view(np.int32).astype(np.int64).view(np.uint64)


def field_targets(image, field, rtype, end):
    """What each field reaches today: absolute = its value (32S sign-extended),
    PC-relative = end + value."""
    field = np.asarray(field, np.uint64)
    rtype = np.asarray(rtype, np.uint32)
    out = np.zeros(len(field), np.uint64)
    for t, w in _WIDTH.items():
        m = np.nonzero(rtype == t)[0]
        if not len(m):
            continue
        v = read_fields(image, field[m], w)
        if t in (R_X86_64_PC32, R_X86_64_PLT32):
            out[m] = end[m] + _sext32(v)
        elif t == R_X86_64_PC64:
            out[m] = end[m] + v
        elif t == R_X86_64_32S:
            out[m] = _sext32(v)
        else:
            out[m] = v
    return out


# -- the link's references -----------------------------------------------------
def link_references(image, dis):
    """References of the link relocations of allocated sections (the truth on
    an image that kept them); ``dis`` gives instruction ends for code fields."""
    fields, types = [], []
    for rel in image.relocations.values():
        if not rel.target.is_alloc or rel.target.type == 8 or not len(rel):
            continue
        keep = np.isin(rel.type, list(_WIDTH))
        fields.append(rel.offset[keep].astype(np.uint64))
        types.append(rel.type[keep])
    field = np.concatenate(fields) if fields else np.zeros(0, np.uint64)
    rtype = np.concatenate(types) if types else np.zeros(0, np.uint32)
    end = _insn_end(dis, field)
    return References(field, rtype, end, field_targets(image, field, rtype, end),
                      np.full(len(field), LINK))


def _insn_end(dis, field):
    i = dis.containing(field)
    ic = np.maximum(i, 0)
    return np.where(i >= 0, dis.addr[ic] + dis.size[ic].astype(np.uint64), field)


# -- recovery ------------------------------------------------------------------
def code_references(dis):
    """PC-relative fields of code: rel32 branches and RIP-relative operands.
    Returns (field, end, target, origin, instruction index)."""
    from .operands import rip_relative
    idx, target, kind = dis.branch_targets()
    b = kind == 4
    bi = idx[b]
    b_end = dis.addr[bi] + dis.size[bi].astype(np.uint64)
    # candidates: mod=00 rm=101 ModRM right before a disp32 (0, 1, 2 or 4
    # immediate bytes after it); Capstone confirms and gives the offset. Rows
    # are taken by length (the ModRM's column is fixed for one length): no
    # per-row index arrays over the whole disassembly
    raw = dis.raw
    cand = np.zeros(len(dis), bool)
    for length in range(5, raw.shape[1] + 1):
        rows = np.nonzero(dis.size == length)[0]
        if not len(rows):
            continue
        hit = np.zeros(len(rows), bool)
        for imm in (0, 1, 2, 4):
            col = length - 5 - imm
            if col >= 0:
                hit |= (raw[rows, col] & 0xC7) == 0x05
        cand[rows[hit]] = True
    cand[idx] = False                       # branches
    ci = np.nonzero(cand)[0]
    size = dis.size[ci].astype(np.int64)
    rip, doff = rip_relative(raw[ci], size)
    ri, doff, size = ci[rip], doff[rip], size[rip]
    r_field = dis.addr[ri] + doff.astype(np.uint64)
    r_end = dis.addr[ri] + size.astype(np.uint64)
    disp = np.zeros(len(ri), np.int64)
    for k in range(4):
        disp |= raw[ri, np.clip(doff + k, 0, 15)].astype(np.int64) << (8 * k)
    disp = np.where(disp >= 2**31, disp - 2**32, disp)
    r_target = (r_end.astype(np.int64) + disp).astype(np.uint64)
    field = np.concatenate([b_end - np.uint64(4), r_field])
    end = np.concatenate([b_end, r_end])
    tgt = np.concatenate([target[b], r_target])
    origin = np.concatenate([np.full(len(bi), CODE_BRANCH, np.uint8),
                             np.full(len(ri), CODE_RIP, np.uint8)])
    return field, end, tgt, origin, np.concatenate([bi, ri])


def _percpu(image):
    """(.data..percpu section, its load address) or (None, None)."""
    sec = image.section(".data..percpu")
    load = image.symbol_address("__per_cpu_load")
    if sec is None or load is None or sec.addr != 0:
        return None, None
    return sec, load


def kaslr_references(image, kaslr):
    """Absolute fields listed by the vmlinuz's KASLR table, as ELF addresses
    (a field of .data..percpu is listed at its load address)."""
    sec, load = _percpu(image)
    out = []
    for arr, origin in ((kaslr.abs64, KASLR64), (kaslr.abs32, KASLR32)):
        f = np.asarray(arr, np.uint64).copy()
        if sec is not None:
            pc = (f >= np.uint64(load)) & (f < np.uint64(load + sec.size))
            f[pc] -= np.uint64(load)
        out.append((f, origin))
    f64, f32 = out[0][0], out[1][0]
    v64 = read_fields(image, f64, 8)
    v32 = read_fields(image, f32, 4)
    t32 = _sext32(v32)
    # a 32-bit field is 32S when its sign-extended value is a kernel address,
    # else R_X86_64_32 (``sym - __START_KERNEL_map``: a physical address)
    is_s = t32 >= np.uint64(START_KERNEL_MAP)
    rtype = np.concatenate([np.full(len(f64), R_X86_64_64, np.uint32),
                            np.where(is_s, R_X86_64_32S, R_X86_64_32).astype(np.uint32)])
    field = np.concatenate([f64, f32])
    target = np.concatenate([v64, np.where(is_s, t32, v32)])
    origin = np.concatenate([np.full(len(f64), KASLR64, np.uint8),
                             np.full(len(f32), KASLR32, np.uint8)])
    return field, rtype, target, origin


def table_references(ctx):
    """PC-relative fields of every kernel table that declares them."""
    from ..kernel import REFERENCE_TABLES
    fields, widths, which, names = [], [], [], []
    for k, cls in enumerate(REFERENCE_TABLES):
        t = cls()
        try:
            a, w = t.references(ctx)
        except ValueError:
            continue                        # a table of another layout: its check says so
        names.append(cls.name)
        fields.append(a)
        widths.append(w)
        which.append(np.full(len(a), len(names) - 1, np.int16))
    return (np.concatenate(fields), np.concatenate(widths), np.concatenate(which), names)


def _table_ranges(ctx):
    """[start, end) of every kernel table whose records are fully known (their
    bytes outside the listed fields are no references)."""
    from ..kernel import REFERENCE_TABLES, TABLES
    lo, hi = [], []
    for cls in set(REFERENCE_TABLES) | set(TABLES):
        try:
            rngs = cls().ranges(ctx)
        except ValueError:
            continue
        for a, n, size in rngs:
            lo.append(a)
            hi.append(a + n * size)
    klo, khi = _kallsyms_ranges(ctx.image)
    lo += klo
    hi += khi
    o = np.argsort(lo)
    lo, hi = np.array(lo, np.uint64)[o], np.array(hi, np.uint64)[o]
    if len(lo):                  # overlapping ranges merged (containing() needs disjoint)
        hi = np.maximum.accumulate(hi)
        keep = np.ones(len(lo), bool)
        keep[1:] = lo[1:] >= hi[:-1]
        lo = lo[keep]
        hi = np.maximum.reduceat(hi, np.nonzero(keep)[0])
    return lo, hi


# kallsyms' arrays, emitted together by scripts/kallsyms (compressed names,
# tokens, offsets): no references, and their bytes are as good as random
_KALLSYMS = ("kallsyms_offsets", "kallsyms_relative_base", "kallsyms_num_syms",
             "kallsyms_names", "kallsyms_markers", "kallsyms_token_table",
             "kallsyms_token_index", "kallsyms_seqs_of_names", "kallsyms_addresses")


def _kallsyms_ranges(image):
    """[start], [end] of the kallsyms arrays (each to the next one; the last by
    its size from kallsyms_num_syms)."""
    at = sorted((a, n) for n in _KALLSYMS for a in [image.symbol_address(n)] if a is not None)
    nsa = image.symbol_address("kallsyms_num_syms")
    if not at or nsa is None:
        return [], []
    try:
        num = int(image.view(nsa, 1, "<u4")[0])
    except ValueError:
        return [], []
    last = {"kallsyms_seqs_of_names": 3 * num, "kallsyms_token_index": 512,
            "kallsyms_offsets": 4 * num, "kallsyms_addresses": 8 * num,
            "kallsyms_markers": 4 * ((num + 255) // 256), "kallsyms_names": 0}
    lo = [a for a, _ in at]
    hi = [b for b, _ in at[1:]] + [at[-1][0] + last.get(at[-1][1], 0)]
    return lo, hi


def code_disassembly(image, units, unit_dis):
    """(parts, boundaries): every instruction of every code section, as
    relayout's own unit disassembly plus a linear sweep of the code sections it
    does not lay out (the sweep the rewriter makes for them: left in its
    per-image cache), so recovery does not decode the kernel a second time; and
    one Disassembly of both by address with only ``addr`` and ``size`` (what the
    checks on targets read: the rows' bytes are not copied again)."""
    from .disasm import Disassembly, disassemble
    laid = {r.section for r in units.regions}
    secs = [s for s in image.sections if s.is_code and s.is_alloc and s.size
            and s.index not in laid]
    if not secs:
        return [unit_dis], unit_dis
    from .context import ImageContext
    done = ImageContext.of(image).derived("other_code", dict)   # shared with the rewriter
    key = tuple(s.index for s in secs)
    if key not in done:
        from ..relayout.rewriter import _Table
        done[key] = disassemble(image, _Table([s.addr for s in secs], [s.size for s in secs]),
                                jobs=1)
    other = done[key]
    addr = np.concatenate([unit_dis.addr, other.addr])
    o = np.argsort(addr, kind="stable")
    return [unit_dis, other], Disassembly(addr[o], np.concatenate([unit_dis.size, other.size])[o],
                                          None, None, [])


def recover(image, kaslr, units=None, log=None, dis=None):
    """References of a kernel image without link relocations: KASLR table
    (``kaslr``: abs64, abs32, inv32 arrays of field addresses), disassembly and
    kernel tables. With ``units`` (relayout's UnitTable), data values that look
    like references into movable code and are none of these are found and their
    units pinned (``References.unexplained``)."""
    from .context import ImageContext
    log = log or (lambda m: None)
    ctx = ImageContext.of(image, log=log)
    # ``dis``: relayout's unit disassembly (the rest of the code is swept here);
    # without it, the context's full decode. Each part's fields on their own
    # (instructions of different parts never share a field)
    if dis is None or units is None:
        dis = ctx.disasm
        parts = [dis]
    else:
        parts, dis = code_disassembly(image, units, dis)
    cf, ce, ct, co = (np.concatenate(c) for c in zip(*(code_references(p)[:4] for p in parts)))
    kf, kt, ktg, ko = kaslr_references(image, kaslr)
    tf, tw, tw_which, tnames = table_references(ctx)
    t_type = np.where(tw == 8, R_X86_64_PC64, R_X86_64_PC32).astype(np.uint32)
    t_target = field_targets(image, tf, t_type, tf)
    field = np.concatenate([kf, tf, cf])
    rtype = np.concatenate([kt, t_type, np.full(len(cf), R_X86_64_PC32, np.uint32)])
    end = np.concatenate([kf, tf, ce])
    target = np.concatenate([ktg, t_target, ct])
    origin = np.concatenate([ko, np.full(len(tf), TABLE, np.uint8), co])
    table = np.concatenate([np.full(len(kf), -1, np.int16), tw_which,
                            np.full(len(cf), -1, np.int16)])
    # one reference per field: the KASLR table first (it is the link's own
    # list), then the tables, then disassembly
    _, first = np.unique(field, return_index=True)
    dup = len(field) - len(first)
    refs = References(field[first], rtype[first], end[first], target[first], origin[first],
                      table[first], tnames)
    refs.stats = {"references.recovered": len(refs), "references.duplicate_fields": int(dup)}
    for k, n in enumerate(ORIGIN_NAMES[1:], 1):
        refs.stats[f"references.{n}"] = int((refs.origin == k).sum())
    inv = np.asarray(kaslr.inv32, np.uint64)
    found = refs.contains(inv)
    refs.stats["references.percpu_pc32"] = int(len(inv))
    refs.stats["references.percpu_pc32_not_in_code"] = int((~found).sum())
    if units is not None:
        pin_boundary_targets(image, refs, units, dis, log)
        scan_unexplained(image, refs, units, dis, log)
    return refs


def _boundaries(units):
    """Addresses of region boundaries (start and end of every laid-out region)."""
    b = [r.start for r in units.regions] + [r.end for r in units.regions]
    return np.unique(np.array(b, np.uint64))


def _boundary_labels(image, units):
    """(addresses, symbol indices) of the NOTYPE labels of code sections that
    sit at a region boundary, sorted by address."""
    names, syms = image.symbol_table()
    code = np.array([s.index for s in image.sections if s.is_code], np.int64)
    lab = np.nonzero(((syms["info"] & 0xF) == 0) & np.isin(syms["value"], _boundaries(units)) &
                     np.isin(syms["shndx"].astype(np.int64), code))[0]
    val = syms["value"][lab].astype(np.uint64)
    o = np.argsort(val, kind="stable")
    return val[o], lab[o]


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
    t = np.unique(t[np.isin(t, b)])             # targets exactly at a boundary label
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
    from .context import ImageContext
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
    at &= np.isin(t, sv)
    # The base of the arithmetic is, as the compiler wrote it, a symbol the
    # same code names elsewhere (``__memcpy(dst, core_restore_code, PAGE_SIZE)``
    # reads the page's last 8 bytes at core_restore_code + 4088 and starts at
    # core_restore_code): the nearest such target at or below, within 64 KiB,
    # names the reference, which then moves with that symbol as the link's
    # does. With no base in sight, the target's unit stays.
    drag = refs.drag
    arith = np.nonzero(~at)[0]
    if len(arith):
        src_u = units.find(refs.field)
        for j in arith[kf[arith] >= 0].tolist():        # from code only
            same = (src_u == kf[j]) & (refs.origin != CODE_BRANCH) & (refs.target <= t[j]) & \
                (refs.target + np.uint64(1 << 16) > t[j])
            cand = np.unique(refs.target[same])
            cand = cand[np.isin(cand, sv)]
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
    from ..relayout.units import Region
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
        regions.append(Region(reg.name, reg.start, int(units.end[head]), reg.section, False))
        region[members[1:]] = len(regions)
        regions.append(Region(f"{reg.name}+rest", int(units.end[head]), reg.end, reg.section,
                              False))
    units.regions[:] = regions
    units.region[:] = region


def check_plan(refs, plan):
    """LayoutError unless every kept-first unit starts its region in ``plan``."""
    from ..relayout.plan import LayoutError
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
    from ..relayout.units import Region
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
    from .context import ImageContext
    tlo, thi = _table_ranges(ImageContext.of(image))
    hits_field, hits_target, hits_kind = [], [], []
    for s in image.sections:
        if not s.is_alloc or s.is_code or s.type == 8 or s.size < 4:
            continue
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
            k = containing(mlo, mhi, t)
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
    refs.stats["references.unexplained_pinned_units"] = int(len(newly))
    if len(f):
        log(f"{len(f)} data values look like references into movable code and are no known "
            f"reference: {len(newly)} units pinned (reason: unexplained reference)")
    return refs.unexplained


# -- one code path: relocation arrays ------------------------------------------
def as_relocations(image, refs, skip=None, named=None):
    """{section name: Relocations} (no .rela section behind them: ``section``
    is None) for the references whose ``skip`` mask is False; ``named``: a
    symbol index per reference to use instead of the SECTION symbol (-1: none)."""
    names, syms = image.symbol_table()
    typ = (syms["info"] & 0xF).astype(np.int64)
    sec_syms = np.nonzero(typ == STT_SECTION)[0]
    by_shndx = {int(syms["shndx"][i]): int(i) for i in sec_syms}
    any_sec = int(sec_syms[0]) if len(sec_syms) else 0
    lo, hi, secs = _section_spans(image)
    keep = np.ones(len(refs), bool) if skip is None else ~np.asarray(skip, bool)
    field, rtype, end, target = refs.field[keep], refs.rtype[keep], refs.end[keep], refs.target[keep]
    # the symbol: the SECTION symbol of the target's section (mapped through the
    # layout); a physical address ``sym - __START_KERNEL_map`` of code names the
    # function there instead, so the rewriter moves the field with it
    ks = containing(lo, hi, target)
    sec_index = np.array([s.index for s in secs], np.int64)
    sym_of_sec = np.array([by_shndx.get(int(i), any_sec) for i in sec_index], np.int64)
    sym = np.where(ks >= 0, sym_of_sec[np.maximum(ks, 0)], any_sec)
    # (``__pa_symbol(fn)``: 6.1's hibernation code stores restore_registers +
    # 0x80000000 in a 64-bit field)
    phys = np.isin(rtype, (R_X86_64_32, R_X86_64_64)) & (target < np.uint64(1 << 31)) & (ks < 0)
    if phys.any():
        from .context import ImageContext
        ft = ImageContext.of(image).functions
        virt = target[phys] + np.uint64(START_KERNEL_MAP)
        fi = ft.find(virt)
        in_fn = fi >= 0
        p = np.nonzero(phys)[0]
        sym[p[in_fn]] = np.asarray(ft.sym_index)[fi[in_fn]]
    if named is not None:
        nm = np.asarray(named, np.int64)[keep]
        sym = np.where(nm >= 0, nm, sym)
    S = syms["value"][sym].astype(np.int64)
    pc = np.isin(rtype, _PC)
    A = np.where(pc, target.astype(np.int64) - S - (end - field).astype(np.int64),
                 target.astype(np.int64) - S)
    info = (sym.astype(np.uint64) << np.uint64(32)) | rtype.astype(np.uint64)
    fk = containing(lo, hi, field)
    out = {}
    for k in np.unique(fk[fk >= 0]).tolist():
        m = fk == k
        rows = np.zeros(int(m.sum()), RELA)
        rows["offset"], rows["info"], rows["addend"] = field[m], info[m], A[m]
        out[secs[k].name] = Relocations(None, secs[k], rows)
    return out


def install(image, refs, functions=None, units=None):
    """Make ``image.relocations`` answer with the recovered references. A
    rel32 branch whose target is in its own function is left out (the
    assembler resolves those: no link relocation, and the CFG would read one
    as a reason not to split). A reference to a region boundary where no unit
    starts names the boundary's label, which stays with its region (the
    layout's anchor), not the code that ends there."""
    skip = np.zeros(len(refs), bool)
    if functions is not None:
        br = refs.origin == CODE_BRANCH
        src = functions.find(refs.field[br])
        dst = functions.find(refs.target[br])
        skip[np.nonzero(br)[0]] = (src >= 0) & (src == dst)
    named = None
    if units is not None:
        val, lab = _boundary_labels(image, units)
        if len(lab):
            j = np.searchsorted(val, refs.target)
            jc = np.minimum(j, len(val) - 1)
            hit = (j < len(val)) & (val[jc] == refs.target) & (refs.origin != CODE_BRANCH) & \
                (refs.origin != TABLE) & ~np.isin(refs.target, units.start)
            named = np.where(hit, lab[jc], -1)
            refs.stats["references.boundary_labels"] = int(hit.sum())
    drag = getattr(refs, "drag", None)
    if drag:
        if named is None:
            named = np.full(len(refs), -1, np.int64)
        named[np.array(list(drag), np.int64)] = np.array(list(drag.values()), np.int64)
    image._relocs = as_relocations(image, refs, skip, named)
    from .context import ImageContext
    ImageContext.of(image).recovered = refs
    return image._relocs


def load_recovered(image, vmlinuz_path, units=None, log=None, dis=None):
    """Read the KASLR table of ``vmlinuz_path`` (same build as ``image``) and
    recover the image's references (image/references.py)."""
    from ..errors import BadInput
    from .bootimage import read_vmlinuz
    # a path, or an object with the table already read (``.kaslr``: tests)
    z = vmlinuz_path if hasattr(vmlinuz_path, "kaslr") else read_vmlinuz(vmlinuz_path)
    bid = getattr(z, "build_id", None)
    if bid and image.build_id and bid.lower() != image.build_id.lower():
        raise BadInput(f"{vmlinuz_path}: another build than {image.path} (build-id "
                       f"{bid[:16]}..., the vmlinux has {image.build_id[:16]}...)")
    return recover(image, z.kaslr, units=units, log=log, dis=dis)


# -- completeness against the truth --------------------------------------------
def compare(image, recovered, link, movable_lo, movable_hi):
    """Recovered references against the link's, by section of the field.

    A link relocation counts when its target lies in movable code
    (``movable_lo``/``movable_hi``: the unpinned units before any unexplained
    pin), or it is PC-relative and its field lies there; an absolute field in
    movable code whose target stays (a zero-based per-CPU symbol: not in the
    KASLR table) is counted apart, as it needs no fix. missing = a counted
    field the recovery does not list (or lists with another width); extra =
    recovered fields the link has no relocation for (the assembler's own
    references, mostly). Returns a dict for reports."""
    lo, hi, secs = _section_spans(image)

    def sec_names(addrs):
        k = containing(lo, hi, addrs)
        return np.array([secs[i].name if i >= 0 else "?" for i in k.tolist()], dtype=object)

    # an absolute field's value is its target alone: moved with its instruction
    # to a target that stays (a per-CPU offset, data) it needs no fix
    tgt_moves = containing(movable_lo, movable_hi, link.target) >= 0
    pc = np.isin(link.rtype, _PC)
    rel = tgt_moves | (pc & (containing(movable_lo, movable_hi, link.field) >= 0))
    abs_fixed = ~rel & ~pc & (containing(movable_lo, movable_hi, link.field) >= 0)
    got = recovered.contains(link.field)
    i = np.searchsorted(recovered.field, link.field)
    ic = np.minimum(i, max(len(recovered) - 1, 0))
    lw = np.array([_WIDTH[int(t)] for t in link.rtype.tolist()], np.int64) if len(link) else \
        np.zeros(0, np.int64)
    rw = np.array([_WIDTH[int(t)] for t in recovered.rtype.tolist()], np.int64) if len(recovered) \
        else np.zeros(0, np.int64)
    same_width = got & (lw == rw[ic]) if len(recovered) else got
    same_target = same_width & (link.target == recovered.target[ic]) if len(recovered) else got
    missing = rel & ~same_width
    wrong_target = rel & same_width & ~same_target
    extra = ~link.contains(recovered.field)
    by = {}
    names_rel = sec_names(link.field[rel])
    for n in np.unique(names_rel).tolist():
        by.setdefault(n, {"relevant": 0, "recovered": 0, "missing": 0, "wrong_target": 0,
                          "extra": 0})["relevant"] = int((names_rel == n).sum())
    for key, mask, src in (("missing", missing, link), ("wrong_target", wrong_target, link),
                           ("extra", extra, recovered)):
        nm = sec_names(src.field[mask])
        for n in np.unique(nm).tolist():
            by.setdefault(n, {"relevant": 0, "recovered": 0, "missing": 0, "wrong_target": 0,
                              "extra": 0})[key] = int((nm == n).sum())
    for n, d in by.items():
        d["recovered"] = d["relevant"] - d["missing"]
    examples = []
    for j in np.nonzero(missing | wrong_target)[0][:20].tolist():
        examples.append({"field": f"{int(link.field[j]):#x}",
                         "type": int(link.rtype[j]), "target": f"{int(link.target[j]):#x}",
                         "why": "missing" if missing[j] else "other target"})
    extra_by_origin = {ORIGIN_NAMES[k]: int(((recovered.origin == k) & extra).sum())
                       for k in range(1, len(ORIGIN_NAMES))}
    return {"relevant": int(rel.sum()), "recovered": int((rel & same_target).sum()),
            "missing": int(missing.sum()), "wrong_target": int(wrong_target.sum()),
            "extra": int(extra.sum()), "extra_by_origin": extra_by_origin,
            "link_total": len(link), "recovered_total": len(recovered),
            "absolute_in_movable_code_to_fixed_targets": int(abs_fixed.sum()),
            "absolute_in_movable_code_to_fixed_targets_recovered": int((abs_fixed & got).sum()),
            "by_section": by, "examples": examples}


def use_vmlinuz(image, vmlinuz_path, log=None):
    """relayout's hook: recover ``image``'s references from ``vmlinuz_path``,
    pin the units of unexplained references, and make ``image.relocations``
    serve the recovered ones (link relocations the image may have are ignored).
    Returns the References (``summary()`` for relayout's report)."""
    from ..relayout.units import units_of
    units, functions, dis = units_of(image, log)
    refs = load_recovered(image, vmlinuz_path, units=units, log=log, dis=dis)
    install(image, refs, functions=functions, units=units)
    if log:
        log(f"references recovered from {vmlinuz_path}: {len(refs)} fields "
            f"({refs.stats['references.kaslr-64']} + {refs.stats['references.kaslr-32']} "
            f"absolute, {refs.stats['references.table']} in kernel tables, "
            f"{refs.stats['references.code-branch'] + refs.stats['references.code-rip']} "
            "in code)")
    return refs


def summary_of(refs):
    """The relayout summary's ``references`` entry."""
    out = {k.split(".", 1)[1]: v for k, v in refs.stats.items()}
    out["unexplained"] = refs.unexplained
    out["pinned_units"] = list(refs.pinned_units)
    out["kept_first"] = list(refs.kept_first)
    return {"references": out}
