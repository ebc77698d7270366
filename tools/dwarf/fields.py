"""The address fields of an image's DWARF, from its link relocations or found by
parsing it, as the same arrays: one rewriter for both sources.

The rewriter needs, per DWARF section, the 8-byte address fields the link
relocated (R_X86_64_64 against a symbol of an allocated section) and, in
.debug_info, the 4-byte section offsets into the list sections (R_X86_64_32).
A kernel since 6.5 ships its vmlinux without relocations (.rela.debug_* too),
so `ParsedFields` finds the same fields by walking the DWARF with the C core
(fields.c): DW_FORM_addr values and DW_OP_addr operands in .debug_info, list
entries reached from DW_AT_ranges / DW_AT_location, DW_LNE_set_address,
.debug_aranges tuples, .debug_frame FDEs, .debug_addr entries. Both sources
answer ``of_type(section, rtype)`` with (field offsets uint64, the section
index of what each field points at int64), as the relocations give them.
"""

import ctypes
import os

import numpy as np

from . import encoding as enc
from .native import library, _p, _u8, _DIE_ERRORS
from ..image.references import START_KERNEL_MAP
from ..image.relocs import R_X86_64_32, R_X86_64_64

# attributes of the location class (their section offsets point into
# .debug_loclists / .debug_loc); GNU location views come with them
_LOCATION_ATTRS = {0x02, 0x19, 0x2a, 0x2e, 0x38, 0x40, 0x48, 0x4a, 0x4d, 0x50, 0x2137}
_RANGES_ATTRS = {0x55, 0x2c}
DW_AT_GNU_locviews = 0x2137
DW_AT_rnglists_base, DW_AT_loclists_base = 0x74, 0x8c
REF_TARGETS = ("", ".debug_loclists", ".debug_loc", ".debug_rnglists", ".debug_ranges",
               ".debug_line", ".debug_addr")      # "": another section
FIELD_SECTIONS = (".debug_info", ".debug_addr", ".debug_line", ".debug_aranges",
                  ".debug_rnglists", ".debug_ranges", ".debug_loclists", ".debug_loc",
                  ".debug_frame")


def read_section(image, s):
    """A section's bytes, read from the file when the image is one (a copy made
    through the mapping would also keep the mapped pages resident: 156 MB of
    .debug_info in a kernel)."""
    path = getattr(image, "path", None)
    if path and type(image).__name__ == "ElfImage" and s.type != 8:      # 8: SHT_NOBITS
        import os
        with open(path, "rb") as f:
            data = os.pread(f.fileno(), s.size, s.offset)
        if len(data) == s.size:
            return data
    return bytes(image.section_bytes(s))


def read_writable(image, s):
    """A section's bytes as a writable uint8 array of its own (read from the
    file into it when the image is one: no intermediate bytes object)."""
    out = np.empty(s.size, np.uint8)
    path = getattr(image, "path", None)
    if path and type(image).__name__ == "ElfImage" and s.type != 8:
        with open(path, "rb") as f:
            if os.preadv(f.fileno(), [out], s.offset) == s.size:
                return out
    out[:] = image.section_bytes(s)
    return out


def mapped_section(image, s):
    """A section's bytes read in place (a read-only memoryview of the image's
    file mapping: a page becomes resident only when read)."""
    return memoryview(image.section_bytes(s)).toreadonly()


def _declare(lib):
    if getattr(lib, "_fields_declared", False):
        return lib
    P, I64 = ctypes.c_void_p, ctypes.c_int64
    lib.lp_info_fields.argtypes = [P, I64, P, I64, I64, P, P, P, P, P, P, P, P, I64,
                                   P, P, P, P, P, I64, P, P, P]
    lib.lp_info_fields.restype = I64
    lib.lp_list_fields.argtypes = [P, I64, ctypes.c_int, I64, P, P, P, P, P, P, I64, P]
    lib.lp_list_fields.restype = I64
    lib.lp_line_fields.argtypes = [P, I64, P, P, I64, P]
    lib.lp_line_fields.restype = I64
    lib.lp_aranges_fields.argtypes = [P, I64, P, P, I64]
    lib.lp_aranges_fields.restype = I64
    lib.lp_frame_fields.argtypes = [P, I64, P, P, I64, P]
    lib.lp_frame_fields.restype = I64
    lib._fields_declared = True
    return lib


