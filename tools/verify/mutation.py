"""Mutation testing of verify itself: corrupt one table entry (or one
instruction of a rewritten image) in memory, run only the checks that read
what changed, and see whether verify names the fault with its table and
address.

Nothing is written to disk: :class:`PatchedImage` overlays a copy of each
touched section on the mapped image, and every mutation is undone after its
check. The code partition (functions, swept asm code, padding) does not
depend on any kernel table (image/coverage.py), so a table mutation leaves
the decoded instructions valid and only the table's own check has to run,
on a window of entries around the mutated ones (``KernelTable.check_window``).

Mutation classes (table, field, kind) that no static check can catch are not
generated; ``UNDETECTABLE`` lists them with the reason (the README repeats it).
"""

import copy

import numpy as np

from ..kernel import TABLES
from .patched import PatchedImage  # noqa: F401 (the mutation views; blocks.py reads them)

# (table, field) -> why a wrong value there cannot be seen in the image alone.
UNDETECTABLE = {
    ("__jump_table", "key: another key of the same initial state"):
        "any static_key is a valid key; which one a site tests is the program's meaning",
    ("__jump_table", "flags bit 1"):
        "C sites set it (2 | branch), asm sites leave it clear; nothing in the image ties it to a site",
    (".altinstructions", "cpuid: another valid feature bit"):
        "every feature bit below NCAPINTS*32 is legal; which one selects the patch is the source's choice",
    ("__bug_table", "file, line"):
        "debug text for the WARN/BUG message; any string and line number are well-formed",
    ("__bug_table", "flags: ONCE / NO_CUT_HERE"):
        "both settings are legal for any site",
    ("__ex_table", "data: another valid handler type or register"):
        "each type is legal for any faulting instruction; only the source says which one applies",
    ("orc_unwind", "sp_offset, bp_offset, valid registers/types"):
        "the stack state at an IP needs objtool's whole-function stack analysis to recompute",
    ("__jump_table", "target of a nop site: another instruction of its function"):
        "a nop site encodes no target; any instruction of the function is a well-formed label",
    ("__ex_table", "insn: another instruction of the same function"):
        "any instruction of the function may fault; which one does is the source's choice",
    ("__ex_table", "fixup: another instruction of the same function"):
        "any instruction of the insn's function (or shared asm fixup code) is a well-formed landing point",
    (".altinstructions", "instrlen/replacementlen: another instruction boundary"):
        "a site may cover any number of whole instructions; the length is only known to the assembler",
    ("orc_unwind", "ip: moved to another instruction between its neighbours"):
        "an instruction start (or int3 fill) between the neighbouring IPs is a well-formed IP; which one "
        "is right needs the stack analysis",
    ("kallsyms", "a symbol the ELF symtab does not have"):
        "no second source for its address",
}


def patched_context(ctx):
    """An ImageContext over a PatchedImage sharing ctx's decoded code and caches."""
    pctx = copy.copy(ctx)
    pctx.image = PatchedImage(ctx.image)
    return pctx


# -- table entry mutations ---------------------------------------------------------

def _s32(v):
    return int(v).to_bytes(4, "little", signed=True)


class Field:
    """One field of a table record: where it is and how to corrupt it."""

    def __init__(self, name, offset, kind, storage=0):
        # kind: rel32 / abs64 (code addresses), len8, flags (key fields), ...
        self.name, self.offset, self.kind, self.storage = name, offset, kind, storage


def table_fields(table, ctx):
    """The mutable fields of one table for this kernel's layout."""
    n = table.name
    if n == "__jump_table":
        return [Field("code", 0, "rel32"), Field("target", 4, "rel32"), Field("key", 8, "jump_key")]
    if n == ".static_call_sites":
        return [Field("addr", 0, "rel32"), Field("key", 4, "call_key")]
    if n == ".altinstructions":
        dt = table.dtype
        return [Field("instr", 0, "rel32"), Field("repl", 4, "rel32_repl"),
                Field("cpuid", dt.fields["cpuid"][1], "cpuid"),
                Field("instrlen", dt.fields["instrlen"][1], "len8"),
                Field("replacementlen", dt.fields["replacementlen"][1], "len8_repl")]
    if n == ".parainstructions":
        return [Field("instr", 0, "abs64"), Field("type", 8, "type8"), Field("len", 9, "len8")]
    if n in (".retpoline_sites", ".return_sites", ".smp_locks", ".call_sites", ".ibt_endbr_seal"):
        return [Field("addr", 0, "rel32")]
    if n == "__ex_table":
        return [Field("insn", 0, "rel32"), Field("fixup", 4, "rel32"), Field("data", 8, "extype")]
    if n == "__bug_table":
        return [Field("bug_addr", 0, "rel32"), Field("flags", 10, "bugflags")]
    if n == "orc_unwind":
        return [Field("ip", 0, "rel32"), Field("bits", 4, "orcbits", storage=1)]
    if n == "__mcount_loc":
        return [Field("addr", 0, "abs64")]
    if n == "kallsyms":
        return [Field("offset", 0, "kallsyms")]
    if n in ("__ksymtab", "__ksymtab_gpl"):
        return [Field("value", 0, "rel32_export"), Field("name", 4, "rel32_name")]
    return []


