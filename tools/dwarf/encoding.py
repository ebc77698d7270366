"""Small DWARF decoding helpers: LEB128, forms, abbreviation tables, unit headers."""

import struct

from ..leb128 import read_sleb, read_uleb
from ..leb128 import sleb as _sleb_enc
from ..leb128 import uleb as _uleb_enc

DW_AT_low_pc, DW_AT_high_pc, DW_AT_ranges, DW_AT_identifier_case = 0x11, 0x12, 0x55, 0x42
DW_AT_entry_pc = 0x52
DW_FORM_addr, DW_FORM_data4, DW_FORM_data8, DW_FORM_sec_offset = 0x01, 0x06, 0x07, 0x17
DW_FORM_implicit_const, DW_FORM_indirect = 0x21, 0x16
DW_UT_compile, DW_UT_partial = 1, 3


uleb, sleb = read_uleb, read_sleb     # (data, pos) -> (value, pos); IndexError when truncated
enc_uleb = _uleb_enc


def u(b, p, n):
    return int.from_bytes(b[p:p + n], "little")


def form_value(b, p, e, form):
    """The value of an attribute whose bytes are b[p:e] in ``form``: LEB128 forms
    decoded (GNU as gives a unit's high pc as DW_FORM_udata: 2 bytes from 128 on),
    any other the little-endian value of its first <= 8 bytes (as the C core's)."""
    if form == 0x0d:
        return sleb(b, p)[0] & ((1 << 64) - 1)
    if form in _LEB_FORMS:
        return uleb(b, p)[0]
    return u(b, p, min(e - p, 8))


# Fixed sizes by form; None = variable (handled in skip_form).
_FIXED = {0x03: None, 0x04: None, 0x05: 2, 0x06: 4, 0x07: 8, 0x08: None, 0x09: None, 0x0a: None,
          0x0b: 1, 0x0c: 1, 0x0d: None, 0x0f: None, 0x11: 1, 0x12: 2, 0x13: 4, 0x14: 8, 0x15: None,
          0x18: None, 0x19: 0, 0x1a: None, 0x1b: None, 0x1c: 4, 0x1e: 16, 0x20: 8, 0x21: 0,
          0x22: None, 0x23: None, 0x24: 8, 0x25: 1, 0x26: 2, 0x27: 3, 0x28: 4, 0x29: 1, 0x2a: 2,
          0x2b: 3, 0x2c: 4, 0x1f01: None, 0x1f02: None}
_OFFSET_FORMS = (0x0e, 0x10, 0x17, 0x1d, 0x1f, 0x1f20, 0x1f21)
_LEB_FORMS = (0x0d, 0x0f, 0x15, 0x1a, 0x1b, 0x22, 0x23, 0x1f01, 0x1f02)


def skip_form(b, p, form, asz, osz, version):
    """Position after an attribute value of ``form`` at ``p``."""
    if form == DW_FORM_addr:
        return p + asz
    if form in _OFFSET_FORMS:
        if form == 0x10 and version == 2:
            return p + asz
        return p + osz
    n = _FIXED.get(form, -1)
    if n is not None and n >= 0:
        return p + n
    if form in _LEB_FORMS:
        return uleb(b, p)[1]
    if form == 0x08:
        return b.index(b"\0", p) + 1
    if form in (0x09, 0x18):
        n, p = uleb(b, p)
        return p + n
    if form == 0x0a:
        return p + 1 + b[p]
    if form == 0x03:
        return p + 2 + u(b, p, 2)
    if form == 0x04:
        return p + 4 + u(b, p, 4)
    if form == DW_FORM_indirect:
        f, p = uleb(b, p)
        return skip_form(b, p, f, asz, osz, version)
    raise ValueError(f"unknown DWARF form {form:#x}")


# attribute specs seen so far, by their bytes (a kernel has ~1.6 M specs per image but
# only ~8,000 distinct ones): (attr, form, implicit_const) tuples
_SPECS = {}


def parse_abbrevs(b, off):
    """{code: (tag, children, [(attr, form, implicit_const)])} and the table's end offset."""
    # Hot (every unit of a kernel, twice per verify). An entry's attribute specs end
    # with the pair (0, 0); the first 00 00 after them is that pair unless an
    # implicit_const 0 comes last, so b[p:first 00 00] found in _SPECS is exactly
    # a spec list parsed before (its parse would stop at the same place).
    out = {}
    p = off
    specs = _SPECS
    find = b.find if hasattr(b, "find") else None
    while True:
        code = b[p]
        if code < 0x80:
            p += 1
        else:
            code, p = uleb(b, p)
        if code == 0:
            return out, p
        tag = b[p]
        if tag < 0x80:
            p += 1
        else:
            tag, p = uleb(b, p)
        children = b[p]
        p += 1
        if find is not None:
            q = find(b"\0\0", p) + 2
            known = specs.get(b[p:q]) if q > 1 else None
            if known is not None:
                out[code] = (tag, children, list(known))
                p = q
                continue
        start = p
        attrs = []
        while True:
            at = b[p]
            if at < 0x80:
                p += 1
            else:
                at, p = uleb(b, p)
            form = b[p]
            if form < 0x80:
                p += 1
            else:
                form, p = uleb(b, p)
            if form == DW_FORM_implicit_const:
                ic, p = sleb(b, p)
            elif at == 0 and form == 0:
                break
            else:
                ic = None
            attrs.append((at, form, ic))
        if find is not None:
            specs[bytes(b[start:p])] = tuple(attrs)
        out[code] = (tag, children, attrs)


