"""``.eh_frame`` / ``.eh_frame_hdr`` for block-level (split) userspace layouts.

A split function's code lives in two ranges, so its unwind information needs
two FDEs, as gcc writes for its own ``.cold`` parts:

- the hot part keeps the function's FDE: ``pc_begin`` at the symbol,
  ``pc_range`` the hot part's size, a CFI program rebuilt from the original
  rows (tools/relayout/user/cfi.py): each piece of the part starts with the state the
  original program gave at the piece's original address (an inserted jmp: the
  state at the end of the block it closes), and the original rows inside a
  copied piece follow it;
- the cold part gets a new FDE under the same CIE, built the same way, whose
  first row sets the state in effect at its first original instruction.

The sections are rebuilt whole: CIEs and the FDEs of functions not split are
copied (``pc_begin`` mapped), records are padded to 4 bytes instead of gcc's 8
(the room the new FDEs need), and ``.eh_frame_hdr`` gets one more search-table
entry per cold FDE. In place, where the linker put the two sections decides
(_unwind_layout): GNU ld's header right before ``.eh_frame`` grows into its
start (``.eh_frame`` moves up; its end, with crtend's zero terminator
``__FRAME_END__``, stays); lld's header right after ``.eh_frame`` keeps its end
and grows down into ``.eh_frame``'s end; with a section between them (lld:
``.gcc_except_table``) each keeps its place and size, the header's room (none
as lld sizes it) counted apart. ``PT_GNU_EH_FRAME`` covers the new header.
``.rela.eh_frame`` (--emit-relocs) follows its fields to their new offsets.

Room is decided before placement (a part's CFI program depends only on its
pieces' offsets inside the part): splits are taken in heat order while the new
records and header entries fit the two sections' bytes. When some do not, the
caller may give the sections a new segment (``use_segment``: both are rebuilt
after the moved code there, any size, every split fits); only without one are
the others moved whole with the reason R_EH_ROOM.

A function with an LSDA (``.gcc_except_table`` call-site ranges are per FDE,
relative to its start) gets one new LSDA per part (tools/relayout/user/lsda.py),
stored after the ``.eh_frame_hdr`` search table; both FDEs point at theirs.
An LSDA lsda.py does not rewrite (exception specifications) keeps its function
whole (R_EH_LSDA), as does an FDE that does not cover exactly its function's
range or whose CFI uses an opcode cfi.py does not evaluate (R_EH_FRAME).
"""

import bisect
import struct

import numpy as np

from ...image.elf import RELA, SHT_NOBITS
from .cfi import (CfiError, compact_native, evaluate, evaluate_native, evaluate_with_length,
                  native_cie, native_lib, parse_cie_info, pieces_program_native, rows_for_pieces,
                  write_program)
from .lsda import Lsda, LsdaError, call_sites_for_part, size_bound
from .lsda import encode as lsda_encode
from .eh_frame import (DW_EH_PE_omit, DW_EH_PE_pcrel, EhFrameError, EhFrameHdr, _FORMATS,
                       _pack_ptr, _read_ptr, _uleb, parse_eh_frame)

RECORD_ALIGN = 4
HDR_HEAD = 12       # version, 3 encodings, eh_frame_ptr (sdata4), fde_count (udata4)

# where the two sections are, for a rebuild in place (_unwind_layout)
HDR_FIRST = "hdr_first"     # GNU ld: .eh_frame_hdr right before .eh_frame
EH_FIRST = "eh_first"       # .eh_frame right before .eh_frame_hdr
APART = "apart"             # another section between them (lld: .gcc_except_table)


def _unwind_layout(image, hsec, sec):
    """HDR_FIRST or EH_FIRST when the two sections share their bytes (nothing
    but padding between them), else APART."""
    lo, hi = (hsec, sec) if hsec.addr < sec.addr else (sec, hsec)
    if lo.end > hi.addr:
        raise EhFrameError(".eh_frame and .eh_frame_hdr overlap")
    between = [s for s in image.sections
               if s.is_alloc and s.size and s.type != SHT_NOBITS and s.index not in
               (hsec.index, sec.index) and s.addr < hi.addr and s.end > lo.end]
    if between:
        return APART
    return HDR_FIRST if lo is hsec else EH_FIRST


class Record:
    __slots__ = ("start", "end", "is_cie", "cie", "field", "enc", "pc_begin", "pc_range",
                 "aug", "prog", "prog_off", "lsda")


def _records(data, addr, eh):
    """Every CIE and FDE of ``data`` in order (eh: parse_eh_frame of it)."""
    out = []
    pos = 0
    n = len(data)
    fde_at = {int(o): i for i, o in enumerate(eh.fde_off.tolist())}
    while pos + 4 <= n:
        start = pos
        length = struct.unpack_from("<I", data, pos)[0]
        if length == 0:
            pos += 4
            continue
        if length == 0xFFFFFFFF:
            raise EhFrameError(".eh_frame: 64-bit records are not supported by block splitting")
        end = pos + 4 + length
        r = Record()
        r.start, r.end = start, end
        cie_id = struct.unpack_from("<I", data, pos + 4)[0]
        r.is_cie = cie_id == 0
        if r.is_cie:
            r.cie = start
        else:
            i = fde_at[start]
            r.cie = pos + 4 - cie_id
            c = eh.cies[r.cie]
            r.field = int(eh.fde_field[i])
            r.enc = c.fde_enc
            r.pc_begin, r.pc_range = int(eh.pc_begin[i]), int(eh.pc_range[i])
            r.lsda = int(eh.lsda[i])
            p = r.field + 2 * _FORMATS[r.enc & 0x0F][1]
            a0 = p
            if "z" in c.augmentation:
                alen, p = _uleb(data, p)
                p += alen
            r.aug = bytes(data[a0:p])
            r.prog_off = p
            r.prog = bytes(data[p:end])
        out.append(r)
        pos = end
    return out


