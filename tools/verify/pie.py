"""verify --against for userspace executables: every data field that designates
code, and (for a PIE) what ld.so reads at load time, follows the layout.

Any executable, PIE or not (:func:`check_code_fields`); the switch tables are
found here from OLD's code, not from relayout's outputs or its table finder:

- ``equiv.pic-table``: every entry of a PIC switch table (``.long .Lcase -
  .Ltable``: gcc's ``-fPIE`` code, PIE or ``-no-pie``) holds, in NEW, its
  case's new address minus the table's base;
- ``equiv.switch-table``: every entry of an absolute switch table (``.quad
  .Lcase``: ``-fno-pie`` code, ``jmp *.Ltable(,%reg,8)``) holds its case's new
  address;
- ``equiv.pcrel-data``: every other PC-relative relocated data field whose
  target (field + value) is code holds the translated target, relative to itself.

A PIE (:func:`check_pie`):

- ``equiv.dynamic-reloc``: every R_X86_64_RELATIVE / IRELATIVE addend of NEW's
  .rela.dyn/.rela.plt is the translated addend of OLD's (same entries, same
  order, same places), and a field that held its addend in OLD holds the new
  addend in NEW (the GOT slots ld filled in, the pointers a link relocation
  covers); every field .relr.dyn relocates holds the translated value;
- ``equiv.dynamic``: DT_INIT / DT_FINI translate;
- ``equiv.pie-absolute-pointer``: no more absolute code or data addresses in
  the unwind information than the original had (ld.so relocates none of
  them: an absolute personality, FDE start, LSDA pointer or LSDA LPStart in a
  PIE names the link address, and an exception lands there).
"""

import numpy as np

from ..image.elf import RELA
from ..relayout.user.pie import (DT_FINI, DT_INIT, R_X86_64_IRELATIVE, R_X86_64_RELATIVE, dynamic_entries,
                            dynamic_rela_sections, is_pie, relr_addresses)
from ..image.words import read_s32, read_words


def _read(image, addrs, size):
    """(values, have): 4-byte fields sign-extended (int64), 8-byte ones uint64."""
    return read_s32(image, addrs) if size == 4 else read_words(image, addrs, size)


def check_dynamic_entries(old, new, amap, findings, counter, add):
    """DT_INIT / DT_FINI translate (PIE or not: ``-Wl,-init,f`` names code)."""
    (dso, do), (dsn, dn) = dynamic_entries(old), dynamic_entries(new)
    bad_dyn = []
    if do is not None and dn is not None and len(do) == len(dn):
        m = np.isin(do["tag"], (DT_INIT, DT_FINI))
        ok = amap.translates(do["val"][m], dn["val"][m])
        for t, a, b in zip(do["tag"][m][~ok].tolist(), do["val"][m][~ok].tolist(),
                           dn["val"][m][~ok].tolist()):
            bad_dyn.append((dsn.addr, f".dynamic tag {t}: {b:#x}, the original's {a:#x} "
                            "does not map there"))
    elif do is not None:
        bad_dyn.append((dso.addr, ".dynamic changed shape"))
    add(findings, "error", "equiv.dynamic", bad_dyn, lambda b: b, counter)


