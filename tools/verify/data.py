"""verify --against, step 3: data. Data symbols stay (but for the few a rewrite
may move), every relocated pointer in a data section translates (nothing left
pointing at old code), and every function stays inside its region."""

import numpy as np

from ..image.disasm import LEGACY_PREFIXES, skip_prefixes
from ..image.elf import STT_SECTION
from .addrmap import KERNEL_MAP
from .tables import sorted_table_ranges

# Data symbols a rewrite may move (tools/relayout/kernel/kallsyms_cold.py: kallsyms'
# arrays grown by the `.cold` entries of a block-level layout, the token arrays that
# may move to join their free storage, and the end of the
# read-only data behind them). Every other data symbol stays.
MOVABLE_DATA = ("kallsyms_offsets", "kallsyms_names", "kallsyms_markers",
                "kallsyms_seqs_of_names", "kallsyms_token_table", "kallsyms_token_index",
                "__end_rodata")


# End markers among them: a field means the label in one of a few proven forms.
_LABELS = ("__end_rodata",)
_PAGE = 4096


class DataMoves:
    """How the code fields that designate a moved data symbol changed.

    With OLD's link relocations the fields are known: ``addrs`` (sorted addresses
    in OLD) and each one's ``deltas``. An image without them (a distribution's
    stripped vmlinux; relayout recovered its references from the vmlinuz) names
    its fields by value only: a field whose value lies in a moved symbol's old
    extent (up to the next symbol; an end label in the forms relayout proves)
    must have moved with it, by its delta."""

    def __init__(self, addrs=(), deltas=(), extents=None):
        self.addrs = np.asarray(addrs, np.uint64)
        self.deltas = np.asarray(deltas, np.int64)
        self.extents = extents or []    # [(lo, hi inclusive, delta, also physical)]

    def __len__(self):
        return len(self.addrs) + len(self.extents)

    def moved_value(self, value, size=8):
        """``value`` (a field of ``size`` bytes, sign-extended) as moved with the
        data symbol whose extent holds it, or None."""
        mask = (1 << (8 * size)) - 1 if size < 8 else (1 << 64) - 1
        v = int(value) & ((1 << 64) - 1)
        phys = 0 < v < (1 << 31)
        virt = (v + KERNEL_MAP) & ((1 << 64) - 1) if phys else v
        for lo, hi, d, phys_ok in self.extents:
            if lo <= virt <= hi and (phys_ok or not phys):
                return (v + d) & mask
        return None

    def explains(self, field_addr, old_value, new_value, size):
        """The field at ``field_addr`` moved with a moved data symbol."""
        mask = (1 << (8 * size)) - 1 if size < 8 else (1 << 64) - 1
        k = int(np.searchsorted(self.addrs, field_addr))
        if k < len(self.addrs) and int(self.addrs[k]) == field_addr:
            return (new_value - old_value - int(self.deltas[k])) & mask == 0
        if self.extents:
            m = self.moved_value(old_value, size)
            return m is not None and m == new_value & mask
        return False


def data_moves(old, new):
    """Data symbols whose value changed: each must be movable. Returns ([(name, old
    value, new value)] of those that may not move, {name: new value} of those that
    did, the DataMoves the instruction checks use)."""
    code = {s.index for s in old.sections if s.is_code}
    no, so = old.symbol_table()
    nn, sn = new.symbol_table()
    def unique(names, syms):
        out = {}
        for i, (nm, t, x) in enumerate(zip(names, (syms["info"] & 0xF).tolist(),
                                           syms["shndx"].tolist())):
            if nm and t not in (STT_SECTION, 4) and x and x < 0xFF00:
                out[nm] = None if nm in out else i
        return out
    uo, un = unique(no, so), unique(nn, sn)
    moved, bad = {}, []
    for nm, i in uo.items():
        j = un.get(nm)
        if i is None or j is None or int(so["shndx"][i]) in code:
            continue
        if int(so["value"][i]) != int(sn["value"][j]):
            if _follows_its_section(old, new, int(so["shndx"][i]), int(sn["shndx"][j]),
                                    int(so["value"][i]), int(sn["value"][j])):
                continue
            if nm in MOVABLE_DATA:
                moved[i] = (nm, int(sn["value"][j]) - int(so["value"][i]), int(sn["value"][j]))
            else:
                bad.append((nm, int(so["value"][i]), int(sn["value"][j])))
    moved_names = {nm: v for nm, _, v in moved.values()}
    code_rels = [rel for rel in old.relocations.values()
                 if rel.target.is_code and rel.target.is_alloc]
    if moved and not code_rels:
        return bad, moved_names, DataMoves(extents=_extents(old, so, moved))
    addrs, deltas = [], []
    for rel in code_rels if moved else ():
        sel = np.nonzero(np.isin(rel.sym.astype(np.int64), list(moved)))[0]
        for k in sel.tolist():
            addrs.append(int(rel.offset[k]))
            deltas.append(moved[int(rel.sym[k])][1])
    o = np.argsort(np.array(addrs, np.uint64), kind="stable")
    return bad, moved_names, DataMoves(np.array(addrs, np.uint64)[o], np.array(deltas, np.int64)[o])