def _entry_sites(table, entries):
    """The code address each entry is about (its region decides func/non-func/init)."""
    for f in ("code", "addr", "instr", "insn", "ip", "value"):
        if entries.dtype.names and f in entries.dtype.names:
            return entries[f].astype(np.uint64)
    return None


def region_of(ctx, addrs):
    """'func' / 'non-func' / 'init' for code addresses ('' outside code)."""
    addrs = np.asarray(addrs, np.uint64)
    init = ctx.image.section(".init.text")
    in_init = np.zeros(len(addrs), bool) if init is None else \
        (addrs >= np.uint64(init.addr)) & (addrs < np.uint64(init.end))
    in_func = ctx.functions.find(addrs) >= 0
    in_code = ctx.in_code(addrs)
    return np.where(~in_code, "", np.where(in_init, "init", np.where(in_func, "func", "non-func")))


class TableMutator:
    """Generates and checks mutations of one table's entries."""

    def __init__(self, ctx, pctx, cls, rng):
        self.ctx, self.pctx, self.rng = ctx, pctx, rng
        self.table = cls()
        self.loc = self.table.locate(ctx)
        self.entries = self.table.parse(ctx) if self.loc is not None else None
        self.fields = table_fields(self.table, ctx) if self.loc is not None else []
        self.storage = self.table.ranges(ctx)

    def record_address(self, field, raw_index):
        base, _count, size = self.storage[field.storage]
        return base + raw_index * size + field.offset

    # index in the parsed entries -> index of the raw record (site lists drop zeros)
    def raw_index(self, k):
        e = self.entries
        if e.dtype.names and "entry" in e.dtype.names:
            return (int(e["entry"][k]) - self.storage[0][0]) // self.storage[0][2]
        return k

    def _insn_after(self, a):
        d = self.ctx.disasm
        i = int(d.containing([a])[0])
        return None if i < 0 else int(d.addr[i]) + int(d.size[i])

    def _other_function_insn(self, a):
        """An instruction start in a random function other than the one holding a."""
        ft, d = self.ctx.functions, self.ctx.disasm
        own = int(ft.find([a])[0])
        for _ in range(20):
            j = int(self.rng.integers(len(ft)))
            if j == own:
                continue
            lo = np.searchsorted(d.addr, ft.start[j])
            hi = np.searchsorted(d.addr, ft.end[j])
            if hi - lo > 2:
                return int(d.addr[lo + 1 + int(self.rng.integers(hi - lo - 2))])
        return None

    def mutations(self, field, k):
        """[(kind, [(addr, bytes)], involved addresses)] for entry k and field."""
        e, pimg = self.entries, self.ctx.image
        r = self.raw_index(k)
        at = self.record_address(field, r)
        out = []

        def rel_to(target, where=at):
            return _s32(int(target) - where)

        cur_rel = int.from_bytes(bytes(pimg.read(at, 4)), "little", signed=True) if field.kind != "abs64" else 0
        if field.kind in ("rel32", "rel32_repl", "abs64", "rel32_export"):
            t = at + cur_rel if field.kind != "abs64" else int(pimg.view(at, 1, "<u8")[0])
            enc = (lambda x: rel_to(x)) if field.kind != "abs64" else (lambda x: int(x).to_bytes(8, "little"))
            out.append(("off by one", [(at, enc(t + 1))], {t, t + 1}))
            nxt = self._insn_after(t)
            if nxt is not None:
                out.append(("off by an instruction", [(at, enc(nxt))], {t, nxt}))
            if field.kind != "rel32_repl":
                other = self._other_function_insn(t)
                if other is not None:
                    out.append(("into another function", [(at, enc(other))], {t, other}))
            # swap with the next entry's field
            if k + 1 < len(e):
                at2 = self.record_address(field, self.raw_index(k + 1))
                if field.kind == "abs64":
                    t2 = int(pimg.view(at2, 1, "<u8")[0])
                    enc2 = lambda x: int(x).to_bytes(8, "little")
                    patches = [(at, enc2(t2)), (at2, enc2(t))]
                else:
                    t2 = at2 + int.from_bytes(bytes(pimg.read(at2, 4)), "little", signed=True)
                    patches = [(at, rel_to(t2)), (at2, rel_to(t, at2))]
                if t2 != t and self._swap_matters(field, k, t, t2):
                    out.append(("swapped pair", patches, {t, t2, at, at2}))
        elif field.kind == "rel32_name":
            t = at + cur_rel
            out.append(("off by one", [(at, rel_to(t + 1))], {t + 1}))
        elif field.kind == "jump_key":
            raw = int(pimg.view(at, 1, "<i8")[0])
            site = int(e["code"][k])
            enc = lambda v: int(v).to_bytes(8, "little", signed=True)
            out.append(("wrong flag (branch)", [(at, enc(raw ^ 1))], {site}))
            out.append(("misaligned key", [(at, enc(raw + 4))], {site}))
            out.append(("key into code", [(at, enc(site - at))], {site}))
        elif field.kind == "call_key":
            site = int(e["addr"][k])
            out.append(("wrong flag (tail)", [(at, _s32(cur_rel ^ 1))], {site}))
            out.append(("wrong flag (init)", [(at, _s32(cur_rel ^ 2))], {site}))
            out.append(("off by one", [(at, _s32(cur_rel + 4))], {site}))
            # swap keys with an entry of another static call
            key = int(e["key"][k])
            other = np.nonzero(e["key"] != np.uint64(key))[0]
            if len(other):
                j = int(other[self.rng.integers(len(other))])
                at2 = self.record_address(field, self.raw_index(j))
                r2 = int.from_bytes(bytes(pimg.read(at2, 4)), "little", signed=True)
                out.append(("swapped pair", [(at, _s32(at2 + r2 - at)), (at2, _s32(at + cur_rel - at2))],
                            {site, int(e["addr"][j])}))
        elif field.kind in ("len8", "len8_repl"):
            v = int(pimg.read(at, 1)[0])
            site = int(_entry_sites(self.table, e)[k])
            start = int(e["repl"][k]) if field.kind == "len8_repl" else site
            out.append(("wrong length (+1)", [(at, bytes([(v + 1) & 0xFF]))], {site, start + v + 1}))
            if v > 1:
                out.append(("wrong length (-1)", [(at, bytes([v - 1]))], {site, start + v - 1}))
        elif field.kind == "cpuid":
            site = int(e["instr"][k])
            out.append(("feature out of range", [(at, (0xFFFF).to_bytes(2, "little"))], {site}))
        elif field.kind == "type8":
            v = int(pimg.read(at, 1)[0])
            site = int(e["instr"][k])
            out.append(("wrong type (+1)", [(at, bytes([(v + 1) & 0xFF]))], {site}))
            out.append(("type out of range", [(at, bytes([0xFF]))], {site}))
        elif field.kind == "extype":
            site = int(e["insn"][k])
            out.append(("invalid type", [(at, bytes([0]))], {site}))
            out.append(("type out of range", [(at, bytes([0x7F]))], {site}))
        elif field.kind == "bugflags":
            v = int(pimg.view(at, 1, "<u2")[0])
            site = int(e["addr"][k])
            out.append(("wrong flag (DONE)", [(at, (v | 4).to_bytes(2, "little"))], {site}))
            out.append(("wrong flag (taint without WARNING)",
                        [(at, ((v & ~1) | 0x900).to_bytes(2, "little"))], {site}))
        elif field.kind == "orcbits":
            v = int(pimg.view(at, 1, "<u2")[0])
            site = int(e["ip"][k])
            out.append(("invalid sp register", [(at, ((v & ~0xF) | 0xF).to_bytes(2, "little"))], {site}))
            out.append(("invalid type", [(at, (v | 0x300).to_bytes(2, "little"))], {site}))
        elif field.kind == "kallsyms":
            out.append(("off by one", [(at, _s32(cur_rel - 1 if cur_rel < 0 else cur_rel + 1))],
                        {int(e["addr"][k]) + 1}))
        return out

    def _swap_matters(self, field, k, t, t2):
        """Swapping two fields can be a no-op for the image's meaning: two
        entries of one site list exchange places (unsorted lists), ORC IPs
        with the same state. Only swaps that change a meaning are generated."""
        name = self.table.name
        if name in (".retpoline_sites", ".return_sites", ".smp_locks", ".call_sites",
                    ".ibt_endbr_seal", "__bug_table", "__ksymtab", "__ksymtab_gpl"):
            return name in ("__ksymtab", "__ksymtab_gpl") or False
        if name == "orc_unwind":
            e = self.entries
            return any(e[f][k] != e[f][k + 1] for f in ("sp_offset", "bp_offset", "bits"))
        if name == "__jump_table" and field.name == "code":
            e = self.entries
            return e["key"][k] != e["key"][k + 1] or e["flags"][k] != e["flags"][k + 1]
        return True

    def site(self, k):
        sites = _entry_sites(self.table, self.entries)
        return None if sites is None else int(sites[k])

    def check(self, k, patches, involved):
        """Apply patches, run this table's check on a window, undo. Returns the
        findings that name the fault (an error at one of the involved addresses
        or at a patched record)."""
        tokens = [self.pctx.image.patch(a, b) for a, b in patches]
        try:
            table = type(self.table)()
            entries = table.parse(self.pctx)
            found = table.check_window(self.pctx, entries, max(k - 1, 0), min(k + 3, len(entries)))
        finally:
            for t in reversed(tokens):
                self.pctx.image.undo(t)
        names = set(involved) | {a for a, _ in patches} | {self.site(k)}
        return [f for f in found if f.severity == "error" and f.address in names]


