"""Where an instruction's address fields sit, for many instructions at once.

``verify --against`` compares every instruction whose bytes changed: each
changed byte must lie in a displacement or immediate whose value translates.
Capstone's detail decode (one Python object per instruction, ~30 us) was most
of that check's time. The layout of those fields (offset and size of the
displacement and the immediate, and whether the memory operand is
RIP-relative) is fixed by the bytes in front of the first field: prefixes,
REX/VEX/EVEX, opcode, ModRM and SIB. The field *values* never change it. So
each distinct "header" is decoded by Capstone once and every other
instruction starting with the same header reuses the answer.

Why a header match is safe: x86 decoding reads prefixes, opcode, ModRM and SIB
first and derives the displacement and immediate sizes from them alone; an
instruction whose first ``h`` bytes are exactly another's complete header
therefore decodes the same way up to its fields. The instruction's length,
known from the bulk decode, must also agree, else Capstone decodes it itself.
"""

import numpy as np

import capstone
from capstone import x86 as cx86


class FieldLayouts:
    """Capstone's field layout per header, decoded once per distinct header."""

    def __init__(self):
        self._cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        self._cs.detail = True
        self._by_header = {}        # header bytes -> layout tuple
        self._lengths = []          # header lengths seen, ascending

    def _decode(self, code, address):
        """(size, disp offset, disp size, imm offset, imm size, rip) or None."""
        ins = next(self._cs.disasm(code, address, 1), None)
        if ins is None:
            return None
        # EIP-based (67 prefix, rip 2) as RIP-based: the end plus the displacement,
        # truncated to 32 bits by the caller (eip=True) as the CPU does
        bases = [op.mem.base for op in ins.operands if op.type == cx86.X86_OP_MEM]
        rip = 2 if cx86.X86_REG_EIP in bases else 1 if cx86.X86_REG_RIP in bases else 0
        # 64-bit mode has only 1-, 4- (and moffs 8-) byte displacements; Capstone 5
        # reports 2 for RIP-relative operands of 16-bit instructions (66 prefix)
        dsz = 4 if ins.disp_size == 2 else ins.disp_size
        d_off = ins.disp_offset if dsz else 0
        i_off = ins.imm_offset if ins.imm_size else 0
        return ins.size, d_off, dsz, i_off, ins.imm_size, rip

    def layouts(self, raw, size, addr, eip=False):
        """Per row: (decoded, disp offset, disp size, imm offset, imm size, rip) arrays;
        ``rip`` is true for RIP- and EIP-based operands, and with ``eip`` a seventh
        array says which are EIP-based (their target is masked to 32 bits).

        ``raw``: (n, 16) uint8 leading bytes; ``size``: lengths; ``addr``: addresses
        (only for Capstone's decode of a new header)."""
        n = len(size)
        out = np.zeros((n, 6), np.int64)
        blob = np.ascontiguousarray(raw, dtype=np.uint8).tobytes()
        width = raw.shape[1] if n else 16
        by_header, lengths = self._by_header, self._lengths
        sizes = np.asarray(size).tolist()
        addrs = np.asarray(addr).tolist()
        for k in range(n):
            base = k * width
            sz = sizes[k]
            got = None
            for h in lengths:
                if h > sz:
                    break
                got = by_header.get(blob[base:base + h])
                if got is not None:
                    break
            if got is None or got[0] != sz:
                code = blob[base:base + sz]
                got = self._decode(code, addrs[k])
                if got is None or got[0] != sz:
                    continue                         # undecodable: row stays 0
                fields = [off for off, fsz in ((got[1], got[2]), (got[3], got[4])) if fsz]
                h = min(fields) if fields else sz
                if h not in lengths:
                    lengths.append(h)
                    lengths.sort()
                by_header[code[:h]] = got
            out[k] = (1, got[1], got[2], got[3], got[4], int(got[5]))
        got = (out[:, 0].astype(bool), out[:, 1], out[:, 2], out[:, 3], out[:, 4],
               out[:, 5] > 0)
        return got + (out[:, 5] == 2,) if eip else got


def field_values(raw, offset, size):
    """Little-endian value of ``size`` bytes at ``offset`` per row, sign-extended
    to 64 bits when narrower (uint64; wraps like the CPU's address arithmetic)."""
    n = len(raw)
    v = np.zeros(n, np.uint64)
    rows = np.arange(n)
    for k in range(8):
        col = np.minimum(offset + k, raw.shape[1] - 1)
        byte = raw[rows, col].astype(np.uint64) << np.uint64(8 * k)
        v |= np.where(k < size, byte, np.uint64(0))
    narrow = (size > 0) & (size < 8)
    bits = np.where(narrow, size * 8, 64).astype(np.uint64)
    sign = narrow & (((v >> np.maximum(bits - np.uint64(1), np.uint64(0))) & np.uint64(1)) == 1)
    high = ~((np.uint64(1) << np.minimum(bits, np.uint64(63))) - np.uint64(1))
    return np.where(sign, v | high, v)


__all__ = ["FieldLayouts", "field_values"]
