"""x86-64 relocation types: one recipe per type, and the one check that a field
still holds what its link relocation says (S + A, or S + A - P).

Every layer reads these: the rewriter (how to re-encode a field), the kernel
tables' and verify's field checks, kallsyms' symbol moves, the block split's
jump-table leaders. (The psABI's table, like pyelftools' relocation recipes.)
"""

from typing import NamedTuple

import numpy as np

R_X86_64_NONE = 0
R_X86_64_64 = 1
R_X86_64_PC32 = 2
R_X86_64_PLT32 = 4
R_X86_64_RELATIVE = 8
R_X86_64_GOTPCREL = 9
R_X86_64_32 = 10
R_X86_64_32S = 11
R_X86_64_PC64 = 24
R_X86_64_IRELATIVE = 37
R_X86_64_GOTPCRELX = 41
R_X86_64_REX_GOTPCRELX = 42


class Recipe(NamedTuple):
    """How a relocated field is encoded."""
    name: str
    width: int          # bytes
    pcrel: bool         # S + A - P (else S + A)
    signed: bool        # the value is sign-extended from the field (width 4)
    via_got: bool       # the field reaches a GOT slot ld made, not the symbol
    checked: bool       # the field checks compare it with S + A [- P]


# the types a linked x86-64 image keeps with --emit-relocs, by type number
RECIPES = {
    R_X86_64_64: Recipe("64", 8, False, False, False, True),
    R_X86_64_PC32: Recipe("PC32", 4, True, True, False, True),
    R_X86_64_PLT32: Recipe("PLT32", 4, True, True, False, True),
    R_X86_64_GOTPCREL: Recipe("GOTPCREL", 4, True, True, True, False),
    R_X86_64_32: Recipe("32", 4, False, False, False, True),
    R_X86_64_32S: Recipe("32S", 4, False, True, False, True),
    R_X86_64_PC64: Recipe("PC64", 8, True, True, False, False),
    R_X86_64_GOTPCRELX: Recipe("GOTPCRELX", 4, True, True, True, False),
    R_X86_64_REX_GOTPCRELX: Recipe("REX_GOTPCRELX", 4, True, True, True, False),
}

RELOC_NAMES = {R_X86_64_NONE: "NONE", **{t: r.name for t, r in RECIPES.items()}}
PC_TYPES = {t: r.width for t, r in RECIPES.items() if r.pcrel}
ABS_TYPES = {t: r.width for t, r in RECIPES.items() if not r.pcrel}
GOT_TYPES = tuple(t for t, r in RECIPES.items() if r.via_got)
CHECKED_TYPES = tuple(t for t, r in RECIPES.items() if r.checked)


def sext32(v):
    """32-bit field values (any integer array) sign-extended to 64 bits, as uint64:
    what an R_X86_64_32S field or a rel32 displacement means."""
    return np.asarray(v, np.uint64).astype(np.uint32).view(np.int32).astype(np.int64).view(np.uint64)


def field_values(image, sec, addrs, width):
    """The little-endian unsigned values of ``width``-byte fields at ``addrs`` in
    section ``sec`` (read through ``section_bytes``: a patched image's bytes)."""
    buf = np.asarray(image.section_bytes(sec))
    pos = (np.asarray(addrs, np.uint64) - np.uint64(sec.addr)).astype(np.int64)
    raw = buf[pos[:, None] + np.arange(width)[None, :]].copy()
    return raw.view("<u8" if width == 8 else "<u4").ravel().astype(np.uint64)


def link_field_mismatches(image, sec, offset, rtype, sym, addend, exclude_lo=(), exclude_hi=()):
    """Check relocated fields of section ``sec`` against their relocations.

    Rows (arrays ``offset``, ``rtype``, ``sym``, ``addend``) of a checked type
    with a symbol, whose field lies inside ``sec`` and outside the excluded
    ranges (sorted starts ``exclude_lo``, ends ``exclude_hi``: tables sorted
    after the link, their relocations stale by design), are checked: the field
    must hold S + A, or S + A - P when PC-relative. Returns (checked, bad):
    boolean masks over the rows."""
    offset = np.asarray(offset, np.uint64)
    rtype = np.asarray(rtype)
    sym = np.asarray(sym).astype(np.int64)
    addend = np.asarray(addend, np.int64)
    checked = np.zeros(len(offset), bool)
    bad = np.zeros(len(offset), bool)
    if not len(offset):
        return checked, bad
    values = image.symtab["value"]
    outside = np.ones(len(offset), bool)
    if len(exclude_lo):
        k = np.searchsorted(exclude_lo, offset, side="right").astype(np.int64) - 1
        outside = ~((k >= 0) & (offset < exclude_hi[np.maximum(k, 0)]))
    for t in CHECKED_TYPES:
        r = RECIPES[t]
        sel = np.nonzero((rtype == t) & (sym != 0) & outside & (offset >= np.uint64(sec.addr)) &
                         (offset + np.uint64(r.width) <= np.uint64(sec.end)))[0]
        if not len(sel):
            continue
        off = offset[sel]
        want = (values[sym[sel]].astype(np.int64) + addend[sel]).astype(np.uint64)
        if r.pcrel:
            want = want - off
        if r.width == 4:
            want &= np.uint64(0xFFFFFFFF)
        checked[sel] = True
        bad[sel] = field_values(image, sec, off, r.width) != want
    return checked, bad


def relocation_mismatches(image, exclude_lo, exclude_hi):
    """(checked, [(field address, symbol index, addend)]) over every allocated
    section: relocated fields that no longer hold S + A (absolute) or S + A - P
    (PC-relative), outside the excluded ranges (see link_field_mismatches)."""
    count, bad = 0, []
    for rel in image.relocations.values():
        sec = rel.target
        if not sec.is_alloc or sec.type == 8 or not len(rel):
            continue
        checked, wrong = link_field_mismatches(image, sec, rel.offset, rel.type, rel.sym,
                                               rel.addend, exclude_lo, exclude_hi)
        count += int(checked.sum())
        for t in CHECKED_TYPES:          # grouped by type, as the findings list them
            for i in np.nonzero(wrong & (rel.type == t))[0].tolist():
                bad.append((int(rel.offset[i]), int(rel.sym[i]), int(rel.addend[i])))
    return count, bad


__all__ = ["RECIPES", "Recipe", "RELOC_NAMES", "PC_TYPES", "ABS_TYPES", "GOT_TYPES",
           "CHECKED_TYPES", "field_values", "link_field_mismatches", "relocation_mismatches"] + \
    [n for n in dir() if n.startswith("R_X86_64_")]
