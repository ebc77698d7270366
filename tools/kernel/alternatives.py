"""``.altinstructions``: 6.1 ``struct alt_instr {s32 instr; s32 repl; u16 cpuid;
u8 instrlen; u8 replacementlen}`` (12 bytes). The original instruction range
must start and end on instruction boundaries; the replacement lives in
``.altinstr_replacement`` and may not be longer than the original.
"""

import numpy as np

from .base import KernelTable, rel32_targets


class Alternatives(KernelTable):
    name = ".altinstructions"
    start_symbol = "__alt_instructions"
    stop_symbol = "__alt_instructions_end"
    dtype = np.dtype([("instr", "<i4"), ("repl", "<i4"), ("cpuid", "<u2"),
                      ("instrlen", "u1"), ("replacementlen", "u1")])

    def parse(self, ctx):
        base, raw = self.raw(ctx)
        n = len(raw)
        ent = np.zeros(n, dtype=[("entry", "<u8"), ("instr", "<u8"), ("repl", "<u8"), ("cpuid", "<u2"),
                                 ("instrlen", "u1"), ("replacementlen", "u1")])
        if n == 0:
            return ent
        e = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(12)
        ent["entry"] = e
        ent["instr"] = rel32_targets(e, raw["instr"])
        ent["repl"] = rel32_targets(e + np.uint64(4), raw["repl"])
        for f in ("cpuid", "instrlen", "replacementlen"):
            ent[f] = raw[f]
        return ent

    def check(self, ctx, entries):
        findings = []
        instr = entries["instr"]
        self.check_code_refs(ctx, findings, "instr", instr)
        end = instr + entries["instrlen"].astype(np.uint64)
        self.check_code_refs(ctx, findings, "instr_end", end)
        longer = entries["replacementlen"] > entries["instrlen"]
        self.report(findings, "error", ".altinstructions.length", instr[longer],
                    lambda a: f"alternative at {ctx.symbol_at(a)}: replacement longer than original")
        repl_sec = ctx.image.section(".altinstr_replacement")
        has_repl = entries["replacementlen"] > 0
        if repl_sec is not None:
            r = entries["repl"]
            out = has_repl & ((r < np.uint64(repl_sec.addr)) |
                              (r + entries["replacementlen"].astype(np.uint64) > np.uint64(repl_sec.end)))
            # Some replacements are plain code elsewhere (e.g. .altinstr_aux) - code is enough.
            out &= ~ctx.in_code(r)
            self.report(findings, "error", ".altinstructions.repl", instr[out],
                        lambda a: f"alternative at {ctx.symbol_at(a)}: replacement outside code")
        return findings
