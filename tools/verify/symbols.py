"""verify --against, step 4: the symbol table. Every code symbol of OLD is at its
translated address in NEW (a block-level layout adds one `name.cold` symbol per
split function, after the locals)."""

import numpy as np

from ..image.elf import STT_FUNC, STT_SECTION, SHT_SYMTAB


def cold_names(of, split):
    """The `name.cold` symbols a block-level layout adds: one per split function."""
    return frozenset(of.name[i] + ".cold" for i in np.nonzero(split)[0].tolist())


def cold_parts(new):
    """{name.cold: [(start, end)]} of NEW's cold-part symbols."""
    names, syms = new.symbol_table()
    out = {}
    is_func = (syms["info"] & 0xF) == STT_FUNC
    for k in np.nonzero(is_func)[0].tolist():
        if names[k].endswith(".cold"):
            v = int(syms["value"][k])
            out.setdefault(names[k], []).append((v, v + int(syms["size"][k])))
    return out


def added_cold(old, new, cold_names):
    """(name, address) of the `name.cold` symbols a block-level layout inserted
    (after the locals of OLD's symtab, as check_symbols finds them)."""
    so, sn = old.symtab, new.symtab
    if not cold_names or len(sn) <= len(so):
        return []
    first_global = next(s.info for s in old.sections if s.type == SHT_SYMTAB)
    extra = len(sn) - len(so)
    names_new, _ = new.symbol_table()
    return [(names_new[k], int(sn["value"][k])) for k in range(first_global, first_global + extra)
            if names_new[k] in cold_names]


def check_symbols(ctx, out):
    old, new, amap, cold_names = ctx.old, ctx.new, ctx.amap, ctx.cold_names
    so, sn = old.symtab, new.symtab
    if cold_names and len(sn) > len(so):
        # a block-level layout inserts its `name.cold` symbols after the locals
        first_global = next(s.info for s in old.sections if s.type == SHT_SYMTAB)
        extra = len(sn) - len(so)
        names_new, _ = new.symbol_table()
        added = names_new[first_global:first_global + extra]
        if all(nm in cold_names for nm in added):
            sn = np.concatenate([sn[:first_global], sn[first_global + extra:]])
    if len(so) != len(sn):
        out.add("equiv.symtab", [(len(so), len(sn))],
                lambda c: (None, f"symbol table has {c[1]} entries, the original {c[0]}"))
        return
    code_secs = np.array([s.index for s in old.sections if s.is_code and s.is_alloc], dtype=np.int64)
    sel = np.isin(so["shndx"].astype(np.int64), code_secs) & ((so["info"] & 0xF) != STT_SECTION)
    idx = np.nonzero(sel)[0]
    want = amap.map(so["value"][idx])
    got = sn["value"][idx]
    ok = want == got
    ok |= amap.translates(so["value"][idx], got) & amap.point(so["value"][idx])[0]
    bad = idx[~ok]
    names, _ = old.symbol_table()
    out.add("equiv.symbol", bad.tolist(),
            lambda i: (int(sn["value"][i]), f"symbol {names[i]} is at {int(sn['value'][i]):#x}, "
                       f"expected {int(amap.map(np.array([so['value'][i]], np.uint64))[0]):#x}"))

