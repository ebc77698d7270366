"""Operand facts for many instructions at once, through Capstone's C API.

Capstone's Python wrapper builds an instruction object and a detail object per
decoded instruction (~0.1 ms each: seconds for the ~26,000 candidates of a
vmlinux). Here the candidates' bytes are laid end to end and decoded in one
``cs_disasm`` call with details on; the details are read with a numpy dtype.
The facts are exactly the wrapper's (the same decoder, the same bytes).
"""

import ctypes

import numpy as np

import capstone
from capstone import _cs
from capstone import x86 as csx86

_INSN_SIZE = ctypes.sizeof(capstone._cs_insn)
_INSN_OFF = {n: getattr(capstone._cs_insn, n).offset for n, _ in capstone._cs_insn._fields_}
_INSN = np.dtype({"names": ["size", "detail"], "formats": ["<u2", "<u8"],
                  "offsets": [_INSN_OFF["size"], _INSN_OFF["detail"]], "itemsize": _INSN_SIZE})
_X86 = capstone._cs_detail.arch.offset            # cs_x86 inside cs_detail
_OP = ctypes.sizeof(csx86.X86Op)
_OP_COUNT = _X86 + csx86.CsX86.op_count.offset
_OPERANDS = _X86 + csx86.CsX86.operands.offset
_OP_TYPE = csx86.X86Op.type.offset
_OP_MEM_BASE = csx86.X86Op.value.offset + csx86.X86OpMem.base.offset
_DISP_OFFSET = _X86 + csx86.CsX86.encoding.offset + csx86.CsX86Encoding.disp_offset.offset
_DETAIL_BYTES = _X86 + ctypes.sizeof(csx86.CsX86)       # read up to the end of cs_x86


def _one(raw, size):
    """The wrapper's answer for one instruction's bytes (the rare candidate the
    batch cannot decode in step: bytes Capstone rejects)."""
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    md.detail = True
    ins = next(md.disasm(bytes(raw[:size]), 0), None)
    if ins is None:
        return False, False, 0
    bases = {o.mem.base for o in ins.operands if o.type == csx86.X86_OP_MEM}
    return csx86.X86_REG_RIP in bases, csx86.X86_REG_EIP in bases, int(ins.disp_offset)


def _facts(d):
    """(RIP-based memory operand, EIP-based one, displacement offset) from detail
    rows ``d``."""
    nops = d[:, _OP_COUNT]
    rip = np.zeros(len(d), bool)
    eip = np.zeros(len(d), bool)
    for j in range(8):                            # cs_x86.operands[8]
        o = _OPERANDS + j * _OP
        typ = d[:, o + _OP_TYPE:o + _OP_TYPE + 4].copy().view("<u4")[:, 0]
        base = d[:, o + _OP_MEM_BASE:o + _OP_MEM_BASE + 4].copy().view("<u4")[:, 0]
        mem = (j < nops) & (typ == csx86.X86_OP_MEM)
        rip |= mem & (base == csx86.X86_REG_RIP)
        eip |= mem & (base == csx86.X86_REG_EIP)
    return rip, eip, d[:, _DISP_OFFSET].astype(np.int64)


def rip_relative(raw, size):
    """Per instruction (rows of ``raw``: leading bytes, ``size``: lengths):
    (has a RIP-based memory operand, offset of its displacement in the
    instruction), as the wrapper answers for each instruction's bytes alone
    (nothing decoded: (False, 0))."""
    rip, _, disp_off = ip_relative(raw, size)
    return rip, disp_off


def ip_relative(raw, size):
    """rip_relative, and also EIP-based operands (a 67 prefix: the instruction's
    end plus the displacement, truncated to 32 bits): (RIP-based, EIP-based,
    displacement offset)."""
    raw = np.asarray(raw)
    size = np.asarray(size, np.int64)
    n = len(size)
    has = np.zeros(n, bool)
    eip = np.zeros(n, bool)
    disp_off = np.zeros(n, np.int64)
    if not n:
        return has, eip, disp_off
    starts = np.concatenate([[0], np.cumsum(size)])
    cols = np.arange(raw.shape[1])
    code = raw[cols[None, :] < size[:, None]].tobytes()      # row-major: rows in order
    handle = ctypes.c_size_t()
    if _cs.cs_open(capstone.CS_ARCH_X86, capstone.CS_MODE_64, ctypes.byref(handle)) != \
            capstone.CS_ERR_OK:
        raise RuntimeError("capstone cs_open failed")
    try:
        _cs.cs_option(handle, capstone.CS_OPT_DETAIL, capstone.CS_OPT_ON)
        insn = ctypes.POINTER(capstone._cs_insn)()
        k = 0
        while k < n:
            pos = int(starts[k])
            count = _cs.cs_disasm(handle, code[pos:], len(code) - pos, 0, 0, ctypes.byref(insn))
            got = 0
            if count:
                try:
                    rows = np.frombuffer(ctypes.string_at(ctypes.addressof(insn.contents),
                                                          count * _INSN_SIZE), _INSN)
                    # in step with the candidates while the lengths agree
                    agree = rows["size"].astype(np.int64) == size[k:k + count]
                    got = count if agree.all() else int(np.argmin(agree))
                    if got:
                        blob = b"".join(ctypes.string_at(int(p), _DETAIL_BYTES)
                                        for p in rows["detail"][:got].tolist())
                        d = np.frombuffer(blob, np.uint8).reshape(got, _DETAIL_BYTES)
                        has[k:k + got], eip[k:k + got], disp_off[k:k + got] = _facts(d)
                finally:
                    _cs.cs_free(insn, count)
            k += got
            if k < n:
                # candidate k stopped the batch (rejected, or decoded with the next
                # candidate's bytes): ask about its bytes alone
                has[k], eip[k], disp_off[k] = _one(raw[k], int(size[k]))
                k += 1
    finally:
        _cs.cs_close(ctypes.byref(handle))
    return has, eip, disp_off
