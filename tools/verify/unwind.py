"""verify --against for userspace unwind information: every FDE of OLD has its
translated counterpart in NEW; at block level also the cold parts' FDEs, the
unwind state at every piece and the exception lookup (LSDA) of every part."""

import numpy as np

from ..errors import LinepackError
from ..image import blockmap as bm
from ..image.intervals import containing, reach_ranges
from ..relayout.user.eh_frame import parse_eh_frame
from ..relayout.user.eh_frame_split import (EhFrameError, check_split_cfi, check_split_lsda,
                                            parse_for_check)


def check_eh_frame(ctx, out):
    """Userspace unwind info: every FDE's pc_begin translates (as a multiset).

    Block-level layouts: the new FDEs are the translated ones plus one per cold
    part, starting at the part's first piece; and the unwind state at every
    piece of a split function (and at every original CFI row inside a copied
    piece) is the original's (relayout/user/eh_frame_split.py: check_split_cfi)."""
    old, new, amap = ctx.old, ctx.new, ctx.amap
    block_rows = ctx.rows if ctx.split.any() else None
    so, sn = old.section(".eh_frame"), new.section(".eh_frame")
    if so is None or sn is None or not so.size:
        return
    try:
        eo = parse_eh_frame(old.section_bytes(so), so.addr)
        en = parse_eh_frame(new.section_bytes(sn), sn.addr)
    except LinepackError:
        return                      # standalone verify already reports unsupported encodings
    want = np.sort(amap.map(eo.pc_begin))
    got = np.sort(en.pc_begin)
    if block_rows is not None and len(got) > len(want):
        cold = block_rows[(block_rows["part"] == bm.PART_COLD) & (block_rows["new_len"] > 0)]
        # each function's cold part starts at its lowest cold piece; the function
        # itself at its lowest original piece
        c_func, c_start = _group_min(cold["func"], cold["new"])
        f_func, f_start = _group_min(block_rows["func"], block_rows["old"])
        fstart = f_start[np.searchsorted(f_func, c_func)]
        # a function without an FDE (assembly without CFI) gets no cold-part FDE
        has_fde = containing(*reach_ranges(eo.pc_begin, eo.pc_begin + eo.pc_range),
                             fstart) >= 0
        want = np.sort(np.concatenate([want, np.sort(c_start[has_fde])]))
        try:
            parsed = parse_for_check(old, new)
        except EhFrameError as e:
            parsed = None
            bad_cfi = bad_lsda = [(None, str(e))]
            seen = seen_lsda = 0
        if parsed is not None:
            bad_cfi, seen = check_split_cfi(old, new, block_rows, parsed)
            bad_lsda, seen_lsda = check_split_lsda(old, new, block_rows, parsed)
        out.add("equiv.eh_frame-part", bad_cfi, lambda b: b)
        out.add("equiv.lsda-part", bad_lsda, lambda b: b)
        out.extra["equivalence_eh_frame_part_states"] = seen
        out.extra["equivalence_lsda_part_lookups"] = seen_lsda
    if len(want) != len(got):
        bad = [(None, f".eh_frame has {len(got)} FDEs, the original {len(want)}")]
    else:
        idx = np.nonzero(want != got)[0]
        bad = [(int(want[i]), f".eh_frame: no FDE starts at {int(want[i]):#x} (the translated "
                f"start of an original FDE)") for i in idx.tolist()]
    out.add("equiv.eh_frame", bad, lambda b: b)


def _group_min(keys, values):
    """(the distinct keys, sorted; the least value of each), values as uint64."""
    keys = np.asarray(keys)
    values = np.asarray(values).astype(np.uint64)
    order = np.lexsort((values, keys))
    k = keys[order]
    first = np.nonzero(np.concatenate([[True], k[1:] != k[:-1]]))[0] if len(k) else \
        np.zeros(0, np.int64)
    return k[first], values[order][first]