def _same_code(ctx, a, b):
    ft = ctx.functions
    fa, fb = int(ft.find([a])[0]), int(ft.find([b])[0])
    if fa >= 0 or fb >= 0:
        return fa == fb
    return int(ctx.code_piece([a])[0]) == int(ctx.code_piece([b])[0])


def _boundary(ctx, a, end=False):
    d = ctx.disasm
    if d.is_boundary([a])[0]:
        return True
    i = int(d.containing([a - 1])[0]) if end else -1
    return i >= 0 and int(d.addr[i]) + int(d.size[i]) == a


def undetectable(ctx, table, field, kind, entries, k, patches, pctx):
    """The UNDETECTABLE class a mutation falls in, or None.

    Decided from what the mutation wrote (never from whether it was caught):
    a value that is well-formed by every rule the image can show.
    """
    if table.name in ("__ex_table", "orc_unwind") and field.name in ("insn", "fixup", "ip"):
        old = int(entries[field.name][k])
        news = [int(x) for x in _reparsed(table, pctx, patches, field.name, k)]
        if table.name == "orc_unwind":
            from ..image.coverage import PADDING
            # an IP at an instruction start or in int3 fill (objtool's terminators)
            ok = all(_boundary(ctx, n) or int(ctx.coverage.category_at([n])[0]) == PADDING for n in news)
        elif field.name == "fixup":
            # what the check allows: the insn's own function (or non-function fixup code)
            insn = entries["insn"][k:k + len(news)]
            ok = all(_boundary(ctx, n) and (_same_code(ctx, int(i), n) or int(ctx.functions.find([n])[0]) < 0)
                     for i, n in zip(insn.tolist(), news))
        else:
            ok = all(_boundary(ctx, n) and _same_code(ctx, old, n) for n in news)
        if table.name == "orc_unwind":
            ip = entries["ip"]
            lo = int(ip[k - 1]) if k else 0
            hi = int(ip[k + 1]) if k + 1 < len(ip) else 1 << 64
            ok = ok and all(lo <= n <= hi for n in news) and kind != "swapped pair"
            return ("orc_unwind", "ip: moved to another instruction between its neighbours") if ok else None
        if ok and field.name == "insn":
            ins = entries["insn"]
            n = news[0]
            ok = (k == 0 or int(ins[k - 1]) <= n) and (k + 1 >= len(ins) or n <= int(ins[k + 1]))
        return ("__ex_table", f"{field.name}: another instruction of the same function") if ok else None
    if table.name == "__jump_table" and field.name == "target":
        from ..kernel.jump_table import classify
        kind_k, _ = classify(ctx, entries["code"][k:k + 1])
        news = [int(x) for x in _reparsed(table, pctx, patches, "target", k)]
        ok = int(kind_k[0]) in (0, 1) and all(
            _boundary(ctx, n) and _same_code(ctx, int(entries["code"][k]), n) for n in news)
        return ("__jump_table", "target of a nop site: another instruction of its function") if ok else None
    if table.name == "__jump_table" and field.name == "code" and kind == "swapped pair":
        # the premise, from the image: each site now answers to the other entry's key and
        # branch bit, which is invisible only when both ask for the same built form
        same = _built_as_nop(ctx, entries["key"][k], entries["flags"][k]) == \
            _built_as_nop(ctx, entries["key"][k + 1], entries["flags"][k + 1])
        return ("__jump_table", "key: another key of the same initial state") if same else None
    if table.name == ".altinstructions" and field.name in ("instrlen", "replacementlen"):
        start = "instr" if field.name == "instrlen" else "repl"
        e2 = _reparsed_entries(table, pctx, patches)
        end = int(e2[start][k]) + int(e2[field.name][k])
        ok = _boundary(ctx, end, end=True) and int(e2["replacementlen"][k]) <= int(e2["instrlen"][k])
        return (".altinstructions", "instrlen/replacementlen: another instruction boundary") if ok else None
    return None


