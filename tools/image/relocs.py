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
R_X86_64_DTPMOD64 = 16
R_X86_64_DTPOFF64 = 17
R_X86_64_TPOFF64 = 18
R_X86_64_TLSGD = 19
R_X86_64_TLSLD = 20
R_X86_64_DTPOFF32 = 21
R_X86_64_GOTTPOFF = 22
R_X86_64_TPOFF32 = 23
R_X86_64_PC64 = 24
R_X86_64_GOTPC32_TLSDESC = 34
R_X86_64_TLSDESC_CALL = 35
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

# thread-local storage: what ld leaves in an executable's code is either a constant
# (an offset from the thread pointer or in the TLS block, after ld relaxed the access)
# or a RIP-relative reach of a GOT slot ld made (an access left initial-exec)
TLS_NAMES = {R_X86_64_DTPMOD64: "DTPMOD64", R_X86_64_DTPOFF64: "DTPOFF64",
             R_X86_64_TPOFF64: "TPOFF64", R_X86_64_TLSGD: "TLSGD", R_X86_64_TLSLD: "TLSLD",
             R_X86_64_DTPOFF32: "DTPOFF32", R_X86_64_GOTTPOFF: "GOTTPOFF",
             R_X86_64_TPOFF32: "TPOFF32", R_X86_64_GOTPC32_TLSDESC: "GOTPC32_TLSDESC",
             R_X86_64_TLSDESC_CALL: "TLSDESC_CALL"}
# the accesses whose field is a RIP displacement until ld relaxes the sequence
_TLS_ACCESS = (R_X86_64_TLSGD, R_X86_64_TLSLD, R_X86_64_GOTTPOFF, R_X86_64_GOTPC32_TLSDESC)
# a general- or local-dynamic access is `data16 lea x@tlsgd(%rip),%rdi` or `lea
# x@tlsld(%rip),%rdi` followed by the call of __tls_get_addr (`call` or, -fno-plt,
# `call *...@GOTPCREL(%rip)`), whose relocation ld keeps at its old offset when it
# rewrites the sequence (its field is then part of another instruction): the
# call's field is this many bytes after the access's
_TLS_CALL_AFTER = {R_X86_64_TLSGD: (8,), R_X86_64_TLSLD: (5, 6)}

RELOC_NAMES = {R_X86_64_NONE: "NONE", **{t: r.name for t, r in RECIPES.items()}, **TLS_NAMES}
PC_TYPES = {t: r.width for t, r in RECIPES.items() if r.pcrel}
ABS_TYPES = {t: r.width for t, r in RECIPES.items() if not r.pcrel}
GOT_TYPES = tuple(t for t, r in RECIPES.items() if r.via_got)
CHECKED_TYPES = tuple(t for t, r in RECIPES.items() if r.checked)


def _rip_displacement(buf, pos):
    """True where the 4 bytes at ``pos`` are the displacement of a RIP-relative
    mov, add or lea (opcode 8b/03/8d, ModRM mod 00 r/m 101): the only forms the psABI
    gives an unrelaxed TLS access."""
    ok = pos >= 2
    p = np.maximum(pos, 2)
    modrm = buf[p - 1]
    opcode = buf[p - 2]
    return ok & ((modrm & 0xC7) == 0x05) & np.isin(opcode, (0x8B, 0x03, 0x8D))


def tls_effective_types(typ, offset, buf, base):
    """The relocation types of one code section as the linked bytes use them.

    ``typ``/``offset``: its relocations; ``buf``: the section's bytes at address
    ``base``. TLS relocations in an executable's code are either constants (ld
    relaxed the access to local-exec: a thread-pointer offset that holds wherever
    the code is) or, left initial-exec, a RIP-relative reach of a GOT slot.
    Returns (types, unrelaxed): a copy of ``typ`` where the constants (and the
    stale relocation of the __tls_get_addr call inside a relaxed general- or
    local-dynamic sequence, whatever ld put in its place) are ``R_X86_64_NONE``
    and the GOT reaches ``R_X86_64_GOTPCREL``; ``unrelaxed``: offsets of
    general-/local-dynamic accesses ld left as they are (only a shared object
    has them; nothing here rewrites them)."""
    typ = np.asarray(typ).astype(np.int64)
    out = typ.copy()
    tls = np.isin(typ, list(TLS_NAMES))
    if not tls.any():
        return out, np.zeros(0, np.uint64)
    buf = np.asarray(buf, np.uint8)
    pos = (np.asarray(offset, np.uint64) - np.uint64(base)).astype(np.int64)
    inside = (pos >= 0) & (pos + 4 <= len(buf))
    rip = np.zeros(len(typ), bool)
    rip[inside] = _rip_displacement(buf, pos[inside])
    dynamic = np.isin(typ, (R_X86_64_TLSGD, R_X86_64_TLSLD))
    off = np.asarray(offset, np.uint64).astype(np.int64)
    unrelaxed = off[dynamic & rip].astype(np.uint64)
    # the call's relocation inside a relaxed sequence: what its field now is decides
    calls = [off[(typ == R_X86_64_TLSGD) & ~rip] + d for d in _TLS_CALL_AFTER[R_X86_64_TLSGD]] + \
        [off[(typ == R_X86_64_TLSLD) & ~rip] + d for d in _TLS_CALL_AFTER[R_X86_64_TLSLD]]
    in_seq = ~tls & np.isin(off, np.concatenate(calls))
    access = np.isin(typ, _TLS_ACCESS)
    out[tls] = R_X86_64_NONE
    out[access & rip & ~dynamic] = R_X86_64_GOTPCREL
    out[in_seq] = np.where(rip[in_seq], R_X86_64_GOTPCREL, R_X86_64_NONE)
    return out, unrelaxed


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


__all__ = ["RECIPES", "Recipe", "RELOC_NAMES", "TLS_NAMES", "tls_effective_types",
           "PC_TYPES", "ABS_TYPES", "GOT_TYPES",
           "CHECKED_TYPES", "field_values", "link_field_mismatches", "relocation_mismatches"] + \
    [n for n in dir() if n.startswith("R_X86_64_")]
