"""Every byte of every executable section, classified: decoded instruction,
padding, data in code, or unexplained, each with the reason.

Sized FUNC symbols cover about 70% of Debian 6.1's ``.text``; the rest is
int3 fill and code written in assembly without a size (entry code, thunks,
``.altinstr_replacement`` snippets, ...). The partition is built without
trusting any kernel table, so that the table checks can use it to judge the
tables (a table entry cannot create the instruction boundary it is checked
against):

1. function bodies, decoded by :func:`linepack.image.disasm.disassemble`;
2. every gap between functions is cut at each code symbol of any type (asm
   labels, ``SYM_CODE_*`` entry points, section starts) and swept linearly
   from each cut; a sweep never runs past the next cut, so decoding never
   starts inside an instruction another path decoded (an instruction that
   would straddle a cut is not kept, its bytes are reported);
3. leading/trailing 0xCC runs of a piece are alignment fill; ``int3`` and
   nop instructions inside swept code are padding instructions (kept in the
   instruction arrays, so table entries pointing at them are still checked);
4. bytes Capstone cannot decode that sit after an unconditional transfer
   (jmp/ret/ud2) up to the next cut, or inside a sized STT_OBJECT symbol (7.x's
   kexec_debug_gdt in the kexec code linked into .data), are data in code;
   other undecodable bytes stay unexplained and are listed.

Branch targets of all decoded code that land in non-function code must be
instruction boundaries; any that are not are listed as conflicts.

Bulk state is numpy: one category byte per code byte, instruction arrays
(address, size, first 16 bytes, reason) for the non-function code.
"""

import capstone
import numpy as np

from .disasm import RAW, Disassembly, _Decoder, _known_length

DECODED, PADDING, DATA, UNEXPLAINED = 1, 2, 3, 0
CATEGORY_NAMES = {DECODED: "decoded", PADDING: "padding", DATA: "data", UNEXPLAINED: "unexplained"}

# Reasons for swept (non-function) instructions.
R_FUNCTION, R_SYMBOL, R_GAP, R_PADDING, R_MODE32, R_MODE32_TARGET = 0, 1, 2, 3, 4, 5
REASONS = ("function symbol", "code symbol (linear sweep)", "after a function (linear sweep)",
           "int3/nop padding instruction", "32-bit entry code (PVH note, 32-bit mode)",
           "target of the 32-bit entry's far jump (linear sweep)")
KERNEL_MAP = 0xFFFFFFFF80000000          # x86-64 __START_KERNEL_map
XEN_ELFNOTE_PHYS32_ENTRY = 18


def _xen_phys32_entries(image):
    """Physical addresses in Xen PHYS32_ENTRY notes (the PVH 32-bit entry)."""
    out = []
    for s in image.sections:
        if s.type != 7:                   # SHT_NOTE
            continue
        buf = bytes(image.section_bytes(s))
        pos = 0
        while pos + 12 <= len(buf):
            namesz, descsz, ntype = np.frombuffer(buf[pos:pos + 12], "<u4").tolist()
            name = buf[pos + 12:pos + 12 + namesz].rstrip(b"\0")
            dpos = pos + 12 + ((namesz + 3) & ~3)
            desc = buf[dpos:dpos + descsz]
            if name == b"Xen" and ntype == XEN_ELFNOTE_PHYS32_ENTRY and len(desc) in (4, 8):
                out.append(int.from_bytes(desc, "little"))
            pos = dpos + ((descsz + 3) & ~3)
    return out

_STT_OBJECT, _STT_SECTION, _STT_FILE = 1, 3, 4


def _no_fallthrough(insn):
    """True for instructions execution never falls through: jmp, ret, ud2, int3."""
    b = insn.lstrip(b"\x2e\x3e\xf2\xf3")          # segment / bnd / rep prefixes
    return bool(b) and (b[0] in (0xC3, 0xC2, 0xE9, 0xEB, 0xCC) or b[:2] == b"\x0f\x0b"
                        or (b[0] == 0xFF and len(b) > 1 and (b[1] >> 3) & 7 in (4, 5)))


