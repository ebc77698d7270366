"""``.eh_frame`` and ``.eh_frame_hdr`` of a userspace executable after relayout.

The unwinder (libgcc's ``_Unwind_Find_FDE`` through ``dl_iterate_phdr`` and
PT_GNU_EH_FRAME) finds a function's FDE with a binary search in the
``.eh_frame_hdr`` table, then checks ``pc_begin <= pc < pc_begin + pc_range``
of that FDE. After functions move, both must describe the new addresses:

- every FDE's ``pc_begin`` is mapped through the AddressMap; ``pc_range`` stays
  (whole units move; a range that would straddle two pieces is refused);
- the CFA program (``DW_CFA_advance_loc``) and the LSDA call-site tables in
  ``.gcc_except_table`` are relative to the function start: unchanged;
- the ``.eh_frame_hdr`` search table (``{initial_loc, fde}`` pairs, datarel
  sdata4 relative to the header) is rebuilt and sorted by the new locations.

Pointer encodings come from each CIE's augmentation (``zR``, ``zPLR``, ...).
Supported: absptr, udata4/sdata4, udata8/sdata8, each plain or pcrel, and
omit. Anything else (uleb128 pointers, textrel, funcrel, aligned, indirect
``pc_begin``, unknown augmentation letters) is refused with a BadInput
(exit 2), never guessed at.

The relocation pass may already have translated ``pc_begin`` through
``.rela.eh_frame`` (``--emit-relocs``); this module recomputes every field
from the original bytes and writes the same value, so it does not depend on
those relocations being complete (the linker edits ``.eh_frame``: CIE merging,
dropped FDEs).
"""

import functools
import struct

import numpy as np

from ...errors import BadInput
from ...leb128 import read_sleb, read_uleb

DW_EH_PE_absptr = 0x00
DW_EH_PE_omit = 0xFF
DW_EH_PE_uleb128, DW_EH_PE_udata2, DW_EH_PE_udata4, DW_EH_PE_udata8 = 0x01, 0x02, 0x03, 0x04
DW_EH_PE_sleb128, DW_EH_PE_sdata2, DW_EH_PE_sdata4, DW_EH_PE_sdata8 = 0x09, 0x0A, 0x0B, 0x0C
DW_EH_PE_pcrel, DW_EH_PE_textrel, DW_EH_PE_datarel = 0x10, 0x20, 0x30
DW_EH_PE_funcrel, DW_EH_PE_aligned, DW_EH_PE_indirect = 0x40, 0x50, 0x80

# value format -> (struct format, size)
_FORMATS = {DW_EH_PE_absptr: ("<Q", 8), DW_EH_PE_udata4: ("<I", 4), DW_EH_PE_sdata4: ("<i", 4),
            DW_EH_PE_udata8: ("<Q", 8), DW_EH_PE_sdata8: ("<q", 8),
            DW_EH_PE_udata2: ("<H", 2), DW_EH_PE_sdata2: ("<h", 2)}
_MASK = (1 << 64) - 1


class EhFrameError(BadInput):
    """An .eh_frame this module cannot keep true (exit 2)."""


_uleb = functools.partial(read_uleb, exc=EhFrameError, what="LEB128 in .eh_frame")
_sleb = functools.partial(read_sleb, exc=EhFrameError, what="LEB128 in .eh_frame")


def _check_enc(enc, what, where, allow_indirect=False):
    if enc == DW_EH_PE_omit:
        return
    app, fmt, ind = enc & 0x70, enc & 0x0F, enc & 0x80
    if fmt not in _FORMATS or app not in (0, DW_EH_PE_pcrel) or (ind and not allow_indirect):
        raise EhFrameError(f".eh_frame {where}: {what} pointer encoding {enc:#04x} is not "
                           "supported (linepack handles absptr/udata4/sdata4/udata8/sdata8, "
                           "plain or pcrel); relayout refused")


