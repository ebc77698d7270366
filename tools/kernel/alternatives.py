"""``.altinstructions``: 6.1 ``struct alt_instr {s32 instr; s32 repl; u16 cpuid;
u8 instrlen; u8 replacementlen}`` (12 bytes). The original instruction range
must start and end on instruction boundaries; the replacement lives in
``.altinstr_replacement`` and may not be longer than the original.
"""

import numpy as np

from .base import KernelTable


class Alternatives(KernelTable):
    name = ".altinstructions"
    start_symbol = "__alt_instructions"
    stop_symbol = "__alt_instructions_end"
    dtype = np.dtype([("instr", "<i4"), ("repl", "<i4"), ("cpuid", "<u2"),
                      ("instrlen", "u1"), ("replacementlen", "u1")])

    def parse(self, ctx):
        return self.decode(ctx, rel=("instr", "repl"), copy=("cpuid", "instrlen", "replacementlen"))

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
