"""verify --against, step 4: kernel tables. Every table's address columns
translate as a multiset (sorted tables may be re-sorted); kallsyms keeps its
(name, translated address) pairs, plus one `name.cold` entry per function a
block-level layout split; ORC gives the original's entry at every translated
instruction."""

import numpy as np

from ..kernel import TABLES
from .code import fill_instructions
from .symbols import added_cold, cold_parts

ADDRESS_COLUMNS = {"code", "target", "addr", "ip", "insn", "fixup", "instr", "value"}

_EMPTY = np.zeros(0, np.uint64)
_NO_SPLIT = ((_EMPTY, _EMPTY), (_EMPTY, _EMPTY))      # split_ranges of a function-level layout


def sorted_table_ranges(octx):
    """Byte ranges of tables a rewrite re-sorts (checked as multisets instead)."""
    lo, hi = [], []
    for cls in TABLES:
        t = cls()
        if not getattr(t, "resorted_by_relayout", False):
            continue
        for start, count, itemsize in t.ranges(octx):
            lo.append(start)
            hi.append(start + count * itemsize)
    return np.array(lo, np.uint64), np.array(hi, np.uint64)


def check_tables(ctx, out):
    octx, nctx, amap = ctx.octx, ctx.nctx, ctx.amap
    cold_names, moved_data = ctx.cold_names, ctx.moved_data
    split_ranges = _split_ranges(ctx)
    address_columns = ADDRESS_COLUMNS

    def moved_any():
        """Whether the map moves any instruction of OLD (every one mapped: asked
        only where a table needs it, the ORC table, not in an executable)."""
        od_addr = octx.disasm.addr
        return bool(len(od_addr)) and bool((amap.map(od_addr) != od_addr).any())
    for cls in TABLES:
        t_old, t_new = cls(), cls()
        if t_old.locate(octx) is None:
            continue
        if t_new.locate(nctx) is None:
            out.add("equiv.table-missing", [cls.name],
                    lambda n: (None, f"{n} is missing from the new image"))
            continue
        eo, en = t_old.parse(octx), t_new.parse(nctx)
        if cls.name == "kallsyms" and cold_names:
            # a block-level layout adds a `name.cold` symbol per split function, each
            # at its cold part (gcc's own cold parts may carry the same names: the
            # added ones are told apart by their address)
            from collections import Counter
            want = Counter(added_cold(ctx.old, ctx.new, cold_names))
            keep = []
            for nm, a in zip(t_new.names, en["addr"].tolist()):
                if want[(nm, a)] > 0:
                    want[(nm, a)] -= 1
                    keep.append(False)
                else:
                    keep.append(True)
            missing = sorted(p for p, k in want.items() for _ in range(k))
            out.add("equiv.kallsyms-cold", missing,
                    lambda p: (p[1], f"kallsyms has no entry for {p[0]} at {p[1]:#x}: backtraces "
                               "and kprobes name its cold code after the symbol before it"))
            keep = np.array(keep, dtype=bool)
            en = en[keep]
            t_new.names = [nm for nm, k in zip(t_new.names, keep.tolist()) if k]
        if len(eo) != len(en):
            out.add("equiv.table-count", [(cls.name, len(eo), len(en))],
                    lambda c: (None, f"{c[0]}: {c[1]} entries before, {c[2]} after"))
            continue
        if cls.name == "orc_unwind":
            # What the unwinder sees must not change: the lookup at every
            # translated instruction gives the original's entry. Relayout adds an
            # entry at every moved piece and compacts the table, so IPs match as a
            # multiset only where nothing moved.
            if not moved_any():
                _check_orc(eo, en, amap, nctx, out)
            _check_orc_lookup(octx, nctx, amap, split_ranges or _NO_SPLIT, out)
            continue
        for colname in eo.dtype.names:
            # kallsyms is checked below by (name, address) pairs, which also
            # knows which names are region labels rather than functions
            if colname not in address_columns or cls.name == "kallsyms":
                continue
            want = np.sort(amap.map(eo[colname]))
            got = np.sort(en[colname])
            if not np.array_equal(want, got):
                nbad = int((want != got).sum())
                first = int(np.nonzero(want != got)[0][0])
                out.add("equiv.table", [(cls.name, colname, nbad, int(want[first]))],
                        lambda c: (c[3], f"{c[0]}.{c[1]}: {c[2]} entries do not translate "
                                   f"(first expected {c[3]:#x})"))
        if cls.name == "kallsyms":
            from ..image.functions import KERNEL_REGION_LABELS
            mapped = amap.map(eo["addr"]).tolist()
            for k, nm in enumerate(t_old.names):
                if nm in KERNEL_REGION_LABELS:
                    v = nctx.image.symbol_address(nm)
                    mapped[k] = v if v is not None else mapped[k]
                elif moved_data and nm in moved_data:
                    mapped[k] = moved_data[nm]
            o_pairs = sorted(zip(t_old.names, mapped))
            n_pairs = sorted(zip(t_new.names, en["addr"].tolist()))
            if o_pairs != n_pairs:
                diff = [p for p, q in zip(o_pairs, n_pairs) if p != q]
                out.add("equiv.kallsyms", diff,
                        lambda p: (p[1], f"kallsyms {p[0]} should be at {p[1]:#x}"))