def check_pie(old, new, amap, octx, findings, counter, report, add):
    if octx.is_kernel:
        return
    if not is_pie(old) and old.type != 2:
        check_dynamic_entries(old, new, amap, findings, counter, add)
        return
    # a PIE's dynamic relocations, and an ET_EXEC's (IRELATIVE: its own ifuncs)
    bad_rel, checked = [], 0
    new_secs = {s.name: s for s in dynamic_rela_sections(new)}
    for so in dynamic_rela_sections(old):
        sn = new_secs.get(so.name)
        ro = np.array(old.section_bytes(so)).view(RELA)
        rn = np.array(new.section_bytes(sn)).view(RELA) if sn is not None else None
        if rn is None or len(rn) != len(ro) or (rn["offset"] != ro["offset"]).any() or \
                (rn["info"] != ro["info"]).any():
            bad_rel.append((so.addr, f"{so.name}: entries differ from the original's "
                            "(only RELATIVE/IRELATIVE addends may change)"))
            continue
        typ = (ro["info"] & 0xFFFFFFFF).astype(np.int64)
        sel = np.isin(typ, (R_X86_64_RELATIVE, R_X86_64_IRELATIVE))
        other = ~sel & (rn["addend"] != ro["addend"])
        for p in ro["offset"][other][:5].tolist():
            bad_rel.append((p, f"{so.name}: addend of the non-relative entry at {p:#x} changed"))
        ao = ro["addend"][sel].view(np.uint64)
        an = rn["addend"][sel].view(np.uint64)
        P = ro["offset"][sel].astype(np.uint64)
        checked += int(sel.sum())
        ok = amap.translates(ao, an)
        for p, a, b in zip(P[~ok].tolist(), ao[~ok].tolist(), an[~ok].tolist()):
            bad_rel.append((p, f"{so.name}: relative relocation at {p:#x} has addend {b:#x}; "
                            f"the original's {a:#x} ({octx.symbol_at(a)}) maps to "
                            f"{int(amap.map(np.array([a], np.uint64))[0]):#x}"))
        fo, ho = _read(old, P, 8)
        fn, hn = _read(new, P, 8)
        stale = ho & hn & (fo == ao) & (fn != an)
        for p, v, b in zip(P[stale].tolist(), fn[stale].tolist(), an[stale].tolist()):
            bad_rel.append((p, f"field at {p:#x} holds {v:#x}, its relative relocation "
                            f"says {b:#x}"))
    relr = relr_addresses(old)
    if len(relr):
        if not np.array_equal(relr, relr_addresses(new)):
            bad_rel.append((int(relr[0]), ".relr.dyn: the relocated places differ from the "
                            "original's"))
        fo, ho = _read(old, relr, 8)
        fn, hn = _read(new, relr, 8)
        wrong = ~(ho & hn) | ~amap.translates(fo, fn)
        for p, a, b in zip(relr[wrong].tolist(), fo[wrong].tolist(), fn[wrong].tolist()):
            bad_rel.append((p, f".relr.dyn field at {p:#x} holds {b:#x}; the original's "
                            f"{a:#x} ({octx.symbol_at(a)}) does not map there"))
        checked += len(relr)
    add(findings, "error", "equiv.dynamic-reloc", bad_rel, lambda b: b, counter)
    report.extra["equivalence_dynamic_relocs_checked"] = checked

    check_dynamic_entries(old, new, amap, findings, counter, add)
    if not is_pie(old):
        return      # an ET_EXEC's absolute unwind pointers are right at its link address

    abs_old, abs_new = absolute_unwind_pointers(old), absolute_unwind_pointers(new)
    extra_abs = [] if len(abs_new) <= len(abs_old) else abs_new
    add(findings, "error", "equiv.pie-absolute-pointer", extra_abs,
        lambda b: (b[0], f"absolute {b[1]} at {b[0]:#x} in a PIE: ld.so does not relocate it "
                         "(the original has " + str(len(abs_old)) + " such)"), counter)


def absolute_unwind_pointers(image):
    """[(address, what)] of absolute-encoded pointers in ``image``'s .eh_frame
    and the LSDAs its FDEs name (none in what gcc writes for a PIE)."""
    from ..relayout.user.eh_frame import DW_EH_PE_omit, parse_eh_frame
    sec = image.section(".eh_frame")
    if sec is None or not sec.size:
        return []
    eh = parse_eh_frame(image.section_bytes(sec), sec.addr)
    out = []
    for off, c in eh.cies.items():
        if c.personality_enc != DW_EH_PE_omit and not c.personality_enc & 0x70:
            out.append((sec.addr + c.personality_field, "personality pointer"))
    absolute_fde = (eh.fde_enc & 0x70) == 0
    for f in (sec.addr + eh.fde_field[absolute_fde]).tolist():
        out.append((f, "FDE start"))
    for a in np.unique(eh.lsda[eh.lsda != 0]).tolist():
        try:
            enc = image.read(int(a), 1)[0]
        except ValueError:
            continue
        if enc != DW_EH_PE_omit and not enc & 0x70:
            out.append((int(a) + 1, "LSDA LPStart"))
    return out


