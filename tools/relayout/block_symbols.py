"""Symbols of a block-level layout: every split function's symbol keeps its
name at its hot part with the hot part's size (from its entry: a prefix before
it keeps its own symbol), and its cold part gets a
``name.cold`` STT_FUNC symbol (local, sized), as gcc names its own cold parts.
A prefix trimmed to the call-depth thunk's size (relayout/blocks.py trim_prefix)
gets the size it kept.

New local symbols must precede the globals (``sh_info`` of .symtab is the
first non-local index), so they are inserted there and every relocation's
symbol index at or after that point shifts by the number inserted.
"""

import numpy as np

from ..image.elf import RELA, SHT_RELA, SHT_SYMTAB, SYM, STT_FUNC, STB_LOCAL


def cold_symbols(rw, image, log=None):
    """Patch symtab, strtab and relocation sections of ``rw`` (a BlockRewriter
    after run()); sets ``rw.header_updates`` for the symtab's sh_info."""
    symsec = next(s for s in image.sections if s.type == SHT_SYMTAB)
    strsec = image.sections[symsec.link]
    rows = np.array(image.section_bytes(symsec)).view(SYM).copy()
    rows["value"] = rw.sym_new
    splits = rw.block_split["splits"]
    first_global = int(symsec.info)
    strtab = bytearray(image.section_bytes(strsec))
    new = np.zeros(len(splits), SYM)
    names, _ = image.symbol_table()
    k = 0
    for sf in splits:
        if sf.prefix_sym >= 0:
            rows["size"][sf.prefix_sym] = sf.head      # a trimmed prefix: what was kept
        if not sf.sizes[1]:
            continue
        rows["size"][sf.sym] = sf.hot_size
        new["name"][k] = len(strtab)
        strtab += (names[sf.sym] + ".cold").encode("latin-1") + b"\0"
        new["info"][k] = (STB_LOCAL << 4) | STT_FUNC
        new["shndx"][k] = rows["shndx"][sf.sym]
        new["value"][k] = sf.new_start[1]
        new["size"][k] = sf.sizes[1]
        k += 1
    new = new[:k]
    # aliases of a split function (same address) get the hot size too
    old_size = image.symtab["size"]
    hot_size = {}                  # (new value, original size) -> hot size; the last split wins
    for sf in splits:
        hot_size[(int(rows["value"][sf.sym]), int(old_size[sf.sym]))] = sf.hot_size
    vals = np.array(sorted({v for v, _ in hot_size}), np.uint64)
    cand = np.nonzero(np.isin(rows["value"], vals) & ((rows["info"] & 0xF) == STT_FUNC))[0]
    # (a prefix dropped whole sits at its function's entry: it is no alias, it keeps 0)
    cand = cand[~np.isin(cand, [sf.prefix_sym for sf in splits if sf.prefix_sym >= 0])]
    for i, v, sz in zip(cand.tolist(), rows["value"][cand].tolist(), old_size[cand].tolist()):
        h = hot_size.get((v, sz))
        if h is not None:
            rows["size"][i] = h
    out = np.concatenate([rows[:first_global], new, rows[first_global:]])
    rw.patched[symsec.index] = out.view(np.uint8)
    rw.patched[strsec.index] = np.frombuffer(bytes(strtab), np.uint8)
    n = len(new)
    for s in image.sections:
        if s.type != SHT_RELA or s.link != symsec.index or not s.size:
            continue
        if image.sections[s.info].name.startswith(".debug_"):
            continue      # .rela.debug_* never reach the output (driver: rewritten DWARF drops them)
        buf = rw.patched.get(s.index)
        r = np.array(buf if buf is not None else image.section_bytes(s)).view(RELA)
        # symbol index += n from first_global on, in place and by chunks: the
        # kernel's .rela.debug_info alone has 10 M entries
        info = r["info"]
        shifted = np.uint64(first_global) << np.uint64(32)
        step = np.uint64(n) << np.uint64(32)
        for c in range(0, len(info), 1 << 20):
            part = info[c:c + (1 << 20)]
            part[part >= shifted] += step
        rw.patched[s.index] = r.view(np.uint8)
    rw.header_updates = {symsec.index: {"info": first_global + n}}
    rw.sym_index_shift = (first_global, n)
    rw.stats["cold_symbols"] = n
    if log:
        log(f"symbols: {n} .cold parts added, split functions sized to their hot part")
    return n
