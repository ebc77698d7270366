"""``__ex_table``: exception fixups ``{s32 insn; s32 fixup; s32 data}``.

insn and fixup are relative to their fields; data holds the handler type and
register (not an address). Sorted by insn at build time (sorttable) because
the kernel binary-searches it. Unchanged in 6.12 and 7.3 (arch/x86/include/asm/extable.h; handler types
end at EX_TYPE_ERETU = 21 in both).
"""

import numpy as np

from .base import KernelTable


EX_TYPE_ERETU = 21


class ExTable(KernelTable):
    name = "__ex_table"
    start_symbol = "__start___ex_table"
    stop_symbol = "__stop___ex_table"
    dtype = np.dtype([("insn", "<i4"), ("fixup", "<i4"), ("data", "<i4")])
    relative_fields = ("insn", "fixup")
    resorted_by_relayout = True

    def parse(self, ctx):
        return self.decode(ctx, rel=("insn", "fixup"), copy=("data",))

    def check(self, ctx, entries):
        findings = []
        self.check_sorted(ctx, findings, entries["insn"], "faulting instructions")
        self.check_code_refs(ctx, findings, "insn", entries["insn"])
        self.check_code_refs(ctx, findings, "fixup", entries["fixup"])
        # an ERETU (FRED's return to user) that faults resumes at the FRED user
        # entry point (arch/x86/entry/entry_64_fred.S): its fixup is other code
        local = (entries["data"] & 0xFF) != EX_TYPE_ERETU
        self.check_same_code(ctx, findings, "fixup", entries["insn"][local], entries["fixup"][local])
        # data = type (low byte) | reg:4 flags:4 | imm:16 (asm/extable_fixup_types.h):
        # EX_TYPE_NONE (0) never appears in the table; 6.1 ends at EX_TYPE_ZEROPAD
        # (20), 6.12 at EX_TYPE_ERETU (21)
        typ = entries["data"] & 0xFF
        top = 20 if ctx.version is not None and ctx.version[:2] < (6, 2) else 21
        bad = (typ == 0) | (typ > top)
        self.report(findings, "error", "__ex_table.type", entries["insn"][bad],
                    lambda a: f"__ex_table: entry for {ctx.symbol_at(a)} has an unknown handler type")
        return findings

    def update(self, ctx, entries, amap):
        """Relayout: map insn and fixup through the address map, re-sort by insn.

        6.1's __ex_table relocations are R_X86_64_NONE (sorttable), so this is
        the only place its fields are updated.
        """
        out = entries.copy()
        out["insn"], _ = amap.map(entries["insn"])
        out["fixup"], _ = amap.map(entries["fixup"])
        order = np.argsort(out["insn"], kind="stable")
        out = out[order]
        out["entry"] = entries["entry"]          # slots stay, contents move
        return out

    def write(self, ctx, entries, out):
        if not len(entries):
            return
        e = entries["entry"].astype(np.int64)
        raw = np.zeros(len(entries), dtype=self.dtype)
        raw["insn"] = (entries["insn"].astype(np.int64) - e).astype(np.int32)
        raw["fixup"] = (entries["fixup"].astype(np.int64) - (e + 4)).astype(np.int32)
        raw["data"] = entries["data"]
        out.write(int(entries["entry"][0]), raw.view(np.uint8))