def _read_ptr(data, pos, enc, sec_addr):
    """(target, raw value, field size) of an encoded pointer at data[pos]."""
    fmt, size = _FORMATS[enc & 0x0F]
    raw = struct.unpack_from(fmt, data, pos)[0]
    t = raw
    if enc & 0x70 == DW_EH_PE_pcrel:
        t = sec_addr + pos + raw
    return t & _MASK, raw, size


class Cie:
    __slots__ = ("offset", "augmentation", "fde_enc", "lsda_enc", "personality_enc",
                 "personality", "personality_field", "signal")

    def __init__(self, offset):
        self.offset = offset
        self.augmentation = ""
        self.fde_enc = DW_EH_PE_absptr
        self.lsda_enc = DW_EH_PE_omit
        self.personality_enc = DW_EH_PE_omit
        self.personality = None
        self.personality_field = None
        self.signal = False


class EhFrame:
    """Parsed ``.eh_frame``: CIEs by offset and FDE arrays (numpy)."""

    def __init__(self, addr, cies, fde_off, fde_field, fde_enc, pc_begin, pc_range, lsda):
        self.addr = addr
        self.cies = cies
        self.fde_off = np.asarray(fde_off, np.int64)        # offset of the FDE record
        self.fde_field = np.asarray(fde_field, np.int64)    # offset of its pc_begin field
        self.fde_enc = np.asarray(fde_enc, np.int64)
        self.pc_begin = np.asarray(pc_begin, np.uint64)
        self.pc_range = np.asarray(pc_range, np.uint64)
        self.lsda = np.asarray(lsda, np.uint64)             # 0 where none

    def __len__(self):
        return len(self.fde_off)


_PARSED = []                # the last few (addr, bytes, EhFrame): see parse_eh_frame
_PARSED_KEEP = 4


def parse_eh_frame(data, addr):
    """Parse the bytes of an ``.eh_frame`` section mapped at ``addr``.

    The same section is asked for by several checks of one command (verify: the
    standalone tables, the FDE multiset, the split functions' unwind states, the
    PIE's pointers; each image's), so the last few results are kept and handed out
    again for equal bytes: callers read the result, none changes it (its arrays
    are read-only)."""
    data = bytes(data)
    for k, (a, d, eh) in enumerate(_PARSED):
        if a == addr and d == data:
            return eh
    eh = _parse_eh_frame(data, addr)
    for arr in (eh.fde_off, eh.fde_field, eh.fde_enc, eh.pc_begin, eh.pc_range, eh.lsda):
        arr.flags.writeable = False
    _PARSED.insert(0, (addr, data, eh))
    del _PARSED[_PARSED_KEEP:]
    return eh


def _parse_eh_frame(data, addr):
    cies = {}
    fo, ff, fe, pb, pr, ls = [], [], [], [], [], []
    pos = 0
    n = len(data)
    while pos + 4 <= n:
        start = pos
        length = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        if length == 0:               # terminator (crtend.o's zero word)
            continue
        if length == 0xFFFFFFFF:
            if pos + 8 > n:
                raise EhFrameError(f".eh_frame at {addr + start:#x}: truncated 64-bit length")
            length = struct.unpack_from("<Q", data, pos)[0]
            pos += 8
        end = pos + length
        if end > n:
            raise EhFrameError(f".eh_frame at {addr + start:#x}: record runs past the section")
        id_pos = pos
        cie_id = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        if cie_id == 0:
            cies[start] = _parse_cie(data, start, pos, end, addr)
        else:
            cie_off = id_pos - cie_id
            cie = cies.get(cie_off)
            if cie is None:
                raise EhFrameError(f".eh_frame FDE at {addr + start:#x}: no CIE at offset "
                                   f"{cie_off:#x}")
            enc = cie.fde_enc
            where = f"FDE at {addr + start:#x}"
            begin, _, size = _read_ptr(data, pos, enc, addr)
            field = pos
            pos += size
            fmt, rsize = _FORMATS[enc & 0x0F]
            rng = struct.unpack_from(fmt, data, pos)[0] & _MASK
            pos += rsize
            lsda = 0
            if "z" in cie.augmentation:
                alen, pos = _uleb(data, pos)
                if cie.lsda_enc != DW_EH_PE_omit and alen:
                    lsda, _, _ = _read_ptr(data, pos, cie.lsda_enc, addr)
                    if cie.lsda_enc & DW_EH_PE_indirect:
                        raise EhFrameError(f".eh_frame {where}: indirect LSDA pointer is not "
                                           "supported; relayout refused")
            fo.append(start)
            ff.append(field)
            fe.append(enc)
            pb.append(begin)
            pr.append(rng)
            ls.append(lsda)
        pos = end
    return EhFrame(addr, cies, fo, ff, fe, pb, pr, ls)