def _compact(prog, info):
    """(program, its rows): the shorter of ``prog`` without its trailing DW_CFA_nop
    padding and the program cfi.py writes for the same rows (redundant instructions
    dropped), checked to give the same rows; ``prog`` itself when it cannot be
    evaluated. The rows are what ``evaluate`` gives for the program returned, when
    this evaluation made them (else None: reason() evaluates it)."""
    if info is None:
        return prog, None
    try:
        rows, used = evaluate_with_length(prog, info, info.init_state)
        trimmed = prog[:used]
        canon = write_program(rows, info)
        if len(canon) < len(trimmed):
            canon_rows = evaluate(canon, info, info.init_state)
            if _same_rows(canon_rows, rows):
                return canon, canon_rows
        return trimmed, (rows if used == len(prog) else None)
    except (CfiError, IndexError, struct.error):
        return prog, None


def _same_rows(a, b):
    """Equal row tables, ignoring a trailing row past the last state change."""
    def norm(rows):
        out = []
        for loc, st in rows:
            if out and out[-1][1] == st:
                continue
            out.append((loc, st))
        return out
    return norm(a) == norm(b)


def _pad(n):
    return (n + RECORD_ALIGN - 1) // RECORD_ALIGN * RECORD_ALIGN


def _fde_size(enc, aug, prog):
    return _pad(4 + 4 + 2 * _FORMATS[enc & 0x0F][1] + len(aug) + len(prog))


