"""``__ex_table``: exception fixups ``{s32 insn; s32 fixup; s32 data}``.

insn and fixup are relative to their fields; data holds the handler type and
register (not an address). Sorted by insn at build time (sorttable) because
the kernel binary-searches it.
"""

import numpy as np

from .base import KernelTable, rel32_targets


class ExTable(KernelTable):
    name = "__ex_table"
    start_symbol = "__start___ex_table"
    stop_symbol = "__stop___ex_table"
    dtype = np.dtype([("insn", "<i4"), ("fixup", "<i4"), ("data", "<i4")])

    def parse(self, ctx):
        base, raw = self.raw(ctx)
        n = len(raw)
        ent = np.zeros(n, dtype=[("entry", "<u8"), ("insn", "<u8"), ("fixup", "<u8"), ("data", "<i4")])
        if n == 0:
            return ent
        e = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(12)
        ent["entry"] = e
        ent["insn"] = rel32_targets(e, raw["insn"])
        ent["fixup"] = rel32_targets(e + np.uint64(4), raw["fixup"])
        ent["data"] = raw["data"]
        return ent

    def check(self, ctx, entries):
        findings = []
        self.check_sorted(ctx, findings, entries["insn"], "faulting instructions")
        self.check_code_refs(ctx, findings, "insn", entries["insn"])
        self.check_code_refs(ctx, findings, "fixup", entries["fixup"])
        return findings
