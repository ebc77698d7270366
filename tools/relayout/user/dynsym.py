"""``.dynsym`` of a userspace executable after relayout.

An executable linked with ``-rdynamic`` (or exporting symbols that shared
libraries bind to) lists its functions in ``.dynsym``: ``dlsym``, ``dladdr``
(glibc's ``backtrace_symbols``) and libraries calling back into it read those
values at run time. They follow the layout like ``.symtab`` does: each value
in rewritten code is mapped, and a split function's size becomes its hot
part's (its cold part has no dynamic symbol, as gcc's ``.cold`` parts have
none). The section keeps its size; ``.gnu.hash``/``.hash`` hash names only.
"""

import numpy as np

from ...image.elf import STT_FUNC, STT_SECTION, SYM

SHT_DYNSYM = 11


def update_dynsym(rw, image, log=None):
    sec = next((s for s in image.sections if s.type == SHT_DYNSYM), None)
    if sec is None or not sec.size or rw.plan.is_identity():
        return 0
    rows = np.array(image.section_bytes(sec)).view(SYM).copy()
    v = rows["value"].astype(np.uint64)
    shndx = rows["shndx"]
    typ = rows["info"] & 0xF
    defined = (shndx != 0) & (shndx < 0xFF00) & (typ != STT_SECTION)
    sel = defined & rw.amap.in_extent(v)
    new, ok = rw.amap.map(v[sel])
    if not ok.all():
        rw.problem("dynsym-in-padding", v[sel][~ok], "dynamic symbol value in dropped padding")
        new = np.where(ok, new, v[sel])
    rows["value"][sel] = new
    split = getattr(rw, "block_split", None)
    if split:
        start = split["orig_units"].start
        for sf in split["splits"]:
            if not sf.sizes[1]:
                continue
            same = sel & (v == np.uint64(int(start[sf.unit]))) & (typ == STT_FUNC)
            rows["size"][same] = sf.sizes[0]
    changed = int((rows["value"] != v).sum())
    rw.patched[sec.index] = rows.view(np.uint8)
    rw.stats["dynsym_updated"] = changed
    if log and changed:
        log(f".dynsym: {changed} exported symbols follow the layout")
    return changed