class EhSplit:
    """Parsed unwind sections of a userspace image, for splitting."""

    def __init__(self, image, compact=True):
        """``compact``: programs compacted (what a rebuild writes) and the room that frees
        counted; verify reads the original programs as they are, and needs neither."""
        self.image = image
        self.sec = image.section(".eh_frame")
        self.hsec = image.section(".eh_frame_hdr")
        data = bytes(image.section_bytes(self.sec))
        self.eh = parse_eh_frame(data, self.sec.addr)
        self.records = _records(data, self.sec.addr, self.eh)
        self.cie_info = {}
        for r in self.records:
            if r.is_cie:
                try:
                    self.cie_info[r.start] = parse_cie_info(data, r.start, r.start + 4)
                except (CfiError, IndexError, struct.error):
                    self.cie_info[r.start] = None
        self.fdes = [r for r in self.records if not r.is_cie]
        self.by_begin = {}
        for r in self.fdes:
            if r.pc_range:
                self.by_begin.setdefault(r.pc_begin, []).append(r)
        hdr = EhFrameHdr(image.section_bytes(self.hsec), self.hsec.addr) if self.hsec else None
        if hdr is None or hdr.loc is None:
            raise EhFrameError(".eh_frame_hdr with a search table is needed to split functions")
        self.layout = _unwind_layout(image, self.hsec, self.sec)
        self.hdr = hdr
        self.end = self.sec.addr + self.sec.size
        self._evaluated = {}      # FDE offset -> rows of its program, from _compact
        self.native_rows = {}     # function start -> its rows as cfi.c rows (reason)
        self._native = None       # FDE offset -> cfi.c rows of every plain FDE (first use)
        if compact:
            infos = [self.cie_info.get(r.cie) for r in self.fdes]
            done = compact_native([r.prog for r in self.fdes], infos) or [None] * len(infos)
            for r, info, prog in zip(self.fdes, infos, done):
                if prog is not None:        # the C core's: the bytes _compact gives
                    r.prog = prog
                    continue
                r.prog, rows = _compact(r.prog, info)
                if rows is not None:
                    self._evaluated[r.start] = rows
        size = sum(_pad(r.end - r.start) if r.is_cie else _fde_size(r.enc, r.aug, r.prog)
                   for r in self.records)
        # room in place (``accept``): one budget where the two sections share their
        # bytes; each its own where they are apart (.eh_frame: records; the header:
        # search-table entries and part LSDAs)
        n = len(self.fdes)
        self.hdr_free = None
        if self.layout == HDR_FIRST:
            self.free = self.end - self._eh_start(n) - size - 4
        elif self.layout == EH_FIRST:
            self.free = self._hdr_start(n, 0) - self.sec.addr - size - 4
        else:
            self.free = self.sec.size - size - 4
            self.hdr_free = self.hsec.size - HDR_HEAD - 8 * n
        self.rows = {}
        self.lsda, self.lsda_refused = {}, {}
        self._begins = np.sort(np.array([r.pc_begin for r in self.fdes if r.pc_range], np.uint64))
        self._begins_list = None
        self._costs = {}          # (id(split), start) -> (split, cost): see accept
        self.segment = None

    def use_segment(self, segment):
        """Rebuild both sections in a new segment (relayout/user/segment.py), where
        they may grow: every split fits."""
        self.segment = segment
        self.free = float("inf")
        self.hdr_free = None

    def _eh_start(self, n):
        """Where .eh_frame starts after a header with ``n`` table entries."""
        return (self.hsec.addr + HDR_HEAD + 8 * n + 7) // 8 * 8

    def _hdr_start(self, n, lsda_bytes):
        """EH_FIRST: where a header with ``n`` table entries and ``lsda_bytes`` of part
        LSDAs starts when it keeps its end (.eh_frame, before it, keeps its start)."""
        return (self.hsec.addr + self.hsec.size - HDR_HEAD - 8 * n - lsda_bytes) // 8 * 8

    def fde_containing(self, addr):
        # bisect on a list: called per block-map piece, where numpy's per-call cost dominates
        if self._begins_list is None:
            self._begins_list = self._begins.tolist()
        i = bisect.bisect_right(self._begins_list, addr) - 1
        if i < 0:
            return None
        for r in self.by_begin.get(int(self._begins[i]), []):
            if r.pc_begin <= addr < r.pc_begin + r.pc_range:
                return r
        return None

    def rows_of(self, r):
        rows = self.rows.get(r.pc_begin)
        if rows is None:
            info = self.cie_info[r.cie]
            rows = self.rows[r.pc_begin] = evaluate(r.prog, info, info.init_state)
        return rows

    def _native_rows_of(self, r):
        """FDE ``r``'s rows as cfi.c rows, or None (no C core, not plain). Every FDE
        whose CIE is plain is evaluated at the first call: one call, not one each."""
        if self._native is None:
            self._native = {}
            if native_lib() is not None:
                fdes = [f for f in self.fdes if self.cie_info.get(f.cie) is not None]
                infos = [self.cie_info[f.cie] for f in fdes]
                plain = [native_cie(i) is not None for i in infos]
                fdes = [f for f, ok in zip(fdes, plain) if ok]
                got = evaluate_native([f.prog for f in fdes],
                                      [i for i, ok in zip(infos, plain) if ok], partial=True)
                if got is not None:
                    rows, first, count = got
                    for f, a, n in zip(fdes, first.tolist(), count.tolist()):
                        if n >= 0:
                            self._native[f.start] = rows[a:a + n]
        return self._native.get(r.start)

    def reason(self, start, end):
        """None if the function [start, end) can be split, else a reason code."""
        from ...image.cfg import R_EH_FRAME, R_EH_LSDA
        fd = self.by_begin.get(start, [])
        lo = int(np.searchsorted(self._begins, start, side="right"))
        inside = lo < len(self._begins) and int(self._begins[lo]) < end
        if not fd and not inside:
            return None
        if len(fd) != 1 or inside or fd[0].pc_begin + fd[0].pc_range != end:
            return R_EH_FRAME
        r = fd[0]
        c = self.eh.cies[r.cie]
        if c.lsda_enc != DW_EH_PE_omit and len(r.aug) > 1 and r.lsda:
            try:
                self.lsda[start] = Lsda(self.image, r.lsda, start)
            except (LsdaError, struct.error, IndexError) as e:
                self.lsda_refused[start] = str(e)
                return R_EH_LSDA
        info = self.cie_info.get(r.cie)
        if info is None:
            return R_EH_FRAME
        rows = self._evaluated.pop(r.start, None)
        if rows is None:
            got = self._native_rows_of(r)
            if got is not None:             # plain: programs() writes its parts in C
                self.native_rows[start] = got
                return None
        if rows is None:
            try:
                rows = evaluate(r.prog, info, info.init_state)
            except (CfiError, IndexError, struct.error):
                return R_EH_FRAME
        self.rows[start] = rows
        return None

    def programs(self, sf, base):
        """(hot program, cold program) of split function ``sf`` (unit at ``base``)."""
        from ..blocks import COPY, INSERTED, REMOVED
        r = self.by_begin[base][0]
        info = self.cie_info[r.cie]
        native = self.native_rows.get(base)
        out = []
        for part in (0, 1):
            flat = []               # (new offset, old offset, old length, copied, state offset)
            for p in sf.parts[part]:
                kind = p.kind
                if kind == REMOVED:
                    continue
                o = p.old - base
                flat += (p.off, o, p.old_len, kind == COPY, o - 1 if kind == INSERTED else o)
            prog = pieces_program_native(native, flat, info) if native is not None else None
            if prog is None:
                pieces = [tuple(flat[k:k + 5]) for k in range(0, len(flat), 5)]
                prog = write_program(rows_for_pieces(self.rows_of(r), pieces), info)
            out.append(prog)
        return out

    def cost(self, sf, base):
        """Bytes the split of ``sf`` adds to the two sections."""
        from ..blocks import COPY
        if base not in self.by_begin:
            return 0, None, 0
        r = self.by_begin[base][0]
        hot, cold = self.programs(sf, base)
        old = _fde_size(r.enc, r.aug, r.prog)     # as counted in ``free`` (compacted)
        extra = 0
        ls = self.lsda.get(base)
        parts = (0, 1) if sf.parts[1] else (0,)   # a function reordered whole: one part
        if ls is not None:                        # one new LSDA per part (bounded size)
            for part in parts:
                pieces = [(p.old, p.old_len, p.off) for p in sf.parts[part] if p.kind == COPY]
                extra += size_bound(ls, len(call_sites_for_part(ls, pieces))) + 8
        # the third: what of it goes to .eh_frame_hdr (part LSDAs, a search-table entry)
        if not sf.parts[1]:
            return _fde_size(r.enc, r.aug, hot) - old + extra, (hot, cold), extra
        return (_fde_size(r.enc, r.aug, hot) + _fde_size(r.enc, r.aug, cold) - old + 8 + extra,
                (hot, cold), 8 + extra)

    def accept(self, splits, starts, heat, reason):
        """Keep the splits that fit, hottest first; mark the others R_EH_ROOM."""
        from ...image.cfg import R_EH_ROOM
        free = self.free            # each header entry adds 8: .eh_frame's start stays 8-aligned
        hdr_free = self.hdr_free    # None: the header's bytes are counted in ``free``
        kept = []
        order = sorted(range(len(splits)), key=lambda k: (-float(heat[splits[k].unit]), k))
        for k in order:
            sf = splits[k]
            # a second accept (after the new segment freed the room) reuses the programs
            key = (id(sf), int(starts[sf.unit]))
            if key not in self._costs:
                self._costs[key] = (sf, self.cost(sf, key[1]))
            c, progs, in_hdr = self._costs[key][1]
            if hdr_free is None:
                if c > free:
                    reason[sf.unit] = R_EH_ROOM
                    continue
            else:
                if c - in_hdr > free or in_hdr > hdr_free:
                    reason[sf.unit] = R_EH_ROOM
                    continue
                hdr_free -= in_hdr
                c -= in_hdr
            free -= c
            sf.cfi = progs
            kept.append(k)
        return [splits[k] for k in sorted(kept)]

    def rebuild(self, rw, splits, starts):
        """New bytes and geometry of both sections in ``rw`` (a BlockRewriter
        after run()); returns stats."""
        amap = rw.amap
        by_unit = {int(starts[sf.unit]): sf for sf in splits if getattr(sf, "cfi", None)}
        # every FDE start mapped at once (map is per address; one call, not one per FDE)
        fde_begin = [r.pc_begin for r in self.records if not r.is_cie]
        mapped, mapped_ok = amap.map(np.array(fde_begin, np.uint64))
        mapped = dict(zip(fde_begin, zip(mapped.tolist(), mapped_ok.tolist())))
        recs = []                 # (old record or None, kind, fields)
        for r in self.records:
            if r.is_cie:
                recs.append(("cie", r, None))
                continue
            sf = by_unit.get(r.pc_begin)
            if sf is None:
                nb, ok = mapped[r.pc_begin]
                if not ok:
                    raise EhFrameError(f".eh_frame FDE {r.pc_begin:#x}: in padding the layout drops")
                recs.append(("fde", r, (nb, r.pc_range, r.prog)))
                continue
            hot, cold = sf.cfi
            recs.append(("fde", r, (sf.new_start[0], sf.sizes[0], hot, (sf, 0))))
            if sf.parts[1]:
                recs.append(("cold", r, (sf.new_start[1], sf.sizes[1], cold, (sf, 1))))
        n_fde = sum(1 for k, _, _ in recs if k != "cie")
        # the header's new address: its own, or after the moved code in a new segment
        H = self.hsec.addr
        if self.segment is not None:
            H = self.segment.place_eh(rw.relocated[self.segment.text.index][1])
        elif self.layout == EH_FIRST:
            # in place after .eh_frame: the header keeps its end and grows down; its
            # start depends on the new LSDAs' size, which does not depend on their place
            blob, _ = self._part_lsdas(by_unit, starts, amap, H + HDR_HEAD + 8 * n_fde)
            H = self._hdr_start(n_fde, len(blob))
        # new LSDAs go after the header's search table
        lsda_at = H + HDR_HEAD + 8 * n_fde
        blob, new_lsda = self._part_lsdas(by_unit, starts, amap, lsda_at)
        end = self.end
        if self.segment is not None or self.layout == HDR_FIRST:
            new_addr = (lsda_at + len(blob) + 7) // 8 * 8
            hdr_size = new_addr - H
        elif self.layout == EH_FIRST:           # .eh_frame keeps its start, up to the header
            new_addr, end, hdr_size = self.sec.addr, H, self.hsec.end - H
        else:                                   # apart: each keeps its place and size
            new_addr, hdr_size = self.sec.addr, self.hsec.size
            if lsda_at + len(blob) > H + hdr_size:
                raise EhFrameError(f".eh_frame_hdr: {n_fde} table entries and {len(blob)} "
                                   f"bytes of LSDAs do not fit ({hdr_size} bytes)")
        out = bytearray()
        sec_bytes = bytes(self.image.section_bytes(self.sec))       # read once, not per record
        cie_new = {}
        field_map = []            # (old start, old end, new start) in .eh_frame: relocated fields
        lsda_fields = {}          # new offset of a hot FDE's LSDA pointer -> its new LSDA
        table = []
        for kind, r, f in recs:
            at = len(out)
            if kind == "cie":
                body = bytearray(sec_bytes[r.start:r.end])
                body += b"\0" * (_pad(len(body)) - len(body))
                struct.pack_into("<I", body, 0, len(body) - 4)
                c = self.eh.cies[r.start]
                if c.personality_field is not None and c.personality_enc & 0x70 == DW_EH_PE_pcrel:
                    # a PIE's personality pointer (DW.ref.__gxx_personality_v0, pc-relative):
                    # the CIE moves with .eh_frame's start, the pointer's target does not
                    o = c.personality_field - r.start
                    n = _FORMATS[c.personality_enc & 0x0F][1]
                    body[o:o + n] = _pack_ptr(c.personality, c.personality_enc,
                                              new_addr + at + o)
                cie_new[r.start] = at
                field_map.append((r.start, r.end, at))
                out += body
                continue
            pc, rng, prog = f[:3]
            fmt, size = _FORMATS[r.enc & 0x0F]
            body = bytearray(8)
            struct.pack_into("<I", body, 4, at + 4 - cie_new[r.cie])
            body += _pack_ptr(pc, r.enc, new_addr + at + 8)
            body += struct.pack(fmt, rng)
            aug = bytearray(r.aug)
            if kind == "fde":
                field_map.append((r.field, r.prog_off, at + 8))
            c = self.eh.cies[r.cie]
            if len(aug) > 1 and c.lsda_enc != DW_EH_PE_omit:
                # the LSDA pointer: a part's new LSDA, or the old one (pc-relative: re-encoded)
                _, p = _uleb(aug, 0)
                lsda, _, _ = _read_ptr(sec_bytes, r.field + 2 * size + p, c.lsda_enc,
                                       self.sec.addr)
                if len(f) > 3 and (id(f[3][0]), f[3][1]) in new_lsda:
                    lsda = new_lsda[(id(f[3][0]), f[3][1])]
                    lsda_fields[at + 8 + 2 * size + p] = lsda
                aug[p:p + _FORMATS[c.lsda_enc & 0x0F][1]] = _pack_ptr(
                    lsda, c.lsda_enc, new_addr + at + 8 + 2 * size + p)
            body += aug + prog
            body += b"\0" * (_pad(len(body)) - len(body))
            struct.pack_into("<I", body, 0, len(body) - 4)
            out += body
            table.append((pc, new_addr + at))
        new_size = end - new_addr
        if self.segment is not None:
            new_size = len(out) + 4          # crtend's zero terminator after the records
        if len(out) + 4 > new_size:
            raise EhFrameError(f".eh_frame: rebuilt records ({len(out)} bytes) do not fit "
                               f"({new_size - 4} bytes)")
        out += b"\0" * (new_size - len(out))
        table.sort()
        hdr = bytearray(hdr_size)
        o = lsda_at - H
        hdr[o:o + len(blob)] = blob
        hdr[0:4] = bytes([1, DW_EH_PE_pcrel | 0x0B, 0x03, 0x3B])
        struct.pack_into("<i", hdr, 4, new_addr - (H + 4))
        struct.pack_into("<I", hdr, 8, len(table))
        for k, (loc, fde) in enumerate(table):
            struct.pack_into("<ii", hdr, HDR_HEAD + 8 * k, loc - H, fde - H)
        hdr_bytes = np.frombuffer(bytes(hdr), np.uint8).copy()
        out_bytes = np.frombuffer(bytes(out), np.uint8).copy()
        if self.segment is not None:
            # both go to the new segment; their old bytes stay, unused
            self.segment.eh = {self.hsec.index: (H, hdr_bytes),
                               self.sec.index: (new_addr, out_bytes)}
            rw.eh_moves = {self.hsec.index: (H, hdr_size), self.sec.index: (new_addr, new_size)}
        else:
            rw.patched[self.hsec.index] = hdr_bytes
            rw.patched[self.sec.index] = out_bytes
            rw.section_moves = {self.hsec.index: (H, hdr_size),
                                self.sec.index: (new_addr, new_size)}
            if self.layout == EH_FIRST:
                # the header's start and .eh_frame's end moved: their symbols follow
                rw.eh_symbol_moves = dict(rw.section_moves)
        self._relocations(rw, field_map, new_addr, lsda_fields, H)
        rw.eh_frame_new_addr = new_addr
        return {"eh_frame.fdes": n_fde,
                "eh_frame.cold_fdes": sum(1 for sf in by_unit.values() if sf.parts[1]),
                "eh_frame.part_lsdas": len(new_lsda), "eh_frame.lsda_bytes": len(blob),
                "eh_frame_hdr.entries": len(table), "eh_frame.bytes_free":
                new_size - 4 - len(out.rstrip(b"\0"))}

    def _part_lsdas(self, by_unit, starts, amap, lsda_at):
        """(bytes, {(id(split), part): address}) of the split functions' part LSDAs
        stored from ``lsda_at`` on."""
        from ..blocks import COPY
        blob = bytearray()
        new_lsda = {}
        for sf in by_unit.values():
            base = int(starts[sf.unit])
            ls = self.lsda.get(base)
            if ls is None:
                continue
            lps = sorted({c[2] for c in ls.calls if c[2]})
            lp_new, ok = amap.map(np.array(lps, np.uint64)) if lps else (np.zeros(0), np.ones(0, bool))
            if not np.all(ok):
                raise EhFrameError(f"LSDA of {sf.name}: a landing pad is in dropped padding")
            lp_map = dict(zip(lps, [int(x) for x in lp_new]))
            lpstart = min(sf.new_start) - 1
            for part in ((0, 1) if sf.parts[1] else (0,)):
                pieces = [(p.old, p.old_len, sf.new_start[part] + p.off)
                          for p in sf.parts[part] if p.kind == COPY]
                blob += b"\0" * (-len(blob) % 4)
                at = lsda_at + len(blob)
                blob += lsda_encode(ls, sf.new_start[part], call_sites_for_part(ls, pieces),
                                    lp_map, lpstart, at, pcrel_lpstart=self.image.type == 3)
                new_lsda[(id(sf), part)] = at
        return blob, new_lsda

    def _relocations(self, rw, field_map, new_addr, lsda_fields, hdr_addr):
        rel = next((s for s in self.image.sections if s.name == ".rela.eh_frame"), None)
        if rel is None or not rel.size:
            return
        buf = rw.patched.get(rel.index)
        r = (np.array(buf) if buf is not None else
             np.array(self.image.section_bytes(rel))).view(RELA).copy()
        off = r["offset"].astype(np.int64) - self.sec.addr
        # each field's record span (the spans are in .eh_frame order and do not overlap)
        spans = np.array(field_map or [(0, 0, 0)], np.int64).reshape(-1, 3)
        k = np.searchsorted(spans[:, 0], off, side="right") - 1
        span = spans[np.maximum(k, 0)]
        inside = (k >= 0) & (off < span[:, 1])
        new = np.where(inside, span[:, 2] + off - span[:, 0], -1)
        # R_X86_64_NONE: what ld leaves of a relocation whose FDE it dropped (static
        # glibc has 13); it applies to nothing, so it names the section's start
        none = (r["info"] & 0xFFFFFFFF) == 0
        new[none & (new < 0)] = 0
        if (new < 0).any():
            i = int(np.nonzero(new < 0)[0][0])
            raise EhFrameError(f".rela.eh_frame: a relocation at {int(r['offset'][i]):#x} is "
                               "outside every record header")
        r["offset"] = (new + new_addr).astype(np.uint64)
        # a split function's LSDA pointer now names its hot part's LSDA, stored
        # in .eh_frame_hdr: relocated against that section's symbol
        if lsda_fields:
            from ...image.elf import SHT_SYMTAB, SYM
            symsec = next(x for x in self.image.sections if x.type == SHT_SYMTAB)
            syms = np.array(self.image.section_bytes(symsec)).view(SYM)
            hit = np.nonzero(((syms["info"] & 0xF) == 3) & (syms["shndx"] == self.hsec.index))[0]
            for k in np.nonzero(np.isin(new, list(lsda_fields)))[0].tolist():
                target = lsda_fields[int(new[k])]
                typ = int(r["info"][k]) & 0xFFFFFFFF
                if len(hit):
                    r["info"][k] = (int(hit[0]) << 32) | typ
                    r["addend"][k] = target - hdr_addr
                else:
                    r["info"][k] = 0             # R_X86_64_NONE: no symbol to name it by
        rw.patched[rel.index] = r.view(np.uint8)


