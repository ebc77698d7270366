"""Plain s32-relative site lists: ``.retpoline_sites``, ``.return_sites``,
``.smp_locks``. Each entry is the address of one instruction the kernel
patches at boot (indirect-thunk calls, return-thunk jumps, lock prefixes).
"""

import numpy as np

from .base import KernelTable


class SiteList(KernelTable):
    dtype = np.dtype("<i4")
    # Allowed first bytes of the instruction at each site (None = any).
    opcodes = None
    in_functions_only = False

    def parse(self, ctx):
        # A zero entry is section padding (the kernel skips it: it points at itself).
        ent = self.decode(ctx, rel=("addr",), keep=lambda raw: raw != 0)
        self.padding = len(self.raw(ctx)[1]) - len(ent)
        return ent

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_code_refs(ctx, findings, "site", addr)
        if self.opcodes is not None and len(addr):
            first = np.array([ctx.image.read(a, 1)[0] if c else 0
                              for a, c in zip(addr.tolist(), ctx.in_code(addr).tolist())], dtype=np.uint8)
            bad = ~np.isin(first, self.opcodes)
            self.report(findings, "error", f"{self.name}.insn", addr[bad],
                        lambda a: f"{self.name}: site {ctx.symbol_at(a)} starts with "
                                  f"{int(ctx.image.read(a, 1)[0]):02x}, expected one of "
                                  + " ".join(f"{o:02x}" for o in self.opcodes))
        return findings


class RetpolineSites(SiteList):
    name = ".retpoline_sites"
    start_symbol = "__retpoline_sites"
    stop_symbol = "__retpoline_sites_end"
    opcodes = (0xE8, 0xE9, 0x0F, 0x2E, 0x3E)     # call/jmp/jcc thunk (optionally prefixed)


class ReturnSites(SiteList):
    name = ".return_sites"
    start_symbol = "__return_sites"
    stop_symbol = "__return_sites_end"
    opcodes = (0xE9, 0x0F, 0xC3, 0xCC, 0x2E, 0x3E)


class SmpLocks(SiteList):
    name = ".smp_locks"
    start_symbol = "__smp_locks"
    stop_symbol = "__smp_locks_end"
    opcodes = (0xF0, 0x3E)           # lock prefix (ds when patched for UP)
