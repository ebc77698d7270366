"""verify --against, step 3: data. Data symbols stay (but for the few a rewrite
may move), every relocated pointer in a data section translates (nothing left
pointing at old code), and every function stays inside its region."""

import numpy as np

from ..image.elf import STT_SECTION
from .tables import sorted_table_ranges

# Data symbols a rewrite may move (tools/relayout/kallsyms_cold.py: kallsyms'
# arrays grown by the `.cold` entries of a block-level layout, and the end of the
# read-only data behind them). Every other data symbol stays.
MOVABLE_DATA = ("kallsyms_offsets", "kallsyms_names", "kallsyms_markers",
                "kallsyms_seqs_of_names", "__end_rodata")


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


def check_data_symbols(ctx, out):
    """Data symbols that moved must be movable (MOVABLE_DATA)."""
    out.add("equiv.data-symbol", ctx.bad_data_symbols,
            lambda b: (b[2], f"data symbol {b[0]} moved from {b[1]:#x} to {b[2]:#x}"))


def check_data_pointers(ctx, out):
    """Every absolute pointer field (R_X86_64_64) in NEW's data sections holds the
    translated value of the same field in OLD."""
    old, new, amap, octx = ctx.old, ctx.new, ctx.amap, ctx.octx
    stale = []
    checked = 0
    t_lo, t_hi = sorted_table_ranges(octx)
    for name, rel in new.relocations.items():
        tgt = rel.target
        if not tgt.is_alloc or tgt.is_code or tgt.type == 8:
            continue
        sel = rel.type == 1
        if not sel.any():
            continue
        offs = rel.offset[sel]
        inside = (offs >= np.uint64(tgt.addr)) & (offs + np.uint64(8) <= np.uint64(tgt.end))
        offs = offs[inside]
        if len(t_lo):
            k = np.searchsorted(t_lo, offs, side="right").astype(np.int64) - 1
            kc = np.maximum(k, 0)
            offs = offs[~((k >= 0) & (offs < t_hi[kc]))]
        o_sec = old.section(tgt.name)
        if o_sec is None or o_sec.addr != tgt.addr:
            continue
        base_n = tgt.offset
        base_o = o_sec.offset
        rel_off = (offs - np.uint64(tgt.addr)).astype(np.int64)
        idx = rel_off[:, None] + np.arange(8)[None, :]
        v_new = new.data[base_n + idx].copy().view("<u8").ravel()
        v_old = old.data[base_o + idx].copy().view("<u8").ravel()
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
        if bad.any():
            outside.append((r.name, int(bad.sum()), int(ns[bad][0])))
    out.add("equiv.region", outside, lambda o: (o[2], f"{o[1]} function(s) left region {o[0]}"))