def fix_section_symbols(rw, image):
    """Section symbols and symbols inside a moved allocated section follow it
    (crtend's ``__FRAME_END__`` sits at the unchanged end)."""
    moves = getattr(rw, "section_moves", None)
    seg_moves = getattr(rw, "eh_moves", None)
    end_moves = getattr(rw, "eh_symbol_moves", None)
    if not moves and not seg_moves:
        return
    from ...image.elf import SHT_SYMTAB, SYM
    symsec = next(s for s in image.sections if s.type == SHT_SYMTAB)
    buf = rw.patched.get(symsec.index)
    rows = (np.array(buf) if buf is not None else np.array(image.section_bytes(symsec))).view(SYM).copy()
    for idx, (addr, _) in (moves or {}).items():
        sel = (rows["shndx"] == idx) & ((rows["info"] & 0xF) == 3)
        rows["value"][sel] = addr
    for idx, (addr, size) in list((seg_moves or {}).items()) + list((end_moves or {}).items()):
        # moved to a new segment, or in place with a start or end of its own (after
        # .eh_frame, the header keeps its end): every symbol follows (the end,
        # crtend's __FRAME_END__ terminator, stays the end)
        sec = image.sections[idx]
        sel = rows["shndx"] == idx
        v = rows["value"][sel].astype(np.int64)
        at_end = v >= sec.addr + sec.size - 4
        rows["value"][sel] = np.where(at_end, addr + size - (sec.addr + sec.size - v),
                                      addr + np.maximum(v - sec.addr, 0)).astype(np.uint64)
    rw.patched[symsec.index] = rows.view(np.uint8)


