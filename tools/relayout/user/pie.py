"""Position-independent executables (ET_DYN with an interpreter, linked with
-pie -Wl,--emit-relocs): what a PIE adds to an executable's relayout.

A PIE's link relocations (.rela.text, .rela.data, ...) are kept like a non-PIE's
and go through the same rewrite. Two things are PIE-only:

- Dynamic relocations. ld.so adds the load base to every R_X86_64_RELATIVE
  (and calls every R_X86_64_IRELATIVE resolver) using the *addend* in
  .rela.dyn/.rela.plt, not the field's file contents. Each addend that names
  rewritten code follows the layout: where a link relocation covers the field
  (a function pointer in .data, an .init_array entry) the addend becomes the
  field's new value, so the two agree exactly; the other fields are the ones
  ld made up itself (GOT slots), and both the addend and the slot's contents
  are mapped. With packed relative relocations (.relr.dyn, ld -z
  pack-relative-relocs) the field itself is the addend: ld's own slots are
  mapped the same way. DT_INIT/DT_FINI that point into rewritten code are
  mapped too.
- PIC switch tables (not PIE-only: gcc's default ``-fPIE`` code linked
  ``-no-pie`` has them too). gcc's ``-fpie`` tables hold ``.long .Lcase - .Ltable``:
  an R_X86_64_PC32 relocation in .rodata whose field is relative to the
  table's base, not to the field itself (S + A is the case's address shifted
  by the entry's offset in the table). The base is the .rodata address the
  function loads with ``lea .Ltable(%rip)``; an entry's case is base + value.
  :func:`pic_table_entries` finds them (base = the nearest lea target at or
  before the entry whose base + value is an instruction start), so that the
  rewriter writes map(case) - base and the CFG makes each case a block leader.
"""

import numpy as np

from ...image.elf import RELA, SHT_RELA
from ...image.words import read_s32, read_words
from ...image.relocs import (R_X86_64_64, R_X86_64_IRELATIVE, R_X86_64_PC32, R_X86_64_PLT32,
                            R_X86_64_RELATIVE)

SHT_DYNAMIC = 6
DT_NULL, DT_INIT, DT_FINI, DT_FLAGS_1 = 0, 12, 13, 0x6FFFFFFB
DF_1_PIE = 0x08000000
DYN = np.dtype([("tag", "<i8"), ("val", "<u8")])
UNWIND = (".eh_frame", ".eh_frame_hdr", ".gcc_except_table")


def dynamic_entries(image):
    sec = next((s for s in image.sections if s.type == SHT_DYNAMIC and s.size), None)
    if sec is None:
        return None, None
    n = sec.size // DYN.itemsize
    return sec, np.array(image.section_bytes(sec)[:n * DYN.itemsize]).view(DYN)


def is_pie(image):
    """An ET_DYN executable: it has an interpreter, or DT_FLAGS_1 says PIE
    (a shared library has neither)."""
    if image.type != 3:
        return False
    if image.section(".interp") is not None:
        return True
    _, dyn = dynamic_entries(image)
    if dyn is None:
        return False
    flags = dyn["val"][dyn["tag"] == DT_FLAGS_1]
    return bool(len(flags) and int(flags[0]) & DF_1_PIE)


def dynamic_rela_sections(image):
    """Allocated SHT_RELA sections: the ones ld.so reads (.rela.dyn, .rela.plt)."""
    return [s for s in image.sections if s.type == SHT_RELA and s.is_alloc and s.size]


