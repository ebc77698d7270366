"""``.static_call_sites``: ``{s32 addr; s32 key}``, both relative; key low bits
are flags (1 = init, 2 = tail call). Each site is a 5-byte ``call``/``jmp``
rel32 (or a nop5/ret once patched) the kernel rewrites at boot.
"""

import numpy as np

from .base import KernelTable, rel32_targets

SITE_OPCODES = (0xE8, 0xE9, 0x0F, 0xC3, 0x2E)   # call, jmp, nop5, ret, cs-prefixed nop


class StaticCallSites(KernelTable):
    name = ".static_call_sites"
    start_symbol = "__start_static_call_sites"
    stop_symbol = "__stop_static_call_sites"
    dtype = np.dtype([("addr", "<i4"), ("key", "<i4")])

    def parse(self, ctx):
        base, raw = self.raw(ctx)
        n = len(raw)
        ent = np.zeros(n, dtype=[("entry", "<u8"), ("addr", "<u8"), ("key", "<u8"), ("flags", "u1")])
        if n == 0:
            return ent
        e = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(8)
        ent["entry"] = e
        ent["addr"] = rel32_targets(e, raw["addr"])
        key = (e + np.uint64(4)).astype(np.int64) + raw["key"]
        ent["flags"] = (key & 3).astype(np.uint8)
        ent["key"] = (key & ~3).astype(np.uint64)
        return ent

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_code_refs(ctx, findings, "site", addr)
        d = ctx.disasm
        i = d.containing(addr)
        ic = np.maximum(i, 0)
        bad = (i >= 0) & ((d.size[ic] != 5) | ~np.isin(d.raw[ic, 0], SITE_OPCODES))
        self.report(findings, "error", ".static_call_sites.insn", addr[bad],
                    lambda a: f"static call site {ctx.symbol_at(a)} is not a 5-byte call/jmp")
        return findings