def _built_as_nop(ctx, key, flags):
    """Whether a __jump_table entry's site is built as a nop: exactly when its key's
    initial ``enabled`` (the static_key's first s32; 0 in .bss or outside the file)
    agrees with the entry's branch bit, the rule __jump_table.initial-state checks."""
    try:
        enabled = int.from_bytes(bytes(ctx.image.read(int(key), 4)), "little", signed=True)
    except ValueError:
        enabled = 0
    return (enabled != 0) == bool(int(flags) & 1)


def _reparsed_entries(table, pctx, patches):
    tokens = [pctx.image.patch(a, b) for a, b in patches]
    try:
        return type(table)().parse(pctx)
    finally:
        for t in reversed(tokens):
            pctx.image.undo(t)


def _reparsed(table, pctx, patches, field, k):
    e = _reparsed_entries(table, pctx, patches)
    return e[field][k:k + 2] if len(patches) > 1 else e[field][k:k + 1]


def table_mutations(ctx, rng, per_class=8, tables=None):
    """Run mutations over every table, field, kind and region.

    Returns rows (table, field, kind, region, entry address, named: bool,
    findings, undetectable class or None) for each mutation. The class is
    only looked up for mutations verify did not name.
    """
    pctx = patched_context(ctx)
    rows = []
    for cls in TABLES:
        if tables and cls.name not in tables:
            continue
        m = TableMutator(ctx, pctx, cls, rng)
        if m.entries is None or not len(m.entries) or not m.fields:
            continue
        sites = _entry_sites(m.table, m.entries)
        if sites is None:
            continue
        regions = region_of(ctx, sites)
        for field in m.fields:
            for region in ("func", "non-func", "init"):
                pool = np.nonzero(regions == region)[0]
                if m.table.name == "kallsyms":
                    pool = pool[_in_symtab(ctx, m, pool)]
                if not len(pool):
                    continue
                picks = rng.choice(pool, size=min(per_class, len(pool)), replace=False)
                for k in sorted(int(x) for x in picks):
                    for kind, patches, involved in m.mutations(field, k):
                        found = m.check(k, patches, involved)
                        why = None if found else undetectable(ctx, m.table, field, kind, m.entries,
                                                               k, patches, pctx)
                        rows.append((m.table.name, field.name, kind, region,
                                     m.record_address(field, m.raw_index(k)), bool(found), found, why))
    return rows