def encode_abbrevs(table):
    out = bytearray()
    for code in sorted(table):
        tag, children, attrs = table[code]
        out += enc_uleb(code) + enc_uleb(tag) + bytes([children])
        for at, form, ic in attrs:
            out += enc_uleb(at) + enc_uleb(form)
            if form == DW_FORM_implicit_const:
                out += _enc_sleb(ic)
        out += b"\0\0"
    return bytes(out + b"\0")


_enc_sleb = _sleb_enc


class Unit:
    """One .debug_info unit header: offsets, version, sizes, abbrev offset, first DIE."""

    __slots__ = ("off", "end", "version", "unit_type", "asz", "osz", "abbrev_off",
                 "abbrev_field", "die")


def units(b):
    """Every unit header of a .debug_info (bytes)."""
    out = []
    p = 0
    n = len(b)
    while p + 4 <= n:
        un = Unit()
        un.off = p
        ln = u(b, p, 4)
        q = p + 4
        un.osz = 4
        if ln == 0xFFFFFFFF:
            ln = u(b, p + 4, 8)
            q = p + 12
            un.osz = 8
        un.end = q + ln
        un.version = u(b, q, 2)
        q += 2
        if un.version >= 5:
            un.unit_type = b[q]
            un.asz = b[q + 1]
            un.abbrev_field = q + 2
            q += 2 + un.osz
            if un.unit_type in (2, 6):            # type units: signature + type offset
                q += 8 + un.osz
            elif un.unit_type in (4, 5):          # skeleton / split: dwo id
                q += 8
        else:
            un.unit_type = DW_UT_compile
            un.abbrev_field = q
            un.asz = b[q + un.osz]
            q += un.osz + 1
        un.abbrev_off = u(b, un.abbrev_field, un.osz)
        un.die = q
        out.append(un)
        p = un.end
    return out


def top_die_attrs(b, un, abbrev_tables):
    """[(attr, form, value position, value end)] of a unit's first DIE, and its abbrev code."""
    code, p = uleb(b, un.die)
    table = abbrev_tables[un.abbrev_off]
    if code not in table:
        return code, []
    out = []
    for at, form, _ in table[code][2]:
        f = form
        q = p
        if f == DW_FORM_indirect:
            f, q = uleb(b, p)
        e = skip_form(b, q, f, un.asz, un.osz, un.version)
        out.append((at, f, q, e))
        p = e
    return code, out


def pack_u(v, n):
    return (v & ((1 << (8 * n)) - 1)).to_bytes(n, "little")


__all__ = ["uleb", "sleb", "enc_uleb", "u", "skip_form", "parse_abbrevs", "encode_abbrevs",
           "units", "top_die_attrs", "pack_u", "struct"]


def read_rnglist(b, off, base):
    """DWARF 5 range list at ``off``: [(lo, hi)] in absolute addresses."""
    out = []
    p = off
    while True:
        k = b[p]
        p += 1
        if k == 0:
            return out
        if k == 4:
            x, p = uleb(b, p)
            y, p = uleb(b, p)
            out.append((base + x, base + y))
        elif k == 5:
            base = u(b, p, 8)
            p += 8
        elif k == 6:
            out.append((u(b, p, 8), u(b, p + 8, 8)))
            p += 16
        elif k == 7:
            x = u(b, p, 8)
            y, p = uleb(b, p + 8)
            out.append((x, x + y))
        else:        # *x forms need .debug_addr, which GCC without split DWARF never emits
            raise ValueError(f".debug_rnglists: unsupported entry kind {k} at {p - 1:#x}")


def read_ranges(b, off, base, asz=8):
    """DWARF 2-4 .debug_ranges list at ``off``: [(lo, hi)] in absolute addresses."""
    out = []
    p = off
    allones = (1 << (8 * asz)) - 1
    while True:
        x, y = u(b, p, asz), u(b, p + asz, asz)
        p += 2 * asz
        if x == 0 and y == 0:
            return out
        if x == allones:
            base = y
            continue
        out.append((base + x, base + y))


def walk_dies(b, un, table):
    """Yield (DIE offset, tag, {attr: (form, value position, value end)}, code)
    for every DIE of a unit, in order."""
    p = un.die
    while p < un.end:
        off = p
        code, p = uleb(b, p)
        if code == 0:
            continue
        ab = table.get(code)
        if ab is None:
            raise ValueError(f".debug_info: unknown abbreviation {code} at {off:#x}")
        attrs = {}
        for at, form, ic in ab[2]:
            f = form
            q = p
            if f == DW_FORM_indirect:
                f, q = uleb(b, p)
            e = skip_form(b, q, f, un.asz, un.osz, un.version)
            attrs[at] = (f, q, e)
            p = e
        yield off, ab[0], attrs, code


def die_ranges(b, un, attrs, base, rnglists=None, ranges=None):
    """Code ranges [(lo, hi)] of a DIE (low/high pc or DW_AT_ranges), or None."""
    if DW_AT_ranges in attrs:
        f, p, e = attrs[DW_AT_ranges]
        if f not in (DW_FORM_sec_offset, DW_FORM_data4, DW_FORM_data8):
            return None
        off = u(b, p, e - p)
        if un.version >= 5:
            return read_rnglist(rnglists, off, base) if rnglists is not None else None
        return read_ranges(ranges, off, base, un.asz) if ranges is not None else None
    if DW_AT_low_pc in attrs and DW_AT_high_pc in attrs:
        f, p, e = attrs[DW_AT_low_pc]
        if f != DW_FORM_addr:
            return None
        lo = u(b, p, un.asz)
        f, p, e = attrs[DW_AT_high_pc]
        hv = form_value(b, p, e, f)
        return [(lo, hv if f == DW_FORM_addr else lo + hv)]
    return None