def check_split_cfi(old_image, new_image, rows, parsed=None):
    """Per-part unwind check of a blocks output: at every block-map piece of a
    split function (and at every original CFI row inside a copied piece), the
    state the new image's FDE gives equals the one the original's gives.
    Returns a list of (address, message)."""
    from ...image import blockmap as bm
    problems = []
    try:
        old, new = parsed or parse_for_check(old_image, new_image)
    except EhFrameError as e:
        return [(None, str(e))], 0
    seen = _all_states_equal(old, new, rows)
    if seen is not None:
        return [], seen
    # something differs (or is not plain): the same points one by one, for the findings
    seen = 0
    locs = {}               # FDE start -> its rows' locations (sorted)
    kinds, olds, news = rows["kind"].tolist(), rows["old"].tolist(), rows["new"].tolist()
    lens, new_lens = rows["old_len"].tolist(), rows["new_len"].tolist()
    for k in range(len(rows)):
        kind = kinds[k]
        if kind == bm.KIND_JMP_REMOVED or not new_lens[k]:
            continue
        o, nw, ln = olds[k], news[k], lens[k]
        ofde = old.fde_containing(o)
        if ofde is None:
            continue
        orows = old.rows_of(ofde)
        if kind == bm.KIND_JMP_INSERTED:
            checks = [(o - 1, nw)]
        elif kind == bm.KIND_COPIED:
            # the piece's start and every original row strictly inside it
            at = locs.get(ofde.start)
            if at is None:
                at = locs[ofde.start] = [loc for loc, _ in orows]
            lo = bisect.bisect_right(at, o - ofde.pc_begin)
            hi = bisect.bisect_left(at, o + ln - ofde.pc_begin)
            checks = [(o, nw)] + [(ofde.pc_begin + loc, nw + ofde.pc_begin + loc - o)
                                  for loc in at[lo:hi]]
        else:
            checks = [(o, nw)]
        at = locs.get(ofde.start)
        if at is None:
            at = locs[ofde.start] = [loc for loc, _ in orows]
        for oa, na in checks:
            want = orows[max(bisect.bisect_right(at, oa - ofde.pc_begin) - 1, 0)][1]   # state_at
            try:
                got = new.state(na)
            except (CfiError, IndexError, struct.error) as e:
                problems.append((na, f"unwind state at {na:#x}: its FDE's CFI cannot be "
                                     f"evaluated ({e})"))
                continue
            seen += 1
            if got != want:
                problems.append((na, f"unwind state at {na:#x} (original {oa:#x}) differs: "
                                     f"{got} != {want}"))
    return problems, seen


