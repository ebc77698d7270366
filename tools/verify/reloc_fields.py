"""verify --against, step 3b: every relocation in NEW still describes its field
(it holds S + A, or S + A - P when PC-relative): a field the rewrite moved or
changed without its relocation would be wrong after KASLR or another relayout."""

import numpy as np

from .tables import sorted_table_ranges

# (ELF type, field size, PC-relative)
_RELOC_FIELDS = ((1, 8, False), (2, 4, True), (4, 4, True), (10, 4, False), (11, 4, False))


def relocation_mismatches(image, exclude_lo, exclude_hi):
    """(checked, [(field address, symbol index, addend)]) of relocations whose
    field no longer holds S + A (absolute) or S + A - P (PC-relative), outside
    the excluded ranges (tables sorted after the link, whose relocations the
    build itself leaves stale)."""
    sy = image.symtab
    checked, bad = 0, []
    for rel in image.relocations.values():
        sec = rel.target
        if not sec.is_alloc or sec.type == 8 or not len(rel):
            continue
        for rtype, size, pcrel in _RELOC_FIELDS:
            sel = np.nonzero((rel.type == rtype) & (rel.sym != 0))[0]
            if not len(sel):
                continue
            off = rel.offset[sel]
            ok = (off >= np.uint64(sec.addr)) & (off + np.uint64(size) <= np.uint64(sec.end))
            if len(exclude_lo):
                k = np.searchsorted(exclude_lo, off, side="right").astype(np.int64) - 1
                kc = np.maximum(k, 0)
                ok &= ~((k >= 0) & (off < exclude_hi[kc]))
            sel, off = sel[ok], off[ok]
            if not len(sel):
                continue
            pos = (off - np.uint64(sec.addr)).astype(np.int64) + sec.offset
            raw = image.data[pos[:, None] + np.arange(size)[None, :]].copy()
            val = raw.view("<u8" if size == 8 else "<u4").ravel().astype(np.uint64)
            want = (sy["value"][rel.sym[sel]].astype(np.int64) + rel.addend[sel]).astype(np.uint64)
            if pcrel:
                want = want - off
            if size == 4:
                want &= np.uint64(0xFFFFFFFF)
            checked += len(sel)
            for i in np.nonzero(val != want)[0].tolist():
                bad.append((int(off[i]), int(rel.sym[sel[i]]), int(rel.addend[sel[i]])))
    return checked, bad


def check_relocations(ctx, out):
    """Relocations whose field is wrong in NEW but was right in OLD (the build
    itself leaves a few stale: those stay allowed)."""
    old, new = ctx.old, ctx.new
    lo, hi = sorted_table_ranges(ctx.octx)
    _, bad_old = relocation_mismatches(old, lo, hi)
    checked, bad_new = relocation_mismatches(new, lo, hi)
    out.extra["equivalence_relocations_checked"] = checked
    if len(bad_new) <= len(bad_old):
        return
    names, _ = new.symbol_table()
    old_names, _ = old.symbol_table()
    # by symbol name, not index: a block-level layout inserts local `.cold`
    # symbols, which shifts the index of every global after them
    old_keys = {(old_names[s], a) for _, s, a in bad_old}
    fresh = [b for b in bad_new if (names[b[1]], b[2]) not in old_keys] or bad_new
    out.add("equiv.relocation", fresh,
            lambda b: (b[0], f"field at {b[0]:#x} no longer holds what its relocation says "
                       f"({names[b[1]] or 'section ' + str(b[1])} + {b[2]:#x})"))