def _parse_cie(data, start, pos, end, addr):
    where = f"CIE at {addr + start:#x}"
    cie = Cie(start)
    version = data[pos]
    pos += 1
    if version not in (1, 3):
        raise EhFrameError(f".eh_frame {where}: version {version} is not supported")
    z = data.index(b"\0", pos)
    aug = data[pos:z].decode("ascii", "replace")
    pos = z + 1
    cie.augmentation = aug
    if aug and not aug.startswith("z"):
        raise EhFrameError(f".eh_frame {where}: augmentation '{aug}' is not supported; "
                           "relayout refused")
    _, pos = _uleb(data, pos)        # code alignment
    _, pos = _sleb(data, pos)        # data alignment
    if version == 1:
        pos += 1
    else:
        _, pos = _uleb(data, pos)
    if aug.startswith("z"):
        alen, pos = _uleb(data, pos)
        aend = pos + alen
        for ch in aug[1:]:
            if ch == "R":
                cie.fde_enc = data[pos]
                pos += 1
                _check_enc(cie.fde_enc, "FDE", where)
                if cie.fde_enc == DW_EH_PE_omit:
                    raise EhFrameError(f".eh_frame {where}: FDE encoding 'omit'")
            elif ch == "L":
                cie.lsda_enc = data[pos]
                pos += 1
                _check_enc(cie.lsda_enc, "LSDA", where, allow_indirect=True)
            elif ch == "P":
                cie.personality_enc = data[pos]
                pos += 1
                _check_enc(cie.personality_enc, "personality", where, allow_indirect=True)
                cie.personality_field = pos
                cie.personality, _, size = _read_ptr(data, pos, cie.personality_enc, addr)
                pos += size
            elif ch == "S":
                cie.signal = True
            elif ch == "B":
                pass
            else:
                raise EhFrameError(f".eh_frame {where}: augmentation letter '{ch}' in "
                                   f"'{aug}' is not supported; relayout refused")
        if pos > aend:
            raise EhFrameError(f".eh_frame {where}: augmentation data overflows")
    if cie.fde_enc != DW_EH_PE_omit:
        _check_enc(cie.fde_enc, "FDE", where)
    return cie


class EhFrameHdr:
    """Parsed ``.eh_frame_hdr`` (version 1)."""

    def __init__(self, data, addr):
        data = bytes(data)
        self.addr = addr
        if len(data) < 4 or data[0] != 1:
            raise EhFrameError(f".eh_frame_hdr at {addr:#x}: version "
                               f"{data[0] if data else '?'} is not supported")
        self.ptr_enc, self.count_enc, self.table_enc = data[1], data[2], data[3]
        pos = 4
        for enc, what in ((self.ptr_enc, "eh_frame_ptr"), (self.count_enc, "fde_count")):
            if enc == DW_EH_PE_omit or (enc & 0x0F) not in _FORMATS or \
                    (enc & 0x70) not in (0, DW_EH_PE_pcrel, DW_EH_PE_datarel):
                raise EhFrameError(f".eh_frame_hdr: {what} encoding {enc:#04x} is not supported")
        fmt, size = _FORMATS[self.ptr_enc & 0x0F]
        raw = struct.unpack_from(fmt, data, pos)[0]
        base = addr + pos if self.ptr_enc & 0x70 == DW_EH_PE_pcrel else \
            addr if self.ptr_enc & 0x70 == DW_EH_PE_datarel else 0
        self.eh_frame_ptr = (base + raw) & _MASK
        pos += size
        fmt, size = _FORMATS[self.count_enc & 0x0F]
        self.count = struct.unpack_from(fmt, data, pos)[0]
        pos += size
        self.table_off = pos
        self.loc = self.fde = None
        if self.table_enc == DW_EH_PE_omit:
            return
        if self.table_enc != (DW_EH_PE_datarel | DW_EH_PE_sdata4):
            raise EhFrameError(f".eh_frame_hdr: table encoding {self.table_enc:#04x} is not "
                               "supported (expected datarel|sdata4, 0x3b)")
        need = pos + 8 * self.count
        if need > len(data):
            raise EhFrameError(f".eh_frame_hdr: table of {self.count} entries runs past the section")
        t = np.frombuffer(data, "<i4", 2 * self.count, pos).reshape(-1, 2).astype(np.int64)
        self.loc = (t[:, 0] + addr).astype(np.uint64)
        self.fde = (t[:, 1] + addr).astype(np.uint64)