def _all_states_equal(old, new, rows, native=True):
    """check_split_cfi's points, all at once: how many there are when the state NEW's
    FDE gives equals the original's at every one of them, else None (some state
    differs, an FDE is missing or does not evaluate, FDEs share a start or overlap:
    then check_split_cfi looks at each point itself and says what is wrong). The
    same points, FDE lookups (the original's FDE containing the piece, NEW's
    through .eh_frame_hdr) and row evaluations as its loop, on arrays: the loop's
    per-point lookups were most of verify's unwind check. ``native``: the rows
    evaluated by the C core (cfi.c) where every program involved is plain, their
    states compared field for field (exactly: no hashes); else by cfi.py's Python,
    states compared as tuples."""
    from ...image import blockmap as bm
    if native and native_lib() is None:
        native = False
    keep = (rows["kind"] != bm.KIND_JMP_REMOVED) & (rows["new_len"] > 0)
    kind = rows["kind"][keep]
    o = rows["old"][keep].astype(np.int64)
    nw = rows["new"][keep].astype(np.int64)
    ln = rows["old_len"][keep].astype(np.int64)
    # the original's FDE containing each piece (fde_containing)
    begins = old._begins.astype(np.int64)
    if not len(begins):
        return None
    fi = np.searchsorted(begins, o, side="right") - 1
    ends_at = np.full(len(begins), -1, np.int64)
    for u in np.unique(fi[fi >= 0]).tolist():
        recs = old.by_begin.get(int(begins[u]), [])
        if len(recs) != 1:
            return None
        ends_at[u] = recs[0].pc_begin + recs[0].pc_range
    has = (fi >= 0) & (o < ends_at[np.maximum(fi, 0)])
    kind, o, nw, ln, fi = kind[has], o[has], nw[has], ln[has], fi[has]
    if not len(o):
        return 0
    # the rows of those FDEs, end to end (each FDE's a run of g_old, in address order)
    uo = np.unique(fi)
    recs = [old.by_begin[int(begins[u])][0] for u in uo.tolist()]
    ids = {}                # unwind state -> a number, for both images (Python rows)
    if native:
        got = _native_rows_end_to_end(recs, [old.cie_info.get(r.cie) for r in recs])
        if got is None:
            return _all_states_equal(old, new, rows, native=False)
        g_old, first, count, s_old = got
    else:
        got = _python_rows_end_to_end(recs, [old.rows_of(r) for r in recs], ids)
        if got is None:
            return None
        g_old, first, count, s_old = got
    if len(g_old) > 1 and (g_old[1:] < g_old[:-1]).any():
        return None
    j = np.searchsorted(uo, fi)
    lo_row = first[j]
    hi_row = lo_row + count[j]
    # the points: each piece's start (an inserted jmp: the byte before its original
    # place) and every original row strictly inside a copied piece
    copied = kind == bm.KIND_COPIED
    oa0 = np.where(kind == bm.KIND_JMP_INSERTED, o - 1, o)
    in_lo = np.clip(np.searchsorted(g_old, o, side="right"), lo_row, hi_row)
    in_hi = np.clip(np.searchsorted(g_old, o + ln, side="left"), lo_row, hi_row)
    n_in = np.where(copied, np.maximum(in_hi - in_lo, 0), 0)
    piece = np.repeat(np.arange(len(o)), n_in)
    step = np.arange(int(n_in.sum())) - np.repeat(np.cumsum(n_in) - n_in, n_in)
    g_in = g_old[in_lo[piece] + step]
    oa = np.concatenate([oa0, g_in])
    na = np.concatenate([nw, nw[piece] + g_in - o[piece]])
    at = np.concatenate([np.arange(len(o)), piece])
    # the original's state at each point (state_at: the last row at or before it)
    want = np.clip(np.searchsorted(g_old, oa, side="right") - 1, lo_row[at], hi_row[at] - 1)
    # NEW's FDE at each point, as the unwinder finds it (fde_at), and its state there
    table = np.array(new.loc, np.int64)
    nj = np.searchsorted(table, na, side="right") - 1
    if not len(table) or (nj < 0).any():
        return None
    un = np.unique(nj)
    nrecs = [new.fde[j] for j in un.tolist()]
    if any(r is None for r in nrecs):
        return None
    if native:
        got = _native_rows_end_to_end(nrecs, [new.info[r.cie] for r in nrecs])
        if got is None:
            return _all_states_equal(old, new, rows, native=False)
    else:
        nrows = []
        for r in nrecs:
            got = new.cache.get(r.start)
            if got is None:
                info = new.info[r.cie]
                try:
                    rr = evaluate(r.prog, info, info.init_state)
                except (CfiError, IndexError, struct.error):
                    return None
                got = new.cache[r.start] = (rr, [loc for loc, _ in rr])
            nrows.append(got[0])
        got = _python_rows_end_to_end(nrecs, nrows, ids)
        if got is None:
            return None
    g_new, n_first, n_count, s_new = got
    n_lo = np.array([r.pc_begin for r in nrecs], np.int64)
    n_hi = n_lo + np.array([r.pc_range for r in nrecs], np.int64)
    k = np.searchsorted(un, nj)
    if ((na < n_lo[k]) | (na >= n_hi[k])).any():
        return None
    if len(g_new) > 1 and (g_new[1:] < g_new[:-1]).any():
        return None
    nf, nc = n_first[k], n_count[k]
    got = np.clip(np.searchsorted(g_new, na, side="right") - 1, nf, nf + nc - 1)
    if native:
        # the states of both images numbered, equal bytes (every field) the same number;
        # words zero in every state of both (registers no rule names) left out
        used = np.flatnonzero(s_old.any(axis=0) | s_new.any(axis=0)) if len(s_old[0]) else []
        used = used if len(used) else [0]
        words = np.ascontiguousarray(np.concatenate([s_old[:, used], s_new[:, used]]))
        whole = words.view(np.dtype((np.void, len(used) * 8)))
        ids = np.unique(whole.ravel(), return_inverse=True)[1].ravel()
        s_old, s_new = ids[:len(s_old)], ids[len(s_old):]
    same = (s_old[want] == s_new[got]).all()
    return int(len(oa)) if same else None