def _in_symtab(ctx, m, pool):
    """kallsyms entries whose name the ELF symtab knows (second source)."""
    where = ctx.symbol_addresses()
    return np.array([m.table.names[i] in where and len(where[m.table.names[i]]) == 1
                     for i in pool.tolist()], dtype=bool)


def catch_table(rows, key=lambda r: (r[0], r[3])):
    """{key: (mutations, named)} aggregated from mutation rows."""
    out = {}
    for r in rows:
        n, c = out.get(key(r), (0, 0))
        out[key(r)] = (n + 1, c + int(r[5]))
    return out


# -- code mutations under verify --against ------------------------------------------

# Single-instruction nops of each length (gas's forms; 10/11 with extra 66 prefixes).
_NOPS = {1: "90", 2: "6690", 3: "0f1f00", 4: "0f1f4000", 5: "0f1f440000", 6: "660f1f440000",
         7: "0f1f8000000000", 8: "0f1f840000000000", 9: "660f1f840000000000",
         10: "66660f1f840000000000", 11: "6666660f1f840000000000"}


class CodeMutator:
    """Mutates single instructions of NEW (a relayout of OLD) and runs the
    instruction comparison of ``verify --against`` on just that instruction."""

    def __init__(self, octx, nctx, rng):
        from .addrmap import (FunctionMap as _Map, code_labels as _labels, match_functions,
                              piece_ends as _piece_ends, region_points as _region_points)
        from .code import compared_instructions as _compared_instructions
        import capstone
        self.octx, self.nctx, self.rng = octx, nctx, rng
        old, new = octx.image, nctx.image
        of, nf = octx.functions, nctx.functions
        oi, ni, _missing = match_functions(octx, nctx)
        self.amap = _Map(of.start[oi], _piece_ends(old, of)[oi], nf.start[ni], *_labels(old, new, of),
                         points=_region_points(old, new))
        same_size = np.ones(len(of), bool)
        same_size[oi[of.size[oi] != nf.size[ni]]] = False
        matched = np.zeros(len(of), bool)
        matched[oi] = True
        od, nd = octx.disasm, nctx.disasm
        self.use = _compared_instructions(octx, od, matched, same_size)
        self.new_addr = self.amap.map(od.addr)
        k = np.searchsorted(nd.addr, self.new_addr)
        kc = np.minimum(k, len(nd.addr) - 1)
        self.new_row = np.where((k < len(nd.addr)) & (nd.addr[kc] == self.new_addr), kc, -1)
        self.cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        self.cs.detail = True
        from ..image.disasm import _Decoder
        self.dec = _Decoder()

    def candidates(self, region, moved):
        """Old instruction rows of a region ('func' / 'non-func' / 'init'),
        moved or not, that exist in NEW and are not nops or padding."""
        od = self.octx.disasm
        ok = self.use & (self.new_row >= 0)
        ok &= (self.new_addr != od.addr) if moved else (self.new_addr == od.addr)
        if getattr(self, "_nops", None) is None:
            self._nops = _NOP_MASK(od)
        ok &= ~self._nops
        if getattr(self, "_regions", None) is None:
            self._regions = region_of(self.octx, od.addr)
        return np.nonzero(ok & (self._regions == region))[0]

    def mutations(self, o):
        """[(kind, new bytes)] for the NEW counterpart of old row o."""
        nd = self.nctx.disasm
        n = int(self.new_row[o])
        size = int(nd.size[n])
        cur = bytes(nd.raw[n][:size])
        out = []
        ins = next(self.cs.disasm(cur, int(nd.addr[n]), 1), None)
        if ins is None:
            return out
        groups = set(ins.groups)
        is_branch = bool(groups & {capstone_groups.JUMP, capstone_groups.CALL}) and \
            any(op.type == capstone_groups.OP_IMM for op in ins.operands)
        if is_branch:
            # relative branch: the displacement is the last 1 or 4 bytes
            w = 1 if size - len(ins.prefix) - (2 if cur[0] == 0x0F else 1) <= 1 else 4
            disp = int.from_bytes(cur[size - w:], "little", signed=True)
            nb = cur[:size - w] + ((disp + 1) & ((1 << (8 * w)) - 1)).to_bytes(w, "little")
            out.append(("branch target", nb))
        elif ins.imm_size:
            off, w = ins.imm_offset, ins.imm_size
            v = int.from_bytes(cur[off:off + w], "little")
            nb = cur[:off] + ((v + 1) & ((1 << (8 * w)) - 1)).to_bytes(w, "little") + cur[off + w:]
            out.append(("immediate", nb))
        elif ins.disp_size:
            off, w = ins.disp_offset, (4 if ins.disp_size == 2 else ins.disp_size)
            v = int.from_bytes(cur[off:off + w], "little")
            nb = cur[:off] + ((v + 8) & ((1 << (8 * w)) - 1)).to_bytes(w, "little") + cur[off + w:]
            out.append(("displacement", nb))
        if size in _NOPS:
            out.append(("nop over the instruction", bytes.fromhex(_NOPS[size])))
        return out

    def check(self, o, new_bytes):
        """Put new_bytes in NEW's decoded row (re-decoded, as verify would see
        them), compare that one instruction, undo. Returns naming findings."""
        from .code import compare_instructions
        nd = self.nctx.disasm
        n = int(self.new_row[o])
        dec = self.dec.decode(new_bytes, int(nd.addr[n]))
        saved = (nd.raw[n].copy(), int(nd.size[n]))
        try:
            nd.raw[n] = 0
            nd.raw[n][:len(new_bytes)] = np.frombuffer(new_bytes, np.uint8)
            nd.size[n] = int(dec["size"][0]) if len(dec) else 1
            use = np.zeros(len(self.use), bool)
            use[o] = True
            findings, counter = [], {}
            compare_instructions(self.octx, self.nctx, self.amap, use, self.octx.is_kernel,
                                 findings, counter)
        finally:
            nd.raw[n], nd.size[n] = saved
        names = {int(self.octx.disasm.addr[o]), int(nd.addr[n])}
        return [f for f in findings if f.severity == "error" and f.address in names]