def _split_ranges(ctx):
    """(old ranges, new part ranges) of the split functions, each as sorted (lo, hi)."""
    of, nf, split, oi, ni, new = ctx.of, ctx.nf, ctx.split, ctx.oi, ctx.ni, ctx.new
    if not split.any():
        return None
    idx = np.nonzero(split)[0]
    old_lo, old_hi = of.start[idx], of.end[idx]
    j_of = dict(zip(oi.tolist(), ni.tolist()))
    lo, hi = [], []
    for i in idx.tolist():
        j = j_of.get(i)
        if j is not None:
            lo.append(int(nf.start[j]))
            hi.append(int(nf.end[j]))
    for parts in cold_parts(new).values():
        for a, b in parts:
            lo.append(a)
            hi.append(b)
    o = np.argsort(old_lo)
    n = np.argsort(np.array(lo, np.uint64))
    return ((old_lo[o], old_hi[o]),
            (np.array(lo, np.uint64)[n], np.array(hi, np.uint64)[n]))


def orc_lookup(ctx):
    """(sorted IPs, one comparable key per entry) of an image's ORC table, or None."""
    from ..kernel.orc import OrcTable
    t = OrcTable()
    if t.locate(ctx) is None:
        return None
    e = t.parse(ctx)
    e = e[np.argsort(e["ip"], kind="stable")]
    key = (e["sp_offset"].astype(np.int64) & 0xFFFF) | \
        ((e["bp_offset"].astype(np.int64) & 0xFFFF) << 16) | (e["bits"].astype(np.int64) << 32)
    return e["ip"].astype(np.uint64), key


def _within(addrs, ranges):
    """True where an address lies in one of the (sorted, disjoint) [lo, hi) ranges."""
    from ..image.intervals import containing
    return containing(ranges[0], ranges[1], addrs) >= 0


def _check_orc_lookup(octx, nctx, amap, split_ranges, out):
    """A block-level layout adds ORC entries at moved pieces and compacts the
    table (an entry equal to the one before it is redundant), so the IPs no longer
    match as a multiset; what must hold is what the unwinder sees: the lookup at
    every translated instruction of a function moved whole gives the original's
    entry (split functions are checked piece by piece in blocks.py)."""
    lo, ln = orc_lookup(octx), orc_lookup(nctx)
    if lo is None or ln is None:
        return
    od = octx.disasm
    # int3/nop fill between code is not compared: relayout drops and inserts it
    fill = fill_instructions(octx, od)
    a = od.addr[~_within(od.addr, split_ranges[0]) & ~fill]
    b = amap.map(a)

    def key(orc, x):
        i = np.searchsorted(orc[0], x, side="right").astype(np.int64) - 1
        return np.where(i >= 0, orc[1][np.maximum(i, 0)], -1)
    bad = np.nonzero(key(lo, a) != key(ln, b))[0]
    out.add("equiv.orc", bad.tolist(),
            lambda k: (int(b[k]), f"ORC lookup at {int(b[k]):#x} ({octx.symbol_at(int(a[k]))}) "
                       "differs from the original's"))


def _check_orc(eo, en, amap, nctx, out):
    """ORC IPs translate as a multiset, except that relayout may drop entries the
    unwinder can never find (another entry has the same IP) to make room for
    'undefined' entries at the start of the int3 padding it inserts."""
    want = np.sort(amap.map(eo["ip"]))
    got = np.sort(en["ip"])
    wv, wc = np.unique(want, return_counts=True)
    gv, gc = np.unique(got, return_counts=True)
    allv = np.union1d(wv, gv)
    wn = np.zeros(len(allv), np.int64)
    gn = np.zeros(len(allv), np.int64)
    wn[np.searchsorted(allv, wv)] = wc
    gn[np.searchsorted(allv, gv)] = gc
    lost = allv[(gn < wn) & (gn == 0)]              # an IP the unwinder can no longer find
    added = allv[gn > wn]
    problems = [(int(a), "lost") for a in lost.tolist()]
    if len(added):
        ent = en[np.isin(en["ip"], added)]
        undefined = (ent["bits"] & 0xF) == 0
        first = np.array([nctx.image.read(int(a), 1)[0] if nctx.in_code([a])[0] else 0
                          for a in ent["ip"].tolist()], dtype=np.uint8)
        at_padding = (first == 0xCC) | nctx.code_section_ends(ent["ip"])
        problems += [(int(a), "added") for a in ent["ip"][~(undefined & at_padding)].tolist()]
    out.add("equiv.orc", problems,
            lambda p: (p[0], f"orc_unwind: IP {p[0]:#x} " + (
                "of the original has no entry any more" if p[1] == "lost" else
                "is new but not an undefined entry at inserted padding")))
