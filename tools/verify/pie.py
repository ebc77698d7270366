"""verify --against for a PIE: what ld.so reads at load time follows the layout.

- ``equiv.dynamic-reloc``: every R_X86_64_RELATIVE / IRELATIVE addend of NEW's
  .rela.dyn/.rela.plt is the translated addend of OLD's (same entries, same
  order, same places), and a field that held its addend in OLD holds the new
  addend in NEW (the GOT slots ld filled in, the pointers a link relocation
  covers); every field .relr.dyn relocates holds the translated value;
- ``equiv.pic-table``: every PIC switch-table entry (relayout/user/pie.py) of OLD
  holds, in NEW, its case's new address minus the table's base;
- ``equiv.dynamic``: DT_INIT / DT_FINI translate;
- ``equiv.pie-absolute-pointer``: no more absolute code or data addresses in
  the unwind information than the original had (ld.so relocates none of
  them: an absolute personality, FDE start, LSDA pointer or LSDA LPStart in a
  PIE names the link address, and an exception lands there).
"""

import numpy as np

from ..image.elf import RELA
from ..relayout.user.pie import (DT_FINI, DT_INIT, R_X86_64_IRELATIVE, R_X86_64_RELATIVE, dynamic_entries,
                            dynamic_rela_sections, is_pie, pic_table_entries, read_fields,
                            relr_addresses)


def _read(image, addrs, size):
    return read_fields(image, addrs, size)


def check_pie(old, new, amap, octx, findings, counter, report, add):
    if not is_pie(old):
        return
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

    pic = pic_table_entries(old, octx.disasm)
    bad_pic = []
    if len(pic):
        vn, have = _read(new, pic.field, 4)
        want = amap.map(pic.case).astype(np.int64) - pic.base.astype(np.int64)
        wrong = ~have | (vn != want)
        for f, c, v, w in zip(pic.field[wrong].tolist(), pic.case[wrong].tolist(),
                              vn[wrong].tolist(), want[wrong].tolist()):
            bad_pic.append((f, f"switch-table entry at {f:#x} holds {v:#x}; its case "
                            f"{octx.symbol_at(c)} is now at base + {w:#x}"))
    add(findings, "error", "equiv.pic-table", bad_pic, lambda b: b, counter)
    report.extra["equivalence_pic_table_entries_checked"] = len(pic)

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