class _CapstoneGroups:
    def __init__(self):
        import capstone
        self.JUMP, self.CALL = capstone.CS_GRP_JUMP, capstone.CS_GRP_CALL
        self.OP_IMM = capstone.x86.X86_OP_IMM
        self.BRANCH_RELATIVE = capstone.CS_GRP_BRANCH_RELATIVE


capstone_groups = _CapstoneGroups()


def _NOP_MASK(dis):
    from ..image.coverage import _is_padding_insn
    return _is_padding_insn(dis.raw, dis.size.astype(np.int64))


def code_mutations(octx, nctx, rng, per_class=20):
    """Code mutations in moved and unmoved code of every region. Rows:
    ('code', kind, region, 'moved'/'unmoved', old address, named, findings, None)."""
    m = CodeMutator(octx, nctx, rng)
    rows = []
    for region in ("func", "non-func", "init"):
        for moved in (True, False):
            pool = m.candidates(region, moved)
            if not len(pool):
                continue
            picks = rng.choice(pool, size=min(per_class, len(pool)), replace=False)
            for o in sorted(int(x) for x in picks):
                for kind, nb in m.mutations(o):
                    found = m.check(o, nb)
                    rows.append(("code", kind, region, "moved" if moved else "unmoved",
                                 int(octx.disasm.addr[o]), bool(found), found, None))
    m.dec.close()
    return rows


