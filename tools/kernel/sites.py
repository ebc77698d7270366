"""Plain s32-relative site lists: ``.retpoline_sites``, ``.return_sites``,
``.smp_locks`` and, from 6.2 on (absent before, so skipped), ``.call_sites``
(CONFIG_CALL_THUNKS: direct calls the kernel may redirect to call-depth
accounting thunks) and ``.ibt_endbr_seal`` (CONFIG_X86_KERNEL_IBT: ENDBR64
instructions of functions never called indirectly, poisoned at boot). Each
entry is the address of one instruction the kernel patches at boot.

The record is the same in 6.1, 6.12 and 7.3; 7.3 has no ``.smp_locks`` (no
``__smp_locks`` symbol: the table is absent and skipped). ``.call_sites`` lists
the direct calls whose destination callthunks.c redirects, at boot, to the
accounting thunk it writes into the callee's 16-byte padding (``__pfx_``,
kernel/prefixes.py): relayout keeps each padding with its function
(relayout/units.py) and rewrites these fields like every PC-relative reference.
"""

import numpy as np

from .base import KernelTable


class SiteList(KernelTable):
    dtype = np.dtype("<i4")
    relative_fields = (None,)
    # Allowed first bytes of the instruction at each site (None = any).
    opcodes = None
    # Allowed byte strings at each site besides ``opcodes`` (exact prefixes).
    sequences = ()
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
        self.check_unique(ctx, findings, addr)
        if self.opcodes is not None and len(addr):
            first = np.array([ctx.image.read(a, 1)[0] if c else 0
                              for a, c in zip(addr.tolist(), ctx.in_code(addr).tolist())], dtype=np.uint8)
            bad = ~np.isin(first, self.opcodes)
            for seq in self.sequences:
                for k in np.nonzero(bad)[0].tolist():
                    if bytes(ctx.image.read(int(addr[k]), len(seq))) == seq:
                        bad[k] = False
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
    # A 16-bit locked instruction the compiler wrote as 66 f0 (Debian 6.12:
    # __pv_queued_spin_lock_slowpath's cmpxchgw): the site is the instruction
    # start, the kernel only rewrites a site whose byte is f0/3e, so it leaves
    # this one locked. Harmless, and what the build produced.
    sequences = (b"\x66\xf0", b"\x66\x3e")


class CallSites(SiteList):
    name = ".call_sites"
    start_symbol = "__call_sites"
    stop_symbol = "__call_sites_end"
    opcodes = (0xE8,)                # direct call rel32
    # a call objtool or an alternative already patched out: the kernel skips it
    sequences = (b"\x0f\x1f\x44\x00\x00", b"\x2e\x0f\x1f\x84\x00")


class IbtEndbrSeal(SiteList):
    name = ".ibt_endbr_seal"
    start_symbol = "__ibt_endbr_seal"
    stop_symbol = "__ibt_endbr_seal_end"
    opcodes = (0xF3,)
    sequences = ()
    endbr = (b"\xf3\x0f\x1e\xfa", b"\x66\x0f\x1f\x00")   # endbr64, or nop4 once sealed

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_code_refs(ctx, findings, "site", addr)
        code = ctx.in_code(addr)
        bad = [a for a, c in zip(addr.tolist(), code.tolist())
               if c and bytes(ctx.image.read(a, 4)) not in self.endbr]
        self.report(findings, "error", f"{self.name}.insn", bad,
                    lambda a: f"{self.name}: site {ctx.symbol_at(a)} is not an endbr64 "
                              f"({bytes(ctx.image.read(a, 4)).hex(' ')})")
        return findings
