"""Growing the payload room of an x86-64 boot image's decompressor (no symbols, no source).

The decompressor ("ZO", arch/x86/boot/compressed/vmlinux) is linked at 0 with
startup_32 first (vmlinux.lds.S)::

    [0, _ehead)              .head.text: startup_32 (32-bit) then, at 0x200, startup_64
    [_ehead, B)              .rodata..compressed: the payload (input_data .. input_data_end)
    [B, _edata)              .text, .rodata, .data of the decompressor (and the EFI stub)
    [_edata, _end)           .bss and .pgtable (memory only)

and the boot image is the setup code followed by the bytes [0, _edata). To give the
payload D more bytes, everything from B on moves up by D (a multiple of 4096, so
every section keeps its alignment) and every value that crosses B is rewritten:

- PC-relative branches and RIP-relative operands from one side of B to the other;
- ``rva(X)`` constants (X - startup_32, head_64.S) in the head's code, which are the
  address of X: +D when X lies past B;
- ``$X - 1b`` constants of 32-bit code past B that name the head (efi_mixed.S's
  ``startup_32 - 1b`` after ``call 1f; 1: pop``): -D;
- the setup header and the PE/COFF header fields computed from ZO symbols
  (header.S): syssize, init_size, handover_offset, kernel_info_offset, the PE entry
  points, SizeOfCode/SizeOfInitializedData/SizeOfImage and the .text/.data sections.

The references are found by disassembly: the head by linear sweep (32-bit up to
0x200, 64-bit after), the rest by recursive descent from every entry the image
declares (the head's branches and rva constants into the code, the PE entry, the
.compat 32-bit entry, the EFI handover entries), following direct branches and
RIP-relative address loads, then a linear sweep of the gaps between what the descent
reached (functions nothing calls). A value this cannot explain (a reference into the
payload's interior, a branch of 8 or 16 bits across B, a head constant between B and
_end that is not an operand) stops the rewrite: BadInput, nothing written.

Proven against the truth on a kernel build (tests/test_zoroom.py): the references
this finds in the kbuild hook's decompressor are exactly the link's relocations
(``--emit-relocs``) whose field and target lie on different sides of B.
"""

import struct
from dataclasses import dataclass

import numpy as np

from ..errors import BadInput

PAGE = 4096
STARTUP_64 = 0x200                      # boot protocol: 64-bit entry at startup_32 + 0x200
# references into the payload name input_data or its first bytes (misc.c and the
# decompressors look at the stream's magic); anything deeper is not explained
PAYLOAD_HEAD = 16
XLF_EFI_HANDOVER_32, XLF_EFI_HANDOVER_64 = 1 << 2, 1 << 3

# one row per crossing value: ZO address of the field, its size, +1 (gains D) or -1
REFS = np.dtype([("field", "<u4"), ("size", "u1"), ("sign", "i1"), ("kind", "u1")])
KIND_PCREL, KIND_RVA, KIND_ANCHOR = 0, 1, 2
KIND_NAMES = ("pc-relative", "rva constant", "anchor-relative constant")


# header.S's sections (6.7 to 7.x): the setup code, the IA-32 entry record, the
# decompressor's code and read-only data, its data and memory
KNOWN_PE_SECTIONS = {".setup", ".compat", ".text", ".data"}


@dataclass(frozen=True)
class ZoLayout:
    """The decompressor's bounds as the boot image declares them (ZO addresses)."""

    ehead: int          # _ehead = input_data = payload_offset
    boundary: int       # input_data_end: everything from here on moves
    edata: int          # _edata = syssize * 16
    end: int            # _end (PE SizeOfImage - setup size), or init_size's bound
    end_known: bool
    pe: object          # PeHeader or None
    entries: tuple      # ((ZO address, bits), ...) declared by the headers


@dataclass(frozen=True)
class PeHeader:
    """Offsets (in the file) of the PE/COFF fields header.S fills from ZO symbols."""

    opt: int
    sections: dict      # name -> file offset of its 40-byte section header
    setup_size: int


