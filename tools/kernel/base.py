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

import numpy as np

# the context every table works on lives with the image model; named here too for
# the table modules and their callers
from ..image.context import ImageContext, kernel_version_of  # noqa: F401
from ..image.relocs import link_field_mismatches
from ..errors import BadInput


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


def split_key_flags(entries):
    """A key pointer's low two bits are the entry's flags (static keys and static
    calls point at 4-aligned keys): move them from ``key`` to ``flags``."""
    entries["flags"] = (entries["key"] & np.uint64(3)).astype(np.uint8)
    entries["key"] &= ~np.uint64(3)
    return entries


def _rela_rows(ctx, sec):
    """The RELA records that apply to section sec (a numpy view), or None."""
    if sec is None:
        return None
    from ..image.elf import RELA, SHT_RELA
    for s in ctx.image.sections:
        if s.type == SHT_RELA and s.info == sec.index and s.size:
            return ctx.image.section_bytes(s).view(RELA)
    return None


def same_function_parts(a, b):
    """True when functions named ``a`` and ``b`` are parts of one function: one is the
    other's gcc-split or cloned part (``foo`` and ``foo.cold``, ``foo.part.0``), or both
    are its cold parts (gcc's ``foo.cold`` and the one a block-level split adds, also
    named ``foo.cold``)."""
    # two functions named foo (statics of two files) are not one; two named foo.cold are
    # gcc's cold part and the split's
    return b.startswith(a + ".") or a.startswith(b + ".") or (a == b and a.endswith(".cold"))


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

    def decode(self, ctx, rel=(), copy=(), keep=None, extra=()):
        """Entries with absolute addresses: the common parse of relative tables.

        ``rel``: fields holding offsets from their own address (decoded to
        u64 addresses); ``copy``: fields taken as they are; ``keep``: optional
        mask of records to keep (e.g. to drop zero padding); ``extra``: more
        columns ``(name, dtype)``, zero, for the caller to fill. Every result
        has an ``entry`` column: the address of the record itself.
        """
        base, raw = self.raw(ctx)
        idx = np.arange(len(raw)) if keep is None else np.nonzero(keep(raw))[0]
        dt = [("entry", "<u8")] + [(f, "<u8") for f in rel] + [(f, raw.dtype[f]) for f in copy] + \
            list(extra)
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
        info = rows["info"].astype(np.uint64)
        _, wrong = link_field_mismatches(ctx.image, sec, rows["offset"], info & np.uint64(0xFFFFFFFF),
                                         info >> np.uint64(32), rows["addend"])
        bad = rows["offset"][wrong].tolist()
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
                        allow_section_end=False, allow_inside=None, allow_padding=(),
                        end_of_range=False):
        """Every address must be in code, at the start of a decoded instruction.

        ``allow_inside(ctx, addrs)``: a mask of addresses that may also lie inside
        an instruction (ORC: patch sites, kernel/patch_sites.py);
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
        if allow_inside is not None and mid.any():
            mid &= ~allow_inside(ctx, addrs)
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
        own_part = np.array([i >= 0 and j >= 0 and same_function_parts(ft.name[i], ft.name[j])
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
