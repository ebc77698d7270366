"""``.static_call_sites``: ``{s32 addr; s32 key}``, both relative; key low bits
are flags (include/linux/static_call_types.h: STATIC_CALL_SITE_TAIL = 1,
STATIC_CALL_SITE_INIT = 2; objtool sets TAIL for a ``jmp``, the kernel sets
INIT at boot, so the image has it clear). The key is a ``__SCK__<name>``
symbol and the site calls or jumps to the ``__SCT__<name>`` trampoline. Each site is a 5-byte ``call``/``jmp``
rel32 (or a nop5/ret once patched) the kernel rewrites at boot; a tail-call
site may also be a 6-byte ``Jcc rel32`` (``0f 80..8f``: __static_call_validate
accepts it in 6.1 and 6.12 alike). Same layout in 6.1, 6.12 and 7.3
(include/linux/static_call_types.h).
"""

import numpy as np

from .base import KernelTable, split_key_flags

SITE_OPCODES = (0xE8, 0xE9, 0x0F, 0xC3, 0x2E)   # call, jmp, nop5, ret, cs-prefixed nop
TAIL, INIT = 1, 2


class StaticCallSites(KernelTable):
    name = ".static_call_sites"
    start_symbol = "__start_static_call_sites"
    stop_symbol = "__stop_static_call_sites"
    dtype = np.dtype([("addr", "<i4"), ("key", "<i4")])
    relative_fields = ("addr", "key")

    def parse(self, ctx):
        # flags: 1 = tail call, 2 = init
        return split_key_flags(self.decode(ctx, rel=("addr", "key"), extra=[("flags", "u1")]))

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_code_refs(ctx, findings, "site", addr)
        d = ctx.disasm
        i = d.containing(addr)
        ic = np.maximum(i, 0)
        five = (d.size[ic] == 5) & np.isin(d.raw[ic, 0], SITE_OPCODES)
        tail = (entries["flags"] & TAIL) != 0
        jcc = tail & (d.size[ic] == 6) & (d.raw[ic, 0] == 0x0F) & ((d.raw[ic, 1] & 0xF0) == 0x80)
        bad = (i >= 0) & ~(five | jcc)
        self.report(findings, "error", ".static_call_sites.insn", addr[bad],
                    lambda a: f"static call site {ctx.symbol_at(a)} is not a 5-byte call/jmp")
        # a call is not a tail call, a jmp is; INIT is only set at boot
        op = d.raw[ic, 0]
        wrong_tail = (i >= 0) & (((op == 0xE8) & tail) | (((op == 0xE9) | jcc) & ~tail))
        self.report(findings, "error", ".static_call_sites.flags", addr[wrong_tail | ((entries["flags"] & INIT) != 0)],
                    lambda a: f"static call site {ctx.symbol_at(a)}: tail/init flags disagree with "
                              "the instruction (tail = jmp; init is set at boot, never in the image)")
        # key = a __SCK__ symbol; a direct site calls its __SCT__ trampoline
        sck, sct = _static_call_symbols(ctx)
        key_name = [sck.get(k) for k in entries["key"].tolist()]
        self.report(findings, "error", ".static_call_sites.key",
                    [a for a, k in zip(addr.tolist(), key_name) if k is None],
                    lambda a: f"static call site {ctx.symbol_at(a)}: key is not a __SCK__ symbol")
        direct = (i >= 0) & ((op == 0xE8) | (op == 0xE9))
        disp = np.zeros(len(addr), np.int64)
        for k in range(4):
            disp |= d.raw[ic, 1 + k].astype(np.int64) << (8 * k)
        disp = np.where(disp >= 1 << 31, disp - (1 << 32), disp)
        tgt = (addr.astype(np.int64) + 5 + disp).astype(np.uint64)
        wrong = [a for a, dr, t, kn in zip(addr.tolist(), direct.tolist(), tgt.tolist(), key_name)
                 if dr and kn is not None and sct.get(t) != kn]
        self.report(findings, "error", ".static_call_sites.target", wrong,
                    lambda a: f"static call site {ctx.symbol_at(a)} does not call its key's "
                              "__SCT__ trampoline")
        return findings


def _static_call_symbols(ctx):
    """({key address: name}, {trampoline address: name}) for __SCK__/__SCT__ symbols."""
    if getattr(ctx, "_static_call_syms", None) is None:
        sck, sct = {}, {}
        for name, addrs in ctx.symbol_addresses().items():
            if name.startswith("__SCK__"):
                for a in addrs:
                    sck[a] = name[7:]
            elif name.startswith("__SCT__"):
                for a in addrs:
                    sct[a] = name[7:]
        ctx._static_call_syms = (sck, sct)
    return ctx._static_call_syms
