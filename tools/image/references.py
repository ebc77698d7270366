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
- a value in padding between sections is arithmetic on a symbol bounding it:
  named after that symbol only from evidence (``attribute_padding_targets``),
  else listed as unattributed;
- anything else in data that looks like a reference into movable code (an
  8-byte value there, or an s32 whose field + value lands there) is
  *unexplained*: relayout pins the function it points at, never moves it on a
  guess (relayout/kernel/recovered.py: what depends on relayout's units).

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
                     R_X86_64_PLT32, sext32)
from .intervals import containing, merge_overlapping
from .words import section_spans, read_words

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
        self.padding_unattributed = np.zeros(0, np.uint64)   # attribute_padding_targets

    def __len__(self):
        return len(self.field)

    def contains(self, addrs):
        """True where an address is the field of one of these references."""
        a = np.asarray(addrs, np.uint64)
        i = np.searchsorted(self.field, a)
        ic = np.minimum(i, max(len(self.field) - 1, 0))
        return (i < len(self.field)) & (self.field[ic] == a) if len(self.field) else \
            np.zeros(a.shape, bool)


def in_sorted(a, s):
    """np.isin(a, s) for ``s`` sorted ascending, of ``a``'s dtype (a binary
    search per value: no sort of ``a``, which may have a million values)."""
    a = np.asarray(a)
    if not len(s):
        return np.zeros(a.shape, bool)
    i = np.searchsorted(s, a)
    return (i < len(s)) & (s[np.minimum(i, len(s) - 1)] == a)


# -- reading fields ------------------------------------------------------------
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
        v, _ = read_words(image, field[m], w)
        if t in (R_X86_64_PC32, R_X86_64_PLT32):
            out[m] = end[m] + sext32(v)
        elif t == R_X86_64_PC64:
            out[m] = end[m] + v
        elif t == R_X86_64_32S:
            out[m] = sext32(v)
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
    # immediate bytes after it); Capstone confirms and gives the offset
    raw, size = dis.raw, dis.size.astype(np.int64)
    branch = np.zeros(len(dis), bool)
    branch[idx] = True
    cand = np.zeros(len(dis), bool)
    rows = np.arange(len(dis))
    for imm in (0, 1, 2, 4):
        mpos = size - 5 - imm
        ok = (mpos >= 0) & ~branch
        modrm = raw[rows, np.clip(mpos, 0, 15)]
        cand |= ok & ((modrm & 0xC7) == 0x05)
    ci = np.nonzero(cand)[0]
    rip, doff = rip_relative(raw[ci], size[ci])
    ri, doff = ci[rip], doff[rip]
    r_field = dis.addr[ri] + doff.astype(np.uint64)
    r_end = dis.addr[ri] + size[ri].astype(np.uint64)
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
    v64, _ = read_words(image, f64, 8)
    v32, _ = read_words(image, f32, 4)
    t32 = sext32(v32)
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
    return merge_overlapping(lo, hi)        # containing() needs them disjoint


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
    """Every instruction of every code section from relayout's own unit
    disassembly plus a linear sweep of the code sections it does not lay out
    (the sweep the rewriter makes for them: left in its per-image cache), so
    recovery does not decode the kernel a second time."""
    from .disasm import Disassembly
    laid = {r.section for r in units.regions}
    secs = [s for s in image.sections if s.is_code and s.is_alloc and s.size
            and s.index not in laid]
    if not secs:
        return unit_dis
    from .context import ImageContext
    other = ImageContext.of(image).swept(secs)     # the rewriter's sweep, shared
    addr = np.concatenate([unit_dis.addr, other.addr])
    o = np.argsort(addr, kind="stable")
    cat = lambda a, b: np.concatenate([a, b])[o]        # noqa: E731
    d = Disassembly(addr[o], cat(unit_dis.size, other.size),
                    cat(unit_dis.func, np.full(len(other), -1, unit_dis.func.dtype)),
                    cat(unit_dis.raw, other.raw), list(unit_dis.undecodable) +
                    list(other.undecodable))
    # each row's branch decodes alone: the units' decode (cached) and the sweep's,
    # renumbered, are the merged one's, without decoding all of it again
    row = np.empty(len(o), np.int64)
    row[o] = np.arange(len(o))
    (ui, ut, uk), (oi, ot, ok) = unit_dis.branch_targets(), other.branch_targets()
    index = np.concatenate([row[ui], row[oi + len(unit_dis)]])
    order = np.argsort(index, kind="stable")
    d.adopt_branch_targets((index[order], np.concatenate([ut, ot])[order],
                            np.concatenate([uk, ok])[order]))
    return d


