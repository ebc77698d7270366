"""verify --against, step 3: data. Data symbols stay (but for the few a rewrite
may move), every relocated pointer in a data section translates (nothing left
pointing at old code), and every function stays inside its region."""

import numpy as np

from ..image.elf import STT_SECTION
from .tables import sorted_table_ranges

# Data symbols a rewrite may move (tools/relayout/kernel/kallsyms_cold.py: kallsyms'
# arrays grown by the `.cold` entries of a block-level layout, the token arrays that
# may move to join their free storage, and the end of the
# read-only data behind them). Every other data symbol stays.
MOVABLE_DATA = ("kallsyms_offsets", "kallsyms_names", "kallsyms_markers",
                "kallsyms_seqs_of_names", "kallsyms_token_table", "kallsyms_token_index",
                "__end_rodata")


def data_moves(old, new):
    """Data symbols whose value changed: each must be movable. Returns ([(name, old
    value, new value)] of those that may not move, {name: new value} of those that
    did, (sorted addresses in OLD of the code fields relocated against one, each
    field's move)) for the instruction checks."""
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
    addrs, deltas = [], []
    for rel in old.relocations.values():
        if not (rel.target.is_code and rel.target.is_alloc) or not moved:
            continue
        sel = np.nonzero(np.isin(rel.sym.astype(np.int64), list(moved)))[0]
        for k in sel.tolist():
            addrs.append(int(rel.offset[k]))
            deltas.append(moved[int(rel.sym[k])][1])
    o = np.argsort(np.array(addrs, np.uint64), kind="stable")
    return (bad, {nm: v for nm, _, v in moved.values()},
            (np.array(addrs, np.uint64)[o], np.array(deltas, np.int64)[o]))


# The values a code field may hold for a symbol S of MOVABLE_DATA (S plus an
# addend) in the idioms relayout proves for a relocation-stripped image
# (image/references.py attribute_padding_targets): S itself, S - 1 (an
# inclusive end) and S + 2**k - 1 (rounding up to 2**k, k <= 12: PFN_ALIGN),
# each also as a physical address (__pa_symbol).
_START_KERNEL_MAP = 0xffffffff80000000      # x86-64 __START_KERNEL_map
_ADDENDS = (0, -1) + tuple((1 << k) - 1 for k in range(1, 13))


def data_moves_by_value(old, new, moved_names):
    """For an OLD without relocations in code (a distribution's stripped
    vmlinux: relayout recovered its references from the vmlinuz), the fields
    that follow a moved data symbol can only be told by value, as relayout told
    them (relayout/kernel/kallsyms_cold.py ``_recovered_moves``): {field value
    in OLD (S + addend, 64 bits): move}. None when OLD has such relocations
    (data_moves lists the fields then) or nothing moved."""
    if not moved_names or any(rel.target.is_code and rel.target.is_alloc and len(rel.offset)
                              for rel in old.relocations.values()):
        return None
    out = {}
    for nm in moved_names:
        a, b = old.symbol_address(nm), new.symbol_address(nm)
        if a is None or b is None or a == b:
            continue
        for add in _ADDENDS:
            out[(a + add) & ((1 << 64) - 1)] = b - a
            if a >= _START_KERNEL_MAP:       # __pa_symbol(S): the physical address
                out[a + add - _START_KERNEL_MAP] = b - a
    return out or None


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