class PicTables:
    """PC-relative data fields into code: PIC switch-table entries (field
    address, table base and case address, sorted by field address) and the
    fields no reading explains (``loose``: kept as they are, the functions
    their possible targets fall in pinned)."""

    def __init__(self, field=(), base=(), case=(), unexplained=0, loose=(), loose_targets=(),
                 self_relative=0):
        self.field = np.asarray(field, np.uint64)
        self.base = np.asarray(base, np.uint64)
        self.case = np.asarray(case, np.uint64)
        self.loose = np.unique(np.asarray(loose, np.uint64))
        # every address a loose field may designate: its functions must stay
        self.loose_targets = np.unique(np.asarray(loose_targets, np.uint64))
        self.unexplained = max(int(unexplained), len(self.loose))
        self.self_relative = self_relative      # ``.long func - .``: relative to the field

    def __len__(self):
        return len(self.field)

    def anchor(self, addrs):
        """(anchor, is_entry): the table base for fields that are table entries."""
        addrs = np.asarray(addrs, np.uint64)
        if not len(self.field):
            return addrs, np.zeros(len(addrs), bool)
        j = np.searchsorted(self.field, addrs)
        jc = np.minimum(j, len(self.field) - 1)
        hit = (j < len(self.field)) & (self.field[jc] == addrs)
        return np.where(hit, self.base[jc], addrs), hit

    def is_loose(self, addrs):
        return np.isin(np.asarray(addrs, np.uint64), self.loose)

    def examples(self, image, functions, n=5):
        """A few loose fields, for the summary: field, section, value and the
        function the value designates read relative to the field."""
        out = []
        for a in self.loose[:n].tolist():
            sec = image.section_at(a)
            sec_rel = image.relocations.get(sec.name) if sec else None
            size = 8 if sec_rel is not None and (sec_rel.type[sec_rel.offset == a] ==
                                                 R_X86_64_PC64).any() else 4
            v = int.from_bytes(bytes(image.read(a, size)), "little", signed=True)
            f = int(functions.find(np.array([a + v], np.uint64))[0])
            out.append({"field": f"{a:#x}", "section": sec.name if sec else "?",
                        "value": v, "relative_to_itself": functions.name[f] if f >= 0 else
                        f"{a + v:#x}"})
        return out


def _code_ranges(image):
    secs = sorted((s for s in image.sections if s.is_code and s.is_alloc and s.size),
                  key=lambda s: s.addr)
    return (np.array([s.addr for s in secs], np.uint64),
            np.array([s.end for s in secs], np.uint64))


def _in(ranges, a):
    from ...image.intervals import containing
    return containing(ranges[0], ranges[1], a) >= 0


# how many table bases at or before an entry are tried (nearest first)
BASE_CANDIDATES = 4
R_X86_64_PC64 = 24


def _family(functions):
    """Per function, an id shared by the parts of one source function (``foo``,
    ``foo.cold``, ``foo.part.0``: gcc puts a switch's cases in any of them)."""
    stems = [n.split(".", 1)[0] for n in functions.name]
    ids = {}
    return np.array([ids.setdefault(s, len(ids)) for s in stems], np.int64)