def _pe_header(data, setup_size):
    if data[:2] != b"MZ" or len(data) < 0x40:
        return None
    pe = struct.unpack_from("<I", data, 0x3c)[0]
    if pe + 24 > len(data) or data[pe:pe + 4] != b"PE\0\0":
        return None
    nsec, = struct.unpack_from("<H", data, pe + 6)
    optsz, = struct.unpack_from("<H", data, pe + 20)
    opt = pe + 24
    if struct.unpack_from("<H", data, opt)[0] != 0x20b:
        raise BadInput("boot image: PE header is not PE32+ (not an x86-64 EFI stub)")
    secs = {}
    for k in range(nsec):
        at = opt + optsz + 40 * k
        name = data[at:at + 8].rstrip(b"\0").decode("ascii", "replace")
        secs[name] = at
    return PeHeader(opt=opt, sections=secs, setup_size=setup_size)


def _u32(data, off):
    return struct.unpack_from("<I", data, off)[0]


def zo_layout(image):
    """ZoLayout of a BootImage (image/bootimage.py), checking that the headers say
    what header.S computes from the decompressor's symbols; BadInput otherwise."""
    data, h = image.data, image.setup
    pm = h.protected_mode_offset
    ehead = h.payload_offset
    boundary = ehead + h.payload_length
    edata = h.syssize * 16
    path = image.path
    if not (STARTUP_64 < ehead < boundary <= edata) or pm + edata > len(data):
        raise BadInput(f"{path}: payload [{ehead:#x}, {boundary:#x}) and _edata {edata:#x} are "
                       "not laid out as arch/x86/boot/compressed/vmlinux.lds.S puts them")
    pe = _pe_header(data, pm)
    entries = [(0, 32), (STARTUP_64, 64)]
    if h.xloadflags & XLF_EFI_HANDOVER_32 and h.handover_offset:
        entries.append((h.handover_offset, 32))
    if h.xloadflags & XLF_EFI_HANDOVER_64 and h.handover_offset:
        entries.append((h.handover_offset + 0x200, 64))
    if pe is None:
        # no EFI stub: _end from init_size when the decompressor decides it (header.S:
        # INIT_SIZE = max(ZO__end + ZO_z_min_extract_offset, VO_INIT_SIZE))
        end = h.init_size - min_extract_offset(len(image.payload), h.payload_length)
        known = end % PAGE == 0 and edata <= end <= edata + (64 << 20)
        return ZoLayout(ehead, boundary, edata, end if known else h.init_size, known, None,
                        tuple(entries))
    o = pe.opt
    size_of_code, init_data, entry = _u32(data, o + 4), _u32(data, o + 8), _u32(data, o + 16)
    size_of_image = _u32(data, o + 56)
    end = size_of_image - pm
    zdata = size_of_code
    text, sdata = pe.sections.get(".text"), pe.sections.get(".data")
    problems = []
    unknown = sorted(set(pe.sections) - KNOWN_PE_SECTIONS)
    if unknown:
        problems.append(f"section {unknown[0]} linepack does not know how to move")
    if text is None or sdata is None:
        problems.append("no .text/.data section")
    else:
        vs, va, rs, rp = struct.unpack_from("<IIII", data, text + 8)
        if (vs, va, rs, rp) != (zdata, pm, zdata, pm):
            problems.append(".text section")
        vs, va, rs, rp = struct.unpack_from("<IIII", data, sdata + 8)
        if (vs, va, rs, rp) != (end - zdata, pm + zdata, edata - zdata, pm + zdata):
            problems.append(".data section")
    if init_data != end - zdata:
        problems.append("SizeOfInitializedData")
    if zdata % PAGE or end % PAGE or not boundary <= zdata < edata <= end:
        problems.append("_data/_end")
    if problems:
        raise BadInput(f"{path}: PE header does not match header.S's layout ({', '.join(problems)})"
                       ": cannot move the decompressor")
    entries.append((entry - pm, 64))
    compat = pe.sections.get(".compat")
    if compat is not None:
        va, = struct.unpack_from("<I", data, compat + 12)
        if data[va] != 1 or data[va + 1] != 8 or struct.unpack_from("<H", data, va + 2)[0] != 0x14c:
            raise BadInput(f"{path}: .compat section is not header.S's IA-32 entry record")
        entries.append((_u32(data, va + 4) - pm, 32))
    return ZoLayout(ehead, boundary, edata, end, True, pe, tuple(entries))


