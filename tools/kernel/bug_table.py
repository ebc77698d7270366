"""``__bug_table``: BUG()/WARN() sites (include/asm-generic/bug.h, x86 with
GENERIC_BUG_RELATIVE_POINTERS and DEBUG_BUGVERBOSE), decided by kernel version
and cross-checked against the section's size (base.KernelTable.locate):

- up to 6.18 (6.1, 6.12): ``{s32 bug_addr; s32 file; u16 line; u16 flags}``,
  12 bytes;
- 6.19 and later (7.3): a format string joined the record (HAVE_ARCH_BUG_FORMAT,
  x86-64 always): ``{s32 bug_addr; s32 format; s32 file; u16 line; u16 flags}``,
  16 bytes, and flag ``BUGFLAG_ARGS`` (0x10): a WARN whose arguments go to
  ``__WARN_trap`` through a static call.

Each bug_addr is an instruction boundary: a ``ud2`` (0f 0b), except with
BUGFLAG_ARGS, where it is the instruction after the ``lea`` that loads the
entry's own address (arch/x86/include/asm/bug.h, __WARN_bug_entry). The kernel
searches the table linearly, so order does not matter. Measured: Debian
6.12.118 12-byte records, 7.3.4 16-byte records.
"""

import numpy as np

from .base import KernelTable, rename_fields


BUG_ENTRY_6_1 = np.dtype([("bug_addr", "<i4"), ("file", "<i4"), ("line", "<u2"), ("flags", "<u2")])
BUG_ENTRY_6_19 = np.dtype([("bug_addr", "<i4"), ("format", "<i4"), ("file", "<i4"),
                           ("line", "<u2"), ("flags", "<u2")])
BUGFLAG_WARNING, BUGFLAG_ARGS = 1, 0x10
TAINT_FLAGS_COUNT = 20          # 7.3 (TAINT_FWCTL = 19); 6.1 and 6.12 stop at 19


class BugTable(KernelTable):
    name = "__bug_table"
    start_symbol = "__start___bug_table"
    stop_symbol = "__stop___bug_table"
    dtype = BUG_ENTRY_6_1
    layouts = [((0, 0), BUG_ENTRY_6_1), ((6, 19), BUG_ENTRY_6_19)]

    @property
    def relative_fields(self):
        return tuple(f for f in ("bug_addr", "format", "file") if f in self.dtype.names)

    def parse(self, ctx):
        self.select_layout(ctx)
        ent = self.decode(ctx, rel=self.relative_fields, copy=("line", "flags"))
        return rename_fields(ent, {"bug_addr": "addr"})

    def check(self, ctx, entries):
        findings = []
        addr = entries["addr"]
        self.check_code_refs(ctx, findings, "bug_addr", addr)
        d = ctx.disasm
        i = d.containing(addr)
        ok = i >= 0
        ic = np.maximum(i, 0)
        args = (entries["flags"].astype(np.int64) & BUGFLAG_ARGS) != 0
        if "format" not in self.dtype.names:
            args[:] = False            # no such flag before 6.19
        not_ud2 = ok & ~args & ~((d.raw[ic, 0] == 0x0F) & (d.raw[ic, 1] == 0x0B))
        self.report(findings, "error", "__bug_table.ud2", addr[not_ud2],
                    lambda a: f"BUG site {ctx.symbol_at(a)} is not a ud2 instruction")
        # flags (asm-generic/bug.h): WARNING 1, ONCE 2, DONE 4 (set at run time),
        # NO_CUT_HERE 8, 6.19+ ARGS 16 (WARNs only), and a taint number in the
        # high byte of WARNs only
        fl = entries["flags"].astype(np.int64)
        low, taint = fl & 0xFF, fl >> 8
        known = 0x1B if "format" in self.dtype.names else 0x0B
        bad = (((low & ~known) != 0) | (taint >= TAINT_FLAGS_COUNT) |
               ((taint != 0) & ((low & BUGFLAG_WARNING) == 0)) |
               (((low & BUGFLAG_ARGS) != 0) & ((low & BUGFLAG_WARNING) == 0)))
        self.report(findings, "error", "__bug_table.flags", addr[bad],
                    lambda a: f"BUG site {ctx.symbol_at(a)}: flags are not a valid build-time "
                              "BUGFLAG combination")
        return findings