# -- switch tables and PC-relative data fields, any executable --------------------

UNWIND = (".eh_frame", ".eh_frame_hdr", ".gcc_except_table")
R_64, R_PC32, R_PC64 = 1, 2, 24


class SwitchTables:
    """Switch-table entries of an image, found from the code that reads them:
    PIC and absolute (field, base, case), each sorted by field."""

    def __init__(self, pic=((), (), ()), absolute=((), (), ())):
        self.pic_field, self.pic_base, self.pic_case = (np.asarray(a, np.uint64) for a in pic)
        self.abs_field, self.abs_base, self.abs_case = (np.asarray(a, np.uint64)
                                                        for a in absolute)


def _data_reloc_fields(image, rtype):
    """Sorted addresses of OLD's relocated fields of one type in allocated,
    file-backed data sections (unwind sections aside)."""
    out = []
    for name, r in image.relocations.items():
        t = r.target
        if len(r) and t.is_alloc and not t.is_code and t.type != 8 and name not in UNWIND \
                and not getattr(r.section, "is_alloc", False):
            out.append(r.offset[r.type == rtype].astype(np.uint64))
    return np.unique(np.concatenate(out)) if out else np.zeros(0, np.uint64)


_ROWS = 1 << 15


class _RawRows:
    """Rows of instruction bytes, as classify reads a Disassembly (``raw``, ``len``)."""

    def __init__(self, raw):
        self.raw = raw

    def __len__(self):
        return len(self.raw)