# -- switch-table entries of a rewritten executable under verify --against -----------

def against_map(octx, nctx):
    """The old -> new map ``verify --against`` rebuilds from the two images
    (block-aware when NEW carries a block map)."""
    from ..image import blockmap as bm
    from .addrmap import (BlockAwareMap as _BlockAwareMap, code_labels as _labels,
                          code_ranges as _code_ranges, FunctionMap as _Map,
                          match_functions, piece_ends as _piece_ends,
                          region_points as _region_points)
    old, new = octx.image, nctx.image
    of, nf = octx.functions, nctx.functions
    oi, ni, _missing = match_functions(octx, nctx)
    amap = _Map(of.start[oi], _piece_ends(old, of)[oi], nf.start[ni], *_labels(old, new, of),
                points=_region_points(old, new))
    if not octx.is_kernel:
        amap.fixed = np.array(sorted(e for _, e in _code_ranges(old)), np.uint64)
    rows = bm.read_blockmap(new)
    if rows is not None and len(rows):
        amap = _BlockAwareMap(amap, rows)
    return amap


class _Extra:
    def __init__(self):
        self.extra = {}


def switch_table_mutations(octx, nctx, rng, per_kind=8):
    """Wrong switch-table entries written into NEW (a relayout of the executable
    OLD), one at a time, each checked by verify's code-field check
    (tools/verify/pie.py: the tables found from OLD's code). Kinds: off by one,
    another case of the same table, the original value left in place (stale),
    and what translating the entry as S + A gives (a PIC entry read relative to
    itself: what relayout wrote for ET_EXEC before issue 22); a kind that would
    write the right value is not generated. Rows: ('switch-table', kind, 'pic'
    / 'absolute', '', field address, named, findings, None)."""
    from .findings import add_findings as _add
    from .pie import check_code_fields, old_switch_tables
    amap = against_map(octx, nctx)
    st = old_switch_tables(octx)
    pnew = PatchedImage(nctx.image)
    old = octx.image
    rows = []
    for what, fields, cases, bases, width in (
            ("pic", st.pic_field, st.pic_case, st.pic_base, 4),
            ("absolute", st.abs_field, st.abs_case, st.abs_base, 8)):
        if not len(fields):
            continue
        new_case = amap.map(cases)
        right = (new_case.astype(np.int64) - bases.astype(np.int64)) if width == 4 else \
            new_case.astype(np.int64)
        for k in sorted(int(x) for x in rng.choice(len(fields), size=min(per_kind, len(fields)),
                                                  replace=False)):
            f = int(fields[k])
            v_old = int.from_bytes(bytes(old.read(f, width)), "little", signed=width == 4)
            want = int(right[k])
            same_table = np.nonzero(bases == bases[k])[0]
            other = [int(right[j]) for j in same_table.tolist() if int(right[j]) != want]
            kinds = [("off by one", want + 1), ("stale (original value)", v_old)]
            if other:
                kinds.append(("another case of the table", other[int(rng.integers(len(other)))]))
            if width == 4:
                # S + A: the entry taken as relative to itself, its target mapped
                t = f + v_old
                kinds.append(("translated as S + A",
                              int(amap.map(np.array([t], np.uint64))[0]) - f))
            for kind, value in kinds:
                if value == want:
                    continue
                token = pnew.patch(f, int(value).to_bytes(width, "little", signed=value < 0))
                try:
                    findings, counter = [], {}
                    check_code_fields(old, pnew, amap, octx, findings, counter, _Extra(), _add)
                finally:
                    pnew.undo(token)
                found = [x for x in findings if x.severity == "error" and x.address == f]
                rows.append(("switch-table", kind, what, "", f, bool(found), found, None))
    return rows


