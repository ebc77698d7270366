"""Rewrite DWARF (versions 4 and 5) for a new code layout given by an AddressMap.

The map is a sorted list of pieces (old start, old end, new start); a function
may be one piece (function-level relayout) or many (block-level). What changes:

- every absolute address field that the link relocated (.rela.debug_*): low/high
  pc, entry pcs, call sites, range/location list starts and base addresses,
  DW_OP_addr, FDE starts — patched in place to its translated value (same size);
- .debug_line: every sequence re-sequenced by the C core (lines.c): one output
  sequence per contiguous new range, so each stays monotonic; DW_AT_stmt_list
  offsets follow;
- .debug_aranges: rebuilt from the translated ranges;
- a unit's own ranges: when its code no longer maps to the same ranges, a new
  range list is appended (a new .debug_rnglists contribution, or to
  .debug_ranges) and DW_AT_ranges repointed; a unit described by
  low_pc/high_pc whose code is now in several ranges gets DW_AT_ranges instead
  (an appended copy of its abbreviation table: high_pc becomes ranges plus, when
  high_pc was 8 bytes, DW_AT_identifier_case = case-sensitive as 4 bytes of
  filler so no DIE changes size), with base address 0; every range and location
  list of such a unit (their entries are relative to the unit's base) is
  re-encoded with absolute entries and appended, with its GNU location-view list;
- everything else is copied.

The .rela.debug_* sections are dropped: .debug_line, .debug_aranges and the
appended lists are re-encoded, so their relocations would no longer describe
them, and no consumer of a linked image reads them (the kernel's relocs tool
reads relocations of allocated sections only; linepack verify checks allocated
sections).
"""

import bisect
import gc


import numpy as np

from . import encoding as enc
from . import native
from .fields import (ParsedFields, RelocationFields, has_debug_relocations, mapped_section,
                     read_section, read_writable)
from .native import relines
from ..image.intervals import append_range
from ..image.relocs import R_X86_64_32, R_X86_64_64

LIST_SECTIONS = (".debug_rnglists", ".debug_loclists", ".debug_ranges", ".debug_loc")
PATCHED_IN_PLACE = (".debug_info", ".debug_rnglists", ".debug_loclists", ".debug_ranges",
                    ".debug_loc", ".debug_frame")
DW_AT_GNU_locviews, DW_AT_stmt_list = 0x2137, 0x10
DW_AT_linepack_pad, DW_FORM_block1 = 0x3fe0, 0x0a     # filler: a vendor attribute, skipped by readers
DW_AT_linepack_pad2 = 0x3fdf                          # a second filler (0x3fe1 is DW_AT_APPLE_optimized)


class Segments:
    """The address map as sorted disjoint segments: its pieces, and identity
    outside the pieces and the rewritten extents; addresses in none of them
    (dropped padding) are unmapped.

    A segment maps old [old, end) to new [new, new_end). Copied code maps
    linearly; a collapsed piece (a branch a block-level layout re-encoded, a
    jmp it removed) maps every address inside to its new start and its end to
    its new end (a removed jmp: an empty new range). A jmp the layout appended
    after a piece (``amap.occupied``: code with no old address) is described as
    the end of that piece: its new_end grows over the jmp, so the jmp gets the
    line row and the DIE ranges of the block it closes."""

    def __init__(self, amap):
        old = [int(x) for x in amap.old_start]
        end = [int(x) for x in amap.old_end]
        new = [int(x) for x in amap.new_start]
        new_end = [int(x) for x in amap.new_end] if amap.new_end is not None else \
            [n + e - o for o, e, n in zip(old, end, new)]
        collapse = [bool(x) for x in amap.collapse] if amap.collapse is not None else \
            [False] * len(old)
        # appended jmps: the piece whose new end is where the jmp starts owns it
        ends_at = {ne: i for i, ne in enumerate(new_end) if ne > new[i] or collapse[i]}
        occ_lo, occ_hi = getattr(amap, "occupied", (np.zeros(0, np.uint64),) * 2)
        orphans = 0
        for lo, hi in zip(np.asarray(occ_lo).tolist(), np.asarray(occ_hi).tolist()):
            i = ends_at.pop(int(lo), None)
            if i is None:
                orphans += 1
                continue
            new_end[i] = int(hi)
            ends_at[int(hi)] = i
        self.orphan_jmps = orphans
        # identity wherever neither a rewritten extent nor a piece is
        ext = sorted(list(zip(amap.ext_lo.tolist(), amap.ext_hi.tolist())) +
                     list(zip(old, end)))
        pos = 0
        top = (1 << 64) - 1      # the identity reaches the top of the address space
        for lo, hi in ext + [(top, top)]:
            if lo > pos:
                old.append(pos)
                end.append(lo)
                new.append(pos)
                new_end.append(lo)
                collapse.append(False)
            pos = max(pos, hi)
        order = sorted(range(len(old)), key=lambda i: old[i])
        self.old = [old[i] for i in order]
        self.end = [end[i] for i in order]
        self.new = [new[i] for i in order]
        self.new_end = [new_end[i] for i in order]
        self.collapse = [collapse[i] for i in order]

    def arrays(self):
        """(old, end, new, new_end, collapse) arrays of the non-empty segments."""
        o, e, n, ne, c = self.c_arrays()
        m = e > o
        return o[m], e[m], n[m], ne[m], c[m].astype(bool)

    def c_arrays(self):
        """Every segment (empty ones too, as ``map`` and ``ranges`` see them) as
        the arrays the C core takes: old, end, new, new_end, collapse."""
        if getattr(self, "_c", None) is None:
            self._c = (np.array(self.old, np.uint64), np.array(self.end, np.uint64),
                       np.array(self.new, np.uint64), np.array(self.new_end, np.uint64),
                       np.array(self.collapse, np.uint8))
        return self._c

    def _place(self, k, a, b):
        """New [start, end) of old [a, b) inside segment k."""
        if self.collapse[k]:
            na = self.new[k]
            return na, (self.new_end[k] if b == self.end[k] else na)
        na = self.new[k] + a - self.old[k]
        return na, (self.new_end[k] if b == self.end[k] else na + b - a)

    def map(self, a):
        """New address of ``a`` (start-inclusive; a segment's end maps to its new
        end), or None when unmapped."""
        k = bisect.bisect_right(self.end, a)
        if k < len(self.old) and self.old[k] <= a:
            return self._place(k, a, a)[0]
        if k > 0 and self.end[k - 1] == a:
            return self.new_end[k - 1]
        return None

    def ranges(self, lo, hi):
        """New ranges [(lo, hi)] of old [lo, hi): contiguous runs merged, in old
        order (sorted for function-level maps)."""
        out = []
        k = bisect.bisect_right(self.end, lo)
        while k < len(self.old) and self.old[k] < hi:
            na, nb = self._place(k, max(lo, self.old[k]), min(hi, self.end[k]))
            k += 1
            append_range(out, na, nb)
        return out

    def continuous(self, k):
        """Does segment k + 1 follow segment k in both layouts?"""
        return k + 1 < len(self.old) and self.end[k] == self.old[k + 1] and \
            self.new_end[k] == self.new[k + 1]


