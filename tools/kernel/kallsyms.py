"""kallsyms: the symbol table the link step generated (no relocations cover it).

6.1 layout (scripts/kallsyms.c, CONFIG_KALLSYMS_BASE_RELATIVE with absolute
per-cpu): ``kallsyms_offsets`` s32 per symbol (>= 0: absolute value; < 0:
``kallsyms_relative_base - 1 - offset``), ``kallsyms_names`` (per symbol a
length — one byte, or two when bit 7 is set — then token indices whose
expansion starts with the type letter), ``kallsyms_markers`` (u32 offset into
names of every 256th symbol), ``kallsyms_token_table``/``_index``, and
``kallsyms_seqs_of_names`` (3-byte big-endian symbol indices in name order).
Addresses must be sorted; names must agree with the ELF symbol table.

6.12 (scripts/kallsyms.c write_src): same encodings (base-relative is no longer
optional; x86-64 SMP keeps CONFIG_KALLSYMS_ABSOLUTE_PERCPU), but the arrays
are emitted in another order: num_syms, names, markers, token_table,
token_index, offsets, relative_base, seqs_of_names. The parse finds each by
its symbol and only relies on names preceding markers and token_table
preceding token_index, true in both.

7.3 (kernel/kallsyms.c ``kallsyms_sym_address``: ``offset_to_ptr``): no
``kallsyms_relative_base``; each ``kallsyms_offsets`` entry is an s32 relative
to its own address (x86-64 per-CPU symbols are no longer zero-based, so none is
absolute). The format is decided by the kernel version (6.12 and before:
base-relative; 7.0 and later: PC-relative) and cross-checked against the
image: base-relative needs the ``kallsyms_relative_base`` symbol, PC-relative
must not have it; a disagreement is refused in one line (exit 2). relayout
re-encodes each offset against the entry's final address.
"""

import numpy as np

from .base import Finding, KernelTable, TableFormatError, for_version

BASE_RELATIVE, PC_RELATIVE = "base-relative", "pc-relative"
# between 6.12 (base-relative, measured) and 7.3 (PC-relative, measured) the
# image's own kallsyms_relative_base symbol must agree with this choice
FORMATS = [((0, 0), BASE_RELATIVE), ((7, 0), PC_RELATIVE)]


def offsets_format(ctx):
    """How ``kallsyms_offsets`` encodes addresses for this image's kernel."""
    fmt = for_version(FORMATS, ctx.version)
    has_base = ctx.image.symbol_address("kallsyms_relative_base") is not None
    if has_base != (fmt == BASE_RELATIVE):
        ver = "unknown version" if ctx.version is None else ".".join(map(str, ctx.version))
        raise TableFormatError(f"kallsyms: kernel {ver} should use {fmt} offsets, but the image "
                               f"{'has' if has_base else 'has no'} kallsyms_relative_base: "
                               "unknown table format")
    return fmt


def _linker_provided(name):
    """scripts/kallsyms.c may_be_linker_script_provide_symbol()."""
    if len(name) < 8 or not name.startswith("__"):
        return False
    return (name.startswith(("__start_", "__stop_", "__end_")) or name.endswith("_start")
            or name.endswith("_end"))


# every array scripts/kallsyms.c emits (those a version has)
ARRAY_SYMBOLS = ("kallsyms_offsets", "kallsyms_relative_base", "kallsyms_num_syms",
                 "kallsyms_names", "kallsyms_markers", "kallsyms_token_table",
                 "kallsyms_token_index", "kallsyms_seqs_of_names")


