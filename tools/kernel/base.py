"""The one interface every kernel table module implements.

A table module (``jump_table.py``, ``orc.py``, ...) defines one subclass of
``KernelTable`` and lists it in ``linepack.kernel.TABLES``. The life cycle:

    entries = table.parse(ctx)            # decode to absolute addresses (numpy)
    findings = table.check(ctx, entries)  # invariants the kernel relies on
    entries = table.update(ctx, entries, amap)   # relayout: map addresses
    table.write(ctx, entries, out)        # relayout: encode into the new image

``ctx`` is an ``ImageContext``: the image, its functions, instruction
boundaries and kernel version, computed once and shared by all tables.
"""

import re

import numpy as np

from ..errors import BadInput
from ..image.disasm import disassemble
from ..image.functions import FunctionTable
from ..image.intervals import containing


class TableFormatError(BadInput):
    """A kernel table whose size does not fit the record format of the image's
    kernel version: relayout and verify refuse the image (exit 2) rather than
    misread it."""


class Finding:
    """One problem found in an image. severity: 'error' | 'warning' | 'info'."""

    __slots__ = ("severity", "check", "address", "message")

    def __init__(self, severity, check, address, message):
        self.severity, self.check, self.message = severity, check, message
        self.address = None if address is None else int(address)

    def as_dict(self):
        return {"severity": self.severity, "check": self.check,
                "address": None if self.address is None else f"{self.address:#x}",
                "message": self.message}

    def __repr__(self):
        a = "" if self.address is None else f" @{self.address:#x}"
        return f"<{self.severity} {self.check}{a}: {self.message}>"


def kernel_version_of(image):
    """(major, minor, patch) and the banner text from linux_banner, or (None, None)."""
    addr = image.symbol_address("linux_banner")
    if addr is None:
        return None, None
    sec = image.section_at(addr)
    if sec is None:
        return None, None
    try:
        raw = bytes(image.read(addr, min(256, sec.end - addr)))
    except ValueError:
        return None, None
    text = raw.split(b"\0", 1)[0].decode("ascii", "replace").strip()
    m = re.match(r"Linux version (\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None, text
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)), text