def min_extract_offset(output_len, input_len):
    """header.S's ZO_z_min_extract_offset (6.x: 128 KiB of extra bytes)."""
    extra = (output_len >> 8) + 131072
    off = output_len + extra - input_len if output_len > input_len else extra
    return (off + PAGE - 1) & ~(PAGE - 1)


# --- disassembly --------------------------------------------------------------------

def _decoders():
    import capstone
    out = {}
    for bits, mode in ((32, capstone.CS_MODE_32), (64, capstone.CS_MODE_64)):
        d = capstone.Cs(capstone.CS_ARCH_X86, mode)
        d.detail = True
        out[bits] = d
    return out


_STOPS = {"ret", "retf", "retfq", "iret", "iretd", "iretq", "ud2", "jmp", "ljmp", "sysret",
          "hlt"}


def _one(dec, zo, a):
    return next(dec.disasm(zo[a:a + 16], a, 1), None)


class _Code:
    """Decoded instructions of the decompressor: {address: (insn, bits)}."""

    def __init__(self, zo, layout):
        from capstone import x86_const as X
        self.X = X
        self.zo, self.lay = zo, layout
        self.dec = _decoders()
        self.insns = {}
        self._sweep(0, STARTUP_64, 32)
        self._sweep(STARTUP_64, layout.ehead, 64)
        B = layout.boundary
        work = [e for e in layout.entries if B <= e[0] < layout.edata]
        head = sorted(self.insns)
        for k, a in enumerate(head):
            i, bits = self.insns[a]
            work += self._branch_targets(i, bits)
            work += self._head_code_constant(i, bits, [self.insns[b][0] for b in head[k + 1:k + 7]])
        # first the code reached by control flow; below its end, RIP-relative address
        # loads are function pointers (above it lies .rodata)
        self._descend(work, layout.edata)
        top = self._top()
        tried = set()
        while True:
            more = {t for a, (i, bits) in self.insns.items() if a >= B
                    for t in self._lea_targets(i, bits) if t[0] < top} - tried
            if not more:
                break
            tried |= more
            self._descend(sorted(more), top)
        self.top = top = max(top, self._top())
        reached = sorted(a for a in self.insns if a >= B)
        self._sweep_gaps(reached)

    def _top(self):
        return max((a + i.size for a, (i, _) in self.insns.items() if a >= self.lay.boundary),
                   default=self.lay.boundary)

    def _sweep(self, lo, hi, bits):
        a = lo
        while a < hi:
            i = _one(self.dec[bits], self.zo, a)
            if i is None or a + i.size > hi:
                a += 1
                continue
            self.insns[a] = (i, bits)
            a += i.size

    def _is_branch(self, i):
        return self.X.X86_GRP_JUMP in i.groups or self.X.X86_GRP_CALL in i.groups

    def _branch_targets(self, i, bits):
        X = self.X
        if not self._is_branch(i):
            return []
        return [(op.imm, bits) for op in i.operands if op.type == X.X86_OP_IMM
                and self.lay.boundary <= op.imm < self.lay.edata]

    def _lea_targets(self, i, bits):
        X = self.X
        if bits != 64 or i.mnemonic != "lea":
            return []
        op = i.operands[1]
        if op.type != X.X86_OP_MEM or op.mem.base != X.X86_REG_RIP:
            return []
        return [(i.address + i.size + op.mem.disp, 64)]

    def _head_code_constant(self, i, bits, following):
        """An rva constant of the head that is jumped to or far-returned to (``lea
        rva(X)(%reg), %r`` then ``jmp *%r`` or ``push %r``): 64-bit code past B (the
        head enters the rest in 32-bit mode only by direct branches)."""
        X = self.X
        if i.mnemonic != "lea" or len(i.operands) != 2:
            return []
        dst, src = i.operands
        if src.type != X.X86_OP_MEM or src.mem.base == X.X86_REG_RIP:
            return []
        t = src.mem.disp & 0xffffffff
        if not self.lay.boundary <= t < self.lay.edata:
            return []
        for j in following:
            regs = [o.reg for o in j.operands if o.type == X.X86_OP_REG]
            if j.mnemonic in ("jmp", "push") and regs == [dst.reg]:
                return [(t, 64)]
            if j.operands and j.operands[0].type == X.X86_OP_REG and j.operands[0].reg == dst.reg:
                break
        return []

    def _descend(self, work, hi):
        while work:
            a, bits = work.pop()
            while self.lay.boundary <= a < hi and a not in self.insns:
                i = _one(self.dec[bits], self.zo, a)
                if i is None:
                    break
                self.insns[a] = (i, bits)
                work += self._branch_targets(i, bits)
                if i.mnemonic in _STOPS or i.mnemonic.startswith("ret"):
                    break
                a += i.size

    def _sweep_gaps(self, reached):
        """64-bit linear sweep of what lies between reached code (functions nothing
        references), from the first byte that is not padding (int3, nop, zero)."""
        pos = self.lay.boundary
        for a in reached:
            if a > pos:
                gap_lo = pos
                while gap_lo < a and self.zo[gap_lo] in (0xcc, 0x90, 0x00):
                    gap_lo += 1
                if gap_lo < a:
                    self._sweep(gap_lo, a, 64)
            pos = max(pos, a + self.insns[a][0].size)