def switch_tables(image, dis, functions):
    """SwitchTables of ``image`` (``dis``: its decoded code).

    A table base is what a function with an indirect jump loads: ``lea
    .Ltable(%rip), %reg`` (REX.W 8d /r, RIP-relative: PIC tables) or the
    displacement of ``jmp *.Ltable(,%reg,8)`` (absolute tables). Its entries
    are the relocated fields from the base on (R_X86_64_PC32, 4 bytes, for a
    PIC table; R_X86_64_64, 8 bytes, for an absolute one), one after the other,
    up to the next base, as long as each designates an instruction start of
    the same source function (``foo`` or a part of it, ``foo.cold``)."""
    from ..image.cfg import classify
    from ..image.disasm import skip_prefixes
    if not len(dis) or not len(functions):
        return SwitchTables()
    stems = {}
    fam = np.array([stems.setdefault(n.split(".", 1)[0], len(stems)) for n in functions.name],
                   np.int64)
    fi = functions.find(dis.addr)
    raw = dis.raw
    # indirect jumps, classified a slice at a time: classify's per-row temporaries over
    # all of an image's instructions were most of verify's memory peak (zstd: +19 MiB)
    ijmp = np.zeros(len(raw), bool)
    for lo in range(0, len(raw), _ROWS):
        ijmp[lo:lo + _ROWS] = classify(_RawRows(raw[lo:lo + _ROWS])) == 7
    jumpers = np.unique(fam[fi[ijmp & (fi >= 0)]])
    owner = np.where(fi >= 0, fam[np.maximum(fi, 0)], -1)
    del fi
    # only the instructions of functions with an indirect jump are looked at again
    useful = np.nonzero(np.isin(owner, jumpers))[0]
    u_raw, u_size = raw[useful], dis.size[useful]
    code = [(s.addr, s.end) for s in image.sections if s.is_code and s.is_alloc and s.size]

    def in_code(a):
        return any(lo <= a < hi for lo, hi in code)

    def disp32(rows, at):
        return raw[rows[:, None], at[:, None] + np.arange(4)[None, :]].copy().view("<i4")[:, 0] \
            .astype(np.int64)
    # PIC: lea disp32(%rip), %r64
    lea = useful[np.nonzero((u_size == 7) & ((u_raw[:, 0] & 0xF8) == 0x48) &
                            (u_raw[:, 1] == 0x8D) & ((u_raw[:, 2] & 0xC7) == 0x05))[0]]
    pic_b = (dis.addr[lea].astype(np.int64) + 7 + disp32(lea, np.full(len(lea), 3))).astype(
        np.uint64)
    # absolute: [prefixes] [REX] ff /4, mod 00 rm 100, SIB base 101: jmp *disp32(,%reg,s)
    skip, op, _ = skip_prefixes(u_raw, (0x2E, 0x3E))
    rex = (op >= 0x40) & (op <= 0x4F)
    at = skip + rex.astype(np.int64)
    rows = np.arange(len(u_raw))
    b0 = u_raw[rows, np.minimum(at, u_raw.shape[1] - 1)]
    modrm = u_raw[rows, np.minimum(at + 1, u_raw.shape[1] - 1)]
    sib = u_raw[rows, np.minimum(at + 2, u_raw.shape[1] - 1)]
    jl = np.nonzero(ijmp[useful] & (b0 == 0xFF) & (modrm == 0x24) & ((sib & 7) == 5))[0]
    jt = useful[jl]
    abs_b = disp32(jt, at[jl] + 3).astype(np.uint64)       # sign-extended (R_X86_64_32S)
    pcrel = set(_data_reloc_fields(image, R_PC32).tolist())
    absolute = set(_data_reloc_fields(image, R_64).tolist())
    bases = sorted({(int(b), int(owner[i]), 4) for b, i in zip(pic_b.tolist(), lea.tolist())
                    if not in_code(b)} |
                   {(int(b), int(owner[i]), 8) for b, i in zip(abs_b.tolist(), jt.tolist())
                    if not in_code(b)})
    starts = sorted({b for b, _, _ in bases})
    # each base's run of relocated fields, read (up to the next base or an unreadable
    # field); then every field's destination checked at once
    runs = []
    for b, family, width in bases:
        k = starts.index(b)
        stop = starts[k + 1] if k + 1 < len(starts) else 1 << 64
        have = pcrel if width == 4 else absolute
        a, run = b, []
        while a < stop and a in have:
            try:
                v = int.from_bytes(bytes(image.read(a, width)), "little", signed=width == 4)
            except ValueError:
                break
            run.append((a, (b + v) & (2**64 - 1) if width == 4 else v))
            a += width
        runs.append((b, family, width, run))
    dest = np.array([c for *_, run in runs for _, c in run], np.uint64)
    f = functions.find(dest)
    good = ((f >= 0) & (fam[np.maximum(f, 0)] == np.array(
        [family for _, family, _, run in runs for _ in run], np.int64)) &
        dis.is_boundary(dest)).tolist()
    out = {4: ([], [], []), 8: ([], [], [])}
    first = 0                       # the run's first field in dest
    for b, family, width, run in runs:
        # the table: its fields up to the first whose destination is not an
        # instruction start of the same source function
        for k, (a, c) in enumerate(run):
            if not good[first + k]:
                break
            out[width][0].append(a)
            out[width][1].append(b)
            out[width][2].append(c)
        first += len(run)
    (pf, pb, pc), (af, ab, ac) = out[4], out[8]
    po, ao = np.argsort(np.array(pf, np.uint64)), np.argsort(np.array(af, np.uint64))
    return SwitchTables((np.array(pf, np.uint64)[po], np.array(pb, np.uint64)[po],
                         np.array(pc, np.uint64)[po]),
                        (np.array(af, np.uint64)[ao], np.array(ab, np.uint64)[ao],
                         np.array(ac, np.uint64)[ao]))


