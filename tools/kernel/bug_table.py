"""``__bug_table``: BUG()/WARN() sites ``{s32 bug_addr; s32 file; u16 line; u16 flags}``.

Each bug_addr must point at a ``ud2`` (0f 0b) at an instruction boundary; the
kernel searches the table linearly, so order does not matter. Same 12-byte
record in 6.12 (include/asm-generic/bug.h, GENERIC_BUG_RELATIVE_POINTERS).
"""

import numpy as np

from .base import KernelTable, rename_fields


class BugTable(KernelTable):
    name = "__bug_table"
    start_symbol = "__start___bug_table"
    stop_symbol = "__stop___bug_table"
    dtype = np.dtype([("bug_addr", "<i4"), ("file", "<i4"), ("line", "<u2"), ("flags", "<u2")])
    relative_fields = ("bug_addr", "file")

    def parse(self, ctx):
        ent = self.decode(ctx, rel=("bug_addr", "file"), copy=("line", "flags"))
        return rename_fields(ent, {"bug_addr": "addr"})

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_code_refs(ctx, findings, "bug_addr", addr)
        d = ctx.disasm
        i = d.containing(addr)
        ok = i >= 0
        ic = np.maximum(i, 0)
        not_ud2 = ok & ~((d.raw[ic, 0] == 0x0F) & (d.raw[ic, 1] == 0x0B))
        self.report(findings, "error", "__bug_table.ud2", addr[not_ud2],
                    lambda a: f"BUG site {ctx.symbol_at(a)} is not a ud2 instruction")
        # flags (asm-generic/bug.h): WARNING 1, ONCE 2, DONE 4 (set at run time),
        # NO_CUT_HERE 8, and a taint number (< 19) in the high byte of WARNs only
        fl = entries["flags"].astype(np.int64)
        low, taint = fl & 0xFF, fl >> 8
        bad = ((low & ~0xB) != 0) | (taint >= 19) | ((taint != 0) & ((low & 1) == 0))
        self.report(findings, "error", "__bug_table.flags", addr[bad],
                    lambda a: f"BUG site {ctx.symbol_at(a)}: flags are not a valid build-time "
                              "BUGFLAG combination")
        return findings
