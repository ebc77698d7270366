"""``__mcount_loc``: absolute addresses of every ``call __fentry__`` (5 bytes,
or nop5 once patched). ftrace requires the list sorted (it is sorted at
build time by sorttable and binary-searched at run time).

Zero entries are skipped by ftrace_process_locs() (NULL pointers: linker
padding, and in Debian 6.12.117 the entries scripts/sorttable.c zeroes because
they lie in no function of ``nm -S`` - overridden weak functions; sorted
first). Debian 6.1 has none; Debian 6.12.117 has 622 of 43,189. ``parse`` returns the real sites and
``self.padding`` counts the zeros; ``write`` puts them back in front.
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
        keep = np.nonzero(raw != 0)[0]
        self.base, self.slots, self.padding = base, len(raw), len(raw) - len(keep)
        ent = np.zeros(len(keep), dtype=[("entry", "<u8"), ("addr", "<u8")])
        if len(keep):
            ent["entry"] = np.uint64(base) + keep.astype(np.uint64) * np.uint64(8)
            ent["addr"] = raw[keep]
        return ent

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_sorted(ctx, findings, addr, "call sites")
        self.check_code_refs(ctx, findings, "site", addr)
        self.check_unique(ctx, findings, addr)
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
        """Relayout: map every call site, keep the table sorted (padding first)."""
        out = entries.copy()
        out["addr"], _ = amap.map(entries["addr"])
        out["addr"] = np.sort(out["addr"], kind="stable")
        pad = getattr(self, "padding", 0)
        if len(out):
            base = getattr(self, "base", int(entries["entry"][0]))
            out["entry"] = np.uint64(base) + np.arange(pad, pad + len(out), dtype=np.uint64) * np.uint64(8)
        return out

    def write(self, ctx, entries, out):
        if len(entries):
            pad = getattr(self, "padding", 0)
            data = np.concatenate((np.zeros(pad, "<u8"), entries["addr"].astype("<u8")))
            out.write(int(entries["entry"][0]) - 8 * pad, data.view(np.uint8))