def _extents(old, syms, moved):
    """[(lo, hi inclusive, delta, also physical)] of the moved symbols ({symbol
    index: (name, delta, new value)}) in OLD: a kallsyms array over its size
    (kernel/kallsyms.py: the symbols have no ELF size; unnamed strings may follow
    the last one), any other up to the next symbol; a label in its proven forms."""
    from ..image.context import ImageContext
    from ..kernel.kallsyms import Kallsyms
    values = np.unique(syms["value"].astype(np.uint64))
    known = Kallsyms().array_sizes(ImageContext.of(old))
    out = []
    for i, (nm, d, _) in moved.items():
        lo = int(syms["value"][i])
        if nm in _LABELS:
            # the forms relayout proves (image/references.py): the label, the
            # byte before it (``__pa_symbol(label) - 1``, also physical) and
            # ``PFN_ALIGN(label)`` (compiled as label + PAGE-1, then an and)
            out += [(v, v, d, True) for v in (lo - 1, lo, lo + _PAGE - 1)]
            continue
        size = int(syms["size"][i]) or known.get(nm, 0)
        if not size:
            k = int(np.searchsorted(values, np.uint64(lo), side="right"))
            size = int(values[k]) - lo if k < len(values) else 1
        out.append((lo, lo + size - 1, d, False))
    return out


def _follows_its_section(old, new, oi, ni, ov, nv):
    """A symbol of a section the rewrite moved (a userspace executable's unwind
    tables in a new segment) keeps its place from the section's start or end."""
    if oi >= len(old.sections) or ni >= len(new.sections):
        return False
    a, b = old.sections[oi], new.sections[ni]
    return a.name == b.name and a.addr != b.addr and \
        (ov - a.addr == nv - b.addr or a.end - ov == b.end - nv)


def check_data_symbols(ctx, out):
    """Data symbols that moved must be movable (MOVABLE_DATA)."""
    out.add("equiv.data-symbol", ctx.bad_data_symbols,
            lambda b: (b[2], f"data symbol {b[0]} moved from {b[1]:#x} to {b[2]:#x}"))