# -- single instructions of a block-level rewrite under the block check ---------------

def block_mutations(octx, nctx, rng, count=20):
    """Copied instructions of NEW's split functions (a ``blocks`` relayout of OLD:
    pieces NEW holds with OLD's bytes) corrupted one at a time in a PatchedImage and
    checked by the block check (verify/blocks.py check_blocks) on the function that
    holds them. The PatchedImage's reader is what the block check's C scan
    (blocks.c) reads, so the C scan decides first, as in ``verify --against``: a
    mutation it passed as unchanged would be an escape here. Kinds as
    CodeMutator's: the branch target, an immediate, a displacement, a nop over the
    instruction. Rows: ('block', kind, 'copied', '', old address, named, findings,
    None)."""
    import capstone
    from ..image import blockmap as bm
    from .addrmap import match_functions
    from .blocks import check_blocks
    from .split import split_functions, split_mask
    rows = bm.read_blockmap(nctx.image)
    if rows is None or not len(rows):
        return []
    oi, ni, _missing = match_functions(octx, nctx)
    funcs = split_functions(octx, nctx, rows, split_mask(octx, rows), oi, ni)
    outside = against_map(octx, nctx).base.map
    old, pnew = octx.image, PatchedImage(nctx.image)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True
    # instructions of copied pieces NEW holds unchanged (not nops)
    cands = []
    for r in rows[(rows["kind"] == bm.KIND_COPIED) & (rows["old_len"] > 0)]:
        o, n, size = int(r["old"]), int(r["new"]), int(r["old_len"])
        code = bytes(old.read(o, size))
        if bytes(nctx.image.read(n, size)) != code:
            continue
        for ins in cs.disasm(code, o):
            if ins.mnemonic != "nop" and not ins.mnemonic.startswith("int3"):
                cands.append((ins.address, n + ins.address - o, bytes(ins.bytes)))
    out = []
    if not cands:
        return out
    f_start = np.array([f.old_start for f in funcs], np.uint64)
    order = np.argsort(f_start)
    for k in sorted(rng.choice(len(cands), size=min(count, len(cands)), replace=False).tolist()):
        a_old, a_new, cur = cands[k]
        ins = next(cs.disasm(cur, a_new, 1))
        fi = int(order[np.searchsorted(f_start[order], np.uint64(a_old), side="right") - 1])
        f = funcs[fi]
        mine = rows[(rows["old"] >= f.old_start) & (rows["old"] <= f.old_end)]
        # what the check says of the function unmutated (run without the kernel's
        # patch sites and noreturn lists it may name an edge): not the mutation's
        base, _ = check_blocks(mine, [f], old.read, pnew.read, outside)
        base = {(x.check, x.address, x.message) for x in base}
        for kind, nb in _instruction_mutations(ins, cur):
            token = pnew.patch(a_new, nb)
            try:
                found, _ = check_blocks(mine, [f], old.read, pnew.read, outside)
            finally:
                pnew.undo(token)
            named = [x for x in found if x.address in (a_old, a_new) and   # (all are errors)
                     (x.check, x.address, x.message) not in base]
            out.append(("block", kind, "copied", "", a_old, bool(named), named, None))
    return out


def _instruction_mutations(ins, cur):
    """[(kind, bytes)] of one instruction (Capstone detail ``ins``, bytes ``cur``):
    a relative branch's target +1, else an immediate +1, else a displacement +8;
    and a nop of the same length over a non-nop."""
    size, out = len(cur), []
    if ins.imm_size:
        off, w = ins.imm_offset, ins.imm_size
        v = int.from_bytes(cur[off:off + w], "little")
        out.append(("branch target" if ins.group(capstone_groups.BRANCH_RELATIVE) else
                    "immediate",
                    cur[:off] + ((v + 1) & ((1 << (8 * w)) - 1)).to_bytes(w, "little")
                    + cur[off + w:]))
    elif ins.disp_size:
        off, w = ins.disp_offset, (4 if ins.disp_size == 2 else ins.disp_size)
        v = int.from_bytes(cur[off:off + w], "little")
        out.append(("displacement", cur[:off] + ((v + 8) & ((1 << (8 * w)) - 1))
                    .to_bytes(w, "little") + cur[off + w:]))
    if size in _NOPS:
        out.append(("nop over the instruction", bytes.fromhex(_NOPS[size])))
    return out