def _python_rows_end_to_end(recs, rows_each, ids):
    """(row addresses, each record's first row, row count, state numbers) of cfi.py
    rows ``rows_each`` of records ``recs``; None when one has no rows. ``ids``:
    state -> number, shared by both images."""
    first, count, g, st = [], [], [], []
    for r, rr in zip(recs, rows_each):
        if not rr:
            return None
        first.append(len(g))
        count.append(len(rr))
        g.extend(r.pc_begin + loc for loc, _ in rr)
        st.extend(ids.setdefault(s, len(ids)) for _, s in rr)
    return (np.array(g, np.int64), np.array(first, np.int64), np.array(count, np.int64),
            np.array(st, np.int64))


def _native_rows_end_to_end(recs, infos):
    """_python_rows_end_to_end from cfi.c's rows; the states as rows of 64-bit words
    (every field of the state, the location left out), numbered by their bytes. None
    when a program or CIE is not plain."""
    if any(i is None for i in infos):
        return None
    got = evaluate_native([r.prog for r in recs], infos)
    if got is None:
        return None
    rows, first, count = got
    if (count == 0).any():
        return None
    g = np.repeat(np.array([r.pc_begin for r in recs], np.int64), count) + rows["loc"]
    words = rows.view(np.uint64).reshape(len(rows), -1)[:, 1:]     # word 0: the location
    return g, first, count, words