def _s32(v):
    return v - (1 << 32) if v & 0x80000000 else v


def crossing_references(zo, layout):
    """REFS rows of every value of the decompressor bytes ``zo`` ([0, _edata)) that
    changes when [B, _end) moves; BadInput for a value it cannot explain."""
    code = _Code(zo, layout)
    X = code.X
    B, ehead, end = layout.boundary, layout.ehead, layout.end
    rows = []
    anchors = []                        # (address of the pop, register) in 32-bit code past B
    for a in sorted(code.insns):
        i, bits = code.insns[a]
        if bits == 32 and a >= B and i.mnemonic == "pop" and a - 5 in code.insns:
            c = code.insns[a - 5][0]
            if c.mnemonic == "call" and c.operands[0].imm == a:
                anchors.append(a)
    anchors = np.array(sorted(anchors), np.int64)

    def where(x):
        return "head" if x < ehead else "payload" if x < B else "moved"

    def bad(i, what):
        raise BadInput(f"decompressor at {i.address:#x} ({i.mnemonic} {i.op_str}): {what}; "
                       "cannot move the decompressor safely")

    for a in sorted(code.insns):
        i, bits = code.insns[a]
        moved = a >= B
        branch = X.X86_GRP_JUMP in i.groups or X.X86_GRP_CALL in i.groups
        for op in i.operands:
            if op.type == X.X86_OP_IMM and branch and i.imm_size:
                t = op.imm
                if (t >= B) != moved:
                    if i.imm_size != 4:
                        bad(i, f"a {8 * i.imm_size}-bit branch across the payload's end")
                    if B > t >= ehead:
                        bad(i, "a branch into the payload")
                    rows.append((a + i.imm_offset, 4, 1 if t >= B else -1, KIND_PCREL))
            elif op.type == X.X86_OP_MEM and op.mem.base == X.X86_REG_RIP:
                t = a + i.size + op.mem.disp
                if (t >= B) != moved:
                    if ehead + PAYLOAD_HEAD <= t < B:
                        bad(i, f"a reference to {t:#x}, inside the payload")
                    if t >= end or t < 0:
                        bad(i, f"a reference to {t:#x}, outside the decompressor")
                    rows.append((a + i.disp_offset, 4, 1 if t >= B else -1, KIND_PCREL))
            elif not branch and op.type in (X.X86_OP_IMM, X.X86_OP_MEM):
                if op.type == X.X86_OP_IMM:
                    v, off, size = op.imm, i.imm_offset, i.imm_size
                else:
                    v, off, size = op.mem.disp, i.disp_offset, i.disp_size
                if size != 4 or not off:
                    continue
                if not moved:
                    u = v & 0xffffffff
                    if B <= u <= end:
                        rows.append((a + off, 4, 1, KIND_RVA))
                elif bits == 32 and len(anchors):
                    k = int(np.searchsorted(anchors, a, side="right")) - 1
                    if k >= 0:
                        t = int(anchors[k]) + _s32(v & 0xffffffff)
                        if 0 <= t < B:
                            if t >= ehead + PAYLOAD_HEAD:
                                bad(i, f"a constant naming {t:#x}, inside the payload")
                            rows.append((a + off, 4, -1, KIND_ANCHOR))
    out = np.array(sorted(set(rows)), REFS)
    return out