class ImageContext:
    """What all table checks share, computed lazily once per image."""

    @classmethod
    def of(cls, image, log=None):
        """The one context of an image object (built on first use, then shared)."""
        ctx = getattr(image, "_linepack_context", None)
        if ctx is None:
            ctx = image._linepack_context = cls(image, log=log)
        return ctx

    def __init__(self, image, log=None):
        self.image = image
        self.log = log or (lambda msg: None)
        self._functions = None
        self._disasm = None
        self.version, self.banner = kernel_version_of(image)
        text = image.section(".text")
        self.text_start = image.symbol_address("_stext", text.addr if text else 0)
        self.text_end = image.symbol_address("_etext", text.end if text else 0)

    @property
    def is_kernel(self):
        return self.version is not None and self.image.symbol_address("_stext") is not None

    @property
    def functions(self):
        if self._functions is None:
            self._functions = FunctionTable(self.image)
        return self._functions

    @property
    def function_disasm(self):
        """Instructions of the sized FUNC symbols only."""
        if getattr(self, "_function_disasm", None) is None:
            self.log(f"disassembling {len(self.functions)} functions")
            self._function_disasm = disassemble(self.image, self.functions)
        return self._function_disasm

    @property
    def coverage(self):
        """The partition of every executable byte (linepack.image.coverage);
        computed before ``disasm``, which merges its instructions."""
        if getattr(self, "_coverage", None) is None:
            from ..image.coverage import CodeCoverage
            self._coverage = CodeCoverage(self.image, self.functions, self.function_disasm)
        return self._coverage

    @property
    def disasm(self):
        """Every decoded instruction of every executable section: functions
        (``func`` = their index) and the code outside them (``func`` = -1)."""
        if self._disasm is None:
            from ..image.coverage import merge
            self._disasm = merge(self.function_disasm, self.coverage.extra)
            # the merged arrays hold every function instruction: keep one copy
            self._function_disasm = None
        return self._disasm

    def in_code(self, addrs):
        """True where an address lies in an executable allocated section."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        ok = np.zeros(len(addrs), dtype=bool)
        for s in self._code_sections():
            ok |= (addrs >= np.uint64(s.addr)) & (addrs < np.uint64(s.end))
        return ok

    def _code_sections(self):
        if getattr(self, "_code_secs", None) is None:
            from ..image.elf import code_sections
            self._code_secs = code_sections(self.image)
        return self._code_secs

    def symbol_addresses(self):
        """{name: set of addresses} over the ELF symtab (names repeat for statics)."""
        if getattr(self, "_sym_addrs", None) is None:
            names, syms = self.image.symbol_table()
            where = {}
            for nm, v, t in zip(names, syms["value"].tolist(), (syms["info"] & 0xF).tolist()):
                if nm and t not in (3, 4):       # not SECTION / FILE
                    where.setdefault(nm, set()).add(v)
            self._sym_addrs = where
        return self._sym_addrs

    def code_section_ends(self, addrs):
        """True where an address is exactly the end of a code section (terminators)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        ends = [s.end for s in self._code_sections()]
        return np.isin(addrs, np.array(ends, dtype=np.uint64))

    def in_patch_site(self, addrs):
        """True where an address lies inside an alternative or paravirt patch site.

        objtool describes the replacement code's instruction boundaries too, so
        ORC IPs legitimately fall inside the original instruction there.
        """
        if getattr(self, "_patch_ranges", None) is None:
            from .alternatives import Alternatives
            from .paravirt import ParaInstructions
            starts, ends = [], []
            for cls, a, ln in ((Alternatives, "instr", "instrlen"), (ParaInstructions, "instr", "len")):
                e = cls().parse(self)
                starts.append(e[a])
                ends.append(e[a] + e[ln].astype(np.uint64))
            st, en = np.concatenate(starts), np.concatenate(ends)
            order = np.argsort(st, kind="stable")
            st, en = st[order], en[order]
            self._patch_ranges = (st, np.maximum.accumulate(en) if len(en) else en)
        st, en = self._patch_ranges
        # ends made monotone above: "the last site starting before" answers overlaps too
        return containing(st, en, addrs) >= 0

    def code_piece(self, addrs):
        """Index of the stretch between consecutive code symbols holding each address."""
        if getattr(self, "_code_symbols", None) is None:
            names, syms = self.image.symbol_table()
            typ = syms["info"] & 0xF
            v = syms["value"][(typ != 3) & (typ != 4)].astype(np.uint64)
            self._code_symbols = np.unique(v[self.in_code(v)])
        return np.searchsorted(self._code_symbols, np.asarray(addrs, np.uint64), side="right")

    def symbol_at(self, addr):
        """'func+0xoff' for messages."""
        ft = self.functions
        i = int(ft.find([addr])[0])
        if i < 0:
            return f"{int(addr):#x}"
        return f"{ft.name[i]}+{int(addr) - int(ft.start[i]):#x}"


def for_version(layouts, version):
    """Pick a table's layout for a kernel version.

    ``layouts`` is a list of ``(since, value)`` pairs in ascending order of
    ``since`` (a ``(major, minor)`` tuple): the value of the newest entry whose
    ``since`` is <= ``version`` wins. An unknown version (None: not a kernel,
    or no ``linux_banner``) takes the newest layout.
    """
    if version is None:
        return layouts[-1][1]
    chosen = layouts[0][1]
    for since, value in layouts:
        if tuple(version[:2]) >= tuple(since):
            chosen = value
    return chosen


def rename_fields(arr, mapping):
    """A view of a structured array with some fields renamed."""
    names = [mapping.get(n, n) for n in arr.dtype.names]
    out = arr.copy()
    out.dtype.names = names
    return out


def rel32_targets(base, values):
    """Addresses encoded as s32 relative to each field's own address."""
    return (np.asarray(base, dtype=np.int64) + np.asarray(values, dtype=np.int64)).astype(np.uint64)


def _rela_rows(ctx, sec):
    """The RELA records that apply to section sec (a numpy view), or None."""
    if sec is None:
        return None
    from ..image.elf import RELA, SHT_RELA
    for s in ctx.image.sections:
        if s.type == SHT_RELA and s.info == sec.index and s.size:
            return ctx.image.section_bytes(s).view(RELA)
    return None


# relocation type -> (field width, PC-relative)
_RELOC_FIELD = {1: (8, False), 2: (4, True), 4: (4, True), 10: (4, False), 11: (4, False)}


