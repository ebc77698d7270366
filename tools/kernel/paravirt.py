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
        return self.decode(ctx, copy=("instr", "type", "len"))

    def check(self, ctx, entries):
        findings = []
        self.check_code_refs(ctx, findings, "instr", entries["instr"])
        self.check_code_refs(ctx, findings, "instr_end",
                             entries["instr"] + entries["len"].astype(np.uint64), end_of_range=True)
        # each site is the compiler's `call *pv_ops[type](%rip)` (ff 15 disp32)
        # until boot patches it: its memory operand names its own slot
        pv = _pv_ops(ctx)
        if pv is not None and len(entries):
            start, size = pv
            d = ctx.disasm
            i = d.containing(entries["instr"])
            ic = np.maximum(i, 0)
            raw = d.raw[ic]
            disp = np.zeros(len(entries), np.int64)
            for k in range(4):
                disp |= raw[:, 2 + k].astype(np.int64) << (8 * k)
            disp = np.where(disp >= 1 << 31, disp - (1 << 32), disp)
            slot = entries["instr"].view(np.int64) + 6 + disp
            is_call = (i >= 0) & (raw[:, 0] == 0xFF) & (raw[:, 1] == 0x15) & (d.size[ic] == 6)
            want = np.int64(start - (1 << 64) if start >= 1 << 63 else start) + 8 * entries["type"].astype(np.int64)
            bad = (entries["type"].astype(np.int64) * 8 >= size) | \
                (is_call & ((slot != want) | (entries["len"] != 6)))
            self.report(findings, "error", ".parainstructions.type", entries["instr"][bad],
                        lambda a: f".parainstructions: site {ctx.symbol_at(a)}: type or length "
                                  "disagrees with its call through pv_ops")
        return findings


def _pv_ops(ctx):
    """(address, size) of pv_ops, the table of paravirt op slots, or None."""
    names, syms = ctx.image.symbol_table()
    for k, n in enumerate(names):
        if n == "pv_ops" and int(syms["size"][k]):
            return int(syms["value"][k]), int(syms["size"][k])
    return None
