"""``.altinstructions``: ``struct alt_instr``, one record per patch site. The
original instruction range must start and end on instruction boundaries; the
replacement lives in ``.altinstr_replacement`` and may not be longer than the
original.

Layouts (arch/x86/include/asm/alternative.h):

- up to 6.2: ``{s32 instr; s32 repl; u16 cpuid; u8 instrlen; u8 replacementlen}``
  (12 bytes, packed);
- 6.3 and later: the feature word became ``u32 ft_flags`` = ``cpuid:16 | flags:16``
  (``ALT_FLAG_NOT``, 6.12 also ``ALT_FLAG_DIRECT_CALL``), so
  ``{s32 instr; s32 repl; u16 cpuid; u16 flags; u8 instrlen; u8 replacementlen}``
  (14 bytes, packed). Debian 6.12's table is 129,948 bytes: a multiple of both 12
  and 14, so the size alone cannot tell the layouts apart. 7.3 keeps the 14-byte
  record and the same two flags.
"""

import numpy as np

from .base import KernelTable

ALT_INSTR_6_1 = np.dtype([("instr", "<i4"), ("repl", "<i4"), ("cpuid", "<u2"),
                          ("instrlen", "u1"), ("replacementlen", "u1")])
ALT_INSTR_6_3 = np.dtype([("instr", "<i4"), ("repl", "<i4"), ("cpuid", "<u2"), ("flags", "<u2"),
                          ("instrlen", "u1"), ("replacementlen", "u1")])
ALT_FLAG_NOT = 1
ALT_FLAG_DIRECT_CALL = 2


class Alternatives(KernelTable):
    name = ".altinstructions"
    start_symbol = "__alt_instructions"
    stop_symbol = "__alt_instructions_end"
    layouts = [((0, 0), ALT_INSTR_6_1), ((6, 3), ALT_INSTR_6_3)]
    dtype = ALT_INSTR_6_1
    relative_fields = ("instr", "repl")

    def parse(self, ctx):
        self.select_layout(ctx)
        copy = ("cpuid", "instrlen", "replacementlen")
        if "flags" in self.dtype.names:
            copy += ("flags",)
        return self.decode(ctx, rel=("instr", "repl"), copy=copy)

    def check(self, ctx, entries):
        findings = []
        instr = entries["instr"]
        self.check_code_refs(ctx, findings, "instr", instr)
        end = instr + entries["instrlen"].astype(np.uint64)
        self.check_code_refs(ctx, findings, "instr_end", end, end_of_range=True)
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
        # the replacement code is decoded too (image/coverage.py): it starts and
        # ends on its own instruction boundaries
        r = entries["repl"][has_repl]
        self.check_code_refs(ctx, findings, "repl", r)
        self.check_code_refs(ctx, findings, "repl_end",
                             r + entries["replacementlen"][has_repl].astype(np.uint64), end_of_range=True,
                             allow_section_end=True)
        # feature bits: NCAPINTS words of CPU features then NBUGINTS words of bugs
        # (at most 24 words in 6.1.y and 6.12); 6.1 keeps ALT_FLAG_NOT in bit 15
        feature = entries["cpuid"].astype(np.int64) & (0x7FFF if "flags" not in entries.dtype.names else 0xFFFF)
        self.report(findings, "error", ".altinstructions.cpuid", instr[feature >= 32 * 24],
                    lambda a: f"alternative at {ctx.symbol_at(a)}: feature bit beyond the last "
                              "capability/bug word")
        return findings
