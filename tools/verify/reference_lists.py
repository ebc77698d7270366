"""verify --against: the plain PC-relative lists into code (kernel/prel32_lists.py:
``.pci_fixup`` hooks, initcalls, the runtime-constant site lists).

No relayout pass rewrites them as a table: their fields are fixed like any
PC-relative reference, from the link relocations or from the references
recovered from a vmlinuz. On an image with link relocations reloc_fields.py
checks them; a kernel without (6.12, 7.x) has only this check. It matters
most for the runtime-constant sites: they point inside an instruction, the
immediate the boot patches, and one left at its old address makes the boot
write a constant into whatever code moved there (7.3's futex mask).

Each field of OLD (a non-zero s32 offset from its own address) must, in NEW,
designate OLD's target translated through the map; the lists themselves do
not move.
"""

import numpy as np

from ..image.words import read_s32
from ..kernel import REFERENCE_TABLES, TABLES
from ..kernel.base import rel32_targets

# the lists with no table check of their own (tables.py checks the others)
PLAIN_LISTS = [t for t in REFERENCE_TABLES if t not in TABLES]


def _targets(image, fields):
    """What each s32 field designates: its address plus its value."""
    return rel32_targets(fields, read_s32(image, fields)[0])


def check_reference_lists(ctx, out):
    octx, nctx, amap = ctx.octx, ctx.nctx, ctx.amap
    checked = 0
    for cls in PLAIN_LISTS:
        t_old, t_new = cls(), cls()
        fields, _ = t_old.references(octx)
        if not len(fields):
            continue
        new_fields, _ = t_new.references(nctx)
        if not np.array_equal(np.sort(new_fields), np.sort(fields)):
            out.add("equiv.reference-list", [(cls.name, len(fields), len(new_fields))],
                    lambda c: (None, f"{c[0]}: {c[1]} non-zero fields before, {c[2]} after "
                               "(the list moved or lost entries)"))
            continue
        old_t, new_t = _targets(octx.image, fields), _targets(nctx.image, fields)
        want = amap.map(old_t)
        bad = np.nonzero(want != new_t)[0]
        checked += len(fields)
        out.add("equiv.reference-list",
                [(cls.name, int(fields[k]), int(old_t[k]), int(want[k]), int(new_t[k]))
                 for k in bad.tolist()],
                lambda b: (b[1], f"{b[0]}: the field at {b[1]:#x} designated "
                           f"{octx.symbol_at(b[2])}, which is now at {b[3]:#x}, but it "
                           f"designates {b[4]:#x}"))
    if checked:
        out.extra["equivalence_reference_list_fields"] = checked