def _is_padding_insn(raw, size):
    """int3 and the nop encodings (90, 66 90, 0f 1f /0, with prefixes) as a mask."""
    rows = np.arange(len(raw))
    skip = np.zeros(len(raw), np.int64)
    for _ in range(14):           # operand-size / cs prefixes in long nops (clang/rustc
        # pad with up to 15-byte ones: six 66 and a 2e before 0f 1f 84)
        b = raw[rows, np.minimum(skip, RAW - 1)]
        more = ((b == 0x66) | (b == 0x2E)) & (skip + 1 < size)
        if not more.any():
            break
        skip += more
    op = raw[rows, np.minimum(skip, RAW - 1)]
    op2 = raw[rows, np.minimum(skip + 1, RAW - 1)]
    modrm_reg = (raw[rows, np.minimum(skip + 2, RAW - 1)] >> 3) & 7
    int3 = (raw[:, 0] == 0xCC) & (size == 1)
    nop1 = (op == 0x90)
    nopl = (op == 0x0F) & (op2 == 0x1F) & (modrm_reg == 0)
    return int3 | nop1 | nopl


class CodeCoverage:
    """The partition of every executable section (see the module docstring).

    ``sections``: per executable section, ``{"name", "addr", "size", "category"}``
    where ``category`` is a u1 array (one per byte). ``extra``: Disassembly of
    the non-function instructions (``func`` = -1). ``reason``: per extra
    instruction, an index into REASONS. ``unexplained``: [(address, section,
    length, reason)] runs; ``conflicts``: [(address, section, reason)].
    """

    def __init__(self, image, functions, function_disasm):
        self.image = image
        self.sections = []
        self.unexplained = []
        self.conflicts = []
        self.data_runs = []
        self._memo = {}
        parts = []
        names, syms = image.symbol_table()
        typ = syms["info"] & 0xF
        sym_ok = (typ != _STT_SECTION) & (typ != _STT_FILE)
        sym_values = np.unique(syms["value"][sym_ok].astype(np.uint64))
        # sized data objects: undecodable bytes inside one are data by their symbol
        obj = (typ == _STT_OBJECT) & (syms["size"] > 0) & (syms["shndx"] != 0) \
            & (syms["shndx"] < 0xff00)
        o = np.argsort(syms["value"][obj], kind="stable")
        self._obj_lo = syms["value"][obj][o].astype(np.uint64)
        self._obj_hi = self._obj_lo + syms["size"][obj][o].astype(np.uint64)
        dec = _Decoder()
        try:
            from .elf import code_sections
            for sec in code_sections(image):
                parts.append(self._section(sec, functions, function_disasm, sym_values, dec))
        finally:
            dec.close()
        addr = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.uint64)
        size = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.uint8)
        raw = np.concatenate([p[2] for p in parts]) if parts else np.zeros((0, RAW), np.uint8)
        reason = np.concatenate([p[3] for p in parts]) if parts else np.zeros(0, np.uint8)
        self.extra = Disassembly(addr, size, np.full(len(addr), -1, np.int32), raw, [])
        self.reason = reason
        self._check_branch_targets(function_disasm)

    # -- one section ---------------------------------------------------------
    def _section(self, sec, functions, fdis, sym_values, dec):
        data = np.asarray(self.image.section_bytes(sec))
        n = sec.size
        cat = np.zeros(n, np.uint8)
        lo, hi = np.uint64(sec.addr), np.uint64(sec.end)
        # 1. function bodies: decoded by the function pass, except the bytes it
        #    could not decode (it resumes one byte later)
        fm = (functions.start >= lo) & (functions.start < hi)
        fstart = (functions.start[fm] - lo).astype(np.int64)
        fend = np.minimum(functions.end[fm] - lo, np.uint64(n)).astype(np.int64)
        # (a slice per function: no per-byte integer temporaries on a 15 MB section)
        in_func = np.zeros(n, bool)
        for a, b in zip(fstart.tolist(), fend.tolist()):
            in_func[a:b] = True
        cat[in_func] = DECODED
        for a, _f in fdis.undecodable:
            if sec.addr <= a < sec.end:
                cat[a - sec.addr] = UNEXPLAINED
                self.unexplained.append((a, sec.name, 1, "inside a function, Capstone cannot decode it"))
        # 2. gaps, cut at every code symbol
        gap = ~in_func
        change = np.flatnonzero(gap[1:] != gap[:-1]) + 1
        bounds = np.concatenate(([0], change, [n]))
        g_start = bounds[:-1][gap[bounds[:-1]]] if n else bounds[:0]
        g_end = bounds[1:][gap[bounds[:-1]]] if n else bounds[:0]
        sv = sym_values[(sym_values >= lo) & (sym_values < hi)]
        sv = (sv - lo).astype(np.int64)
        sv = sv[gap[sv]] if len(sv) else sv
        cuts = np.unique(np.concatenate([g_start, sv]))
        seg_gap = np.searchsorted(g_start, cuts, side="right") - 1
        seg_end = np.minimum(np.append(cuts[1:], n), g_end[seg_gap])
        is_sym = np.isin(cuts, sv)
        cc = data == 0xCC
        # leading / trailing int3 fill of each piece, found in bulk
        code_pos = np.flatnonzero(gap & ~cc)          # pieces lie in gaps
        k0 = np.searchsorted(code_pos, cuts)
        k1 = np.searchsorted(code_pos, seg_end) - 1
        has_code = k1 >= k0
        # (a section of int3 only: the old place of code moved to a new segment)
        code_at = code_pos if len(code_pos) else np.zeros(1, np.int64)
        first = code_at[np.minimum(k0, len(code_at) - 1)]
        last = code_at[np.maximum(k1, 0)] + 1
        parts = []
        special = self._mode32_starts(sec)
        for a, b, p, q, symcut in zip(cuts[has_code].tolist(), seg_end[has_code].tolist(),
                                      first[has_code].tolist(), last[has_code].tolist(),
                                      is_sym[has_code].tolist()):
            reason = R_SYMBOL if symcut else R_GAP
            if sec.addr + a in special:
                self._decode_mode32(sec, data, a, b, cat, parts, reason, dec)
                continue
            self._sweep(sec, data, cc, cat, p, q, b, reason, parts, dec)
        # the rest of each gap that is int3 is alignment fill
        cat[gap & cc & (cat == UNEXPLAINED)] = PADDING
        if parts:
            off = np.concatenate([p[0] for p in parts])
            size = np.concatenate([p[1] for p in parts]).astype(np.uint8)
            reason = np.repeat(np.array([p[2] for p in parts], np.uint8), [len(p[0]) for p in parts])
            order = np.argsort(off, kind="stable")
            off, size, reason = off[order], size[order], reason[order]
            addr = off.astype(np.uint64) + lo
            col = np.arange(RAW)
            padded = np.concatenate([data, np.zeros(RAW, np.uint8)])
            raw = padded[off[:, None] + col[None, :]]
            raw[col[None, :] >= size[:, None].astype(np.int64)] = 0
        else:
            addr, size = np.zeros(0, np.uint64), np.zeros(0, np.uint8)
            raw, reason = np.zeros((0, RAW), np.uint8), np.zeros(0, np.uint8)
        # 3. int3 / nop instructions outside functions are padding (still instructions)
        pad = _is_padding_insn(raw, size.astype(np.int64))
        reason[pad] = R_PADDING
        off = (addr[pad] - lo).astype(np.int64)
        psize = size[pad]
        for k in range(int(psize.max()) if len(psize) else 0):
            cat[off[psize > k] + k] = PADDING
        self.sections.append({"name": sec.name, "addr": sec.addr, "size": n, "category": cat})
        return addr, size, raw, reason

    def _sweep(self, sec, data, cc, cat, pos, stop, b, reason, parts, dec):
        """Linear sweep of [pos, stop) (offsets in sec), never past the cut b.

        Instruction lengths do not depend on the address, so pieces with the
        same bytes (alignment nops between functions, mostly) are decoded once.
        """
        # only short pieces are memoised (a 7.3 gap between cuts can exceed 64 KiB)
        key = bytes(data[pos:min(b, stop + 15)]) + (stop - pos).to_bytes(2, "little") \
            if b - pos <= 64 else None
        hit = self._memo.get(key) if key is not None else None
        if hit is not None:
            rel, sizes, end = hit
            parts.append((pos + rel, sizes, reason))
            cat[pos:pos + end] = DECODED
            return
        start = pos
        offs, lens = [], []
        # the instruction just before this piece, if the previous sweep ended here
        last_insn = None
        if parts and len(parts[-1][0]) and int(parts[-1][0][-1] + parts[-1][1][-1]) == pos:
            last_insn = bytes(data[int(parts[-1][0][-1]):pos])
        clean = True
        while pos < stop:
            # decode up to the cut; the last instruction may end in the trailing fill
            ins = dec.decode(bytes(data[pos:min(b, stop + 15)]), sec.addr + pos)
            if len(ins):
                sizes = ins["size"].astype(np.int64)
                starts = pos + np.concatenate(([0], np.cumsum(sizes)[:-1]))
                keep = int(np.searchsorted(starts, stop))
                starts, sizes = starts[:keep], sizes[:keep]
                if keep and starts[-1] + sizes[-1] > b:
                    # straddles the next cut: not kept
                    self.conflicts.append((sec.addr + int(starts[-1]), sec.name,
                                           "instruction runs past the next symbol"))
                    clean = False
                    starts, sizes = starts[:-1], sizes[:-1]
                if len(starts):
                    offs.append(starts)
                    lens.append(sizes)
                    end = int(starts[-1] + sizes[-1])
                    last_insn = bytes(data[int(starts[-1]):end])
                    pos = end
            if pos >= stop:
                break
            clean = False
            known = _known_length(bytes(data[pos:pos + 8]))
            if known and pos + known <= b:
                offs.append(np.array([pos], np.int64))
                lens.append(np.array([known], np.int64))
                last_insn = bytes(data[pos:pos + known])
                pos += known
                continue
            # undecodable up to the cut: data after an unconditional transfer, else unexplained
            tail = ~cc[pos:b]
            stop_at = pos + int(np.nonzero(tail)[0][-1]) + 1
            obj_end = self._object_end(sec.addr + pos)
            if obj_end is not None:
                # a sized data object: data up to its end, the sweep goes on after it
                e = min(obj_end - sec.addr, stop_at)
                cat[pos:e] = DATA
                self.data_runs.append((sec.addr + pos, sec.name, e - pos,
                                       "undecodable bytes inside a sized data object symbol"))
                pos, last_insn = e, None
                continue
            if last_insn is not None and _no_fallthrough(last_insn):
                cat[pos:stop_at] = DATA
                self.data_runs.append((sec.addr + pos, sec.name, stop_at - pos,
                                       "undecodable bytes after an unconditional jump/ret"))
            else:
                cat[pos:stop_at] = UNEXPLAINED
                self.unexplained.append((sec.addr + pos, sec.name, stop_at - pos,
                                         "Capstone cannot decode it and code falls through into it"))
            break
        if offs:
            o, z = np.concatenate(offs), np.concatenate(lens)
            parts.append((o, z, reason))
            cat[start:int(o[-1] + z[-1])][cat[start:int(o[-1] + z[-1])] == UNEXPLAINED] = DECODED
            if clean and b - start <= 64:
                self._memo[key] = (o - start, z, int(o[-1] + z[-1]) - start)

    def _object_end(self, addr):
        """The end of the sized STT_OBJECT symbol holding ``addr`` (the farthest, where
        objects nest), or None."""
        k = int(np.searchsorted(self._obj_lo, np.uint64(addr), side="right"))
        if not k:
            return None
        hi = int(self._obj_hi[:k].max())
        return hi if hi > addr else None

    def _mode32_starts(self, sec):
        """Entry points that run in 32-bit protected mode: the PVH entry
        (Xen ELF note XEN_ELFNOTE_PHYS32_ENTRY, a physical address)."""
        if getattr(self, "_entry32", None) is None:
            self._entry32 = set()
            for addr in _xen_phys32_entries(self.image):
                self._entry32.add(addr + KERNEL_MAP)
        return {a for a in self._entry32 if sec.addr <= a < sec.end}

    def _decode_mode32(self, sec, data, a, b, cat, parts, reason, dec):
        """32-bit code from a up to its far jump into 64-bit code, which goes on
        in 64-bit mode at the jump's target (a physical address)."""
        dec32 = _Decoder(capstone.CS_MODE_32)
        try:
            ins = dec32.decode(bytes(data[a:b]), sec.addr + a)
        finally:
            dec32.close()
        far = np.nonzero(ins["bytes"][:, 0] == 0xEA)[0]
        if len(far):
            ins = ins[:far[0] + 1]
        sizes = ins["size"].astype(np.int64)
        end = a + int(sizes.sum())
        parts.append((a + np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes, R_MODE32))
        cat[a:end] = DECODED
        if not len(far):
            return
        target = int.from_bytes(bytes(ins["bytes"][-1][1:5]), "little") + KERNEL_MAP - sec.addr
        if end <= target < b:
            cat[end:target][data[end:target] == 0xCC] = PADDING
            if (cat[end:target] == UNEXPLAINED).any():
                self.unexplained.append((sec.addr + end, sec.name, target - end,
                                         "between a 32-bit far jump and its target"))
            cc = data == 0xCC
            seg = cc[target:b]
            q = target + (len(seg) - int(np.argmin(seg[::-1]))) if not seg.all() else target
            self._sweep(sec, data, cc, cat, target, q, b, R_MODE32_TARGET, parts, dec)

    def _check_branch_targets(self, fdis):
        """Direct branches into non-function code must land on instruction starts."""
        for dis in (fdis, self.extra):
            if not len(dis):
                continue
            _, tgt, _ = dis.branch_targets()
            in_extra = self.extra.containing(tgt) >= 0
            mid = in_extra & ~self.extra.is_boundary(tgt)
            for a in np.unique(tgt[mid]).tolist()[:100]:
                self.conflicts.append((a, self._section_name(a), "branch target inside a swept instruction"))

    # -- queries ---------------------------------------------------------------
    def _section_name(self, addr):
        for s in self.sections:
            if s["addr"] <= addr < s["addr"] + s["size"]:
                return s["name"]
        return "?"

    def category_at(self, addrs):
        """Category of each address (UNEXPLAINED also for addresses outside code)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        out = np.zeros(len(addrs), np.uint8)
        for s in self.sections:
            m = (addrs >= np.uint64(s["addr"])) & (addrs < np.uint64(s["addr"] + s["size"]))
            if m.any():
                out[m] = s["category"][(addrs[m] - np.uint64(s["addr"])).astype(np.int64)]
        return out

    def describe(self, addr):
        """'int3 fill in .text' style words for messages."""
        c = int(self.category_at([addr])[0])
        return f"{CATEGORY_NAMES[c]} bytes in {self._section_name(addr)}"

    def table(self):
        """Per-section byte counts: [{section, bytes, decoded, padding, data, unexplained}]."""
        rows = []
        for s in self.sections:
            # (not bincount: it counts through an int64 copy, 8 bytes per code byte)
            counts = [int(np.count_nonzero(s["category"] == c)) for c in range(4)]
            rows.append({"section": s["name"], "bytes": int(s["size"]),
                         "decoded": int(counts[DECODED]), "padding": int(counts[PADDING]),
                         "data": int(counts[DATA]), "unexplained": int(counts[UNEXPLAINED])})
        return rows


def merge(function_disasm, extra, release=False):
    """One Disassembly of function and non-function instructions, by address (ties:
    function rows first, each part in its own order, as a stable sort of the two
    would place them). ``release``: the caller's function_disasm is not used again:
    each of its columns is dropped once copied (the peak holds one column of it
    beside the result, not all four)."""
    f, e = function_disasm, extra
    nf, ne = len(f.addr), len(e.addr)
    rank = np.empty(nf + ne, np.int64)      # each row's place in the result
    if nf > 1 and (f.addr[1:] < f.addr[:-1]).any():
        order = np.argsort(np.concatenate([f.addr, e.addr]), kind="stable")
        rank[order] = np.arange(nf + ne)
    else:
        # both parts sorted: a row's place is its index plus how many rows of the
        # other part come before it, and each column is written there once (no
        # concatenated copy beside the result: zstd's 240,000 rows are 7 MiB)
        eo = np.argsort(e.addr, kind="stable")
        ea = e.addr[eo]
        rank[:nf] = np.arange(nf) + np.searchsorted(ea, f.addr, side="left")
        rank[nf + eo] = np.arange(ne) + np.searchsorted(f.addr, ea, side="right")
    cols = []
    for name in ("addr", "size", "func", "raw"):
        a, b = getattr(f, name), getattr(e, name)
        col = np.empty((nf + ne,) + a.shape[1:], a.dtype)
        col[rank[:nf]] = a
        col[rank[nf:]] = b
        cols.append(col)
        del a
        if release:
            setattr(f, name, None)
    out = Disassembly(*cols, f.undecodable)
    # A row's direct branch target depends on that row alone: the parts' (decoded
    # for the coverage's branch check) are carried over instead of decoded again.
    bf, be = getattr(f, "_branch_targets", None), getattr(e, "_branch_targets", None)
    if bf is not None and be is not None:
        index = np.concatenate([rank[bf[0]], rank[be[0] + nf]])
        o = np.argsort(index, kind="stable")
        found = (index[o], np.concatenate([bf[1], be[1]])[o], np.concatenate([bf[2], be[2]])[o])
        for a in found:
            a.flags.writeable = False
        out._branch_targets = found
    return out