class _Tables(dict):
    """Abbreviation tables by offset, each read entry by entry on demand."""

    def __init__(self, abbrev):
        super().__init__()
        self.abbrev = abbrev

    def __missing__(self, off):
        t = self[off] = native.AbbrevTable(self.abbrev, off)
        return t


_TOP = (DW_AT_stmt_list, enc.DW_AT_low_pc, enc.DW_AT_high_pc, enc.DW_AT_ranges,
        enc.DW_AT_identifier_case, enc.DW_AT_entry_pc, DW_AT_linepack_pad)


def _member(a, sorted_b):
    """np.isin(a, sorted_b) for a sorted ``sorted_b``, by binary search."""
    if not len(sorted_b):
        return np.zeros(len(a), bool)
    j = np.minimum(np.searchsorted(sorted_b, a), len(sorted_b) - 1)
    return sorted_b[j] == a


def _le_words(buf, n):
    """A view of uint8 array ``buf``: the n-byte little-endian word at every byte
    offset (unaligned; writable when ``buf`` is). An offset too close to the end
    raises IndexError, as reading its bytes one by one would."""
    return np.ndarray((max(len(buf) - n + 1, 0),), dtype=f"<u{n}", buffer=buf, strides=(1,))


def _range_ends(words, pos):
    """Which of the 8-byte fields at ``pos`` of .debug_ranges (DWARF 2-4) end a
    non-empty (begin, end) entry. Entries are 16 bytes and every list (and
    every unit's contribution) a whole number of them, so an entry's end is at
    an offset of 8 modulo 16, after a begin that is not a base selection (~0)."""
    pos = np.asarray(pos, np.int64)
    out = (pos % 16 == 8) & (pos >= 8)
    k = np.nonzero(out)[0]
    prev, val = words[pos[k] - 8], words[pos[k]]
    out[k] = (prev != np.uint64(0xFFFFFFFFFFFFFFFF)) & (prev < val)
    return out


