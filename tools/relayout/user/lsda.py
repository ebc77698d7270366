"""LSDAs (``.gcc_except_table``) of split functions: one per part.

The personality routine (libstdc++'s ``__gxx_personality_v0``) finds the
LSDA through the FDE that covers the pc, takes call-site starts relative to
that FDE's start (``_Unwind_GetRegionStart``) and landing pads relative to
LPStart (the same start unless the LSDA gives one), and scans the call-site
table in order, stopping once a start is past the pc. A split function's
original LSDA is right for neither part, so each part gets its own:

- call sites: every original range is cut along the copied pieces of the part
  and translated (adjacent pieces that stay adjacent merge again), sorted;
- landing pads: translated through the block map; they may lie in the other
  part, so each new LSDA gives an explicit LPStart (absptr) one byte below
  both parts (a landing-pad offset of 0 means "none");
- action table copied as is (call sites index it by offset); type table
  entries re-encoded at their new place (absolute or pc-relative, direct or
  indirect), so catch clauses name the same type_info; ``catch (...)``'s entry
  is 0 in every encoding (a pc-relative 0 is no offset) and stays 0.

Exception specifications (negative filters) are not supported: such a
function is not split. New LSDAs are stored after the ``.eh_frame_hdr``
search table (the table's size comes from its count; readers ignore what
follows), in the room the rebuilt ``.eh_frame`` frees.
"""

import struct

from ...leb128 import uleb_fixed
from .cfi import uleb
from .eh_frame import DW_EH_PE_omit, DW_EH_PE_pcrel, _FORMATS, _sleb, _uleb

DW_EH_PE_uleb128 = 0x01
DW_EH_PE_indirect = 0x80


class LsdaError(ValueError):
    """An LSDA this module does not rewrite (the function is not split)."""


def _ptr(data, pos, enc, base_addr):
    """(value, new pos): an encoded pointer at data[pos] (data mapped at base_addr)."""
    app, fmt = enc & 0x70, enc & 0x0F
    if fmt == DW_EH_PE_uleb128:
        v, p = _uleb(data, pos)
    elif fmt in _FORMATS:
        f, size = _FORMATS[fmt]
        v, p = struct.unpack_from(f, data, pos)[0], pos + size
    else:
        raise LsdaError(f"LSDA pointer encoding {enc:#04x}")
    if app == DW_EH_PE_pcrel:
        # a 0 stays 0 (libgcc's read_encoded_value): catch (...)'s type entry
        v += base_addr + pos if v else 0
    elif app:
        raise LsdaError(f"LSDA pointer encoding {enc:#04x}")
    return v & ((1 << 64) - 1), p


class Lsda:
    """A parsed LSDA: call sites (absolute start, length, landing pad or 0,
    action), the action table bytes, the type table (decoded targets)."""

    def __init__(self, image, addr, func_start):
        sec = image.section_at(addr) if hasattr(image, "section_at") else None
        if sec is None:
            raise LsdaError(f"LSDA at {addr:#x} is in no section")
        data = bytes(image.section_bytes(sec))
        base = sec.addr
        pos = addr - base
        lp_enc = data[pos]
        pos += 1
        lpstart = func_start
        if lp_enc != DW_EH_PE_omit:
            lpstart, pos = _ptr(data, pos, lp_enc, base)
        self.ttype_enc = data[pos]
        pos += 1
        ttype_base = None
        if self.ttype_enc != DW_EH_PE_omit:
            off, pos = _uleb(data, pos)
            ttype_base = pos + off
            if (self.ttype_enc & 0x0F) not in _FORMATS or \
                    (self.ttype_enc & 0x70) not in (0, DW_EH_PE_pcrel):
                raise LsdaError(f"type table encoding {self.ttype_enc:#04x}")
        # the TType base's address: type entry k is the k-th field below it
        self.ttype_base = None if ttype_base is None else base + ttype_base
        cs_enc = data[pos]
        pos += 1
        cs_len, pos = _uleb(data, pos)
        end = pos + cs_len
        self.calls = []
        while pos < end:
            s, pos = _ptr(data, pos, cs_enc, base)
            n, pos = _ptr(data, pos, cs_enc, base)
            lp, pos = _ptr(data, pos, cs_enc, base)
            act, pos = _uleb(data, pos)
            self.calls.append((func_start + s, n, lpstart + lp if lp else 0, act))
        # the action table runs to the last byte any call site's chain reaches
        act_start = pos
        act_end = pos
        max_filter = 0
        for _, _, _, a in self.calls:
            p = act_start + a - 1 if a else None
            while p is not None:
                f, q = _sleb(data, p)
                nxt, r = _sleb(data, q)
                act_end = max(act_end, r)
                if f < 0:
                    raise LsdaError("exception specification (negative filter)")
                max_filter = max(max_filter, f)
                p = q + nxt if nxt else None
        self.actions = data[act_start:act_end]
        self.types = []
        if max_filter:
            if ttype_base is None:
                raise LsdaError("filter without a type table")
            size = _FORMATS[self.ttype_enc & 0x0F][1]
            for k in range(1, max_filter + 1):
                v, _ = _ptr(data, ttype_base - k * size, self.ttype_enc & 0x7F, base)
                self.types.append(v)           # types[k - 1]: filter k
        self.addr = addr