def _write(buf, off, fmt, value):
    buf[off:off + struct.calcsize(fmt)] = np.frombuffer(struct.pack(fmt, value), np.uint8)


def _pack_ptr(value, enc, field_addr):
    fmt, size = _FORMATS[enc & 0x0F]
    v = value - field_addr if enc & 0x70 == DW_EH_PE_pcrel else value
    lim_lo, lim_hi = (-(1 << (8 * size - 1)), 1 << (8 * size - 1)) if fmt[1].islower() else \
        (0, 1 << (8 * size))
    if not lim_lo <= v < lim_hi:
        raise EhFrameError(f".eh_frame: new pointer {value:#x} does not fit encoding {enc:#04x}")
    return struct.pack(fmt, v)


def update_eh_frame(rw, log=None):
    """Rewrite ``.eh_frame`` FDE starts and the ``.eh_frame_hdr`` table in the
    rewriter's patched sections. Returns a stats dict ({} when there is none)."""
    log = log or (lambda m: None)
    image, amap = rw.image, rw.amap
    sec = image.section(".eh_frame")
    if sec is None or not sec.size or rw.plan.is_identity():
        return {}
    if amap.in_extent(np.array([sec.addr], np.uint64))[0]:
        raise EhFrameError(".eh_frame lies inside rewritten code")
    old = image.section_bytes(sec)
    eh = parse_eh_frame(old, sec.addr)
    new_begin, ok = amap.map(eh.pc_begin)
    if not ok.all():
        i = int(np.nonzero(~ok)[0][0])
        raise EhFrameError(f".eh_frame FDE at {sec.addr + int(eh.fde_off[i]):#x}: pc_begin "
                           f"{int(eh.pc_begin[i]):#x} is in padding the layout drops")
    # Whole pieces move: the last byte of each range must move with its first.
    nz = eh.pc_range > 0
    last = eh.pc_begin + eh.pc_range - np.uint64(1)
    new_last, ok_last = amap.map(last)
    split = nz & (~ok_last | (new_last != new_begin + eh.pc_range - np.uint64(1)))
    if split.any():
        i = int(np.nonzero(split)[0][0])
        raise EhFrameError(f".eh_frame FDE {int(eh.pc_begin[i]):#x}+{int(eh.pc_range[i]):#x} "
                           f"spans code the layout separates ({int(split.sum())} such FDEs); "
                           "relayout refused")
    for what, addrs in (("LSDA", eh.lsda[eh.lsda != 0]),
                        ("personality", np.array([c.personality for c in eh.cies.values()
                                                  if c.personality is not None
                                                  and not c.personality_enc & DW_EH_PE_indirect],
                                                 np.uint64))):
        if len(addrs) and amap.in_extent(addrs).any():
            moved = amap.moved(addrs)
            if moved.any():
                raise EhFrameError(f".eh_frame: {what} pointer into moved code is not supported")
    buf = rw.buf(sec)
    changed = 0
    for i in np.nonzero(new_begin != eh.pc_begin)[0].tolist():
        f = int(eh.fde_field[i])
        b = _pack_ptr(int(new_begin[i]), int(eh.fde_enc[i]), sec.addr + f)
        buf[f:f + len(b)] = np.frombuffer(b, np.uint8)
        changed += 1
    # Write unchanged ones too if the relocation pass touched them (it should agree).
    same = np.nonzero(new_begin == eh.pc_begin)[0]
    for i in same.tolist():
        f = int(eh.fde_field[i])
        b = _pack_ptr(int(eh.pc_begin[i]), int(eh.fde_enc[i]), sec.addr + f)
        buf[f:f + len(b)] = np.frombuffer(b, np.uint8)
    stats = {"eh_frame.fdes": int(len(eh)), "eh_frame.fdes_moved": changed,
             "eh_frame.cies": len(eh.cies)}
    hsec = image.section(".eh_frame_hdr")
    if hsec is not None and hsec.size:
        hdr = EhFrameHdr(image.section_bytes(hsec), hsec.addr)
        if hdr.eh_frame_ptr != sec.addr:
            raise EhFrameError(f".eh_frame_hdr points at {hdr.eh_frame_ptr:#x}, not at "
                               f".eh_frame ({sec.addr:#x})")
        if hdr.loc is not None:
            by_fde = dict(zip((eh.fde_off + sec.addr).tolist(), range(len(eh))))
            idx = [by_fde.get(a) for a in hdr.fde.tolist()]
            if any(i is None for i in idx):
                raise EhFrameError(".eh_frame_hdr names an FDE that .eh_frame does not have")
            idx = np.array(idx, np.int64)
            if (eh.pc_begin[idx] != hdr.loc).any():
                raise EhFrameError(".eh_frame_hdr disagrees with .eh_frame on an FDE's start")
            loc = new_begin[idx]
            order = np.lexsort((hdr.fde, loc))
            loc, fde = loc[order], hdr.fde[order]
            table = np.empty((len(loc), 2), "<i4")
            table[:, 0] = loc.astype(np.int64) - hsec.addr
            table[:, 1] = fde.astype(np.int64) - hsec.addr
            hbuf = rw.buf(hsec)
            o = hdr.table_off
            hbuf[o:o + table.nbytes] = table.reshape(-1).view(np.uint8)
            stats["eh_frame_hdr.entries"] = int(len(loc))
    rw.stats.update(stats)
    log(f"updated .eh_frame: {changed} of {len(eh)} FDEs moved"
        + (f"; .eh_frame_hdr table re-sorted ({stats['eh_frame_hdr.entries']} entries)"
           if "eh_frame_hdr.entries" in stats else ""))
    return stats