class Kallsyms(KernelTable):
    name = "kallsyms"
    start_symbol = "kallsyms_offsets"
    dtype = np.dtype("<i4")

    def locate(self, ctx):
        a = ctx.image.symbol_address("kallsyms_offsets")
        n = ctx.image.symbol_address("kallsyms_num_syms")
        if a is None or n is None:
            return None
        return a, int(ctx.image.view(n, 1, "<u4")[0])

    def parse(self, ctx):
        im = ctx.image
        loc = self.locate(ctx)
        if loc is None:
            return np.zeros(0, dtype=[("addr", "<u8"), ("offset", "<i4")])
        off_addr, n = loc
        offsets = im.view(off_addr, n, "<i4")
        self.format = offsets_format(ctx)
        if self.format == PC_RELATIVE:
            self.relative_base = None
            field = np.uint64(off_addr) + np.arange(n, dtype=np.uint64) * np.uint64(4)
            addr = (field.astype(np.int64) + offsets.astype(np.int64)).astype(np.uint64)
        else:
            base = int(im.view(im.symbol_address("kallsyms_relative_base"), 1, "<u8")[0])
            self.relative_base = base
            addr = np.where(offsets >= 0, offsets.astype(np.int64).astype(np.uint64),
                            (np.int64(base - (1 << 64)) - 1 - offsets.astype(np.int64)).astype(np.uint64))
        names_addr = im.symbol_address("kallsyms_names")
        tt_addr = im.symbol_address("kallsyms_token_table")
        ti_addr = im.symbol_address("kallsyms_token_index")
        token_index = im.view(ti_addr, 256, "<u2").tolist()
        blob_end = ti_addr - tt_addr
        table = bytes(im.read(tt_addr, blob_end))
        tokens = [table[o:table.index(b"\0", o)].decode("latin-1") for o in token_index]
        expand = dict(enumerate(tokens))         # str.translate: token byte -> its text
        markers_addr = im.symbol_address("kallsyms_markers")
        # names run up to the next kallsyms array or their section's end (the
        # records, walked below, say where they end: a block-level layout may
        # place kallsyms_markers elsewhere, relayout/kernel/kallsyms_cold.py)
        after = [a for a in (im.symbol_address(nm) for nm in ARRAY_SYMBOLS)
                 if a is not None and a > names_addr]
        sec = im.section_at(names_addr)
        names = bytes(im.read(names_addr, min(after + [sec.addr + sec.size]) - names_addr))
        self.names, self.types, name_off = [], [], []
        pos = 0
        for _ in range(n):
            name_off.append(pos)
            ln = names[pos]
            pos += 1
            if ln & 0x80:
                ln = (ln & 0x7F) | (names[pos] << 7)
                pos += 1
            s = names[pos:pos + ln].decode("latin-1").translate(expand)
            pos += ln
            self.types.append(s[:1])
            self.names.append(s[1:])
        name_off.append(pos)                     # end of the last record
        self.name_offsets = np.array(name_off[:-1], dtype=np.int64)
        self._names_blob = names[:pos]
        self._record_bounds = np.array(name_off, dtype=np.int64)
        nmarkers = (n + 255) // 256
        self.markers = im.view(markers_addr, nmarkers, "<u4").astype(np.int64)
        seq_addr = im.symbol_address("kallsyms_seqs_of_names")
        self.seqs = None
        if seq_addr is not None:
            s3 = im.view(seq_addr, 3 * n, "u1").reshape(n, 3).astype(np.int64)
            self.seqs = (s3[:, 0] << 16) | (s3[:, 1] << 8) | s3[:, 2]
        ent = np.zeros(n, dtype=[("addr", "<u8"), ("offset", "<i4")])
        ent["addr"], ent["offset"] = addr, offsets
        return ent

    def array_sizes(self, ctx):
        """{array symbol: its size in bytes} of the image's kallsyms arrays, from the
        symbol count and the last names marker (no names parse: verify uses it
        to bound the arrays a rewrite moved, which have no ELF sizes)."""
        im = ctx.image
        loc = self.locate(ctx)
        if loc is None:
            return {}
        n = loc[1]
        at = {nm: im.symbol_address(nm) for nm in ARRAY_SYMBOLS}
        out = {"kallsyms_offsets": 4 * n, "kallsyms_num_syms": 4,
               "kallsyms_markers": 4 * ((n + 255) // 256), "kallsyms_seqs_of_names": 3 * n,
               "kallsyms_token_index": 2 * 256, "kallsyms_relative_base": 8}
        if at["kallsyms_token_table"] is not None and at["kallsyms_token_index"] is not None:
            out["kallsyms_token_table"] = at["kallsyms_token_index"] - at["kallsyms_token_table"]
        if at["kallsyms_names"] is not None and at["kallsyms_markers"] is not None and n:
            last = int(im.view(at["kallsyms_markers"], (n + 255) // 256, "<u4")[-1])
            pos = at["kallsyms_names"] + last
            for _ in range(n - 256 * ((n - 1) // 256)):       # the records after the last marker
                ln = int(im.view(pos, 1, "u1")[0])
                pos += 1
                if ln & 0x80:
                    ln = (ln & 0x7F) | (int(im.view(pos, 1, "u1")[0]) << 7)
                    pos += 1
                pos += ln
            out["kallsyms_names"] = pos - at["kallsyms_names"]
        return {nm: size for nm, size in out.items() if at.get(nm) is not None}

    # -- relayout ---------------------------------------------------------------
    # -- adding symbols (block-level layouts: `name.cold` parts) ----------------
    def _tokens(self, ctx):
        im = ctx.image
        tt_addr = im.symbol_address("kallsyms_token_table")
        ti_addr = im.symbol_address("kallsyms_token_index")
        table = bytes(im.read(tt_addr, ti_addr - tt_addr))
        index = im.view(ti_addr, 256, "<u2").tolist()
        return [table[o:table.index(b"\0", o)] for o in index]

    def encode_name(self, tokens, text, by_token=None):
        """One kallsyms_names record for ``text`` (type letter + name) in the
        image's existing token table: the fewest tokens (dynamic programming over
        the positions), then the 1- or 2-byte length."""
        raw = text.encode("latin-1")
        if by_token is None:
            by_token = {t: i for i, t in enumerate(tokens) if t}
        longest = max(len(t) for t in by_token)
        inf = len(raw) + 1
        cost = [0] + [inf] * len(raw)
        pick = [None] * (len(raw) + 1)
        for end in range(1, len(raw) + 1):
            for ln in range(1, min(longest, end) + 1):
                t = by_token.get(raw[end - ln:end])
                if t is not None and cost[end - ln] + 1 < cost[end]:
                    cost[end], pick[end] = cost[end - ln] + 1, (t, ln)
        if cost[-1] >= inf:
            raise ValueError(f"kallsyms: {text[1:]!r} cannot be written with this image's "
                             "token table")
        seq, pos = [], len(raw)
        while pos:
            t, ln = pick[pos]
            seq.append(t)
            pos -= ln
        seq.reverse()
        n = len(seq)
        head = bytes([n]) if n < 0x80 else bytes([(n & 0x7F) | 0x80, n >> 7])
        if n >= 1 << 14:
            raise ValueError(f"kallsyms: {text[1:]!r} is too long")
        return head + bytes(seq)

    def add_symbols(self, ctx, names, types):
        """Append records for new symbols (their addresses go to ``update(extra=)``);
        returns how many were added."""
        tokens = self._tokens(ctx)
        by_token = {t: i for i, t in enumerate(tokens) if t}
        recs = [self.encode_name(tokens, t + nm, by_token) for nm, t in zip(names, types)]
        blob = self._names_blob + b"".join(recs)
        ends = np.cumsum([len(r) for r in recs], dtype=np.int64) + len(self._names_blob)
        self._record_bounds = np.concatenate([self._record_bounds, ends])
        self._names_blob = blob
        self.names = self.names + list(names)
        self.types = self.types + list(types)
        return len(recs)

    def update(self, ctx, entries, amap, extra_addr=None, retarget=None):
        """Map every address, then re-sort the symbols by their new address.

        Region boundary labels (``__sched_text_start`` ...) take the label's new
        address, not that of the function that happened to start there.
        ``extra_addr``: final addresses of the symbols ``add_symbols`` appended
        (not mapped). ``retarget``: {name: new address} for data symbols a
        rewrite moved (e.g. ``__end_rodata``).
        """
        from ..image.functions import KERNEL_REGION_LABELS

        new_addr, _ok = amap.map(entries["addr"])
        new_addr = np.asarray(new_addr, dtype=np.uint64).copy()
        anchors = dict(zip(getattr(amap, "anchor_old", np.zeros(0)).tolist(),
                           getattr(amap, "anchor_new", np.zeros(0)).tolist()))
        special = set(KERNEL_REGION_LABELS) | set(retarget or ())
        names = self.names[:len(entries)]
        for k in [k for k, nm in enumerate(names) if nm in special]:
            nm = names[k]
            if nm in KERNEL_REGION_LABELS:
                a = int(entries["addr"][k])
                if a in anchors:
                    new_addr[k] = anchors[a]
            if retarget and nm in retarget:
                new_addr[k] = retarget[nm]
        absolute = entries["offset"] >= 0          # per-cpu symbols: absolute values
        if extra_addr is not None and len(extra_addr):
            new_addr = np.concatenate([new_addr, np.asarray(extra_addr, np.uint64)])
            absolute = np.concatenate([absolute, np.zeros(len(extra_addr), bool)])
            grown = np.zeros(len(new_addr), dtype=entries.dtype)
            grown[:len(entries)] = entries
            entries = grown
        # Ties (several symbols at one address) in scripts/kallsyms' order
        # (compare_symbols): strong before weak, then not a linker-script
        # symbol (__start_x, __stop_x, __end_x, __x_start, __x_end) before one,
        # then fewer leading underscores, then the original order. The first
        # symbol at an address is the name backtraces print.
        weak = np.array([t in ("w", "W") for t in self.types], dtype=np.int8)
        provide = np.array([_linker_provided(nm) for nm in self.names], dtype=np.int8)
        under = np.array([len(nm) - len(nm.lstrip("_")) for nm in self.names], dtype=np.int64)
        # a prefix whose padding the layout dropped entirely (relayout/blocks.py
        # trim_prefix) sits at its function's entry: ``__pfx_fn`` after ``fn``, so
        # that backtraces still name the function (only that tie: a prefix never
        # shares its own function's address in a kernel as linked)
        own = _own_prefix_ties(self.names, new_addr)
        order = np.lexsort((np.arange(len(entries)), under, provide, weak, own, new_addr))
        out = np.zeros(len(entries), dtype=[("addr", "<u8"), ("offset", "<i4"), ("old_index", "<i8")])
        out["addr"] = new_addr[order]
        out["old_index"] = order
        if self.format == PC_RELATIVE:
            # offsets depend on where the array ends up: arrays() encodes them
            return out
        rel = ~absolute[order]
        base = self.relative_base
        if (out["addr"][rel] < np.uint64(base)).any():
            raise ValueError("kallsyms: a symbol moved below kallsyms_relative_base")
        # offset = relative_base - 1 - addr (relative) or addr (absolute), as s32: the
        # low 32 bits of either, so u64 arithmetic (which wraps) gives them
        a = out["addr"]
        offs = np.where(rel, np.uint64((base - 1) & ((1 << 64) - 1)) - a, a)
        out["offset"] = offs.view(np.int64).astype(np.int32)
        return out

    # The arrays whose size follows the symbol count, in the order they are laid out.
    GROWING = ("kallsyms_offsets", "kallsyms_names", "kallsyms_markers", "kallsyms_seqs_of_names")

    def arrays(self, ctx, entries, at=None):
        """{array symbol: bytes} of the arrays ``write`` stores for ``entries``
        (only those the image has); ``at`` as for ``write``."""
        n = len(entries)
        old_index = entries["old_index"].tolist()
        offsets = entries["offset"]
        if self.format == PC_RELATIVE:
            base = (at or {}).get("kallsyms_offsets", ctx.image.symbol_address("kallsyms_offsets"))
            field = np.uint64(base) + np.arange(n, dtype=np.uint64) * np.uint64(4)
            rel = entries["addr"].astype(np.int64) - field.astype(np.int64)
            if len(rel) and (rel.min() < -(1 << 31) or rel.max() >= (1 << 31)):
                raise ValueError("kallsyms: a symbol is out of s32 reach of kallsyms_offsets")
            offsets = rel
        out = {"kallsyms_offsets": np.asarray(offsets).astype("<i4").tobytes()}
        bounds = self._record_bounds
        blob = self._names_blob
        b = np.asarray(bounds, np.int64)
        order = np.asarray(old_index, np.int64)
        lens = b[order + 1] - b[order]
        new_off = np.concatenate([[0], np.cumsum(lens)[:-1]]) if n else np.zeros(0, np.int64)
        out["kallsyms_names"] = b"".join([blob[x:y] for x, y in
                                         zip(b[order].tolist(), b[order + 1].tolist())])
        out["kallsyms_markers"] = new_off[::256].astype("<u4").tobytes()
        if ctx.image.symbol_address("kallsyms_seqs_of_names") is not None:
            # name order (strcmp on the name without its type letter), ties by address
            addr = entries["addr"].tolist()
            keyed = sorted(range(n), key=lambda j: (self.names[old_index[j]].encode("latin-1"), addr[j], j))
            seq = np.array(keyed, dtype=np.int64)
            b = np.zeros((n, 3), dtype=np.uint8)
            b[:, 0], b[:, 1], b[:, 2] = (seq >> 16) & 0xFF, (seq >> 8) & 0xFF, seq & 0xFF
            out["kallsyms_seqs_of_names"] = b.tobytes()
        return out

    def write(self, ctx, entries, out, at=None):
        """Store the arrays at their symbols' addresses, or at ``at`` ({array
        symbol: address}, for arrays a rewrite moved because they grew); the
        symbol count goes to ``kallsyms_num_syms`` when it changed."""
        im = ctx.image
        n_old = self.locate(ctx)[1]
        if len(entries) != n_old:
            if not at or any(nm not in at for nm in self.GROWING if im.symbol_address(nm)):
                raise ValueError(f"kallsyms: {len(entries)} symbols do not fit the image's "
                                 f"arrays (sized for {n_old})")
            out.write(im.symbol_address("kallsyms_num_syms"),
                      np.array([len(entries)], "<u4").view(np.uint8))
        for nm, data in self.arrays(ctx, entries, at).items():
            addr = (at or {}).get(nm, im.symbol_address(nm))
            out.write(addr, np.frombuffer(data, np.uint8))

    def check_window(self, ctx, entries, lo, hi):
        # names are parsed per table, indexed like entries: check it whole
        return self.check(ctx, entries)

    def check(self, ctx, entries):
        findings = []
        n = len(entries)
        if n == 0:
            return findings
        addr = entries["addr"]
        self.check_sorted(ctx, findings, addr, "symbol addresses")
        expect = self.name_offsets[::256]
        bad = np.nonzero(self.markers != expect)[0]
        for i in bad[:self.max_findings_per_check].tolist():
            findings.append(Finding("error", "kallsyms.markers", None,
                                    f"kallsyms_markers[{i}] = {int(self.markers[i])}, but symbol "
                                    f"{256 * i} starts at {int(expect[i])} in kallsyms_names"))
        if self.seqs is not None:
            if not np.array_equal(np.sort(self.seqs), np.arange(n)):
                findings.append(Finding("error", "kallsyms.seqs_of_names", None,
                                        "kallsyms_seqs_of_names is not a permutation of the symbols"))
            else:
                ordered = [self.names[i] for i in self.seqs.tolist()]
                unsorted = [k for k in range(1, n) if ordered[k] < ordered[k - 1]]
                for k in unsorted[:self.max_findings_per_check]:
                    findings.append(Finding("error", "kallsyms.seqs_of_names", None,
                                            f"kallsyms_seqs_of_names out of name order at "
                                            f"{ordered[k - 1]!r} > {ordered[k]!r}"))
        # Every kallsyms symbol that the ELF symtab also has must agree on the address.
        where = ctx.symbol_addresses()
        mismatched = []
        for i, (nm, a) in enumerate(zip(self.names, addr.tolist())):
            got = where.get(nm)
            if got is not None and a not in got:
                mismatched.append(i)
        for i in mismatched[:self.max_findings_per_check]:
            nm = self.names[i]
            findings.append(Finding("error", "kallsyms.address", int(addr[i]),
                                    f"kallsyms says {nm} is at {int(addr[i]):#x}, the ELF symbol "
                                    f"table says {', '.join(hex(v) for v in sorted(where[nm]))}"))
        if len(mismatched) > self.max_findings_per_check:
            findings.append(Finding("error", "kallsyms.address", None,
                                    f"{len(mismatched)} kallsyms addresses disagree with the symtab"))
        self.matched = n - len(mismatched)
        return findings


def _own_prefix_ties(names, addr):
    """1 where ``__pfx_<fn>`` is at the same address as a symbol ``<fn>``, else 0.
    Only entries sharing their address with another are looked at by name (none
    but aliases in a kernel as linked or with its paddings kept)."""
    n = len(addr)
    out = np.zeros(n, np.int8)
    if n < 2:
        return out
    order = np.argsort(addr, kind="stable")
    same = addr[order][1:] == addr[order][:-1]
    shared = np.zeros(n, bool)
    shared[order[1:][same]] = True
    shared[order[:-1][same]] = True
    rows = np.nonzero(shared)[0].tolist()
    at = {}
    for k in rows:
        at.setdefault(int(addr[k]), set()).add(names[k])
    for k in rows:
        if names[k].startswith("__pfx_") and names[k][6:] in at[int(addr[k])]:
            out[k] = 1
    return out