class KernelTable:
    """Base class. Subclasses set ``name`` and the bounding symbols and dtype."""

    name = "?"
    start_symbol = None
    stop_symbol = None
    dtype = None
    # Checks report at most this many findings of one kind, then a summary.
    max_findings_per_check = 20
    # True for tables relayout re-sorts by address (their link relocations go stale).
    resorted_by_relayout = False
    # Optional [(since (major, minor), dtype)] when the record layout changed
    # between kernel versions; ``dtype`` is then chosen from ctx.version.
    layouts = None

    # Fields holding an s32 (``relative_fields``) or s64 (``relative64_fields``)
    # offset from their own address, by dtype field name (None: the whole
    # record is one s32). ``references`` lists them for kernels without link
    # relocations (linepack.image.references); a zero field points nowhere.
    relative_fields = ()
    relative64_fields = ()

    def references(self, ctx):
        """(field addresses u64, widths u8) of every non-zero PC-relative field
        of the table: what its link relocations would be (R_X86_64_PC32/PC64)."""
        base, raw = self.raw(ctx)
        addrs, widths = [np.zeros(0, np.uint64)], [np.zeros(0, np.uint8)]
        if not len(raw):
            return addrs[0], widths[0]
        rec = np.uint64(base) + np.arange(len(raw), dtype=np.uint64) * np.uint64(raw.dtype.itemsize)
        for fields, width in ((self.relative_fields, 4), (self.relative64_fields, 8)):
            for f in fields:
                vals = raw if f is None else raw[f]
                off = 0 if f is None else raw.dtype.fields[f][1]
                keep = vals != 0
                addrs.append(rec[keep] + np.uint64(off))
                widths.append(np.full(int(keep.sum()), width, np.uint8))
        return np.concatenate(addrs), np.concatenate(widths)

    def select_layout(self, ctx):
        """Set ``self.dtype`` for this image's kernel version (tables with ``layouts``)."""
        if self.layouts:
            self.dtype = for_version(self.layouts, ctx.version)
        return self.dtype

    def locate(self, ctx):
        """(address, count) of the table in the image, or None if absent."""
        self.select_layout(ctx)
        a = ctx.image.symbol_address(self.start_symbol)
        b = ctx.image.symbol_address(self.stop_symbol)
        if a is None or b is None:
            return None
        size = b - a
        item = self.dtype.itemsize
        ver = "unknown version" if ctx.version is None else ".".join(map(str, ctx.version))
        if size % item:
            raise TableFormatError(f"{self.name}: {size} bytes are not whole {item}-byte records "
                                   f"(the format of kernel {ver}): unknown table format")
        # a table that fills its own output section: the section's size agrees
        sec = ctx.image.section(self.name)
        if sec is not None and sec.addr == a and sec.size != size and sec.size % item:
            raise TableFormatError(f"{self.name}: section of {sec.size} bytes is not whole "
                                   f"{item}-byte records (the format of kernel {ver}): "
                                   "unknown table format")
        return a, size // item

    def ranges(self, ctx):
        """[(start address, count, item size)] of the table's storage."""
        loc = self.locate(ctx)
        return [] if loc is None else [(loc[0], loc[1], self.dtype.itemsize)]

    def raw(self, ctx):
        """The table's records as a numpy view (empty when absent)."""
        loc = self.locate(ctx)
        if loc is None:
            return None, np.zeros(0, dtype=self.dtype)
        addr, count = loc
        return addr, ctx.image.view(addr, count, self.dtype)

    def decode(self, ctx, rel=(), copy=(), keep=None):
        """Entries with absolute addresses: the common parse of relative tables.

        ``rel``: fields holding s32 offsets from their own address (decoded to
        u64 addresses); ``copy``: fields taken as they are; ``keep``: optional
        mask of records to keep (e.g. to drop zero padding). Every result has
        an ``entry`` column: the address of the record itself.
        """
        base, raw = self.raw(ctx)
        idx = np.arange(len(raw)) if keep is None else np.nonzero(keep(raw))[0]
        dt = [("entry", "<u8")] + [(f, "<u8") for f in rel] + [(f, raw.dtype[f]) for f in copy]
        ent = np.zeros(len(idx), dtype=dt)
        if len(idx):
            e = np.uint64(base) + idx.astype(np.uint64) * np.uint64(self.dtype.itemsize)
            ent["entry"] = e
            for f in rel:
                field_off = 0 if raw.dtype.names is None else raw.dtype.fields[f][1]
                vals = raw[idx] if raw.dtype.names is None else raw[f][idx]
                ent[f] = rel32_targets(e + np.uint64(field_off), vals)
            for f in copy:
                ent[f] = raw[f][idx]
        return ent

    def parse(self, ctx):
        raise NotImplementedError

    def check(self, ctx, entries):
        raise NotImplementedError

    def check_window(self, ctx, entries, lo, hi):
        """Check only entries[lo:hi] (plus what they need of the rest): every
        per-entry check, order between neighbours, and the link relocations of
        those records. The mutation test runs this after changing one entry,
        instead of the whole table."""
        findings = self.check(ctx, entries[lo:hi])
        self.check_relocations(ctx, findings, entries[lo:hi])
        return findings

    def check_relocations(self, ctx, findings, entries):
        """Every field of these records that carries a link relocation
        (``--emit-relocs``) holds S + A (absolute) or S + A - P (PC-relative):
        a second, independent source for each address. Tables the build sorts
        after the link (their relocations are stale by design) are skipped."""
        if self.resorted_by_relayout or not len(entries) or "entry" not in (entries.dtype.names or ()):
            return
        size = self.dtype.itemsize
        lo = int(entries["entry"].min())
        hi = int(entries["entry"].max()) + size
        sec = ctx.image.section_at(lo)
        rows = _rela_rows(ctx, sec)
        if rows is None or not len(rows):
            return
        # only this section's RELA rows (image.relocations would decode every
        # relocation section, DWARF's included)
        rows = rows[(rows["offset"] >= np.uint64(lo)) & (rows["offset"] < np.uint64(hi))]
        sy = ctx.image.symtab
        bad = []
        for off, info, addend in zip(rows["offset"].tolist(), rows["info"].tolist(), rows["addend"].tolist()):
            sym, rtype = info >> 32, info & 0xFFFFFFFF
            field = _RELOC_FIELD.get(rtype)
            if field is None or sym == 0:
                continue
            width, pcrel = field
            val = int.from_bytes(bytes(ctx.image.read(off, width)), "little")
            want = int(sy["value"][sym]) + addend - (off if pcrel else 0)
            if val != want & ((1 << (8 * width)) - 1):
                bad.append(off)
        self.report(findings, "error", f"{self.name}.relocation", bad,
                    lambda a: f"{self.name}: field at {a:#x} disagrees with its link relocation")

    def update(self, ctx, entries, amap):
        raise NotImplementedError(f"{self.name}: update for relayout is not implemented")

    def write(self, ctx, entries, out):
        raise NotImplementedError(f"{self.name}: write for relayout is not implemented")

    # -- helpers for checks -------------------------------------------------
    def report(self, findings, severity, check, addrs, describe):
        """Add one finding per offending address (capped), then a count line."""
        addrs = list(addrs)
        for a in addrs[:self.max_findings_per_check]:
            findings.append(Finding(severity, check, a, describe(a)))
        if len(addrs) > self.max_findings_per_check:
            findings.append(Finding(severity, check, None,
                                    f"{self.name}: {len(addrs) - self.max_findings_per_check} more "
                                    f"of the same ({len(addrs)} in all)"))

    def check_code_refs(self, ctx, findings, what, addrs, allow_outside_functions=True,
                        allow_section_end=False, allow_in_patch_sites=False, allow_padding=(),
                        end_of_range=False):
        """Every address must be in code, at the start of a decoded instruction.

        ``allow_padding``: coverage categories (image/coverage.py) an address
        may also point at (ORC: objtool describes int3 fill too);
        ``end_of_range``: the addresses are exclusive ends (the end of an
        instruction is enough)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        not_code = ~ctx.in_code(addrs)
        if allow_section_end:
            not_code &= ~ctx.code_section_ends(addrs)
        self.report(findings, "error", f"{self.name}.{what}-in-code", addrs[not_code],
                    lambda a: f"{self.name}: {what} {a:#x} is not in executable code")
        mid = ctx.disasm.inside_instruction(addrs) & ~not_code
        if allow_in_patch_sites and mid.any():
            mid &= ~ctx.in_patch_site(addrs)
        self.report(findings, "error", f"{self.name}.{what}-boundary", addrs[mid],
                    lambda a: f"{self.name}: {what} {ctx.symbol_at(a)} ({a:#x}) is inside an "
                              "instruction, not at its start")
        # every executable byte is classified (image/coverage.py): an address in
        # code that starts no decoded instruction points at fill or data
        d = ctx.disasm
        no_insn = ~not_code & (d.containing(addrs) < 0)
        if end_of_range:
            # an end may also be the first byte after the last instruction
            before = d.containing(addrs - np.uint64(1))
            bc = np.maximum(before, 0)
            no_insn &= ~((before >= 0) & (d.addr[bc] + d.size[bc].astype(np.uint64) == addrs))
        if allow_section_end:
            no_insn &= ~ctx.code_section_ends(addrs)
        if allow_padding and no_insn.any():
            no_insn &= ~np.isin(ctx.coverage.category_at(addrs), allow_padding)
        self.report(findings, "error", f"{self.name}.{what}-not-instruction", addrs[no_insn],
                    lambda a: f"{self.name}: {what} {ctx.symbol_at(a)} ({a:#x}) is "
                              f"{ctx.coverage.describe(a)}, not an instruction")
        if not allow_outside_functions:
            outside = (ctx.functions.find(addrs) < 0) & ~not_code
            self.report(findings, "error", f"{self.name}.{what}-in-function", addrs[outside],
                        lambda a: f"{self.name}: {what} {a:#x} is not inside any function")

    def check_same_code(self, ctx, findings, what, addrs, others):
        """Each pair (addr, other) lies in one function (or its .cold part), or,
        outside functions, between the same two code symbols: a site's branch
        target or fixup stays in the site's own code."""
        a, b = np.asarray(addrs, np.uint64), np.asarray(others, np.uint64)
        ft = ctx.functions
        fa, fb = ft.find(a), ft.find(b)
        piece = ctx.code_piece
        # allowed: the function's own gcc-split part (foo.cold), and shared
        # fixup code outside functions (bad_get_user, .Lcopy_user_handle_tail)
        # either way round: after a block-level split the site may sit in the cold
        # part and its fixup in the hot one
        own_part = np.array([i >= 0 and j >= 0 and (ft.name[j].startswith(ft.name[i] + ".") or
                                                     ft.name[i].startswith(ft.name[j] + "."))
                             for i, j in zip(fa.tolist(), fb.tolist())], dtype=bool)
        bad = ((fb >= 0) & (fa != fb) & ~own_part) | ((fa < 0) & (fb < 0) & (piece(a) != piece(b)))
        self.report(findings, "error", f"{self.name}.{what}-same-code", a[bad],
                    lambda x: f"{self.name}: {what} of the entry at {ctx.symbol_at(x)} lies in other code")

    def check_unique(self, ctx, findings, addrs, what="site"):
        """A site is patched once: an address listed twice means a lost entry."""
        a = np.sort(np.asarray(addrs, dtype=np.uint64))
        dup = np.unique(a[1:][a[1:] == a[:-1]]) if len(a) > 1 else a[:0]
        self.report(findings, "error", f"{self.name}.duplicate", dup,
                    lambda x: f"{self.name}: {what} {ctx.symbol_at(x)} ({x:#x}) is listed twice")

    def check_sorted(self, ctx, findings, keys, what="entries", strict=False):
        keys = np.asarray(keys)
        if len(keys) < 2:
            return
        bad = np.nonzero(keys[1:] <= keys[:-1] if strict else keys[1:] < keys[:-1])[0]
        # name the entry that is out of place: the later one when it is also
        # below the entry before the pair, else the earlier one (too big)
        prev = keys[np.maximum(bad - 1, 0)]
        later = (bad == 0) | (keys[bad + 1] < prev)
        culprit = np.where(later, bad + 1, bad)
        pair = {int(keys[c]): (int(keys[b]), int(keys[b + 1])) for c, b in zip(culprit.tolist(), bad.tolist())}
        self.report(findings, "error", f"{self.name}.sorted", (keys[culprit]).tolist(),
                    lambda a: f"{self.name}: {what} out of order at {ctx.symbol_at(a)} ({a:#x}): "
                              f"{pair[a][0]:#x} before {pair[a][1]:#x}")