def call_sites_for_part(lsda, pieces):
    """Call sites of one part: ``pieces`` [(old, old_len, new)] are the part's
    copied pieces; returns sorted [(new start, length, old landing pad, action)]."""
    out = []
    for s, n, lp, act in lsda.calls:
        for old, ln, new in pieces:
            a, b = max(s, old), min(s + n, old + ln)
            if a < b:
                out.append([new + a - old, b - a, lp, act])
    out.sort()
    merged = []
    for c in out:
        if merged and merged[-1][0] + merged[-1][1] == c[0] and merged[-1][2:] == c[2:]:
            merged[-1][1] += c[1]
        else:
            merged.append(c)
    return [tuple(c) for c in merged]


def encode(lsda, region_start, calls, lp_map, lpstart, at, pcrel_lpstart=False):
    """Bytes of a part's LSDA placed at address ``at``. ``calls`` from
    call_sites_for_part; ``lp_map``: old landing pad -> new address.
    ``pcrel_lpstart``: LPStart pc-relative (a PIE: ld.so relocates nothing in
    the LSDA, so an absolute LPStart would name the link address)."""
    cs = bytearray()
    for s, n, lp, act in calls:
        cs += uleb(s - region_start) + uleb(n) + uleb(lp_map[lp] - lpstart if lp else 0) + \
            uleb(act)
    if pcrel_lpstart:                                           # LPStart, pcrel sdata8
        head = bytearray([DW_EH_PE_pcrel | 0x0C]) + struct.pack("<q", lpstart - (at + 1))
    else:
        head = bytearray([0x00]) + struct.pack("<Q", lpstart)   # LPStart, absptr
    ttype_enc = lsda.ttype_enc if lsda.types else DW_EH_PE_omit
    head.append(ttype_enc)
    tt_field = len(head)
    if lsda.types:
        head += b"\0" * 4                                       # ttype offset, fixed width
    head.append(DW_EH_PE_uleb128)
    head += uleb_fixed(len(cs), 4, LsdaError)
    body = head + cs + lsda.actions
    if not lsda.types:
        return bytes(body)
    size = _FORMATS[ttype_enc & 0x0F][1]
    body += b"\0" * (-len(body) % 4)
    table_at = len(body)
    body += b"\0" * (size * len(lsda.types))
    base = len(body)                                            # TType base
    body[tt_field:tt_field + 4] = uleb_fixed(base - (tt_field + 4), 4, LsdaError)
    fmt = _FORMATS[ttype_enc & 0x0F][0]
    for k, v in enumerate(lsda.types, 1):
        field = base - k * size
        val = v - (at + field) if ttype_enc & 0x70 == DW_EH_PE_pcrel and v else v
        struct.pack_into(fmt, body, field, val)
    assert table_at == base - size * len(lsda.types)
    return bytes(body)


def size_bound(lsda, n_calls):
    """Upper bound of an encoded part LSDA with ``n_calls`` call sites."""
    size = _FORMATS[lsda.ttype_enc & 0x0F][1] if lsda.types else 0
    return 1 + 8 + 1 + 4 + 1 + 4 + n_calls * 16 + len(lsda.actions) + 3 + size * len(lsda.types)