def recover(image, kaslr, log=None, dis=None):
    """References of a kernel image without link relocations: KASLR table
    (``kaslr``: abs64, abs32, inv32 arrays of field addresses), disassembly
    (``dis``: every code section's instructions; default the context's full
    decode) and kernel tables. relayout adds what depends on its units (pins for
    unexplained values and label arithmetic: relayout/kernel/recovered.py)."""
    from .context import ImageContext
    log = log or (lambda m: None)
    ctx = ImageContext.of(image, log=log)
    dis = ctx.disasm if dis is None else dis
    cf, ce, ct, co, ci = code_references(dis)
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
    attribute_padding_targets(image, refs, dis)
    return refs


# -- arithmetic on the symbols that bound padding -------------------------------
def _padding(image):
    """(starts, ends) of the gaps between consecutive allocated sections of the
    kernel's address range: no object lies there. .data..percpu counts at its
    load address (``__per_cpu_load``), where the KASLR table's per-CPU fields
    point (``early_gdt_descr``: ``init_per_cpu__gdt_page``)."""
    spans = sorted((s.addr, s.end) for s in image.sections if s.is_alloc and s.size and s.addr)
    sec, load = _percpu(image)
    if sec is not None:
        spans = sorted(spans + [(load, load + sec.size)])
    lo, hi = [], []
    end = None
    for a, e in spans:
        if end is not None and a > end:
            lo.append(end)
            hi.append(a)
        end = e if end is None else max(end, e)
    return np.array(lo, np.uint64), np.array(hi, np.uint64)


def padding_around(image, addr):
    """[start, end] of the padding that holds ``addr`` or has it at an edge
    (``__end_rodata``, past .BTF_ids), or None."""
    lo, hi = _padding(image)
    k = np.nonzero((lo <= np.uint64(addr)) & (np.uint64(addr) <= hi))[0]
    return (int(lo[k[0]]), int(hi[k[0]])) if len(k) else None


def _symbol_addresses(image):
    """(sorted values, symbol index) of the symbols a field may name: defined
    in a section, not SECTION or FILE."""
    names, syms = image.symbol_table()
    typ = syms["info"] & 0xF
    ok = (typ != STT_SECTION) & (typ != 4) & (syms["shndx"] > 0) & (syms["shndx"] < 0xFF00)
    si = np.nonzero(ok)[0]
    sv = syms["value"][si].astype(np.uint64)
    o = np.argsort(sv, kind="stable")
    return sv[o], si[o]


def virtual_target(refs):
    """Targets as kernel virtual addresses: a 32-bit R_X86_64_32 (or 64-bit)
    value below 2 GiB is ``sym - __START_KERNEL_map`` (``__pa_symbol``)."""
    t = refs.target.copy()
    phys = np.isin(refs.rtype, (R_X86_64_32, R_X86_64_64)) & (t < np.uint64(1 << 31))
    t[phys] += np.uint64(START_KERNEL_MAP)
    return t


def _round_up_mask(dis, field):
    """The ``and $-2**k`` that rounds the value the instruction holding ``field``
    loads, or 0: that instruction is ``mov $imm32, %r64`` (REX.W C7 /0, the
    field its immediate) and one of the next instructions ands the same register
    with a negative power of two (REX.W 81 /4 id, or REX.W 25 id for %rax)."""
    i = int(dis.containing(np.array([field], np.uint64))[0])
    if i < 0:
        return 0
    raw = dis.raw[i]
    n = int(dis.size[i])
    if n != 7 or raw[0] & 0xF8 != 0x48 or raw[1] != 0xC7 or raw[2] & 0xF8 != 0xC0 or \
            int(dis.addr[i]) + 3 != field:
        return 0
    reg = (raw[2] & 7) | ((raw[0] & 1) << 3)
    for j in range(i + 1, min(i + 9, len(dis))):
        if int(dis.addr[j]) != int(dis.addr[j - 1]) + int(dis.size[j - 1]):
            break                                   # the sweep left the function
        r, m = dis.raw[j], int(dis.size[j])
        imm = None
        if m == 7 and r[0] & 0xF8 == 0x48 and r[1] == 0x81 and r[2] & 0xF8 == 0xE0 and \
                (r[2] & 7) | ((r[0] & 1) << 3) == reg:
            imm = bytes(r[3:7])
        elif m == 6 and r[0] == 0x48 and r[1] == 0x25 and reg == 0:
            imm = bytes(r[2:6])
        if imm is not None:
            v = int.from_bytes(imm, "little", signed=True)
            return v if v < 0 and (-v) & (-v - 1) == 0 else 0
    return 0


