"""``__ksymtab`` and ``__ksymtab_gpl``: exported symbols, 6.1 PREL32 form
``{s32 value; s32 name; s32 namespace}`` each relative to its field. Modules
resolve exports by binary search on the name, so each table is name-sorted;
every value must be the address the ELF symbol table gives that name.
6.12 emits the entries from asm (include/linux/export-internal.h, __KSYMTAB)
but the record is the same ``.long sym - .; .long name - .; .long ns - .``.
7.3 keeps that record but has no ``__ksymtab_gpl`` (nor ``__kcrctab_gpl``): every
export is in ``__ksymtab`` and its GPL-only bit is one byte per entry, in the
same order, in ``__kflagstab`` (include/linux/export-internal.h); the GPL table
is then absent and skipped, and ``__kflagstab`` must have one byte per export.
"""

import numpy as np

from .base import Finding, KernelTable


class Ksymtab(KernelTable):
    name = "__ksymtab"
    start_symbol = "__start___ksymtab"
    stop_symbol = "__stop___ksymtab"
    dtype = np.dtype([("value", "<i4"), ("name", "<i4"), ("namespace", "<i4")])
    relative_fields = ("value", "name", "namespace")

    def parse(self, ctx):
        ent = self.decode(ctx, rel=("value", "name"))
        self.names = []
        if len(ent) == 0:
            return ent
        strs = ctx.image.section("__ksymtab_strings")
        blob = bytes(ctx.image.section_bytes(strs)) if strs is not None else b""
        for a in ent["name"].tolist():
            o = a - strs.addr if strs is not None else -1
            if 0 <= o < len(blob):
                self.names.append(blob[o:blob.index(b"\0", o)].decode("latin-1"))
            else:
                self.names.append(None)
        return ent

    def check_window(self, ctx, entries, lo, hi):
        # names are parsed per table, indexed like entries: check it whole
        findings = self.check(ctx, entries)
        self.check_relocations(ctx, findings, entries[lo:hi])
        return findings

    def check(self, ctx, entries):
        findings = []
        if len(entries) == 0:
            return findings
        for i, nm in enumerate(self.names):
            if nm is None:
                findings.append(Finding("error", f"{self.name}.name", int(entries["entry"][i]),
                                        f"{self.name} entry {i}: name outside __ksymtab_strings"))
        names = [n or "" for n in self.names]
        bad = [k for k in range(1, len(names)) if names[k] <= names[k - 1]]
        for k in bad[:self.max_findings_per_check]:
            findings.append(Finding("error", f"{self.name}.sorted", int(entries["entry"][k]),
                                    f"{self.name} not sorted by name at {names[k - 1]!r} / {names[k]!r}"))
        value = entries["value"].tolist()
        where = ctx.symbol_addresses()
        wrong = []
        for i, nm in enumerate(names):
            got = where.get(nm)
            if nm and got is not None and value[i] not in got:
                wrong.append((i, nm, got))
        for i, nm, got in wrong[:self.max_findings_per_check]:
            findings.append(Finding("error", f"{self.name}.value", value[i],
                                    f"export {nm} points at {value[i]:#x}, the symtab says "
                                    + ", ".join(hex(v) for v in sorted(got))))
        if len(wrong) > self.max_findings_per_check:
            findings.append(Finding("error", f"{self.name}.value", None,
                                    f"{len(wrong)} exports disagree with the symbol table"))
        fa = ctx.image.symbol_address("__start___kflagstab")
        fb = ctx.image.symbol_address("__stop___kflagstab")
        if self.name == "__ksymtab" and fa is not None and fb is not None and fb - fa != len(entries):
            findings.append(Finding("error", "__kflagstab.count", fa,
                                    f"__kflagstab has {fb - fa} flag bytes for {len(entries)} exports"))
        return findings


class KsymtabGpl(Ksymtab):
    name = "__ksymtab_gpl"
    start_symbol = "__start___ksymtab_gpl"
    stop_symbol = "__stop___ksymtab_gpl"