def check_data_pointers(ctx, out):
    """Every absolute pointer field in the data sections (R_X86_64_64; in an
    executable also R_X86_64_32 / 32S) that OLD's relocations name holds, in
    NEW, the translated value of the same field in OLD. Switch-table entries
    are left to the code-fields check (pie.py), which knows their tables."""
    from .addrmap import code_ranges
    old, new, amap, octx = ctx.old, ctx.new, ctx.amap, ctx.octx
    skip = None
    if not octx.is_kernel:
        from .pie import old_switch_tables
        skip = old_switch_tables(octx).abs_field
    stale = []
    checked = 0
    t_lo, t_hi = sorted_table_ranges(octx)
    types = ((1, 8, False),) if octx.is_kernel else ((1, 8, False), (10, 4, False), (11, 4, True))
    for name, rel in old.relocations.items():
        tgt = rel.target
        if not tgt.is_alloc or tgt.is_code or tgt.type == 8:
            continue
        n_sec = new.section(tgt.name)
        if n_sec is None or n_sec.addr != tgt.addr:
            continue
        for rtype, width, signed in types:
            sel = rel.type == rtype
            if not sel.any():
                continue
            offs = rel.offset[sel]
            inside = (offs >= np.uint64(tgt.addr)) & (offs + np.uint64(width) <= np.uint64(tgt.end))
            offs = offs[inside]
            if len(t_lo):
                k = np.searchsorted(t_lo, offs, side="right").astype(np.int64) - 1
                kc = np.maximum(k, 0)
                offs = offs[~((k >= 0) & (offs < t_hi[kc]))]
            if skip is not None and len(skip):
                offs = offs[~np.isin(offs, skip)]
            rel_off = (offs - np.uint64(tgt.addr)).astype(np.int64)
            idx = rel_off[:, None] + np.arange(width)[None, :]
            dt = "<u8" if width == 8 else ("<i4" if signed else "<u4")

            def values(image, base):
                v = image.data[base + idx].copy().view(dt).ravel()
                return v.astype(np.int64).view(np.uint64) if width == 4 else v
            v_new, v_old = values(new, n_sec.offset), values(old, tgt.offset)
            if width == 4:
                # only the fields that name code (a 4-byte field is often a number)
                code = np.zeros(len(v_old), bool)
                for lo, hi in code_ranges(old):
                    code |= (v_old >= np.uint64(lo)) & (v_old < np.uint64(hi))
                offs, v_old, v_new = offs[code], v_old[code], v_new[code]
            want = amap.map(v_old)
            bad = np.nonzero(~amap.translates(v_old, v_new, octx.is_kernel))[0]
            checked += len(offs)
            for b in bad.tolist():
                stale.append((int(offs[b]), int(v_old[b]), int(v_new[b]), int(want[b]), tgt.name))
    out.add("equiv.data-pointer", stale,
            lambda s: (s[0], f"pointer at {s[0]:#x} in {s[4]} holds {s[2]:#x}; the original "
                       f"pointed at {octx.symbol_at(s[1])}, now at {s[3]:#x}"))


def check_regions(ctx, out):
    """Every function stays inside the region (between the same boundary labels)."""
    old, new, of, nf, oi, ni = ctx.old, ctx.new, ctx.of, ctx.nf, ctx.oi, ctx.ni
    from ..image.functions import regions
    ro = regions(old)
    rn = {r.name: r for r in regions(new)}
    outside = []
    for r in ro:
        n = rn.get(r.name)
        sel = (of.start[oi] >= np.uint64(r.start)) & (of.start[oi] < np.uint64(r.end))
        if n is None:
            if sel.any():
                outside.append((r.name, int(sel.sum()), None))
            continue
        ns, ne = nf.start[ni[sel]], nf.end[ni[sel]]
        bad = (ns < np.uint64(n.start)) | (ne > np.uint64(n.end))
        # code that stayed where it was (pinned, its section moved to a new segment
        # without it) left nothing
        bad &= ns != of.start[oi[sel]]
        if bad.any():
            outside.append((r.name, int(bad.sum()), int(ns[bad][0])))
    out.add("equiv.region", outside, lambda o: (o[2], f"{o[1]} function(s) left region {o[0]}"))



# instructions per slice when check_moved_data_fields looks for candidate fields
_WINDOW_ROWS = 1 << 18


