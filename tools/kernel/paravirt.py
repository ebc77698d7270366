"""``.parainstructions``: 6.1 ``struct paravirt_patch_site {u8 *instr; u8 type;
u8 len;}`` padded to 16 bytes, with an ABSOLUTE instruction address.

Gone since 6.8 (paravirt calls became alternatives with ALT_FLAG_DIRECT_CALL,
see alternatives.py): Debian 6.12 has no ``__parainstructions`` and the table
is skipped.
"""

import numpy as np

from .base import KernelTable


class ParaInstructions(KernelTable):
    name = ".parainstructions"
    start_symbol = "__parainstructions"
    stop_symbol = "__parainstructions_end"
    dtype = np.dtype([("instr", "<u8"), ("type", "u1"), ("len", "u1"), ("pad", "u1", 6)])

    def parse(self, ctx):
        base, raw = self.raw(ctx)
        n = len(raw)
        ent = np.zeros(n, dtype=[("entry", "<u8"), ("instr", "<u8"), ("type", "u1"), ("len", "u1")])
        if n == 0:
            return ent
        ent["entry"] = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(16)
        ent["instr"], ent["type"], ent["len"] = raw["instr"], raw["type"], raw["len"]
        return ent

    def check(self, ctx, entries):
        findings = []
        self.check_code_refs(ctx, findings, "instr", entries["instr"])
        self.check_code_refs(ctx, findings, "instr_end",
                             entries["instr"] + entries["len"].astype(np.uint64), end_of_range=True)
        return findings
