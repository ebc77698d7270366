"""Standalone check that an image's relocation sections agree with its code.

What ships is built from the relocations: ``arch/x86/tools/relocs`` turns the
absolute ones into ``vmlinux.relocs``, which the decompressor applies when KASLR
moves the kernel, and relayout moves code by them. A field the code uses with no
relocation is silently wrong after either. Two kinds can be seen without the
original image:

- ``relocs.absolute``: an instruction's trailing imm32/disp32 (sign-extended) or
  a ``movabs`` imm64 that holds an address inside the kernel image, with no
  relocation at that field: KASLR would leave it pointing at the unrelocated
  address (kernels only: their addresses, 0xffffffff8..., are unmistakable).
- ``relocs.cross-section``: a rel32 call/jump into another section with no
  relocation: the assembler cannot resolve those, so the link relocation was
  dropped and relayout would not move the reference.

Only fields at the end of an instruction are read (immediates and displacements
with nothing after them), which is where the kernel's absolute addresses sit
(``mov $sym``, ``movq $sym, off(%rsp)``, ``sym(,%reg,8)``). Numbers that merely
look like addresses are left out: ALU/test immediates (flag masks), 32-bit moves
(zero-extended), the kernel's first page (``__START_KERNEL`` arithmetic); the
few remaining candidates are decoded in full with Capstone to make sure the
bytes are one whole imm32/disp32/imm64. No false positive on Debian's 6.1 vmlinux.
"""

import numpy as np

from ..image.relocs import R_X86_64_NONE
from ..kernel.base import Finding

KERNEL_MAP = 0xffffffff80000000


def relocated_fields(image):
    """Sorted field addresses (duplicates kept) of every relocation that applies to
    allocated code."""
    sites = [r.offset[r.type != R_X86_64_NONE] for r in image.relocations.values()
             if r.target.is_code and r.target.is_alloc]
    if not sites:
        return np.zeros(0, np.uint64)
    return np.sort(np.concatenate(sites).astype(np.uint64))


def _has(sorted_sites, addrs):
    if not len(sorted_sites):
        return np.zeros(len(addrs), bool)
    i = np.searchsorted(sorted_sites, addrs)
    ic = np.minimum(i, len(sorted_sites) - 1)
    return (i < len(sorted_sites)) & (sorted_sites[ic] == addrs)


def _tail(raw, size, width):
    """Little-endian value of the last ``width`` bytes of each instruction (uint64);
    rows shorter than ``width`` get garbage and must be masked by the caller."""
    cols = np.clip(size.astype(np.int64)[:, None] - width + np.arange(width), 0, raw.shape[1] - 1)
    b = np.ascontiguousarray(np.take_along_axis(raw, cols, axis=1))
    return b.view("<u4" if width == 4 else "<u8")[:, 0].astype(np.uint64)


_LEGACY_PREFIXES = (0x66, 0x67, 0xF2, 0xF3, 0x2E, 0x3E, 0x26, 0x64, 0x65, 0x36, 0xF0)
# ALU/test/imul immediates: masks and flag constants (CLONE_*, IORESOURCE_*) often
# look like 0xffffffff8.... addresses; an address there is rare and not checked.
_CONSTANT_IMM_OPS = (0x81, 0x69, 0xF7, 0x05, 0x0D, 0x15, 0x1D, 0x25, 0x2D, 0x35, 0x3D, 0xA9)


def _opcode_and_rex(raw):
    """(first opcode byte, REX byte or 0) of each instruction."""
    rows = np.arange(len(raw))
    pos = np.zeros(len(raw), np.int64)
    for _ in range(4):
        b = raw[rows, np.minimum(pos, raw.shape[1] - 1)]
        pos += np.isin(b, _LEGACY_PREFIXES)
    b = raw[rows, np.minimum(pos, raw.shape[1] - 1)]
    is_rex = (b & 0xF0) == 0x40
    rex = np.where(is_rex, b, 0)
    op = raw[rows, np.minimum(pos + is_rex, raw.shape[1] - 1)]
    return op, rex


_DETAIL = None


def _is_address_field(raw, address, size):
    """True when the instruction's last 4 (or, for movabs, 8) bytes are one whole
    immediate or displacement that the CPU uses as a 64-bit address."""
    global _DETAIL
    import capstone
    from capstone import x86
    if _DETAIL is None:
        _DETAIL = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        _DETAIL.detail = True
    insn = next(_DETAIL.disasm(bytes(raw[:size]), address), None)
    if insn is None or insn.size != size:
        return False
    width = 8 if size == 10 and insn.imm_size == 8 else 4
    if insn.imm_offset == size - width and insn.imm_size == width:
        return any(op.type == x86.X86_OP_IMM and op.size == 8 for op in insn.operands)
    if width == 4 and insn.disp_offset == size - 4 and insn.disp_size == 4:
        return any(op.type == x86.X86_OP_MEM and op.mem.base != x86.X86_REG_RIP
                   for op in insn.operands)
    return False


