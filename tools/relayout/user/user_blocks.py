"""Userspace specifics of block-level splitting (the ``blocks`` strategy on
executables, PIE or not, linked with --emit-relocs).

Jump tables: gcc's switch tables (``jmp *table(,%reg,8)``) and computed-goto
tables (lua's ``disptab``: ``&&label`` arrays loaded into a register, then
``jmp *%reg``) are arrays of absolute code addresses in ``.rodata``, each with
an R_X86_64_64 relocation kept by --emit-relocs. The relocation pass
translates them through the block map like any other pointer, so a function
whose indirect jumps go through such tables can be split, provided that:

- every code address a data relocation names is a block leader (the CFG
  learns the tables' targets from them: ``TableSites.leaders``);
- position-independent switch tables hold differences (``.long .Lcase -
  .Ltable``) whose relocation's S + A is not the case's address, so they
  cannot be followed by their relocation alone: in any executable (PIE or
  gcc's default -fPIE code linked -no-pie) relayout/user/pie.py finds each entry's
  table base and case; a PC-relative data field it cannot explain is left as
  it is and the functions it may designate are pinned (never moved or split).
  Without that analysis (``pic`` None) any PC-relative data relocation into
  code keeps functions with indirect jumps whole (the CFG's "indirect jump"
  reason).
"""

import numpy as np

from ...image.relocs import R_X86_64_32, R_X86_64_32S, R_X86_64_64, R_X86_64_PC32, R_X86_64_PC64

UNWIND = (".eh_frame", ".eh_frame_hdr", ".gcc_except_table")


def user_table_sites(image, pic=None):
    """(TableSites for the CFG, indirect jumps allowed?, note for the log).

    ``pic``: the PC-relative data fields into code (relayout/user/pie.py, PIE or
    not): the switch-table entries' cases are leaders too; with it, no field
    keeps functions with indirect jumps whole (a loose field is left as it is
    and the functions it may designate are pinned: moved and split never)."""
    from ...image.cfg import TableSites
    sym_value = image.symtab["value"].astype(np.uint64)
    code = [s for s in image.sections if s.is_code and s.is_alloc]

    def in_code(t):
        m = np.zeros(len(t), bool)
        for s in code:
            m |= (t >= np.uint64(s.addr)) & (t < np.uint64(s.addr + s.size))
        return m
    leaders, pcrel = [], 0
    for name, r in image.relocations.items():
        tgt = r.target
        if not len(r) or tgt.is_code or not tgt.is_alloc or name in UNWIND:
            continue
        t = (sym_value[r.sym.astype(np.int64)].astype(np.int64) + r.addend).astype(np.uint64)
        absolute = np.isin(r.type, (R_X86_64_64, R_X86_64_32, R_X86_64_32S))
        pcrel += int((np.isin(r.type, (R_X86_64_PC32, R_X86_64_PC64)) & in_code(t)).sum())
        leaders.append(t[absolute & in_code(t)])
    if pic is not None:
        leaders.append(pic.case)
        pcrel = 0
    leaders = np.unique(np.concatenate(leaders)) if leaders else np.zeros(0, np.uint64)
    ok = pcrel == 0
    note = (f"{len(leaders)} code addresses named by data relocations (jump tables) are "
            "block leaders" + ("" if ok else f"; {pcrel} PC-relative data relocations into "
                                "code (PIC jump tables?): functions with indirect jumps stay whole"))
    return TableSites(leaders=leaders), ok, note