def pic_table_entries(image, dis, functions=None):
    """PicTables of an executable, PIE or not (gcc's default ``-fPIE`` code
    linked ``-no-pie`` has the same tables as a PIE); ``dis``: a Disassembly of
    its functions.

    Every PC-relative relocated field of an allocated data section (unwind
    sections aside) whose reading lands in code is one of:
    - a switch-table entry: relative to a table base that a function loads with
      ``lea .Ltable(%rip)`` (one of the BASE_CANDIDATES nearest at or before
      the field), its case base + value an instruction start of that function
      or of another part of it (``foo.cold``);
    - self-relative (``.long func - .``): field + value is a function's start;
    - loose: nothing explains it. Loose fields are left as they are and every
      address they may designate (relative to themselves, to the candidate
      bases, the relocation's S + A) goes in ``loose_targets``: the caller pins
      the functions there.
    """
    if image.type not in (2, 3):
        return PicTables()
    if functions is None:
        from ...image.context import ImageContext
        functions = ImageContext.of(image).functions
    code = _code_ranges(image)
    sym_value = image.symtab["value"].astype(np.int64)
    family = _family(functions)
    # table bases: data addresses code reaches PC-relatively (lea .Ltable(%rip)),
    # each with the family of the function that loads it
    bases, users = [], []
    for r in image.relocations.values():
        if not len(r) or not r.target.is_code or not r.target.is_alloc:
            continue
        m = np.isin(r.type, (R_X86_64_PC32, R_X86_64_PLT32))
        t = (sym_value[r.sym[m].astype(np.int64)] + r.addend[m] + 4).astype(np.uint64)
        fi = functions.find(r.offset[m].astype(np.uint64))
        keep = ~_in(code, t) & (fi >= 0)
        bases.append(t[keep])
        users.append(family[fi[keep]])
    if bases:
        key = np.unique(np.stack([np.concatenate(bases).astype(np.int64).view(np.uint64),
                                  np.concatenate(users).astype(np.uint64)], 1), axis=0)
        bases, users = key[:, 0], key[:, 1].astype(np.int64)
    else:
        bases, users = np.zeros(0, np.uint64), np.zeros(0, np.int64)
    ubases = np.unique(bases)
    fields, base_of, cases, loose, loose_t, selfrel = [], [], [], [], [], 0
    fstarts = np.unique(functions.start.astype(np.uint64))
    for name, r in image.relocations.items():
        tgt = r.target
        if not len(r) or tgt.is_code or not tgt.is_alloc or name in UNWIND or tgt.type == 8:
            continue
        for rtype, size in ((R_X86_64_PC32, 4), (R_X86_64_PC64, 8)):
            m = np.nonzero(r.type == rtype)[0]
            if not len(m):
                continue
            P = r.offset[m].astype(np.uint64)
            S_A = (sym_value[r.sym[m].astype(np.int64)] + r.addend[m]).astype(np.uint64)
            v, have = read_s32(image, P) if size == 4 else read_words(image, P, 8)
            v = v.view(np.int64) if size == 8 else v
            T_self = (P.astype(np.int64) + v).astype(np.uint64)
            k = np.searchsorted(ubases, P, side="right").astype(np.int64) - 1
            # readings relative to the nearest bases in this section
            cand_B, cand_C = [], []
            for j in range(BASE_CANDIDATES):
                kj = k - j
                B = ubases[np.maximum(kj, 0)] if len(ubases) else np.zeros(len(P), np.uint64)
                okb = (kj >= 0) & (B >= np.uint64(tgt.addr))
                cand_B.append(np.where(okb, B, 0).astype(np.uint64))
                cand_C.append(np.where(okb, (B.astype(np.int64) + v).astype(np.uint64), 0))
            # a field is about code when its relocation or its value, read relative to
            # itself, lands there (a table entry's S + A is its case shifted by the
            # entry's offset in the table: in code too, unless the table's last cases
            # end the code), or when a reading relative to a base is an instruction
            about = _in(code, S_A) | _in(code, T_self)
            for C in cand_C:
                about |= dis.is_boundary(C) & (C != 0)
            sel = np.nonzero(have & about)[0]
            if not len(sel):
                continue
            done = np.zeros(len(sel), bool)
            if size == 4:
                for B, C in zip(cand_B, cand_C):
                    B, C = B[sel], C[sel]
                    i = dis.containing(C)
                    ok = ~done & (B != 0) & (i >= 0)
                    ok &= dis.addr[np.maximum(i, 0)] == C
                    fc = functions.find(C)
                    pair = np.stack([B, family[np.maximum(fc, 0)].astype(np.uint64)], 1)
                    ok &= (fc >= 0) & _rows_in(pair, bases, users)
                    fields.append(P[sel][ok])
                    base_of.append(B[ok])
                    cases.append(C[ok])
                    done |= ok
            is_self = ~done & np.isin(T_self[sel], fstarts)
            selfrel += int(is_self.sum())
            lo = sel[~done & ~is_self]
            if len(lo):
                loose.append(P[lo])
                loose_t += [S_A[lo], T_self[lo]] + [C[lo] for C in cand_C]
    if loose_t:
        t = np.concatenate(loose_t)
        loose_t = [t[_in(code, t)]]
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.uint64)
    f, b, c = cat(fields), cat(base_of), cat(cases)
    o = np.argsort(f, kind="stable")
    return PicTables(f[o], b[o], c[o], loose=cat(loose), loose_targets=cat(loose_t),
                     self_relative=selfrel)


def _rows_in(pairs, bases, users):
    """True where (base, family) is one of the (bases, users) pairs (sorted)."""
    if not len(bases):
        return np.zeros(len(pairs), bool)
    known = set(zip(bases.astype(np.uint64).tolist(), users.tolist()))
    return np.fromiter(((b, f) in known for b, f in pairs.tolist()), bool, len(pairs))


SHT_RELR = 19


def relr_addresses(image):
    """Addresses of the fields a ``.relr.dyn`` (ld -z pack-relative-relocs)
    relocates: relative relocations whose addend is the field's contents."""
    out = []
    for sec in image.sections:
        if sec.type != SHT_RELR or not sec.size:
            continue
        words = np.array(image.section_bytes(sec)).view("<u8").tolist()
        where = 0
        for w in words:
            if not w & 1:               # an address; the bitmaps after it start at the next word
                out.append(w)
                where = w + 8
                continue
            for i in range(1, 64):      # a bitmap of the 63 words from ``where``
                if w >> i & 1:
                    out.append(where + 8 * (i - 1))
            where += 63 * 8
    return np.array(sorted(out), np.uint64)


def _static_fields(image):
    """Addresses of 8-byte absolute fields a link relocation covers (data)."""
    out = []
    for name, r in image.relocations.items():
        # link relocations (or ones recovered from a KASLR table: no section), not ld.so's
        if len(r) and r.target.is_alloc and not r.target.is_code and \
                not getattr(r.section, "is_alloc", False):
            out.append(r.offset[r.type == R_X86_64_64].astype(np.uint64))
    return np.unique(np.concatenate(out)) if out else np.zeros(0, np.uint64)