def check_moved_data_fields(ctx, out):
    """An image without relocations (data_moves by value): every code field of
    OLD whose value designates a moved data symbol holds, in NEW, the moved value.
    The instruction check sees only instructions that changed; this one finds a
    field that should have moved and did not. Candidates are found from the raw
    bytes (every 4-byte window as an absolute or RIP-relative value, every
    8-byte window as a movabs immediate); Capstone's field layout then decides."""
    moves = ctx.data_moves
    if moves is None or not moves.extents:
        return
    from .fields import FieldLayouts, field_values
    od, nd = ctx.octx.disasm, ctx.nctx.disasm
    raw = od.raw

    def inside(v, virt_ok=True):
        v = v.astype(np.uint64)
        phys = (v > 0) & (v < np.uint64(1 << 31))
        virt = np.where(phys, v + np.uint64(KERNEL_MAP), v)
        hit = np.zeros(len(v), bool)
        for a, b, _, phys_ok in moves.extents:
            hit |= (virt >= np.uint64(a)) & (virt <= np.uint64(b)) & (phys_ok | ~phys)
        return hit & (phys | virt_ok)

    # a slice of instructions at a time: the windows of all of them at once were
    # a transient of ~100 bytes an instruction (7.3: 480 MB, the peak of verify)
    cand = np.zeros(len(raw), bool)
    for lo in range(0, len(raw), _WINDOW_ROWS):
        r = raw[lo:lo + _WINDOW_ROWS]
        e = od.addr[lo:lo + _WINDOW_ROWS] + od.size[lo:lo + _WINDOW_ROWS].astype(np.uint64)
        c = np.zeros(len(r), bool)
        for k in range(13):
            sv = np.ascontiguousarray(r[:, k:k + 4]).view("<i4")[:, 0].astype(np.int64) \
                .astype(np.uint64)
            c |= inside(sv) | inside(e + sv)
        for k in range(9):
            c |= inside(np.ascontiguousarray(r[:, k:k + 8]).view("<u8")[:, 0])
        cand[lo:lo + _WINDOW_ROWS] = c
    rows = np.nonzero(cand & (od.size > 0))[0]
    out.extra["equivalence_moved_data_fields"] = 0
    if not len(rows):
        return
    decoded, d_off, d_sz, i_off, i_sz, rip = FieldLayouts().layouts(raw[rows], od.size[rows],
                                                                    od.addr[rows])
    dv = field_values(raw[rows], d_off, d_sz)
    dv = np.where(rip, od.addr[rows] + od.size[rows].astype(np.uint64) + dv, dv)
    iv = field_values(raw[rows], i_off, i_sz)
    n_addr = ctx.amap.map(od.addr[rows])
    k_new = np.minimum(np.searchsorted(nd.addr, n_addr), len(nd.addr) - 1)
    wrong, fields = [], 0
    # a kernel address (sign-extended from 32 bits: R_X86_64_32S) is only in a
    # displacement or in the immediate of a 64-bit operation; any other immediate
    # is a 32-bit value (R_X86_64_32 cannot reach the top 2 GB: the link fails), so
    # only its physical reading counts (Debian 13's generic 6.12: `cmp $0x8241104c,
    # %eax`, a PCI id, inside the moved kallsyms_offsets)
    sext = imm_sign_extended(raw[rows])
    for r, has, off, sz, val, is_rip, virt_ok in (
            (rows, decoded & (d_sz > 0), d_off, d_sz, dv, rip, True),
            (rows, decoded & (i_sz > 0), i_off, i_sz, iv, np.zeros(len(rows), bool), sext)):
        for k in np.nonzero(has & inside(val, virt_ok))[0].tolist():
            fields += 1
            nk = int(k_new[k])
            if int(nd.addr[nk]) != int(n_addr[k]):
                continue                    # no counterpart: the instruction check says so
            width = int(sz[k])
            got = int(field_values(nd.raw[nk:nk + 1], off[k:k + 1], sz[k:k + 1])[0])
            if is_rip[k]:
                got = (got + int(nd.addr[nk]) + int(nd.size[nk])) & ((1 << 64) - 1)
                width = 8
            want = moves.moved_value(int(val[k]), 8)
            mask = (1 << (8 * width)) - 1 if width < 8 else (1 << 64) - 1
            if want is not None and (got & mask) != (want & mask):
                wrong.append((int(od.addr[r[k]]), int(n_addr[k]), int(val[k]), want, got))
    out.extra["equivalence_moved_data_fields"] = fields
    out.add("equiv.moved-data-field", wrong,
            lambda w: (w[1], f"{ctx.octx.symbol_at(w[0])}: field {w[2]:#x} designates a moved "
                       f"data symbol and should be {w[3]:#x}, is {w[4]:#x}"))


def imm_sign_extended(raw):
    """Per instruction (rows of raw bytes): does its 32-bit immediate act as a 64-bit
    value? A REX prefix with W before the opcode (64-bit operand size: the
    immediate is sign-extended), or ``push imm32`` (0x68, 64-bit by default)."""
    _, b, after = skip_prefixes(np.asarray(raw, np.uint8), LEGACY_PREFIXES, rounds=14)
    rex = (b & 0xF0) == 0x40          # REX comes right before the opcode
    op = np.where(rex, after, b)
    return (rex & ((b & 0x08) != 0)) | (op == 0x68)
