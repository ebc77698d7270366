"""ORC unwind tables: ``.orc_unwind_ip`` (s32 relative IPs) and ``.orc_unwind``
(6-byte entries), parallel arrays sorted by IP at build time (sorttable); the
unwinder binary-searches them, so order is an invariant, and every IP must
be an instruction boundary (or the end of a code section: terminators).
"""

import numpy as np

from .base import Finding, KernelTable, rel32_targets

ORC_ENTRY = np.dtype([("sp_offset", "<i2"), ("bp_offset", "<i2"), ("bits", "<u2")])
ORC_TYPES = 3          # 6.1: CALL, REGS, REGS_PARTIAL
ORC_REG_MAX = 10


class OrcTable(KernelTable):
    name = "orc_unwind"
    start_symbol = "__start_orc_unwind_ip"
    stop_symbol = "__stop_orc_unwind_ip"
    dtype = np.dtype("<i4")
    resorted_by_relayout = True

    def ranges(self, ctx):
        out = super().ranges(ctx)
        a = ctx.image.symbol_address("__start_orc_unwind")
        b = ctx.image.symbol_address("__stop_orc_unwind")
        if a is not None and b is not None:
            out.append((a, (b - a) // ORC_ENTRY.itemsize, ORC_ENTRY.itemsize))
        return out

    def parse(self, ctx):
        base, raw = self.raw(ctx)
        n = len(raw)
        ent = np.zeros(n, dtype=[("entry", "<u8"), ("ip", "<u8"), ("sp_offset", "<i2"),
                                 ("bp_offset", "<i2"), ("bits", "<u2")])
        if n == 0:
            return ent
        e = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(4)
        ent["entry"] = e
        ent["ip"] = rel32_targets(e, raw)
        a = ctx.image.symbol_address("__start_orc_unwind")
        b = ctx.image.symbol_address("__stop_orc_unwind")
        self._orc_count = (b - a) // ORC_ENTRY.itemsize if a is not None and b is not None else -1
        if self._orc_count == n:
            orc = ctx.image.view(a, n, ORC_ENTRY)
            for f in ("sp_offset", "bp_offset", "bits"):
                ent[f] = orc[f]
        return ent

    def check(self, ctx, entries):
        findings = []
        if self._orc_count != len(entries):
            findings.append(Finding("error", "orc.parallel", None,
                                    f".orc_unwind has {self._orc_count} entries but .orc_unwind_ip "
                                    f"has {len(entries)}"))
        ip = entries["ip"]
        self.check_sorted(ctx, findings, ip, "IPs")
        self.check_code_refs(ctx, findings, "ip", ip, allow_section_end=True,
                             allow_in_patch_sites=True)
        bits = entries["bits"].astype(np.int64)
        sp_reg, bp_reg, typ = bits & 0xF, (bits >> 4) & 0xF, (bits >> 8) & 0x3
        bad = (typ >= ORC_TYPES) | (sp_reg > ORC_REG_MAX) | (bp_reg > ORC_REG_MAX)
        self.report(findings, "error", "orc.entry", ip[bad],
                    lambda a: f"ORC entry for {ctx.symbol_at(a)} has an invalid register or type")
        return findings

    def update(self, ctx, entries, amap):
        """Relayout: map IPs, re-sort both arrays together.

        Several entries can land on one address (a terminator at a moved
        function's end and the next function's first entry): the function's
        own entry sorts last, since the unwinder takes the last entry <= IP.
        """
        out = entries.copy()
        ip = entries["ip"]
        out["ip"], _ = amap.map(ip)
        own = ctx.functions.find(ip) >= 0
        order = np.lexsort((own.astype(np.int8), out["ip"]))
        out = out[order]
        out["entry"] = entries["entry"]
        return out

    def write(self, ctx, entries, out):
        if not len(entries):
            return
        e = entries["entry"].astype(np.int64)
        rel = (entries["ip"].astype(np.int64) - e).astype("<i4")
        out.write(int(entries["entry"][0]), rel.view(np.uint8))
        a = ctx.image.symbol_address("__start_orc_unwind")
        orc = np.zeros(len(entries), dtype=ORC_ENTRY)
        for f in ("sp_offset", "bp_offset", "bits"):
            orc[f] = entries[f]
        out.write(a, orc.view(np.uint8))