def attribute_padding_targets(image, refs, dis):
    """An absolute or RIP-relative reference whose target lies in padding between
    sections (no object there to point at) is arithmetic on a symbol that bounds
    the padding: the link names that symbol with an addend, and the field must
    move with it (relayout/kernel/kallsyms_cold.py moves ``__end_rodata``). The
    target alone does not tell which symbol; these idioms do, from evidence:

    - at a symbol: that address (nothing to name here; who moves it checks that
      no other symbol shares it);
    - rounding up: the field is the immediate of ``mov $imm32, %r64`` and the
      next instructions ``and`` that register with ``-2**k``: the compiler
      folded ``sym + 2**k - 1`` (``PFN_ALIGN(__end_rodata)`` in 6.1's
      mark_rodata_ro), so the symbol is at target - (2**k - 1), and must be one;
    - an inclusive end: target + 1 is a symbol (``__pa_symbol(__end_rodata) - 1``,
      setup_arch's ``rodata_resource.end``); one byte below a symbol in padding
      can mean nothing else.

    The reference then names that symbol (``refs.drag``, as the link's
    relocation does). Any other target in padding is not provable: it is listed
    (``refs.padding_unattributed``: virtual targets) and a move of a symbol
    bounding that padding is refused."""
    m = np.nonzero(np.isin(refs.origin, (KASLR64, KASLR32, CODE_RIP)))[0]
    t = virtual_target(refs)[m]
    lo, hi = _padding(image)
    g = containing(lo, hi, t)
    m, t = m[g >= 0], t[g >= 0]
    sv, si = _symbol_addresses(image)

    def symbol_at(a):
        j = int(np.searchsorted(sv, np.uint64(a)))
        return int(si[j]) if j < len(sv) and int(sv[j]) == a else None

    exact = rounded = inclusive = 0
    left = []
    for r, v in zip(m.tolist(), t.tolist()):
        if symbol_at(v) is not None:
            exact += 1
            continue
        sym = None
        if refs.origin[r] != CODE_RIP and refs.rtype[r] == R_X86_64_32S:
            mask = _round_up_mask(dis, int(refs.field[r]))
            if mask:
                sym = symbol_at(v + mask + 1)      # v - (2**k - 1)
                rounded += sym is not None
        if sym is None:
            sym = symbol_at(v + 1)
            inclusive += sym is not None
        if sym is None:
            left.append(v)
        else:
            refs.drag[r] = sym
    refs.padding_unattributed = np.array(sorted(left), np.uint64)
    refs.stats["references.padding_targets"] = int(len(m))
    refs.stats["references.padding_at_symbol"] = exact
    refs.stats["references.padding_rounded_up"] = rounded
    refs.stats["references.padding_inclusive_end"] = inclusive
    refs.stats["references.padding_unattributed"] = len(left)


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
    lo, hi, secs = section_spans(image)
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
    by_sec = np.argsort(fk, kind="stable")          # each section's rows in field order
    cut = np.searchsorted(fk[by_sec], np.arange(len(secs) + 1))
    for k in np.unique(fk[fk >= 0]).tolist():
        m = by_sec[cut[k]:cut[k + 1]]
        rows = np.zeros(len(m), RELA)
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
                (refs.origin != TABLE) & ~in_sorted(refs.target, units.start)
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


def read_kaslr(image, vmlinuz_path):
    """The KASLR table of ``vmlinuz_path`` (BadInput unless it is ``image``'s
    build)."""
    from ..errors import BadInput
    from .bootimage import read_vmlinuz
    # a path, or an object with the table already read (``.kaslr``: tests)
    z = vmlinuz_path if hasattr(vmlinuz_path, "kaslr") else read_vmlinuz(vmlinuz_path)
    bid = getattr(z, "build_id", None)
    if bid and image.build_id and bid.lower() != image.build_id.lower():
        raise BadInput(f"{vmlinuz_path}: another build than {image.path} (build-id "
                       f"{bid[:16]}..., the vmlinux has {image.build_id[:16]}...)")
    return z.kaslr


def load_recovered(image, vmlinuz_path, log=None, dis=None):
    """Read the KASLR table of ``vmlinuz_path`` (same build as ``image``) and
    recover the image's references."""
    return recover(image, read_kaslr(image, vmlinuz_path), log=log, dis=dis)


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
    lo, hi, secs = section_spans(image)

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


def summary_of(refs):
    """The relayout summary's ``references`` entry."""
    out = {k.split(".", 1)[1]: v for k, v in refs.stats.items()}
    out["unexplained"] = refs.unexplained
    out["pinned_units"] = list(refs.pinned_units)
    out["kept_first"] = list(refs.kept_first)
    return {"references": out}