def _grow(call, cap):
    """Run ``call(pos, val, cap)`` (a C scan returning its field count, which may
    exceed cap) with room for every field: (positions, values)."""
    while True:
        pos, val = np.empty(max(cap, 1), np.int64), np.empty(max(cap, 1), np.uint64)
        n = call(pos, val, cap)
        if n < 0:
            return n, None, None
        if n <= cap:
            return n, pos[:n].copy(), val[:n].copy()
        cap = int(n)


class DwarfFieldError(ValueError):
    """DWARF the field scan cannot read completely (an address could be missed)."""


class ParsedFields:
    """Every address field of the DWARF in ``sections`` ({name: bytes}), found by
    parsing. ``addresses[name]``: (offsets int64, values uint64) of its 8-byte
    address fields; ``refs``: .debug_info's section offsets (pos, value, the section
    each points into as an index of REF_TARGETS); ``stats``: what the scan read."""

    def __init__(self, sections):
        self.sec = sections
        self.addresses, self.stats = {}, {}
        lib = _declare(library())
        info = sections.get(".debug_info")
        if not info:
            self.refs = (np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.int8))
            return
        self.units = enc.units(info)
        self._info(lib, _u8(info), _u8(sections.get(".debug_abbrev", b"")))
        self._lists(lib)
        del self._ref_attr, self._ref_unit, self._ref_size    # read by _lists only
        self._line(lib)
        self._aranges(lib)
        self._frame(lib)
        self._addr()

    # -- .debug_info ------------------------------------------------------------
    def _info(self, lib, ib, ab):
        us = self.units
        cols = {k: np.array([getattr(u, k) for u in us], np.int64)
                for k in ("die", "end", "version", "asz", "osz", "abbrev_off")}
        n = len(us)
        base = np.zeros(max(n, 1), np.uint64)
        counts, err = np.zeros(4, np.int64), np.zeros(1, np.int64)
        # bounds, not guesses: an address field takes 8 bytes, a reference 4; the
        # arrays' untouched tails are never faulted in
        acap, rcap = len(ib) // 8 + 1, len(ib) // 4 + 1
        apos, aval = np.empty(acap, np.int64), np.empty(acap, np.uint64)
        rpos, rval = np.empty(rcap, np.int64), np.empty(rcap, np.uint64)
        rattr, runit = np.empty(rcap, np.int32), np.empty(rcap, np.int32)
        rsize = np.empty(rcap, np.uint8)
        rc = lib.lp_info_fields(_p(ib), len(ib), _p(ab), len(ab), n,
                                *(_p(cols[k]) for k in ("die", "end", "version", "asz", "osz",
                                                        "abbrev_off")),
                                _p(apos), _p(aval), acap, _p(rpos), _p(rval), _p(rattr), _p(runit),
                                _p(rsize), rcap, _p(base), _p(counts), _p(err))
        if rc < 0:
            raise DwarfFieldError(f".debug_info: {_DIE_ERRORS.get(rc, 'malformed')} at offset "
                                  f"{int(err[0]):#x}")
        na, nr, bad_expr, indexed = counts.tolist()
        if bad_expr:
            raise DwarfFieldError(f".debug_info: {bad_expr} DWARF expressions with an operation "
                                  "the field scan does not know")
        if indexed:
            raise DwarfFieldError(f".debug_info: {indexed} attributes through an index "
                                  "(DW_FORM_addrx, rnglistx, loclistx): not supported")
        # views, not copies: the arrays' untouched tails were never faulted in
        # (a copy would hold the fields twice for a moment: +136 MB on 7.3)
        self.addresses[".debug_info"] = (apos[:na], aval[:na])
        del apos, aval
        self.unit_base = base[:n]
        rpos, rval = rpos[:nr], rval[:nr]
        rattr, runit, rsize = rattr[:nr], runit[:nr], rsize[:nr]
        v5 = np.array([u.version >= 5 for u in us], bool)[runit] if nr else np.zeros(0, bool)
        # the section each reference points into, as an index of REF_TARGETS
        code = {name: k for k, name in enumerate(REF_TARGETS)}
        target = np.zeros(nr, np.int8)
        is_loc = np.isin(rattr, list(_LOCATION_ATTRS))
        is_rng = np.isin(rattr, list(_RANGES_ATTRS))
        target[is_loc & v5] = code[".debug_loclists"]
        target[is_loc & ~v5] = code[".debug_loc"]
        target[is_rng & v5] = code[".debug_rnglists"]
        target[is_rng & ~v5] = code[".debug_ranges"]
        target[rattr == DW_AT_rnglists_base] = code[".debug_rnglists"]
        target[rattr == DW_AT_loclists_base] = code[".debug_loclists"]
        target[rattr == 0x10] = code[".debug_line"]
        target[rattr == 0x73] = code[".debug_addr"]
        self.refs = (rpos, rval, target)
        self._ref_attr, self._ref_unit, self._ref_size = rattr, runit, rsize
        self.stats.update(units=n, info_address_fields=na, info_references=nr)

    # -- lists ------------------------------------------------------------------
    def _lists(self, lib):
        rpos, rval, target = self.refs
        us = self.units
        asz = np.array([u.asz for u in us], np.int64)
        osz = np.array([u.osz if u.version > 2 else u.asz for u in us], np.int64)
        for kind, name in enumerate((".debug_rnglists", ".debug_ranges", ".debug_loclists",
                                     ".debug_loc")):
            sec = self.sec.get(name)
            m = (target == REF_TARGETS.index(name)) & (self._ref_attr != DW_AT_GNU_locviews) & \
                (self._ref_attr != DW_AT_rnglists_base) & (self._ref_attr != DW_AT_loclists_base)
            if sec is None or not m.any():
                continue
            off, first = np.unique(rval[m].astype(np.int64), return_index=True)
            unit = self._ref_unit[m][first]
            b = _u8(sec)
            base = np.ascontiguousarray(self.unit_base[unit], np.uint64)
            a, o = np.ascontiguousarray(asz[unit]), np.ascontiguousarray(osz[unit])
            status = np.zeros(max(len(off), 1), np.uint8)
            n, pos, val = _grow(lambda p, v, c: lib.lp_list_fields(
                _p(b), len(b), kind, len(off), _p(off), _p(base), _p(a), _p(o), _p(p), _p(v), c,
                _p(status)), 2 * len(off) + 16)
            st = status[:len(off)]
            if (st == 1).any():
                k = int(np.nonzero(st == 1)[0][0])
                raise DwarfFieldError(f"{name}: {int((st == 1).sum())} lists unreadable (first "
                                      f"at offset {int(off[k]):#x})")
            if (st == 2).any():
                raise DwarfFieldError(f"{name}: {int((st == 2).sum())} lists with entries "
                                      "through .debug_addr: not supported")
            self.addresses[name] = (pos, val)
            self.stats[name.replace(".debug_", "") + "_lists"] = len(off)

    # -- the other sections -----------------------------------------------------
    def _line(self, lib):
        sec = self.sec.get(".debug_line")
        if sec is None:
            return
        b = _u8(sec)
        counts = np.zeros(1, np.int64)
        n, pos, val = _grow(lambda p, v, c: lib.lp_line_fields(_p(b), len(b), _p(p), _p(v), c,
                                                               _p(counts)), len(b) // 64 + 16)
        if n < 0:
            raise DwarfFieldError(f".debug_line: cannot read the unit at offset {-n - 1:#x}")
        self.addresses[".debug_line"] = (pos, val)

    def _aranges(self, lib):
        sec = self.sec.get(".debug_aranges")
        if sec is None:
            return
        b = _u8(sec)
        _, pos, val = _grow(lambda p, v, c: lib.lp_aranges_fields(_p(b), len(b), _p(p), _p(v), c),
                            len(b) // 16 + 1)
        self.addresses[".debug_aranges"] = (pos, val)

    def _frame(self, lib):
        sec = self.sec.get(".debug_frame")
        if sec is None:
            return
        b = _u8(sec)
        counts = np.zeros(2, np.int64)
        _, pos, val = _grow(lambda p, v, c: lib.lp_frame_fields(_p(b), len(b), _p(p), _p(v), c,
                                                                _p(counts)), len(b) // 24 + 16)
        if counts[1]:
            raise DwarfFieldError(f".debug_frame: {int(counts[1])} entries whose instructions "
                                  "the field scan cannot read")
        self.addresses[".debug_frame"] = (pos, val)
        self.stats["fdes"] = int(counts[0])

    def _addr(self):
        """.debug_addr holds addresses only: every entry of every contribution."""
        sec = self.sec.get(".debug_addr")
        if sec is None:
            return
        pos = []
        p = 0
        while p + 8 <= len(sec):
            ln, q = enc.u(sec, p, 4), p + 4
            if ln == 0xFFFFFFFF:
                ln, q = enc.u(sec, p + 4, 8), p + 12
            end = min(q + ln, len(sec))
            asz = sec[q + 2] if q + 4 <= end else 0      # version, address size, segment size
            if asz == 8:
                pos.append(np.arange(q + 4, end - 7, 8, dtype=np.int64))
            p = end
        pos = np.concatenate(pos) if pos else np.zeros(0, np.int64)
        self.addresses[".debug_addr"] = (pos, words8(sec)[pos])

    def drop_addresses(self):
        """Forget the address fields (16 bytes a field) once they are applied;
        the references stay."""
        self.addresses = {}

    # -- the relocation-shaped arrays --------------------------------------------
    def of_type(self, name, rtype, sections):
        """(field offsets uint64, section index int64 of what each points at) of
        section ``name``'s fields of relocation type ``rtype``, as the link
        relocations give them: an address field's index is the allocated
        section holding its value (len(sections) when none does); a reference's
        the section it points into."""
        if rtype == R_X86_64_64:
            pos, val = self.addresses.get(name, (np.zeros(0, np.int64), np.zeros(0, np.uint64)))
            # one field per place (as one relocation per field): a list two
            # attributes reach is read twice
            if len(pos) > 1 and not (pos[1:] > pos[:-1]).all():   # else unique already
                pos, first = np.unique(pos, return_index=True)
                val = val[first]
            return pos.astype(np.uint64), holder_sections(sections, val)
        if rtype == R_X86_64_32 and name == ".debug_info":
            rpos, _, target = self.refs
            idx = {s.name: s.index for s in sections if s.size}
            of_code = np.array([idx.get(t, len(sections)) for t in REF_TARGETS], np.int64)
            return rpos.astype(np.uint64), of_code[target]
        return np.zeros(0, np.uint64), np.zeros(0, np.int64)


def words8(buf):
    """The 8-byte little-endian word at every byte offset of ``buf`` (a view)."""
    b = _u8(buf)
    return np.ndarray((max(len(b) - 7, 0),), "<u8", buffer=b, strides=(1,))


def holder_sections(sections, values):
    """Index of the allocated section holding each address (its end too: a symbol
    at a section's end), len(sections) when none does. A zero-based section
    (per-CPU data at address 0) holds only what no other section does; a
    kernel's physical address of a symbol (``sym - __START_KERNEL_map``, folded
    into a DW_OP_addr by the compiler) is held by the section of its symbol."""
    out = np.full(len(values), len(sections), np.int64)
    alloc = [s for s in sections if s.is_alloc and s.size]
    # sections at address 0 first, so that a section at its real address wins
    for s in sorted(alloc, key=lambda s: (s.addr != 0, s.addr)):
        m = (values >= np.uint64(s.addr)) & (values <= np.uint64(s.addr + s.size))
        out[m] = s.index
    phys = (out == len(sections)) & (values < np.uint64(1 << 32))
    if phys.any():
        virt = values[phys] + np.uint64(START_KERNEL_MAP)
        got = np.full(len(virt), len(sections), np.int64)
        for s in alloc:
            if s.addr >= START_KERNEL_MAP:
                got[(virt >= np.uint64(s.addr)) & (virt <= np.uint64(s.addr + s.size))] = s.index
        out[phys] = got
    return out


def has_debug_relocations(image):
    """Does the image carry the link's relocations of .debug_info?"""
    rel = image.relocations.get(".debug_info")
    return rel is not None and len(rel) > 0


class RelocationFields:
    """The fields as the link relocated them (.rela.debug_*): R_X86_64_64 and
    R_X86_64_32 rows of each section, with their symbols' section indices."""

    def __init__(self, image):
        self.image = image
        self._typed = {}

    def of_type(self, name, rtype, sections):
        rel = self.image.relocations.get(name)
        if rel is None or rel.section is None:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        hit = self._typed.get(name)
        if hit is None:
            hit = self._typed[name] = self._read(rel)
        return hit[rtype]

    def _read(self, rel):
        """The rows are read in chunks from the file (a kernel's .rela.debug_info
        has 10 M: through the mapping they would all stay resident, with their
        split-out type and symbol arrays)."""
        from ..image.elf import RELA
        image = self.image
        shndx_of = image.symtab["shndx"]
        sec = rel.section
        path = getattr(image, "path", None)
        step = RELA.itemsize << 20
        types = (R_X86_64_64, R_X86_64_32)          # both read in one pass
        offs, idx = {t: [] for t in types}, {t: [] for t in types}
        f = open(path, "rb") if path and type(image).__name__ == "ElfImage" else None
        try:
            for a in range(0, sec.size, step):
                n = min(step, sec.size - a)
                data = os.pread(f.fileno(), n, sec.offset + a) if f is not None else None
                if data is None or len(data) != n:
                    data = bytes(image.section_bytes(sec)[a:a + n])
                rows = np.frombuffer(data, RELA)
                info = rows["info"]
                for t in types:
                    m = (info & 0xFFFFFFFF) == t
                    offs[t].append(rows["offset"][m])
                    idx[t].append(shndx_of[(info[m] >> 32).astype(np.int64)].astype(np.int64))
        finally:
            if f is not None:
                f.close()
        return {t: (np.concatenate(offs[t]) if offs[t] else np.zeros(0, np.uint64),
                    np.concatenate(idx[t]) if idx[t] else np.zeros(0, np.int64)) for t in types}


def image_sections(image, names=FIELD_SECTIONS + (".debug_abbrev",)):
    """{name: bytes} of the image's DWARF sections (read from the file)."""
    out = {}
    for s in image.sections:
        if s.name in names and s.size and s.type != 8:
            out[s.name] = read_section(image, s)
    return out


LIST_TARGETS = (".debug_rnglists", ".debug_ranges", ".debug_loclists", ".debug_loc")


def compare_with_relocations(image, parsed=None, examples=5):
    """Parsed fields against the link relocations of an image that keeps them,
    by section: for address fields, the R_X86_64_64 rows whose symbol lies in
    an allocated section; for .debug_info's list references, its R_X86_64_32
    rows into the list sections. {section: {relocated, parsed, missing, extra,
    missing_examples, extra_examples}} (offsets in hex)."""
    sections = image.sections
    if parsed is None:
        parsed = ParsedFields(image_sections(image))
    relocs = RelocationFields(image)
    alloc = np.array([bool(s.is_alloc) for s in sections] + [False], bool)
    out = {}

    def row(key, truth, got, words=None):
        truth, got = np.unique(truth.astype(np.int64)), np.unique(got.astype(np.int64))
        miss = np.setdiff1d(truth, got, assume_unique=True)
        extra = np.setdiff1d(got, truth, assume_unique=True)
        # a field of value 0 with no relocation: code the link discarded (ld
        # wrote 0 and made the relocation R_X86_64_NONE); 0 stays 0 in any layout
        zero = int((words[extra] == 0).sum()) if words is not None and len(extra) else 0
        out[key] = {"relocated": int(len(truth)), "parsed": int(len(got)),
                    "missing": int(len(miss)), "extra": int(len(extra)),
                    "extra_value_0": zero,
                    "missing_examples": [hex(x) for x in miss[:examples].tolist()],
                    "extra_examples": [hex(x) for x in extra[:examples].tolist()]}

    for name in FIELD_SECTIONS:
        if image.relocations.get(name) is None and name not in parsed.addresses:
            continue
        off, shndx = relocs.of_type(name, R_X86_64_64, sections)
        shndx = np.where(shndx < len(sections), shndx, len(sections))
        got, gsh = parsed.of_type(name, R_X86_64_64, sections)
        row(name, off[alloc[shndx]], got[alloc[gsh]], words8(parsed.sec[name]))
    off, shndx = relocs.of_type(".debug_info", R_X86_64_32, sections)
    poff, pshndx = parsed.of_type(".debug_info", R_X86_64_32, sections)
    for t in LIST_TARGETS:
        s = next((x for x in sections if x.name == t and x.size), None)
        if s is not None:
            row(f".debug_info -> {t}", off[shndx == s.index], poff[pshndx == s.index])
    return out