def check_eh_frame(image):
    """Consistency of an image's unwind tables: list of problems (strings).

    Every FDE parses with a supported encoding; the ``.eh_frame_hdr`` table is
    sorted, names every FDE once and agrees with its pc_begin.
    """
    problems = []
    sec = image.section(".eh_frame")
    if sec is None:
        return problems
    eh = parse_eh_frame(image.section_bytes(sec), sec.addr)
    hsec = image.section(".eh_frame_hdr")
    if hsec is not None and hsec.size:
        hdr = EhFrameHdr(image.section_bytes(hsec), hsec.addr)
        if hdr.loc is not None:
            if len(hdr.loc) != len(eh):
                problems.append(f".eh_frame_hdr has {len(hdr.loc)} entries, .eh_frame {len(eh)} FDEs")
            if (np.diff(hdr.loc.astype(np.int64)) < 0).any():
                problems.append(".eh_frame_hdr table is not sorted")
            fde_at = dict(zip((eh.fde_off + sec.addr).tolist(), eh.pc_begin.tolist()))
            bad = [(l, f) for l, f in zip(hdr.loc.tolist(), hdr.fde.tolist())
                   if fde_at.get(f) != l]
            if bad:
                problems.append(f"{len(bad)} .eh_frame_hdr entries disagree with their FDE "
                                f"(first {bad[0][0]:#x})")
    return problems


__all__ = ["EhFrame", "EhFrameHdr", "EhFrameError", "parse_eh_frame", "update_eh_frame",
           "check_eh_frame"]