def parse_for_check(old_image, new_image):
    """(original's unwind tables as they are, NEW's FDE index): what check_split_cfi and
    check_split_lsda read; parse once, pass to both as ``parsed``."""
    return EhSplit(old_image, compact=False), _FdeIndex(new_image)


class _FdeIndex:
    """FDE lookup by address in an image, as the unwinder does it (the
    ``.eh_frame_hdr`` table, then the FDE's range)."""

    def __init__(self, image):
        sec = image.section(".eh_frame")
        data = bytes(image.section_bytes(sec))
        eh = parse_eh_frame(data, sec.addr)
        self.records = _records(data, sec.addr, eh)
        self.info = {r.start: parse_cie_info(data, r.start, r.start + 4)
                     for r in self.records if r.is_cie}
        hs = image.section(".eh_frame_hdr")
        hdr = EhFrameHdr(image.section_bytes(hs), hs.addr)
        by_off = {sec.addr + r.start: r for r in self.records if not r.is_cie}
        self.loc = hdr.loc.astype(np.int64).tolist()
        self.fde = [by_off.get(int(f)) for f in hdr.fde.tolist()]
        self.cache = {}

    def fde_at(self, addr):
        i = bisect.bisect_right(self.loc, addr) - 1
        if i < 0 or self.fde[i] is None:
            return None
        r = self.fde[i]
        return r if r.pc_begin <= addr < r.pc_begin + r.pc_range else None

    def state(self, addr):
        r = self.fde_at(addr)
        if r is None:
            return None
        got = self.cache.get(r.start)
        if got is None:
            info = self.info[r.cie]
            rows = evaluate(r.prog, info, info.init_state)
            got = self.cache[r.start] = (rows, [loc for loc, _ in rows])
        rows, locs = got
        return rows[max(bisect.bisect_right(locs, addr - r.pc_begin) - 1, 0)][1]   # state_at




def check_split_lsda(old_image, new_image, rows, parsed=None):
    """Exception tables of split functions: at every byte of every copied piece
    of a split function that has an LSDA (at the start of every interval on
    which neither table's answer can change), the personality's lookup in NEW (the
    FDE covering the new address, its LSDA, the call site holding it) gives the
    original's answer: no call site / the same landing pad (translated) and
    the same action chain with the same catch types. Returns (problems, checked)."""
    from ...image import blockmap as bm
    try:
        old, new = parsed or parse_for_check(old_image, new_image)
    except EhFrameError as e:
        return [(None, str(e))], 0
    if not any(r.lsda for r in old.fdes):
        return [], 0                # no function of the original has an LSDA: nothing to look up
    cp = rows[(rows["kind"] == bm.KIND_COPIED) & (rows["old_len"] > 0)]
    lp_map = bm.address_map(rows) if len(rows) else None
    problems, checked = [], 0
    cache = {}

    def lookup(ls, a):
        for s, n, lp, act in ls.calls:
            if s <= a < s + n:
                return lp, _chain(ls, act)
        return None

    for k in range(len(cp)):
        o, ln, nw = int(cp["old"][k]), int(cp["old_len"][k]), int(cp["new"][k])
        r = old.fde_containing(o)
        if r is None or not r.lsda:
            continue
        if r.pc_begin not in old.lsda:
            try:
                old.lsda[r.pc_begin] = Lsda(old_image, r.lsda, r.pc_begin)
            except (LsdaError, struct.error, IndexError):
                continue
        ols = old.lsda[r.pc_begin]
        # both lookups are constant between the boundaries of either table (and
        # of the new FDE): checking where each such interval starts covers every byte
        points = {o}
        for cs, n, _, _ in ols.calls:
            points.update(x for x in (cs, cs + n) if o < x < o + ln)
        f0 = new.fde_at(nw)
        if f0 is not None:
            points.update(o + x - nw for x in (f0.pc_begin + f0.pc_range,) if nw < x < nw + ln)
            nls0 = _new_lsda(cache, new_image, f0)
            if not isinstance(nls0, (str, type(None))):
                for cs, n, _, _ in nls0.calls:
                    points.update(o + x - nw for x in (cs, cs + n) if nw < x < nw + ln)
        for a in sorted(points):
            na = nw + a - o
            f = new.fde_at(na)
            if f is None or not f.lsda:
                got = None if f is not None else "no FDE"
            else:
                nls = _new_lsda(cache, new_image, f)
                got = nls if isinstance(nls, str) else lookup(nls, na)
            want = lookup(ols, a)
            if want is not None and want[0]:
                m, ok = lp_map.map(np.array([want[0]], np.uint64))
                want = (int(m[0]) if ok[0] else None, want[1])
            checked += 1
            if got != want:
                problems.append((na, f"exception lookup at {na:#x} (original {a:#x}): "
                                     f"{got} != {want}"))
                break
    return problems, checked


def _new_lsda(cache, image, f):
    """The parsed LSDA of FDE record ``f`` (None without one; a string when it
    does not parse)."""
    if not f.lsda:
        return None
    key = (f.start, f.lsda)
    if key not in cache:
        try:
            cache[key] = Lsda(image, f.lsda, f.pc_begin)
        except (LsdaError, struct.error, IndexError) as e:
            cache[key] = str(e)
    return cache[key]


def _chain(ls, act):
    """(filter, type) pairs of the action chain starting at ``act`` (1-based)."""
    out = []
    p = act - 1 if act else None
    d = ls.actions
    from .lsda import _sleb as sl
    while p is not None and p < len(d):
        f, q = sl(d, p)
        nxt, _ = sl(d, q)
        out.append((f, ls.types[f - 1] if f > 0 else 0))
        p = q + nxt if nxt else None
    return tuple(out)

