"""``.static_call_sites``: ``{s32 addr; s32 key}``, both relative; key low bits
are flags (1 = init, 2 = tail call). Each site is a 5-byte ``call``/``jmp``
rel32 (or a nop5/ret once patched) the kernel rewrites at boot; a tail-call
site may also be a 6-byte ``Jcc rel32`` (``0f 80..8f``: __static_call_validate
accepts it in 6.1 and 6.12 alike). Same layout in 6.1 and 6.12
(include/linux/static_call_types.h).
"""

import numpy as np

from .base import KernelTable

SITE_OPCODES = (0xE8, 0xE9, 0x0F, 0xC3, 0x2E)   # call, jmp, nop5, ret, cs-prefixed nop


class StaticCallSites(KernelTable):
    name = ".static_call_sites"
    start_symbol = "__start_static_call_sites"
    stop_symbol = "__stop_static_call_sites"
    dtype = np.dtype([("addr", "<i4"), ("key", "<i4")])

    def parse(self, ctx):
        ent = self.decode(ctx, rel=("addr", "key"))
        out = np.zeros(len(ent), dtype=ent.dtype.descr + [("flags", "u1")])
        for f in ent.dtype.names:
            out[f] = ent[f]
        # the key's low bits are flags (1 = init, 2 = tail call)
        out["flags"] = (ent["key"] & np.uint64(3)).astype(np.uint8)
        out["key"] = ent["key"] & ~np.uint64(3)
        return out

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_code_refs(ctx, findings, "site", addr)
        d = ctx.disasm
        i = d.containing(addr)
        ic = np.maximum(i, 0)
        five = (d.size[ic] == 5) & np.isin(d.raw[ic, 0], SITE_OPCODES)
        tail = (entries["flags"] & 2) != 0
        jcc = tail & (d.size[ic] == 6) & (d.raw[ic, 0] == 0x0F) & ((d.raw[ic, 1] & 0xF0) == 0x80)
        bad = (i >= 0) & ~(five | jcc)
        self.report(findings, "error", ".static_call_sites.insn", addr[bad],
                    lambda a: f"static call site {ctx.symbol_at(a)} is not a 5-byte call/jmp")
        return findings