# --- the rewrite --------------------------------------------------------------------

def grow(image, delta, refs=None):
    """(bytes of ``image`` with [B, _edata) moved up by ``delta``, its ZoLayout):
    crossing values patched, the payload room (zero-filled) grown by ``delta``, and
    the headers' ZO-derived fields updated. ``image.setup``'s payload fields are not
    yet rewritten (the caller writes the new payload and its length)."""
    if delta % PAGE or delta <= 0:
        raise ValueError("delta must be a positive multiple of 4096")
    lay = zo_layout(image)
    if not lay.end_known:
        raise BadInput(f"{image.path}: neither a PE header nor init_size tells the "
                       "decompressor's _end; cannot move it")
    h = image.setup
    pm = h.protected_mode_offset
    zo = bytearray(image.data[pm:pm + lay.edata])
    if refs is None:
        refs = crossing_references(bytes(zo), lay)
    for f, size, sign, _ in refs:
        f = int(f)
        v = struct.unpack_from("<I", zo, f)[0]
        struct.pack_into("<I", zo, f, (v + int(sign) * delta) & 0xffffffff)
    B = lay.boundary
    new_zo = zo[:B] + bytes(delta) + zo[B:]
    buf = bytearray(image.data[:pm]) + new_zo
    _patch_headers(buf, image, lay, delta)
    return bytes(buf), lay


def _add32(buf, off, delta):
    struct.pack_into("<I", buf, off, (_u32(buf, off) + delta) & 0xffffffff)


def _patch_headers(buf, image, lay, delta):
    h = image.setup
    B = lay.boundary
    struct.pack_into("<I", buf, 0x1f4, h.syssize + delta // 16)
    if h.kernel_info_offset >= B:
        _add32(buf, 0x268, delta)
    if h.handover_offset >= B:
        _add32(buf, 0x264, delta)
    elif h.handover_offset and h.xloadflags & (XLF_EFI_HANDOVER_32 | XLF_EFI_HANDOVER_64):
        raise BadInput(f"{image.path}: EFI handover entry {h.handover_offset:#x} lies before the "
                       "payload's end (header.S puts it in .text)")
    pe = lay.pe
    if pe is None:
        return
    o = pe.opt
    _add32(buf, o + 4, delta)                   # SizeOfCode = _data
    _add32(buf, o + 56, delta)                  # SizeOfImage = setup + _end
    if _u32(buf, o + 16) - pe.setup_size >= B:
        _add32(buf, o + 16, delta)              # AddressOfEntryPoint (efi_pe_entry)
    t = pe.sections[".text"]
    _add32(buf, t + 8, delta)                   # VirtualSize
    _add32(buf, t + 16, delta)                  # SizeOfRawData
    d = pe.sections[".data"]
    _add32(buf, d + 12, delta)                  # VirtualAddress
    _add32(buf, d + 20, delta)                  # PointerToRawData
    c = pe.sections.get(".compat")
    if c is not None:
        va = _u32(buf, c + 12)
        if _u32(buf, va + 4) - pe.setup_size >= B:
            _add32(buf, va + 4, delta)          # efi32_pe_entry


def room_delta(need, room):
    """The smallest move (a multiple of 4096) that gives ``need`` bytes of payload room."""
    return 0 if need <= room else (need - room + PAGE - 1) // PAGE * PAGE