def check_code_relocations(ctx, findings, limit=20):
    """Append relocs.* findings; returns the number of fields checked."""
    image = ctx.image
    if not image.has_link_relocations():
        return 0
    sites = relocated_fields(image)
    dis = ctx.disasm
    addr, size, raw = dis.addr, dis.size.astype(np.int64), dis.raw
    checked = 0
    if ctx.is_kernel:
        lo = image.symbol_address("_text")
        hi = image.symbol_address("_end")
        if lo is not None and hi is not None and lo >= KERNEL_MAP:
            # The head page counts as numbers: kaslr_offset() subtracts the link
            # address __START_KERNEL (= _text) as a constant, and Hyper-V MSR
            # values alias _text + small offsets.
            lo += 0x1000
            # Cheap first cut on the instruction's last byte (the address's top
            # byte for an imm32/disp32, 0xff for an imm64), then decode the few rows.
            rows = np.arange(len(raw))
            last = raw[rows, np.clip(size - 1, 0, raw.shape[1] - 1)]
            top_lo, top_hi = (lo >> 24) & 0xFF, ((hi - 1) >> 24) & 0xFF
            movabs = (size == 10) & ((raw[:, 0] & 0xF8) == 0x48) & ((raw[:, 1] & 0xF8) == 0xB8)
            pick = np.flatnonzero(((size >= 5) & (last >= top_lo) & (last <= top_hi)) | movabs)
            p_raw, p_size, p_addr = raw[pick], size[pick], addr[pick]
            v32 = _tail(p_raw, p_size, 4)
            ext = np.where(v32 >= np.uint64(1 << 31), v32 | np.uint64(0xffffffff00000000), v32)
            op, rex = _opcode_and_rex(p_raw)
            rex_w = (rex & 0x08) != 0
            # 32-bit operand moves zero-extend: their imm32 is a number, not an address.
            zero_ext = (((op & 0xF8) == 0xB8) | (op == 0xC7)) & ~rex_w
            c32 = (p_size >= 5) & (ext >= np.uint64(lo)) & (ext < np.uint64(hi)) \
                & ~np.isin(op, _CONSTANT_IMM_OPS) & ~zero_ext
            c64 = movabs[pick]
            v64 = _tail(p_raw, p_size, 8)
            c64 &= (v64 >= np.uint64(lo)) & (v64 < np.uint64(hi))
            c32 &= ~c64
            field = np.concatenate([(p_addr + p_size.astype(np.uint64) - np.uint64(4))[c32],
                                    (p_addr + np.uint64(2))[c64]])
            value = np.concatenate([ext[c32], v64[c64]])
            insn = pick[np.concatenate([np.flatnonzero(c32), np.flatnonzero(c64)])]
            checked += len(field)
            bad = ~_has(sites, field)
            # The few unrelocated candidates are decoded in full: only a real imm32/
            # disp32/imm64 field (not a disp8 + imm8 tail that happens to look like
            # an address) counts.
            bad[bad] = [_is_address_field(raw[i], int(addr[i]), int(size[i]))
                        for i in insn[bad].tolist()]
            for f, v in list(zip(field[bad].tolist(), value[bad].tolist()))[:limit]:
                findings.append(Finding("error", "relocs.absolute", f,
                                        f"code field at {ctx.symbol_at(f)} holds kernel address "
                                        f"{v:#x} ({ctx.symbol_at(v)}) but has no relocation: "
                                        "KASLR and relayout would leave it stale"))
            if bad.sum() > limit:
                findings.append(Finding("error", "relocs.absolute", None,
                                        f"... {int(bad.sum()) - limit} more"))
    # rel32 branches into another section
    idx, target, kind = dis.branch_targets()
    sel = kind == 4
    idx, target = idx[sel], target[sel]
    secs = sorted((s.addr, s.end, i) for i, s in enumerate(image.sections)
                  if s.is_alloc and s.size and s.addr)
    starts = np.array([s[0] for s in secs], np.uint64)
    ends = np.array([s[1] for s in secs], np.uint64)

    def section_of(a):
        j = np.searchsorted(starts, a, side="right").astype(np.int64) - 1
        jc = np.maximum(j, 0)
        return np.where((j >= 0) & (a < ends[jc]), jc, -1)

    src = addr[idx]
    cross = section_of(src) != section_of(target)
    field = (src + size[idx].astype(np.uint64) - np.uint64(4))[cross]
    checked += len(field)
    bad = ~_has(sites, field)
    for f, t in list(zip(field[bad].tolist(), target[cross][bad].tolist()))[:limit]:
        findings.append(Finding("error", "relocs.cross-section", f,
                                f"rel32 branch at {ctx.symbol_at(f)} into another section "
                                f"({ctx.symbol_at(t)}) has no relocation"))
    return checked
