"""``__mcount_loc``: absolute addresses of every ``call __fentry__`` (5 bytes,
or nop5 once patched). ftrace requires the list sorted (it is sorted at
build time by sorttable and binary-searched at run time).
"""

import numpy as np

from .base import KernelTable

NOP5 = bytes.fromhex("0f1f440000")


class McountLoc(KernelTable):
    name = "__mcount_loc"
    start_symbol = "__start_mcount_loc"
    stop_symbol = "__stop_mcount_loc"
    dtype = np.dtype("<u8")
    resorted_by_relayout = True

    def parse(self, ctx):
        base, raw = self.raw(ctx)
        ent = np.zeros(len(raw), dtype=[("entry", "<u8"), ("addr", "<u8")])
        if len(raw):
            ent["entry"] = np.uint64(base) + np.arange(len(raw), dtype=np.uint64) * np.uint64(8)
            ent["addr"] = raw
        return ent

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_sorted(ctx, findings, addr, "call sites")
        self.check_code_refs(ctx, findings, "site", addr)
        d = ctx.disasm
        i = d.containing(addr)
        ic = np.maximum(i, 0)
        fentry = ctx.image.symbol_address("__fentry__")
        is_call = (d.raw[ic, 0] == 0xE8) & (d.size[ic] == 5)
        tgt = np.zeros(len(addr), dtype=np.int64)
        for k in range(4):
            tgt |= d.raw[ic, 1 + k].astype(np.int64) << (8 * k)
        tgt = np.where(tgt >= 1 << 31, tgt - (1 << 32), tgt)
        call_target = (addr.astype(np.int64) + 5 + tgt).astype(np.uint64)
        is_nop = np.all(d.raw[ic, :5] == np.frombuffer(NOP5, np.uint8), axis=1)
        ok = is_nop | (is_call & ((call_target == np.uint64(fentry)) if fentry is not None else True))
        bad = (i >= 0) & ~ok
        self.report(findings, "error", "__mcount_loc.insn", addr[bad],
                    lambda a: f"mcount site {ctx.symbol_at(a)} is not 'call __fentry__' or nop5")
        return findings

    def update(self, ctx, entries, amap):
        """Relayout: map every call site, keep the table sorted."""
        out = entries.copy()
        out["addr"], _ = amap.map(entries["addr"])
        out["addr"] = np.sort(out["addr"], kind="stable")
        return out

    def write(self, ctx, entries, out):
        if len(entries):
            out.write(int(entries["entry"][0]), entries["addr"].astype("<u8").view(np.uint8))
