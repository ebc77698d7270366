"""verify --against, step 3b: every relocation in NEW still describes its field
(it holds S + A, or S + A - P when PC-relative): a field the rewrite moved or
changed without its relocation would be wrong after KASLR or another relayout."""

from ..image.relocs import relocation_mismatches
from .tables import sorted_table_ranges


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