def _put_le(buf, pos, value, n):
    """buf[pos:pos + n] = value (little-endian, masked to n bytes) for every pos."""
    pos = np.asarray(pos, np.int64)
    if not len(pos):
        return
    v = np.broadcast_to(np.asarray(value).astype(np.uint64), pos.shape)
    for k in range(n):
        buf[pos + k] = ((v >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8)


class DwarfRewrite:
    """Rewrite the DWARF of ``image`` for ``amap``; results in ``patched``
    {section index: uint8 array (any size)}, ``drop`` [section index], ``stats``."""

    def __init__(self, image, amap, log=None, fields=None):
        self.image, self.amap = image, amap
        self.fields = fields          # None: the link relocations, else parsed (fields.py)
        self.log = log or (lambda m: None)
        self.secs = {s.name: s for s in image.sections}
        self.patched, self.drop, self.stats = {}, [], {}
        self.orig = {}
        self.buf = {}
        self.append = {}       # section name -> bytearray appended after the original

    def _sec(self, name):
        s = self.secs.get(name)
        return s if s is not None and s.size else None

    def run(self):
        if not self._sec(".debug_info"):
            return self
        self.seg = Segments(self.amap)
        if self.seg.orphan_jmps:
            self.stats["dwarf_appended_jmps_unattached"] = self.seg.orphan_jmps
        # One private copy per patched section (the output, patched in place);
        # the original is read through the image's file mapping, where only the
        # pages the rewrite reads after patching become resident (unit headers
        # and first DIEs, the walked units, the lists it re-encodes): on 7.3 that
        # is one 251 MB .debug_info in memory, not two.
        for name in PATCHED_IN_PLACE:
            s = self._sec(name)
            if s is not None:
                self.buf[name] = read_writable(self.image, s)
                self.orig[name] = mapped_section(self.image, s)
        for name in (".debug_line", ".debug_aranges", ".debug_abbrev"):
            s = self._sec(name)
            if s is not None:
                self.orig[name] = read_section(self.image, s)
        self.fields = self._field_source()
        self._keep_reference_words()
        self._read_unit_dies()
        self.patch_addresses()
        if isinstance(self.fields, ParsedFields):
            self.fields.drop_addresses()        # applied: read no more
        self.rewrite_lines()
        self.orig.pop(".debug_line", None)      # re-encoded: read no more
        self.rewrite_units()
        self.rewrite_aranges()
        self.check_frame()
        self.finish()
        return self

    # -- absolute addresses: from the link relocations or found by parsing -------
    def _field_source(self):
        """Where the address fields come from: ``fields`` as given ("parsed" or
        "relocations"), else the link relocations when .rela.debug_info has
        some, else parsing the DWARF."""
        kind = self.fields
        if kind not in ("parsed", "relocations", None):
            return kind                              # a source object (tests)
        if kind is None:
            kind = "relocations" if has_debug_relocations(self.image) else "parsed"
        self.stats["dwarf_fields_from"] = kind
        if kind == "relocations":
            return RelocationFields(self.image)
        # the patched sections are parsed from their copies, not patched yet
        # (their bytes are the original's: nothing more is read from the mapping)
        src = {**self.orig, **{n: memoryview(b) for n, b in self.buf.items()}}
        for name in (".debug_addr",):
            s = self._sec(name)
            if s is not None:
                src[name] = read_section(self.image, s)
        for name in (".debug_line", ".debug_aranges"):     # re-encoded whole: not needed
            src.pop(name, None)
        parsed = ParsedFields(src)
        self.stats.update({f"dwarf_parsed_{k}": v for k, v in parsed.stats.items()})
        return parsed

    def _fields_of(self, name, rtype):
        """(offsets, section index of what each points at) of section ``name``'s
        address fields (R_X86_64_64) or .debug_info's section offsets
        (R_X86_64_32), from the field source (fields.py)."""
        return self.fields.of_type(name, rtype, self.image.sections)

    def patch_addresses(self):
        secs = self.image.sections
        alloc = np.array([bool(s.is_alloc) for s in secs] + [False], bool)
        amap = self.amap
        fields = unmapped = 0
        for name in PATCHED_IN_PLACE:
            if name not in self.buf:
                continue
            off, shndx = self._fields_of(name, R_X86_64_64)
            shndx = np.where(shndx < len(secs), shndx, len(secs))
            pos = off[alloc[shndx]].astype(np.int64)
            if not len(pos):
                continue
            words = _le_words(self.buf[name], 8)
            # a (begin, end) pair's end is the end of the code before it, not the
            # start of what follows (rustc's units list every function in
            # .debug_ranges: one that ends where the next begins got that one's new
            # start); found before any field is written
            ends = _range_ends(words, pos) if name == ".debug_ranges" else None
            # a slice of fields at a time (their temporaries are 40 bytes a field)
            # when no field repeats; else at once, so each is read before any is written
            step = len(pos) if (len(pos) > 1 and (pos[1:] <= pos[:-1]).any()) else 1 << 20
            for a in range(0, len(pos), step):
                p = pos[a:a + step]
                val = words[p]
                new, ok = amap.map(val)
                if ends is not None:
                    end = ends[a:a + step]
                    if end.any():
                        ne, eok = amap.map(val[end] - np.uint64(1))
                        new[end], ok[end] = ne + np.uint64(1), eok
                new = np.where(ok, new, val)
                words[p] = new
                fields += int((new != val).sum())
                unmapped += int((~ok).sum())
        self.stats["dwarf_address_fields_moved"] = fields
        if unmapped:
            self.stats["dwarf_addresses_in_padding"] = unmapped

    def _keep_reference_words(self):
        """The original 4-byte words at .debug_info's offsets into the list
        sections, taken before anything is patched (``_refs`` reads them after:
        through the mapping, the gather would make all of .debug_info resident
        again). Offsets past the last whole word are kept as -1: ``_refs``
        raises IndexError for them, as reading the section would."""
        off, shndx = self._fields_of(".debug_info", R_X86_64_32)
        targets = [s.index for s in (self._sec(n) for n in LIST_SECTIONS) if s is not None]
        pos = off[np.isin(shndx, targets)].astype(np.int64)
        if len(pos) > 1 and (pos[1:] < pos[:-1]).any():      # the DIE walk emits them in order
            pos = np.sort(pos)
        info = self.buf[".debug_info"]
        ok = pos <= len(info) - 4
        words = np.full(len(pos), -1, np.int64)
        words[ok] = _le_words(info, 4)[pos[ok]]
        self._ref_pos, self._ref_words = pos, words

    def _read_unit_dies(self):
        """The unit headers and every unit's first DIE (its forms, places and
        values), read from the copy before anything is patched: the rewrite
        reads them after patching, and through the mapping each unit's first
        DIE would fault in 64 KB around it (180 MB on 7.3)."""
        info = self.buf[".debug_info"]
        self.units = enc.units(memoryview(info))
        self._tops = native.top_dies(info, self.orig.get(".debug_abbrev", b""), self.units, _TOP)
        self._top_row = {u.off: i for i, u in enumerate(self.units)}

    def _top_value(self, un, at, n):
        """The original n-byte value of attribute ``at`` of a unit's first DIE."""
        d, i = self._tops, self._top_row[un.off]
        j = _TOP.index(at)
        p = int(d.pos[i, j])
        if n == int(d.end[i, j]) - p and n <= 8:
            return int(d.val[i, j])
        return enc.u(self.orig[".debug_info"], p, n)

    def _refs(self, target):
        """(field offsets in .debug_info, referenced offsets) of 4-byte section
        offsets into ``target``."""
        s = self._sec(target)
        if s is None:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        off, shndx = self._fields_of(".debug_info", R_X86_64_32)
        pos = np.sort(off[shndx == s.index].astype(np.int64))
        val = self._ref_words[np.searchsorted(self._ref_pos, pos)]
        if (val < 0).any():
            raise IndexError(f".debug_info: a section offset at {int(pos[val < 0][0]):#x} "
                             "runs past the section's end")
        return pos, val

    def _put(self, name, pos, value, n):
        self.buf[name][pos:pos + n] = np.frombuffer(enc.pack_u(value, n), np.uint8)

    # -- line programs -----------------------------------------------------------
    def rewrite_lines(self):
        if ".debug_line" not in self.orig:
            return
        so, se, sn, sne, sc = self.seg.arrays()
        new, uold, unew, st = relines(np.frombuffer(self.orig[".debug_line"], np.uint8),
                                      so, se, sn, sne, sc)
        self.patched[self.secs[".debug_line"].index] = new
        self.stats.update({f"dwarf_line_{k}": v for k, v in st.items()})
        self.line_offsets = dict(zip(uold.tolist(), unew.tolist()))   # DW_AT_stmt_list follows

    # -- units: their own ranges, and lists relative to their base --------------
    def rewrite_units(self):
        abbrev = self.orig.get(".debug_abbrev", b"")
        tables = _Tables(abbrev)
        converted, relisted, kept = [], 0, 0
        self.abbrev_mods = {}
        self.done_fields = set()      # .debug_info fields already pointing at a new list
        self.cu_new_ranges = [None] * len(self.units)
        self.cu_old_ranges = [None] * len(self.units)
        todo = []
        for ui, un in enumerate(self.units):
            if un.unit_type not in (enc.DW_UT_compile, enc.DW_UT_partial):
                self._type_unit_stmt_list(un, tables)
                continue
            code, a = self._top_die(un)
            if DW_AT_stmt_list in a and getattr(self, "line_offsets", None):
                f, p, e = a[DW_AT_stmt_list]
                nv = self.line_offsets.get(self._top_value(un, DW_AT_stmt_list, e - p))
                if nv is None:
                    self.stats["dwarf_stmt_list_unmatched"] = \
                        self.stats.get("dwarf_stmt_list_unmatched", 0) + 1
                else:
                    self._put(".debug_info", p, nv, e - p)
            base = self._top_value(un, enc.DW_AT_low_pc, un.asz) if enc.DW_AT_low_pc in a and \
                a[enc.DW_AT_low_pc][0] == enc.DW_FORM_addr else 0
            old = self._unit_ranges(un, a, base)
            self.cu_old_ranges[ui] = old
            if old is not None:
                todo.append((ui, un, code, a, base, old))
        # every unit's ranges translated at once: per old range its new ranges
        # (contiguous runs merged) and whether it moved as one linear block
        lo = np.array([r[0] for t in todo for r in t[5]], np.uint64)
        hi = np.array([r[1] for t in todo for r in t[5]], np.uint64)
        _, linear, _, _ = native.seg_ranges(self.seg.c_arrays(), lo, hi, merge=False)
        linear = linear.tolist()
        news = native.merged_groups(self.seg.c_arrays(), lo, hi, [len(t[5]) for t in todo])
        k = 0
        for (ui, un, code, a, base, old), new in zip(todo, news):
            ks = range(k, k + len(old))
            k += len(old)
            self.cu_new_ranges[ui] = new
            if enc.DW_AT_ranges in a:
                f, p, e = a[enc.DW_AT_ranges]
                # in place, each entry keeps its length from its translated start
                # (the relocated start moved): right only if no entry was cut
                if any(not linear[i] for i, (lo_, hi_) in zip(ks, old) if hi_ > lo_):
                    self._put(".debug_info", p, self._append_ranges(un, new), 4)
                    self.done_fields.add(p)
                    relisted += 1
                else:
                    kept += 1
            elif enc.DW_AT_low_pc in a and enc.DW_AT_high_pc in a:
                lo_ = base
                nlo = self.seg.map(lo_)
                if len(new) == 1 and nlo == new[0][0] and new[0][1] - nlo == old[0][1] - lo_:
                    kept += 1          # one piece: low_pc patched, the length holds
                    continue
                if self._convert_unit(ui, un, code, tables[un.abbrev_off], a, new):
                    converted.append(ui)
        self.stats["dwarf_units_relisted"] = relisted
        self.stats["dwarf_units_converted_to_ranges"] = len(converted)
        self.stats["dwarf_units_kept"] = kept
        walked = self.split_dies(tables)
        self.finish_abbrevs(tables)
        # lists of these units: relative to a base that moved, or cut: re-encoded
        self.rebase_lists(sorted(set(converted) | set(walked)))

    def _type_unit_stmt_list(self, un, tables):
        if un.unit_type not in (2, 6) or not getattr(self, "line_offsets", None):
            return
        _, a = self._top_die(un)
        if DW_AT_stmt_list in a:
            f, p, e = a[DW_AT_stmt_list]
            v = self._top_value(un, DW_AT_stmt_list, e - p)
            if v in self.line_offsets:
                self._put(".debug_info", p, self.line_offsets[v], e - p)

    def _top_die(self, un):
        """(abbreviation code, {attr: (form, value position, value end)}) of a
        unit's first DIE, for the attributes the rewrite reads (as
        encoding.top_die_attrs: none when its abbreviation is unknown)."""
        d, i = self._tops, self._top_row[un.off]
        if d.off[i] < 0:            # unknown abbreviation or a null entry first
            return 0, {}
        a = {at: (int(d.form[i, j]), int(d.pos[i, j]), int(d.end[i, j]))
             for j, at in enumerate(_TOP) if d.pos[i, j] >= 0}
        return int(d.code[i]), a

    def _unit_ranges(self, un, a, base):
        if enc.DW_AT_ranges in a:
            f, p, e = a[enc.DW_AT_ranges]
            if f != enc.DW_FORM_sec_offset:
                return None
            off = self._top_value(un, enc.DW_AT_ranges, un.osz)
            if un.version >= 5:
                return self._read_rnglist(off, base)
            return self._read_ranges(off, base, un.asz)
        if enc.DW_AT_low_pc in a and enc.DW_AT_high_pc in a:
            f, p, e = a[enc.DW_AT_high_pc]
            hv = self._top_value(un, enc.DW_AT_high_pc, e - p)
            hi = hv if f == enc.DW_FORM_addr else base + hv
            return [(base, hi)]
        return None

    def _read_rnglist(self, off, base):
        return enc.read_rnglist(self.orig[".debug_rnglists"], off, base)

    def _read_ranges(self, off, base, asz):
        return enc.read_ranges(self.orig[".debug_ranges"], off, base, asz)

    # appending lists --------------------------------------------------------------
    def _tail(self, name, header=None):
        """Append area of a section (a new DWARF 5 contribution gets its header)."""
        if name not in self.append:
            self.append[name] = bytearray(header or b"")
        return self.append[name]

    def _list_area(self, name, v5):
        hdr = None
        if v5:
            # unit_length (filled in finish), version 5, address size 8, no selector, no offsets
            hdr = b"\0\0\0\0" + (5).to_bytes(2, "little") + b"\x08\x00" + b"\0\0\0\0"
        return self._tail(name, hdr)

    def _append_ranges(self, un, new):
        v5 = un.version >= 5
        name = ".debug_rnglists" if v5 else ".debug_ranges"
        t = self._list_area(name, v5)
        off = len(self.orig[name]) + len(t)
        if len(new) > 4:        # long lists (a unit's scattered functions): the C encoder
            data, _ = native.encode_ranges(v5, [len(new)], [r[0] for r in new],
                                           [r[1] for r in new], off)
            t += data
            return off
        if v5:
            for lo, hi in new:
                t += b"\x07" + enc.pack_u(lo, 8) + enc.enc_uleb(hi - lo)
            t += b"\x00"
        else:
            t += enc.pack_u(-1, 8) + enc.pack_u(0, 8)
            for lo, hi in new:
                t += enc.pack_u(lo, 8) + enc.pack_u(hi, 8)
            t += bytes(16)
        return off

    def _ranges_attrs(self, attrs, size, keep_low):
        """An abbreviation's attributes with high_pc (``size`` bytes) replaced by
        DW_AT_ranges + 4 bytes of filler when needed; low_pc kept (a unit's base)
        or renamed entry_pc (a DIE's entry: the translated start of its code)."""
        out = []
        if not keep_low and any(at == enc.DW_AT_entry_pc for at, _, _ in attrs):
            # the DIE names its entry already (inlined subroutines): low_pc's 8
            # bytes become DW_AT_ranges + 4 bytes of filler, high_pc all filler
            for at, form, ic in attrs:
                if at == enc.DW_AT_low_pc:
                    out += [(enc.DW_AT_ranges, enc.DW_FORM_sec_offset, None),
                            (DW_AT_linepack_pad2, enc.DW_FORM_data4, None)]
                elif at == enc.DW_AT_high_pc:
                    out.append((DW_AT_linepack_pad, enc.DW_FORM_data4 if size == 4 else
                                enc.DW_FORM_data8, None))
                else:
                    out.append((at, form, ic))
            return out
        for at, form, ic in attrs:
            if at == enc.DW_AT_high_pc:
                out.append((enc.DW_AT_ranges, enc.DW_FORM_sec_offset, None))
                if size == 8:
                    out.append((enc.DW_AT_identifier_case, enc.DW_FORM_data4, None))
            elif at == enc.DW_AT_low_pc and not keep_low:
                out.append((enc.DW_AT_entry_pc, form, ic))
            else:
                out.append((at, form, ic))
        return out

    @staticmethod
    def _convertible(un, a):
        if enc.DW_AT_high_pc not in a or enc.DW_AT_low_pc not in a:
            return False
        f, p, e = a[enc.DW_AT_high_pc]
        return (un.osz == 4 and e - p in (4, 8) and a[enc.DW_AT_low_pc][0] == enc.DW_FORM_addr
                and not (e - p == 8 and enc.DW_AT_identifier_case in a)
                and enc.DW_AT_entry_pc not in a and enc.DW_AT_ranges not in a)

    @staticmethod
    def _convertible_with_entry(un, a):
        """A DIE with its own DW_AT_entry_pc and low_pc (8 bytes) + high_pc (4 or 8
        bytes): low_pc's place holds DW_AT_ranges and filler."""
        if enc.DW_AT_entry_pc not in a or enc.DW_AT_low_pc not in a or \
                enc.DW_AT_high_pc not in a or enc.DW_AT_ranges in a:
            return False
        lf, lp, le = a[enc.DW_AT_low_pc]
        f, p, e = a[enc.DW_AT_high_pc]
        return un.osz == 4 and lf == enc.DW_FORM_addr and le - lp == 8 and e - p in (4, 8) \
            and f != enc.DW_FORM_addr and DW_AT_linepack_pad not in a

    def _write_ranges_attr(self, un, a, new, low_value=None):
        if enc.DW_AT_entry_pc in a and low_value is None:
            lf, lp, le = a[enc.DW_AT_low_pc]
            f, p, e = a[enc.DW_AT_high_pc]
            self.done_fields.add(lp)
            self._put(".debug_info", lp, self._append_ranges(un, new), 4)
            self._put(".debug_info", lp + 4, 0, 4)
            self._put(".debug_info", p, 0, e - p)
            return
        f, p, e = a[enc.DW_AT_high_pc]
        self.done_fields.add(p)
        self._put(".debug_info", p, self._append_ranges(un, new), 4)
        if e - p == 8:
            self._put(".debug_info", p + 4, 0, 4)       # DW_ID_case_sensitive
        if low_value is not None:
            self._put(".debug_info", a[enc.DW_AT_low_pc][1], low_value, un.asz)

    def _convert_unit(self, ui, un, code, table, a, new):
        """The unit DIE: low_pc/high_pc -> low_pc 0 (base: lists absolute) + DW_AT_ranges,
        through a copy of the unit's abbreviation table (no DIE changes size)."""
        if not self._convertible(un, a):
            return self._convert_short_unit(ui, un, code, table, a, new)
        size = a[enc.DW_AT_high_pc][2] - a[enc.DW_AT_high_pc][1]
        tag, children, attrs = table[code]
        self.abbrev_mods.setdefault(ui, {})[code] = (tag, children,
                                                     self._ranges_attrs(attrs, size, True))
        self._write_ranges_attr(un, a, new, low_value=0)
        return True

    def _convert_short_unit(self, ui, un, code, table, a, new):
        """A unit DIE whose high pc is too short for a section offset (the
        assembler's 1-2 byte DW_FORM_udata): adjacent low_pc + high_pc become
        DW_AT_ranges + a DW_FORM_block1 filler (vendor attribute 0x3fe0) of the
        same total size; with no low_pc the unit's base is 0."""
        lf, lp, le = a[enc.DW_AT_low_pc]
        hf, hp, he = a[enc.DW_AT_high_pc]
        if un.osz != 4 or lf != enc.DW_FORM_addr or le != hp or he - lp < 5 or \
                enc.DW_AT_ranges in a:
            self.stats["dwarf_units_not_convertible"] = \
                self.stats.get("dwarf_units_not_convertible", 0) + 1
            return False
        tag, children, attrs = table[code]
        nattrs = []
        for at, form, ic in attrs:
            if at == enc.DW_AT_low_pc:
                nattrs += [(enc.DW_AT_ranges, enc.DW_FORM_sec_offset, None),
                           (DW_AT_linepack_pad, DW_FORM_block1, None)]
            elif at != enc.DW_AT_high_pc:
                nattrs.append((at, form, ic))
        self.abbrev_mods.setdefault(ui, {})[code] = (tag, children, nattrs)
        self.done_fields.add(lp)
        pad = he - lp - 4
        self._put(".debug_info", lp, self._append_ranges(un, new), 4)
        self.buf[".debug_info"][lp + 4:he] = np.frombuffer(bytes([pad - 1]) + bytes(pad - 1),
                                                           np.uint8)
        return True

    def _cuts(self):
        """Old addresses where the map is discontinuous (a piece boundary whose two
        sides do not stay adjacent) or a piece changes size (a re-encoded branch,
        an appended jmp: a length that covers it no longer holds), sorted (uint64)."""
        o, e, n, ne, _ = self.seg.c_arrays()
        resized = (ne - n) != (e - o)
        cont = np.zeros(len(o), bool)
        cont[:-1] = (e[:-1] == o[1:]) & (ne[:-1] == n[1:])
        keep = ~cont | resized
        gap_before = np.ones(len(o), bool)
        gap_before[1:] = e[:-1] != o[1:]
        return np.unique(np.concatenate([e[keep], o[keep & resized], o[keep & gap_before]]))

    def split_dies(self, tables):
        """DIEs (subprograms, lexical blocks, inlined subroutines) with low/high pc
        whose code now lies in several ranges: their abbreviation (in the unit's
        copy) gets DW_AT_ranges, and every DIE using it a list. Only units holding
        a function with a cut inside are walked (none for whole-function moves)."""
        cuts = self._cuts()
        from ..image.context import ImageContext
        ft = ImageContext.of(self.image).functions   # the driver's table of this image
        fs, fe = ft.start.astype(np.uint64), (ft.start + ft.size).astype(np.uint64)
        k = np.searchsorted(cuts, fs, side="right")
        hit = (k < len(cuts)) & (cuts[np.minimum(k, len(cuts) - 1)] < fe) if len(cuts) else \
            np.zeros(len(fs), bool)
        split = list(zip(fs[hit].tolist(), fe[hit].tolist()))
        self.stats["dwarf_split_functions"] = len(split)
        if not split:
            return []
        split.sort()
        starts = [s for s, _ in split]
        walked = []
        info = self.orig[".debug_info"]
        abbrev = self.orig.get(".debug_abbrev", b"")
        cuts_a = cuts
        seg = self.seg.c_arrays()
        dies = stuck = 0
        LO, HI, ENT, RNG, IDC, PAD = range(6)
        want = (enc.DW_AT_low_pc, enc.DW_AT_high_pc, enc.DW_AT_entry_pc, enc.DW_AT_ranges,
                enc.DW_AT_identifier_case, DW_AT_linepack_pad)
        for ui, un in enumerate(self.units):
            old = self.cu_old_ranges[ui]
            if not old or not any(self._overlaps(starts, split, lo, hi) for lo, hi in old):
                continue
            walked.append(ui)
            table = tables[un.abbrev_off]
            d = native.dies(info, abbrev, un, want)
            # DIEs (not the unit's) with an address low pc and a high pc
            idx = np.nonzero((d.off != un.die) & d.has(HI) & d.has(LO) &
                             (d.form[:, LO] == enc.DW_FORM_addr))[0]
            if not len(idx):
                continue
            form, val, has = d.form[idx], d.val[idx], d.pos[idx] >= 0
            hsize = (d.end[idx, HI] - d.pos[idx, HI])
            lsize = (d.end[idx, LO] - d.pos[idx, LO])
            lo = val[:, LO]
            hi = np.where(form[:, HI] == enc.DW_FORM_addr, val[:, HI], lo + val[:, HI])
            k = np.searchsorted(cuts_a, lo, side="right")
            cut = (k < len(cuts_a)) & (cuts_a[np.minimum(k, len(cuts_a) - 1)] < hi) \
                if len(cuts_a) else np.zeros(len(idx), bool)
            count, linear, rlo, rhi = native.seg_ranges(seg, lo, hi, merge=True)
            # no cut inside, but the piece it ends with may have grown (a jmp
            # appended) or shrunk: its length no longer holds
            cut |= (hi > lo) & ~linear
            h48 = (hsize == 4) | (hsize == 8)
            convertible = (un.osz == 4) & h48 & ~((hsize == 8) & has[:, IDC]) & \
                ~has[:, ENT] & ~has[:, RNG]
            with_entry = has[:, ENT] & ~has[:, RNG] & (un.osz == 4) & (lsize == 8) & h48 & \
                (form[:, HI] != enc.DW_FORM_addr) & ~has[:, PAD]
            conv = convertible | with_entry
            stuck += int((cut & ~conv).sum())        # left as they are (counted)
            codes = np.unique(d.code[idx][conv & cut])
            if not len(codes):
                continue
            code = d.code[idx]
            mods = self.abbrev_mods.setdefault(ui, {})
            for c in codes.tolist():
                first = np.nonzero(conv & (code == c))[0][0]
                tag, children, attrs = table[c]
                mods[c] = (tag, children, self._ranges_attrs(attrs, int(hsize[first]), False))
            w = conv & np.isin(code, codes)
            self._write_ranges_attrs(un, d, idx[w], count, rlo, rhi, w)
            dies += int(w.sum())
        self.stats["dwarf_dies_converted_to_ranges"] = dies
        if stuck:
            self.stats["dwarf_dies_not_convertible"] = stuck
        return walked

    def _write_ranges_attrs(self, un, d, rows, count, rlo, rhi, sel):
        """_write_ranges_attr for DIE rows ``rows`` of ``d`` at once: their new
        ranges are the items ``sel`` of the flat (count, rlo, rhi)."""
        starts = np.concatenate([[0], np.cumsum(count)])[:-1]
        pick = np.nonzero(sel)[0]
        c = count[pick]
        flat = np.repeat(starts[pick], c) + (np.arange(int(c.sum())) -
                                             np.repeat(np.cumsum(c) - c, c))
        v5 = un.version >= 5
        name = ".debug_rnglists" if v5 else ".debug_ranges"
        t = self._list_area(name, v5)
        data, offs = native.encode_ranges(v5, c, rlo[flat], rhi[flat],
                                          len(self.orig[name]) + len(t))
        t += data
        LO, HI, ENT = 0, 1, 2
        ent = d.pos[rows, ENT] >= 0
        lp, hp = d.pos[rows, LO], d.pos[rows, HI]
        hsize = d.end[rows, HI] - hp
        buf = self.buf[".debug_info"]
        # the DIE names its entry already: low pc's 8 bytes hold the list offset
        # and filler, high pc is filler; else high pc holds it (+ filler)
        field = np.where(ent, lp, hp)
        self.done_fields.update(field.tolist())
        _put_le(buf, field, offs, 4)
        _put_le(buf, np.where(ent, lp + 4, hp + 4)[ent | (hsize == 8)], 0, 4)
        e8 = ent & (hsize == 8)
        _put_le(buf, hp[e8], 0, 8)
        e4 = ent & (hsize == 4)
        _put_le(buf, hp[e4], 0, 4)

    @staticmethod
    def _overlaps(starts, spans, lo, hi):
        """Does [lo, hi) meet one of the sorted disjoint ``spans``?"""
        k = bisect.bisect_left(starts, hi)
        return k > 0 and spans[k - 1][1] > lo

    def finish_abbrevs(self, tables):
        for ui, mods in sorted(self.abbrev_mods.items()):
            if not mods:
                continue
            un = self.units[ui]
            t = self._tail(".debug_abbrev")
            aoff = len(self.orig[".debug_abbrev"]) + len(t)
            t += native.abbrev_table_with(self.orig[".debug_abbrev"], un.abbrev_off, mods,
                                          lambda c, e: enc.encode_abbrevs({c: e})[:-1])
            self._put(".debug_info", un.abbrev_field, aoff, un.osz)

    def rebase_lists(self, converted):
        """Re-encode, with absolute entries, every range/location list referenced
        from a converted unit (its entries were relative to the old base)."""
        if not converted:
            return
        cu = [self.units[i] for i in converted]
        starts = np.array([un.off for un in cu], np.int64)
        ends = np.array([un.end for un in cu], np.int64)
        base_of = np.array([self._old_base(un) for un in cu], np.uint64)
        v5_of = np.array([un.version >= 5 for un in cu], np.uint8)
        asz_of = np.array([un.asz for un in cu], np.uint8)
        done = np.array(sorted(self.done_fields), np.int64)
        parts = []
        for name in LIST_SECTIONS:
            if name not in self.orig:
                continue
            pos, val = self._refs(name)
            k = np.searchsorted(starts, pos, side="right") - 1
            kc = np.maximum(k, 0)
            inside = (k >= 0) & (pos < ends[kc])
            pos, val, kc = pos[inside], val[inside], kc[inside]
            if not len(pos):
                continue
            is_loc = name in (".debug_loclists", ".debug_loc")
            vp = np.full(len(pos), -1, np.int64)
            keep = ~_member(pos, done)
            if is_loc:
                # DW_AT_GNU_locviews follows DW_AT_location: its list precedes the locations
                views = self._view_fields(pos, val)
                keep &= ~_member(pos, views)
                vp = np.where(_member(pos + 4, views), pos + 4, -1)
            parts.append((pos[keep], val[keep], kc[keep], is_loc, vp[keep]))
        if not parts:
            self.stats["dwarf_lists_reencoded"] = 0
            return
        p = np.concatenate([x[0] for x in parts])
        kc = np.concatenate([x[2] for x in parts])
        items = {"p": p, "v": np.concatenate([x[1] for x in parts]), "base": base_of[kc],
                 "v5": v5_of[kc], "asz": asz_of[kc], "vp": np.concatenate([x[4] for x in parts]),
                 "is_loc": np.concatenate([np.full(len(x[0]), x[3], np.uint8) for x in parts])}
        names = (".debug_rnglists", ".debug_ranges", ".debug_loclists", ".debug_loc")
        sections = [self.orig.get(n) for n in names] + \
            [self.buf.get(".debug_loclists"), self.buf.get(".debug_loc")]
        areas = [(len(self.orig.get(n, b"")), len(self.append.get(n, b"")), n in self.append)
                 for n in names]
        noff, voff, status, added = native.relist(self.seg.c_arrays(), self.orig[".debug_info"],
                                                  sections, items, areas)
        for n, data in zip(names, added):
            if data:
                self.append.setdefault(n, bytearray()).extend(data)
        ok = status == 0
        buf = self.buf[".debug_info"]
        _put_le(buf, p[ok], noff[ok], 4)
        hv = ok & (items["vp"] >= 0)
        _put_le(buf, items["vp"][hv], voff[hv], 4)
        self.stats["dwarf_lists_reencoded"] = int(ok.sum())
        if (~ok).any():
            self.stats["dwarf_lists_unreadable"] = int((~ok).sum())

    @staticmethod
    def _view_fields(pos, val):
        """Fields (sorted offsets ``pos``, referenced offsets ``val``) that hold a
        location-view list: the field 4 bytes after a location field whose
        referenced offset is below that field's (the views list comes first)."""
        if len(pos) > 1 and (np.diff(pos) <= 0).any():     # repeated fields: as a dict would
            nxt = {q: v for q, v in zip(pos.tolist(), val.tolist())}
            return np.array(sorted(q + 4 for q, v in nxt.items()
                                   if nxt.get(q + 4) is not None and nxt[q + 4] < v), np.int64)
        j = np.searchsorted(pos, pos + 4)
        jc = np.minimum(j, len(pos) - 1)
        hit = (j < len(pos)) & (pos[jc] == pos + 4) & (val[jc] < val)
        return pos[jc[hit]]

    def _old_base(self, un):
        _, a = self._top_die(un)
        x = a.get(enc.DW_AT_low_pc)
        if x is not None and x[0] == enc.DW_FORM_addr:
            return self._top_value(un, enc.DW_AT_low_pc, un.asz)
        return 0

    # -- aranges -----------------------------------------------------------------
    def rewrite_aranges(self):
        if ".debug_aranges" not in self.orig:
            return
        b = self.orig[".debug_aranges"]
        out = bytearray()
        p = 0
        moved = 0
        sets = []
        while p + 4 <= len(b):
            ln = enc.u(b, p, 4)
            if ln == 0xFFFFFFFF:        # 64-bit aranges: copied as they are
                sets.append(b[p:p + 12 + enc.u(b, p + 4, 8)])
                p += 12 + enc.u(b, p + 4, 8)
                continue
            end = p + 4 + ln
            ver, info_off, asz, ssz = enc.u(b, p + 4, 2), enc.u(b, p + 6, 4), b[p + 10], b[p + 11]
            q = p + 12
            tup = 2 * asz + ssz
            q += (-q + p) % tup if tup else 0
            rs = []
            if asz in (4, 8) and q <= end:      # the tuples at once, up to the (0, 0) one
                t = np.frombuffer(b, f"<u{asz}", count=(end - q) // (2 * asz) * 2,
                                  offset=q).reshape(-1, 2)
                stop = np.nonzero((t[:, 0] == 0) & (t[:, 1] == 0))[0]
                t = t[:stop[0]] if len(stop) else t
                rs = [(lo, lo + n) for lo, n in t.tolist()]
            while asz not in (4, 8) and q + 2 * asz <= end:
                lo, n = enc.u(b, q, asz), enc.u(b, q + asz, asz)
                q += 2 * asz
                if lo == 0 and n == 0:
                    break
                rs.append((lo, lo + n))
            sets.append((ver, info_off, asz, ssz, rs))
            p = end
        # every set's ranges translated at once
        lo = np.array([r[0] for x in sets if type(x) is tuple for r in x[4]], np.uint64)
        hi = np.array([r[1] for x in sets if type(x) is tuple for r in x[4]], np.uint64)
        news = iter(native.merged_groups(self.seg.c_arrays(), lo, hi,
                                         [len(x[4]) for x in sets if type(x) is tuple]))
        for x in sets:
            if type(x) is not tuple:
                out += x
                continue
            ver, info_off, asz, ssz, rs = x
            new = next(news)
            moved += new != rs
            body = bytearray(enc.pack_u(ver, 2) + enc.pack_u(info_off, 4) + bytes([asz, ssz]))
            while (4 + len(body)) % (2 * asz):
                body += b"\0"
            if asz in (4, 8):
                mask = (1 << (8 * asz)) - 1
                body += enc.struct.pack(f"<{2 * len(new)}{'I' if asz == 4 else 'Q'}",
                                        *[x & mask for lo_, hi_ in new for x in (lo_, hi_ - lo_)])
            else:
                for lo_, hi_ in new:
                    body += enc.pack_u(lo_, asz) + enc.pack_u(hi_ - lo_, asz)
            body += bytes(2 * asz)
            out += enc.pack_u(len(body), 4) + body
        self.patched[self.secs[".debug_aranges"].index] = np.frombuffer(bytes(out), np.uint8)
        self.stats["dwarf_aranges_sets_moved"] = int(moved)

    # -- .debug_frame --------------------------------------------------------------
    def check_frame(self):
        """FDEs move with their start (patched in place). An FDE whose code is now
        in several ranges (or changed size) cannot be described by one FDE: it is
        cut to the run at its start that moved as one block (its CFA rows there are
        still right), so it never covers another function's code; the rest of the
        function has no FDE (counted: dwarf_fdes_split; per-part FDEs not written)."""
        if ".debug_frame" not in self.orig:
            return
        b = self.orig[".debug_frame"]
        buf = self.buf.get(".debug_frame")
        p = 0
        fde_pos, fde_lo, fde_n = [], [], []
        unpack = enc.struct.unpack_from
        size = len(b)
        while p + 4 <= size:
            if p + 24 <= size:
                ln, cie, lo, n = unpack("<IIQQ", b, p)
            else:               # a short last entry: the bytes that are there
                ln, cie = enc.u(b, p, 4), enc.u(b, p + 4, 4)
                lo, n = enc.u(b, p + 8, 8), enc.u(b, p + 16, 8)
            if ln == 0 or ln == 0xFFFFFFFF:
                break
            if cie != 0xFFFFFFFF and ln >= 20 and n:
                fde_pos.append(p)
                fde_lo.append(lo)
                fde_n.append(n)
            p += 4 + ln
        lo = np.array(fde_lo, np.uint64)
        _, linear, _, _ = native.seg_ranges(self.seg.c_arrays(), lo,
                                            lo + np.array(fde_n, np.uint64), merge=False)
        split = 0
        for i in np.nonzero(~linear)[0].tolist():
            split += 1
            if buf is not None:
                p, a = fde_pos[i], fde_lo[i]
                buf[p + 16:p + 24] = np.frombuffer(
                    enc.pack_u(self._linear_run(a, a + fde_n[i]), 8), np.uint8)
        self.stats["dwarf_fdes_split"] = split

    def _linear_run(self, lo, hi):
        """Length of the longest [lo, lo + L) that maps linearly and contiguously."""
        sg = self.seg
        k = bisect.bisect_right(sg.end, lo)
        pos = lo
        while k < len(sg.old) and sg.old[k] <= pos < hi:
            if sg.collapse[k]:
                break
            pos = min(hi, sg.end[k])
            if pos == hi or not sg.continuous(k) or \
                    sg.new_end[k] - sg.new[k] != sg.end[k] - sg.old[k]:
                break
            k += 1
        return pos - lo

    # -- output ------------------------------------------------------------------
    def finish(self):
        # what the rewrite read is freed before the sections with appended lists
        # are joined (each join copies one section)
        self.fields = self._ref_pos = self._ref_words = self._tops = None
        for name in list(self.buf):
            arr = self.buf.pop(name)
            extra = self.append.get(name)
            if extra and name in (".debug_rnglists", ".debug_loclists"):
                extra[0:4] = enc.pack_u(len(extra) - 4, 4)
            data = arr if not extra else np.concatenate([arr, np.frombuffer(bytes(extra), np.uint8)])
            del arr
            self.patched[self.secs[name].index] = data
        if ".debug_abbrev" in self.append:
            self.patched[self.secs[".debug_abbrev"].index] = np.frombuffer(
                self.orig[".debug_abbrev"] + bytes(self.append[".debug_abbrev"]), np.uint8)
        self.drop = [s.index for s in self.image.sections
                     if s.name.startswith(".rela.debug_") or s.name.startswith(".rel.debug_")]


def rewrite_dwarf(image, amap, log=None, fields=None):
    """(patched {index: bytes}, drop [index], stats) for the image's DWARF under
    ``amap``; ``fields``: "relocations", "parsed" or None (relocations when the
    image has .rela.debug_*, else parsed)."""
    # the rewrite makes many small tuples and lists and no reference cycles: the
    # cycle collector would only re-scan the objects of the phases before it
    was = gc.isenabled()
    gc.disable()
    try:
        rw = DwarfRewrite(image, amap, log, fields).run()
    finally:
        if was:
            gc.enable()
    return rw.patched, rw.drop, rw.stats