def old_switch_tables(octx):
    """switch_tables of an ImageContext's image, computed once."""
    return octx.derived("switch_tables",
                        lambda: switch_tables(octx.image, octx.disasm, octx.functions))


def check_code_fields(old, new, amap, octx, findings, counter, report, add):
    """equiv.pic-table, equiv.switch-table, equiv.pcrel-data (module docstring)."""
    if octx.is_kernel:
        return                  # the kernel's PC-relative fields are its tables' (checked there)
    st = old_switch_tables(octx)
    bad = []
    if len(st.pic_field):
        vn, have = _read(new, st.pic_field, 4)
        want = amap.map(st.pic_case).astype(np.int64) - st.pic_base.astype(np.int64)
        wrong = ~have | (vn != want)
        for f, c, v, w in zip(st.pic_field[wrong].tolist(), st.pic_case[wrong].tolist(),
                              vn[wrong].tolist(), want[wrong].tolist()):
            bad.append((f, f"switch-table entry at {f:#x} holds {v:#x}; its case "
                        f"{octx.symbol_at(c)} is now at base + {w:#x}"))
    add(findings, "error", "equiv.pic-table", bad, lambda b: b, counter)
    report.extra["equivalence_pic_table_entries_checked"] = len(st.pic_field)
    bad = []
    if len(st.abs_field):
        vn, have = _read(new, st.abs_field, 8)
        wrong = ~have | ~amap.translates(st.abs_case, vn)
        want = amap.map(st.abs_case)
        for f, c, v, w in zip(st.abs_field[wrong].tolist(), st.abs_case[wrong].tolist(),
                              vn[wrong].tolist(), want[wrong].tolist()):
            bad.append((f, f"switch-table entry at {f:#x} holds {v:#x}; its case "
                        f"{octx.symbol_at(c)} is now at {w:#x}"))
    add(findings, "error", "equiv.switch-table", bad, lambda b: b, counter)
    report.extra["equivalence_switch_table_entries_checked"] = len(st.abs_field)
    # every other PC-relative field into code: relative to itself
    code = [(s.addr, s.end) for s in old.sections if s.is_code and s.is_alloc and s.size]
    bad, checked = [], 0
    for rtype, width in ((R_PC32, 4), (R_PC64, 8)):
        P = _data_reloc_fields(old, rtype)
        P = P[~np.isin(P, st.pic_field)]
        if not len(P):
            continue
        vo, ho = _read(old, P, width)
        vn, hn = _read(new, P, width)
        vo = vo.astype(np.int64) if width == 4 else vo.view(np.int64)
        vn = vn.astype(np.int64) if width == 4 else vn.view(np.int64)
        T = (P.astype(np.int64) + vo).astype(np.uint64)
        into = np.zeros(len(P), bool)
        for lo, hi in code:
            into |= (T >= np.uint64(lo)) & (T < np.uint64(hi))
        sel = np.nonzero(ho & into)[0]
        checked += len(sel)
        Tn = (P[sel].astype(np.int64) + vn[sel]).astype(np.uint64)
        wrong = ~hn[sel] | ~amap.translates(T[sel], Tn)
        want = amap.map(T[sel])
        for f, t, v, w in zip(P[sel][wrong].tolist(), T[sel][wrong].tolist(),
                              Tn[wrong].tolist(), want[wrong].tolist()):
            bad.append((f, f"PC-relative field at {f:#x} designates {v:#x}; the original "
                        f"designated {octx.symbol_at(t)}, now at {w:#x}"))
    add(findings, "error", "equiv.pcrel-data", bad, lambda b: b, counter)
    report.extra["equivalence_pcrel_data_fields_checked"] = checked