def update_dynamic_entries(rw, image):
    """DT_INIT / DT_FINI that name rewritten code (``-Wl,-init,f``), PIE or not;
    returns how many changed (also in ``rw.stats``)."""
    dsec, dyn = dynamic_entries(image)
    dyn_changed = 0
    if dsec is not None:
        dyn = dyn.copy()
        m = np.isin(dyn["tag"], (DT_INIT, DT_FINI)) & rw.amap.in_extent(dyn["val"])
        if m.any():
            new, ok = rw.amap.map(dyn["val"][m])
            dyn["val"][m] = np.where(ok, new, dyn["val"][m])
            dyn_changed = int((dyn["val"][m] != np.asarray(image.section_bytes(dsec)[
                :len(dyn) * DYN.itemsize]).view(DYN)["val"][m]).sum())
            buf = rw.buf(dsec)
            buf[:len(dyn) * DYN.itemsize] = dyn.view(np.uint8)
    rw.stats["dynamic_entries_updated"] = dyn_changed
    return dyn_changed


def update_dynamic(rw, image, log=None):
    """Make the dynamic relocations' addends (and ld's own GOT slots) and the
    .dynamic entries that name rewritten code follow the layout: a PIE's, and an
    ET_EXEC's IRELATIVE ones (an ifunc of the executable's own, dynamically linked
    or static: ld.so or libc's start-up calls the resolver its addend names)."""
    if rw.plan.is_identity():
        return 0
    if not (is_pie(image) or image.type == 2):
        update_dynamic_entries(rw, image)
        return 0
    static = _static_fields(image)
    changed = slots = 0

    def write_slots(P, values):
        for a, v in zip(P.tolist(), values.tolist()):
            sec = image.section_at(a)
            buf = rw.buf(sec)
            o = a - sec.addr
            buf[o:o + 8] = np.frombuffer(int(v).to_bytes(8, "little"), np.uint8)
        return len(P)

    for sec in dynamic_rela_sections(image):
        rows = np.array(image.section_bytes(sec)).view(RELA).copy()
        typ = (rows["info"] & 0xFFFFFFFF).astype(np.int64)
        sel = np.nonzero(np.isin(typ, (R_X86_64_RELATIVE, R_X86_64_IRELATIVE)))[0]
        A = rows["addend"][sel].astype(np.int64).view(np.uint64)
        moving = rw.amap.in_extent(A)
        sel, A = sel[moving], A[moving]
        if not len(sel):
            continue
        P = rows["offset"][sel].astype(np.uint64)
        newA, ok = rw.amap.map(A)
        if not ok.all():
            rw.problem("dynamic-reloc-in-padding", P[~ok], f"{sec.name}: addend in dropped padding")
        covered = np.isin(P, static)
        now, have = read_words(image, P, 8, rw.patched)
        old, _ = read_words(image, P, 8)
        # a link relocation rewrote the field: the addend takes exactly its value
        take = covered & have & (old == A)
        newA = np.where(take, now, newA)
        # ld's own slots (GOT): contents as the addend says
        own = ~covered & have & (old == A) & ok
        slots += write_slots(P[own], newA[own])
        rows["addend"][sel] = newA.view(np.int64)
        changed += int((newA != A).sum())
        rw.patched[sec.index] = rows.view(np.uint8)
    # packed relative relocations: the field is the addend; link relocations
    # rewrote theirs, ld's own slots are mapped here
    relr = relr_addresses(image)
    if len(relr):
        old, have = read_words(image, relr, 8)
        own = have & ~np.isin(relr, static) & rw.amap.in_extent(old)
        new, ok = rw.amap.map(old[own])
        if not ok.all():
            rw.problem("dynamic-reloc-in-padding", relr[own][~ok], ".relr.dyn: field in padding")
        slots += write_slots(relr[own][ok], new[ok])
        changed += int((new[ok] != old[own][ok]).sum())
    dyn_changed = update_dynamic_entries(rw, image)
    rw.stats["dynamic_relocs_updated"] = changed
    rw.stats["got_slots_updated"] = slots
    rw.stats["dynamic_entries_updated"] = dyn_changed
    if log:
        log(f"{'PIE' if is_pie(image) else 'executable'}: {changed} dynamic relocation "
            f"addends follow the layout "
            f"({slots} linker-made slots rewritten, {dyn_changed} .dynamic entries)")
    return changed
