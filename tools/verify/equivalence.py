"""``verify NEW --against OLD``: prove a rewritten image equivalent to its original.

Independent of the rewriter: the address map is rebuilt here from the two
symbol tables (each function of OLD is found in NEW by its symtab index, so
duplicate static names are no problem), never read from the rewriter's output
unless asked. Then, with Capstone decoding both images:

1. every function of OLD exists in NEW, same size, and every instruction starts
   at the mapped address with the same length;
2. every byte that differs belongs to an address field (branch/call
   displacement, RIP-relative displacement, absolute immediate) whose target,
   translated through the map, is what NEW encodes;
3. every relocated pointer in data sections translates (nothing left pointing
   at old code), and every other data byte is unchanged outside the kernel
   tables;
4. every kernel table's address columns translate as a multiset (sorted tables
   may be re-sorted), kallsyms names keep their translated addresses, and the
   symbol table's code symbols translate.

When NEW carries a ``.linepack.blockmap`` (a block-level layout), the functions
it splits are checked block by block instead (tools/verify/blocks.py), and every
other check translates addresses through the block map where it has pieces.
"""

import numpy as np

import capstone

from .. import timings
from ..errors import BadInput, LinepackError
from ..image import blockmap as bm
from ..image.disasm import Disassembly
from ..image.elf import ElfImage, STT_FUNC, STT_SECTION, SHT_SYMTAB
from ..kernel import TABLES
from ..kernel.base import Finding, ImageContext
from .debuginfo import check_debuginfo
from .forked import Forked

MAX_REPORT = 20
KERNEL_MAP = 0xFFFFFFFF80000000      # x86-64 __START_KERNEL_map


class _Map:
    """Old -> new address map from matched functions (piecewise, numpy).

    Code outside functions (assembly labels without a size, e.g.
    ``bad_get_user``) moves with the nearest code symbol at or before it, as
    found in both symbol tables (``label_old``/``label_new``, same code section).
    """

    def __init__(self, old_start, old_end, new_start, label_old=None, label_new=None,
                 label_end=None, points=None):
        # region boundary labels: their new symbol values (an alternative meaning)
        points = dict(points or {})
        self.point_old = np.array(sorted(points), dtype=np.uint64)
        self.point_new = np.array([points[k] for k in sorted(points)], dtype=np.uint64)
        order = np.argsort(old_start, kind="stable")
        self.old_start = old_start[order]
        self.old_end = old_end[order]
        self.new_start = new_start[order]
        if label_old is None:
            label_old = label_new = label_end = np.zeros(0, np.uint64)
        order = np.argsort(label_old, kind="stable")
        self.label_old = np.asarray(label_old, np.uint64)[order]
        self.label_new = np.asarray(label_new, np.uint64)[order]
        self.label_end = np.asarray(label_end, np.uint64)[order]
        self.fixed = np.zeros(0, np.uint64)     # addresses that stay (userspace code section ends)

    def map(self, addrs):
        """Mapped addresses; an address inside (or exactly at the end of) a function
        moves with it; else with the code label before it; anything else maps to itself."""
        a = np.asarray(addrs, dtype=np.uint64)
        i = np.searchsorted(self.old_start, a, side="right").astype(np.int64) - 1
        ic = np.maximum(i, 0)
        inside = (i >= 0) & (a <= self.old_end[ic])
        # an address equal to a function's end that is also the next function's start
        # was caught by searchsorted as that next function: correct.
        delta = self.new_start[ic].astype(np.int64) - self.old_start[ic].astype(np.int64)
        out = np.where(inside, (a.astype(np.int64) + delta).astype(np.uint64), a)
        if len(self.label_old):
            j = np.searchsorted(self.label_old, a, side="right").astype(np.int64) - 1
            jc = np.maximum(j, 0)
            lab = ~inside & (j >= 0) & (a < self.label_end[jc])
            ldelta = self.label_new[jc].astype(np.int64) - self.label_old[jc].astype(np.int64)
            out = np.where(lab, (a.astype(np.int64) + ldelta).astype(np.uint64), out)
        if len(self.fixed):
            # the end of a code section is the start of the next one (.text's end is
            # _fini in .fini when no padding is between): relayout leaves it in place;
            # unless a function piece starts there (.text's first function right after
            # .plt.sec): that one moves with its piece
            at_start = inside & (a == self.old_start[ic])
            out = np.where(np.isin(a, self.fixed) & ~at_start, a, out)
        return out

    def point(self, addrs):
        """(is a region label, the label's new address) for each old address."""
        a = np.asarray(addrs, dtype=np.uint64)
        if not len(self.point_old):
            return np.zeros(a.shape, bool), a
        k = np.searchsorted(self.point_old, a)
        kc = np.minimum(k, len(self.point_old) - 1)
        hit = (k < len(self.point_old)) & (self.point_old[kc] == a)
        return hit, np.where(hit, self.point_new[kc], a)

    def translates(self, old_values, new_values, kernel=False):
        """True where new == map(old); for kernels also through the physical alias
        (``sym - __START_KERNEL_map``, e.g. in movabs of physical addresses)."""
        o = np.asarray(old_values, dtype=np.uint64)
        n = np.asarray(new_values, dtype=np.uint64)
        ok = self.map(o) == n
        # A value equal to a region label (e.g. __sched_text_start) may mean the
        # label rather than the function that started there: accept either.
        hit, label_new = self.point(o)
        ok |= hit & (label_new == n)
        if kernel:
            phys = (o > 0) & (o < np.uint64(1 << 31))
            if phys.any():
                km = np.uint64(KERNEL_MAP)
                alias = (self.map(o + km) - km) == n
                ok |= phys & alias
        return ok


class _BlockAwareMap:
    """The function-level map, with the pieces of a block map taking precedence
    inside split functions."""

    def __init__(self, base, rows):
        from .blocks import BlockMap
        self.base = base
        self.rows = rows
        self.blocks = BlockMap(rows, base.map)
        self._pieces = None

    def pieces(self):
        """(old_start, old_end, new_start, new_end, collapse) as one piecewise
        list: the block map's rows inside split functions (a re-encoded branch or
        removed jmp is collapsed: every address inside maps to its new start, and
        it covers new [new_start, new_end)), the function-level pieces elsewhere.
        What the DWARF check walks."""
        if self._pieces is None:
            r = self.rows[self.rows["old_len"] > 0]
            ro = r["old"].astype(np.uint64)
            re_ = ro + r["old_len"].astype(np.uint64)
            rn = r["new"].astype(np.uint64)
            rne = rn + r["new_len"].astype(np.uint64)
            rc = r["kind"] != bm.KIND_COPIED
            o = np.argsort(ro, kind="stable")
            ro, re_, rn, rne, rc = ro[o], re_[o], rn[o], rne[o], rc[o]
            b = self.base
            k = np.searchsorted(ro, b.old_start)
            kc = np.minimum(k, max(len(ro) - 1, 0))
            covered = (k < len(ro)) & (ro[kc] < b.old_end) if len(ro) else \
                np.zeros(len(b.old_start), bool)
            old = np.concatenate((b.old_start[~covered], ro))
            end = np.concatenate((b.old_end[~covered], re_))
            new = np.concatenate((b.new_start[~covered], rn))
            new_end = np.concatenate((b.new_start[~covered] + (b.old_end[~covered] -
                                                                b.old_start[~covered]), rne))
            collapse = np.concatenate((np.zeros(int((~covered).sum()), bool), rc))
            o = np.argsort(old, kind="stable")
            self._pieces = (old[o], end[o], new[o], new_end[o], collapse[o])
        return self._pieces

    @property
    def old_start(self):
        return self.pieces()[0]

    @property
    def old_end(self):
        return self.pieces()[1]

    @property
    def new_start(self):
        return self.pieces()[2]

    @property
    def new_end(self):
        return self.pieces()[3]

    @property
    def collapse(self):
        return self.pieces()[4]

    @property
    def appended(self):
        """New [start, end) of the jmps the layout appended (no old address)."""
        j = self.rows[self.rows["kind"] == bm.KIND_JMP_INSERTED]
        return (j["new"].astype(np.uint64),
                j["new"].astype(np.uint64) + j["new_len"].astype(np.uint64))

    def map(self, addrs):
        return self.blocks.map(addrs)

    def point(self, addrs):
        return self.base.point(addrs)

    translates = _Map.translates


def _add(findings, severity, check, items, describe, counter):
    counter[check] = counter.get(check, 0) + len(items)
    for it in items[:MAX_REPORT]:
        addr, msg = describe(it)
        findings.append(Finding(severity, check, addr, msg))
    if len(items) > MAX_REPORT:
        findings.append(Finding(severity, check, None, f"{len(items) - MAX_REPORT} more ({len(items)} in all)"))


def match_functions(old_ctx, new_ctx):
    """(old indices, new indices) of matched functions, plus unmatched old indices."""
    of, nf = old_ctx.functions, new_ctx.functions
    new_by_sym = {int(s): i for i, s in enumerate(nf.sym_index.tolist())}
    oi, ni, missing = [], [], []
    for i, s in enumerate(of.sym_index.tolist()):
        j = new_by_sym.get(int(s))
        if j is None or nf.name[j] != of.name[i]:
            # symtab re-ordered: fall back to name + occurrence
            missing.append(i)
        else:
            oi.append(i)
            ni.append(j)
    if missing:
        by_name = {}
        for j, n in enumerate(nf.name):
            by_name.setdefault(n, []).append(j)
        used = set(ni)
        still = []
        for i in missing:
            cands = [j for j in by_name.get(of.name[i], []) if j not in used]
            if cands:
                oi.append(i)
                ni.append(cands[0])
                used.add(cands[0])
            else:
                still.append(i)
        missing = still
    return np.array(oi, dtype=np.int64), np.array(ni, dtype=np.int64), missing


def _piece_ends(image, functions):
    ends = functions.end.copy()
    nxt = np.append(functions.start[1:], np.uint64(2**64 - 1))
    sec_end = np.zeros(len(functions), np.uint64)
    for sec in image.sections:
        if sec.is_code and sec.is_alloc and sec.size:
            inside = (functions.start >= np.uint64(sec.addr)) & (functions.start < np.uint64(sec.end))
            sec_end[inside] = sec.end
    return np.maximum(ends, np.minimum(nxt, sec_end))


def _region_points(old, new):
    from ..image.functions import KERNEL_REGION_LABELS
    pts = {}
    for label in KERNEL_REGION_LABELS:
        a, b = old.symbol_address(label), new.symbol_address(label)
        if a is not None and b is not None:
            pts[a] = b
    return pts


def _labels(old, new, functions):
    """Code symbols outside functions, present in both images (same symtab index):
    (old addresses, new addresses, old end of the code each governs)."""
    so, sn = old.symtab, new.symtab
    if len(so) != len(sn):
        return None, None, None
    code = [s for s in old.sections if s.is_code and s.is_alloc and s.size]
    secs = np.array([s.index for s in code], dtype=np.int64)
    typ = so["info"] & 0xF
    sel = np.isin(so["shndx"].astype(np.int64), secs) & (typ != 3) & (typ != 4) & \
        (so["shndx"] == sn["shndx"])
    idx = np.nonzero(sel)[0]
    v_old, v_new = so["value"][idx], sn["value"][idx]
    outside = functions.find(v_old) < 0
    v_old, v_new = v_old[outside], v_new[outside]
    # one delta per address (aliases agree in a correct rewrite; keep the first)
    v_old, first = np.unique(v_old, return_index=True)
    v_new = v_new[first]
    # each label governs code up to the next label or function start or section end
    stops = np.unique(np.concatenate([v_old, functions.start,
                                      np.array([s.end for s in code], np.uint64)]))
    k = np.searchsorted(stops, v_old, side="right")
    end = stops[np.minimum(k, len(stops) - 1)]
    return v_old, v_new, end


# Data symbols a rewrite may move (tools/relayout/kallsyms_cold.py: kallsyms'
# arrays grown by the `.cold` entries of a block-level layout, and the end of the
# read-only data behind them). Every other data symbol stays.
MOVABLE_DATA = ("kallsyms_offsets", "kallsyms_names", "kallsyms_markers",
                "kallsyms_seqs_of_names", "__end_rodata")


def _data_moves(old, new, findings, counter):
    """Data symbols whose value changed: each must be movable; returns
    ({name: new value}, (sorted addresses in OLD of the code fields relocated
    against one, each field's move)) for the instruction checks."""
    code = {s.index for s in old.sections if s.is_code}
    no, so = old.symbol_table()
    nn, sn = new.symbol_table()
    def unique(names, syms):
        out = {}
        for i, (nm, t, x) in enumerate(zip(names, (syms["info"] & 0xF).tolist(),
                                           syms["shndx"].tolist())):
            if nm and t not in (STT_SECTION, 4) and x and x < 0xFF00:
                out[nm] = None if nm in out else i
        return out
    uo, un = unique(no, so), unique(nn, sn)
    moved, bad = {}, []
    for nm, i in uo.items():
        j = un.get(nm)
        if i is None or j is None or int(so["shndx"][i]) in code:
            continue
        if int(so["value"][i]) != int(sn["value"][j]):
            if nm in MOVABLE_DATA:
                moved[i] = (nm, int(sn["value"][j]) - int(so["value"][i]), int(sn["value"][j]))
            else:
                bad.append((nm, int(so["value"][i]), int(sn["value"][j])))
    _add(findings, "error", "equiv.data-symbol", bad,
         lambda b: (b[2], f"data symbol {b[0]} moved from {b[1]:#x} to {b[2]:#x}"), counter)
    addrs, deltas = [], []
    for rel in old.relocations.values():
        if not (rel.target.is_code and rel.target.is_alloc) or not moved:
            continue
        sel = np.nonzero(np.isin(rel.sym.astype(np.int64), list(moved)))[0]
        for k in sel.tolist():
            addrs.append(int(rel.offset[k]))
            deltas.append(moved[int(rel.sym[k])][1])
    o = np.argsort(np.array(addrs, np.uint64), kind="stable")
    return ({nm: v for nm, _, v in moved.values()},
            (np.array(addrs, np.uint64)[o], np.array(deltas, np.int64)[o]))


def _decoded_old(path):
    """What decoding OLD produces (its coverage, detached from the image, and its
    instructions), computed in start_against's child."""
    ctx = ImageContext(ElfImage(path))
    dis = ctx.disasm
    cov = ctx.coverage
    cov.image = None
    return cov, dis


def start_against(old_path):
    """Start decoding OLD in a forked child (forked.py) so that it runs while
    NEW is decoded and checked alone; pass the result to verify_against as
    ``old_decode`` (or ``cancel()`` it)."""
    return Forked(_decoded_old, old_path)


def verify_against(report, new_path, old_path, layout_map=None, log=None, old_decode=None):
    """Add equivalence findings to ``report`` (a VerifyReport of NEW).

    The map is never taken from the rewriter's output: it is rebuilt from the
    two symbol tables, so this check stays independent of relayout. A layout
    map written by relayout (``layout_map``: rows from read_layout_map) is
    checked against it.
    """
    log = log or (lambda m: None)
    findings = report.findings
    counter = {}
    timings.phase("against: load OLD, match")
    old = ElfImage(old_path)
    # NEW was already decoded by the standalone verify that made ``report``
    nctx = report.context if getattr(report, "context", None) is not None else \
        ImageContext(ElfImage(new_path), log=log)
    new = nctx.image
    octx = ImageContext(old, log=log)
    # relayout keeps the .notes section, so a rewrite keeps its original's build-id
    if old.build_id and new.build_id and old.build_id != new.build_id:
        findings.append(Finding("error", "equiv.build-id", None,
                                f"the images come from different builds (build-id "
                                f"{new.build_id[:16]}... vs original {old.build_id[:16]}...): "
                                "NEW is not a rewrite of OLD"))
    of, nf = octx.functions, nctx.functions
    oi, ni, missing = match_functions(octx, nctx)
    _add(findings, "error", "equiv.function-missing", missing,
         lambda i: (int(of.start[i]), f"function {of.name[i]} of the original is missing"), counter)
    if octx.is_kernel:
        from ..kernel.prefixes import check_endbr_entries
        n = check_endbr_entries(octx, nctx, oi, ni, findings, counter, _add)
        if n:
            report.extra["ibt_entries_checked"] = n
    # a block-level layout: functions with pieces in the block map are split
    rows = bm.read_blockmap(new)
    split = np.zeros(len(of), dtype=bool)
    if rows is not None and len(rows):
        fidx = of.find(rows["old"][rows["old_len"] > 0].astype(np.uint64))
        split[fidx[fidx >= 0]] = True
        log(f"block map: {len(rows)} pieces in {int(split.sum())} split functions")
    size_diff = np.nonzero((of.size[oi] != nf.size[ni]) & ~split[oi])[0]
    _add(findings, "error", "equiv.function-size", size_diff.tolist(),
         lambda k: (int(nf.start[ni[k]]), f"{of.name[oi[k]]} changed size "
                    f"{int(of.size[oi[k]])} -> {int(nf.size[ni[k]])}"), counter)
    # Each function's piece runs to the next function (or its section's end), so
    # code between functions without a symbol moves with the function before it.
    piece_end = _piece_ends(old, of)[oi]
    amap = _Map(of.start[oi], piece_end, nf.start[ni], *_labels(old, new, of),
                points=_region_points(old, new))
    if not octx.is_kernel:
        amap.fixed = np.array(sorted(e for _, e in _code_ranges(old)), np.uint64)
    if split.any():
        amap = _BlockAwareMap(amap, rows)
    kernel = octx.is_kernel
    moved = int((of.start[oi] != nf.start[ni]).sum())
    log(f"{len(oi)} functions matched, {moved} moved")
    moved_data, data_moves = _data_moves(old, new, findings, counter)
    # the block-level checks decode what they need themselves and need nothing
    # the instruction checks make: on the second core, in a forked child
    # (forked.py); their findings are added after the instruction checks'
    blocks = Forked(_block_results, octx, nctx, rows, split, oi, ni, amap, data_moves) \
        if split.any() else None
    try:
        _compare_code(report, octx, nctx, amap, of, oi, size_diff, split, kernel, data_moves,
                      old_decode, findings, counter, log)
        # 3. and 4. while the block checks may still run: their findings are
        # kept aside and added after the block findings (the report's order)
        later = _Aside()
        _check_data_and_tables(old, new, octx, nctx, amap, of, nf, oi, ni, split, rows,
                               moved_data, later.findings, later.counter, later)
        timings.phase("against: blocks (wait)")
        if blocks is not None:
            found, stats = blocks.result()
            _add_block_findings(found, stats, findings, counter, report)
        later.add_to(report, counter)
    finally:
        if blocks is not None:
            blocks.cancel()
    timings.phase("against: debug info")
    check_debuginfo(old, new, amap, findings, counter, report, log)
    timings.phase("against: rest")
    if layout_map:
        _check_layout_map(layout_map, of, nf, oi, ni, findings, counter, report)
    report.extra["equivalence_moved_functions"] = moved
    report.extra["against"] = old_path
    # the full count per check (the findings list stops at MAX_REPORT per check)
    report.extra["equivalence_counts"] = {k: int(v) for k, v in counter.items()}
    log("equivalence: " + (", ".join(f"{k} {v}" for k, v in counter.items()) or "no problems"))
    return report


class _Aside:
    """Findings, counts and report extras of checks run out of the report's order."""

    def __init__(self):
        self.findings, self.counter, self.extra = [], {}, {}

    def add_to(self, report, counter):
        report.findings.extend(self.findings)
        for k, v in self.counter.items():
            counter[k] = counter.get(k, 0) + v
        report.extra.update(self.extra)


def _compare_code(report, octx, nctx, amap, of, oi, size_diff, split, kernel, data_moves,
                  old_decode, findings, counter, log):
    """Steps 1 and 2 (compare_instructions) on the instructions of OLD outside
    split functions."""
    if old_decode is not None:
        timings.phase("against: decode OLD (wait)")
        cov, dis = old_decode.result()
        cov.image = octx.image
        octx._coverage, octx._disasm, octx._function_disasm = cov, dis, None
        log(f"OLD: {len(dis)} instructions, decoded beside NEW")
    timings.phase("against: decode OLD")
    od = octx.disasm
    same_size = np.ones(len(of), dtype=bool)
    same_size[oi[size_diff]] = False
    matched_func = np.zeros(len(of), dtype=bool)
    matched_func[oi] = True
    use = _compared_instructions(octx, od, matched_func, same_size)
    fidx = od.func.astype(np.int64)
    use &= ~((fidx >= 0) & split[np.maximum(fidx, 0)])     # split functions: block-level checks
    timings.phase("against: instructions")
    report.extra.update(compare_instructions(octx, nctx, amap, use, kernel, findings, counter,
                                             data_moves))


def _check_data_and_tables(old, new, octx, nctx, amap, of, nf, oi, ni, split, rows, moved_data,
                           findings, counter, report):
    # 3. data: relocated pointers translate; nothing stale
    timings.phase("against: data, regions, relocations")
    _check_data_relocs(old, new, amap, octx, findings, counter)
    _check_regions(old, new, of, nf, oi, ni, findings, counter)

    # 3b. every relocation in NEW still describes its field (S + A [- P])
    _check_relocations(old, new, octx, findings, counter, report)

    # 4. tables and symbols
    timings.phase("against: tables, symbols")
    cold_names = _cold_names(of, split) if split.any() else frozenset()
    _check_tables(octx, nctx, amap, findings, counter, split_ranges=_split_ranges(
        of, nf, split, oi, ni, new, cold_names), cold_names=cold_names,
        added_cold=_added_cold(old, new, cold_names), moved_data=moved_data)
    _check_eh_frame(old, new, amap, octx, findings, counter,
                    block_rows=rows if split.any() else None, report=report)
    _check_symbols(old, new, octx, amap, findings, counter, cold_names)
    from .pie import check_pie          # a PIE's dynamic relocations and PIC tables
    check_pie(old, new, amap, octx, findings, counter, report, _add)


def compare_instructions(octx, nctx, amap, use, kernel, findings, counter, data_moves=None):
    """Steps 1 and 2 for the instructions of OLD selected by ``use``: each sits
    at its mapped address in NEW with the same length, and every byte that
    differs is a translated address field (or a field relocated against a moved
    data symbol, ``data_moves`` from _data_moves, that moved with it). Cost
    follows ``use``, so the mutation test runs it on one instruction at a time."""
    mv_addr, mv_delta = data_moves if data_moves is not None else (np.zeros(0, np.uint64), None)

    def moved_by(field_addr, old_value, new_value, size):
        """The field carries a relocation against a moved data symbol and moved with it."""
        k = int(np.searchsorted(mv_addr, field_addr))
        if k >= len(mv_addr) or int(mv_addr[k]) != field_addr:
            return False
        mask = (1 << (8 * size)) - 1 if size < 8 else (1 << 64) - 1
        return (new_value - old_value - int(mv_delta[k])) & mask == 0
    od, nd = octx.disasm, nctx.disasm
    o_addr = od.addr[use]
    o_size = od.size[use]
    n_addr = amap.map(o_addr)
    ni_idx = np.searchsorted(nd.addr, n_addr)
    nic = np.minimum(ni_idx, len(nd.addr) - 1)
    found = (ni_idx < len(nd.addr)) & (nd.addr[nic] == n_addr) & (nd.size[nic] == o_size)
    bad = np.nonzero(~found)[0]
    _add(findings, "error", "equiv.instruction", bad.tolist(),
         lambda k: (int(n_addr[k]), f"instruction of {octx.symbol_at(int(o_addr[k]))} has no "
                    f"same-length counterpart at {int(n_addr[k]):#x}"), counter)

    # 2. differing bytes must be translated address fields
    o_idx_all = np.nonzero(use)[0][found]          # old disasm index
    n_idx_all = nic[found]
    o_raw, n_raw = od.raw[o_idx_all], nd.raw[n_idx_all]
    sizes = od.size[o_idx_all].astype(np.int64)
    col = np.arange(16)[None, :]
    differs = ((o_raw != n_raw) & (col < sizes[:, None])).any(axis=1)
    k_diff = np.nonzero(differs)[0]
    # branches: compare decoded targets, all at once (most changed instructions are
    # calls and jumps to moved functions)
    ob_i, ob_t, _ = od.branch_targets()
    jo, jn = o_idx_all[k_diff], n_idx_all[k_diff]
    po = np.minimum(np.searchsorted(ob_i, jo), max(len(ob_i) - 1, 0))
    is_br = (ob_i[po] == jo) if len(ob_i) else np.zeros(len(jo), bool)
    # NEW's targets only for the changed rows (NEW's rows may be patched in place
    # by the mutation test, so nothing is cached for them)
    sub_i, sub_t, _ = Disassembly(nd.addr[jn], nd.size[jn], nd.func[jn], nd.raw[jn], []).branch_targets()
    new_br = np.zeros(len(jn), bool)
    new_br[sub_i] = True
    t_old = ob_t[po] if len(ob_i) else np.zeros(len(jo), np.uint64)
    t_new = np.zeros(len(jn), np.uint64)
    t_new[sub_i] = sub_t
    br_ok = is_br & new_br & (amap.map(t_old) == t_new)
    branch_fixed = int(br_ok.sum())
    wrong_target = [(int(od.addr[o]), int(nd.addr[n]), int(t), int(tn) if nb else None)
                    for o, n, t, tn, nb in zip(jo[is_br & ~br_ok].tolist(), jn[is_br & ~br_ok].tolist(),
                                               t_old[is_br & ~br_ok].tolist(),
                                               t_new[is_br & ~br_ok].tolist(),
                                               new_br[is_br & ~br_ok].tolist())]
    # every other changed instruction: each changed byte must lie in an address
    # field (displacement or immediate) whose value translates; the field layout
    # comes from Capstone, once per distinct instruction header (fields.py)
    from .fields import FieldLayouts, field_values
    rows = k_diff[~is_br]
    r_raw_o, r_raw_n = o_raw[rows], n_raw[rows]
    r_size = sizes[rows]
    r_oa = od.addr[o_idx_all[rows]]
    r_na = nd.addr[n_idx_all[rows]]
    decoded, d_off, d_sz, i_off, i_sz, rip = FieldLayouts().layouts(r_raw_o, r_size, r_oa)
    diff = (r_raw_o != r_raw_n) & (col < r_size[:, None])
    in_disp = (col >= d_off[:, None]) & (col < (d_off + d_sz)[:, None])
    in_imm = (col >= i_off[:, None]) & (col < (i_off + i_sz)[:, None])
    has_disp = (d_sz > 0) & (diff & in_disp).any(axis=1)
    has_imm = (i_sz > 0) & (diff & in_imm).any(axis=1)
    covered = (has_disp[:, None] & in_disp) | (has_imm[:, None] & in_imm)
    all_covered = decoded & ~(diff & ~covered).any(axis=1)
    # the fields to translate, in the order the instructions come (disp before imm)
    dv_o, dv_n = field_values(r_raw_o, d_off, d_sz), field_values(r_raw_n, d_off, d_sz)
    end_o = r_oa + r_size.astype(np.uint64)
    end_n = r_na + r_size.astype(np.uint64)
    dv_o = np.where(rip, end_o + dv_o, dv_o)
    dv_n = np.where(rip, end_n + dv_n, dv_n)
    iv_o, iv_n = field_values(r_raw_o, i_off, i_sz), field_values(r_raw_n, i_off, i_sz)
    use_d, use_i = decoded & has_disp, decoded & has_imm
    f_row = np.concatenate([np.nonzero(use_d)[0], np.nonzero(use_i)[0]])
    f_old = np.concatenate([dv_o[use_d], iv_o[use_i]])
    f_new = np.concatenate([dv_n[use_d], iv_n[use_i]])
    f_at = np.concatenate([r_oa[use_d] + d_off[use_d].astype(np.uint64),
                           r_oa[use_i] + i_off[use_i].astype(np.uint64)])
    f_sz = np.concatenate([d_sz[use_d], i_sz[use_i]])
    fields_ok = np.ones(len(rows), bool)
    if len(f_row):
        good = amap.translates(f_old, f_new, kernel)
        # a field relocated against a moved data symbol moved with it (rare: checked one by one)
        for i in np.nonzero(~good)[0].tolist():
            good[i] = moved_by(int(f_at[i]), int(f_old[i]), int(f_new[i]), int(f_sz[i]))
        np.logical_and.at(fields_ok, f_row, good)
    passed = all_covered & fields_ok
    field_fixed = int(passed.sum())
    unexplained = []
    if not passed.all():
        cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        for k in np.nonzero(~passed)[0].tolist():
            oa, size = int(r_oa[k]), int(r_size[k])
            ins = next(cs.disasm(bytes(r_raw_o[k][:size]), oa, 1), None)
            unexplained.append((oa, "undecodable" if ins is None or not decoded[k] else
                                f"{ins.mnemonic} {ins.op_str}"))
    _add(findings, "error", "equiv.branch-target", wrong_target,
         lambda w: (w[1], f"branch at {octx.symbol_at(w[0])} went to {octx.symbol_at(w[2])}, "
                    f"now goes to {w[3]:#x}" if w[3] is not None else
                    f"branch at {octx.symbol_at(w[0])} is no longer a branch"), counter)
    _add(findings, "error", "equiv.instruction-bytes", unexplained,
         lambda u: (u[0], f"{octx.symbol_at(u[0])}: '{u[1]}' changed in a way that is not a "
                    "translated address"), counter)
    return {"equivalence_instructions": int(found.sum()),
            "equivalence_translated_branches": branch_fixed,
            "equivalence_translated_fields": field_fixed}


def _fill_instructions(octx, od):
    """True for int3/nop fill outside functions (the coverage's padding)."""
    from ..image.coverage import R_PADDING
    inside = od.func.astype(np.int64) >= 0
    extra = octx.coverage.extra
    if not len(extra.addr):
        return ~inside
    k = np.minimum(np.searchsorted(extra.addr, od.addr), len(extra.addr) - 1)
    return ~inside & (octx.coverage.reason[k] == R_PADDING)


def _compared_instructions(octx, od, matched_func, same_size):
    """Which instructions of OLD are compared: those of matched functions that
    kept their size, and every instruction outside functions (``func`` -1:
    entry code, thunks, asm labels, .altinstr_replacement ...) except int3/nop
    padding (relayout drops and inserts fill), which must sit at its mapped
    address (it moves with the code symbol or function before it, or stays)
    with the same length and translated bytes."""
    from ..image.coverage import R_PADDING
    f = od.func.astype(np.int64)
    inside = f >= 0
    fc = np.where(inside, f, 0)
    extra = octx.coverage.extra
    k = np.minimum(np.searchsorted(extra.addr, od.addr), max(len(extra.addr) - 1, 0))
    padding = ~inside & (octx.coverage.reason[k] == R_PADDING) if len(extra.addr) else ~inside
    return np.where(inside, matched_func[fc] & same_size[fc], ~padding)


def _code_ranges(image):
    return [(s.addr, s.end) for s in image.sections if s.is_code and s.is_alloc and s.size]


def _sorted_table_ranges(octx):
    """Byte ranges of tables a rewrite re-sorts (checked as multisets instead)."""
    lo, hi = [], []
    for cls in TABLES:
        t = cls()
        if not getattr(t, "resorted_by_relayout", False):
            continue
        for start, count, itemsize in t.ranges(octx):
            lo.append(start)
            hi.append(start + count * itemsize)
    return np.array(lo, np.uint64), np.array(hi, np.uint64)


def _check_data_relocs(old, new, amap, octx, findings, counter):
    """Every absolute pointer field (R_X86_64_64) in NEW's data sections holds the
    translated value of the same field in OLD."""
    stale = []
    checked = 0
    t_lo, t_hi = _sorted_table_ranges(octx)
    for name, rel in new.relocations.items():
        tgt = rel.target
        if not tgt.is_alloc or tgt.is_code or tgt.type == 8:
            continue
        sel = rel.type == 1
        if not sel.any():
            continue
        offs = rel.offset[sel]
        inside = (offs >= np.uint64(tgt.addr)) & (offs + np.uint64(8) <= np.uint64(tgt.end))
        offs = offs[inside]
        if len(t_lo):
            k = np.searchsorted(t_lo, offs, side="right").astype(np.int64) - 1
            kc = np.maximum(k, 0)
            offs = offs[~((k >= 0) & (offs < t_hi[kc]))]
        o_sec = old.section(tgt.name)
        if o_sec is None or o_sec.addr != tgt.addr:
            continue
        base_n = tgt.offset
        base_o = o_sec.offset
        rel_off = (offs - np.uint64(tgt.addr)).astype(np.int64)
        idx = rel_off[:, None] + np.arange(8)[None, :]
        v_new = new.data[base_n + idx].copy().view("<u8").ravel()
        v_old = old.data[base_o + idx].copy().view("<u8").ravel()
        want = amap.map(v_old)
        bad = np.nonzero(~amap.translates(v_old, v_new, octx.is_kernel))[0]
        checked += len(offs)
        for b in bad.tolist():
            stale.append((int(offs[b]), int(v_old[b]), int(v_new[b]), int(want[b]), tgt.name))
    _add(findings, "error", "equiv.data-pointer", stale,
         lambda s: (s[0], f"pointer at {s[0]:#x} in {s[4]} holds {s[2]:#x}; the original pointed "
                    f"at {octx.symbol_at(s[1])}, now at {s[3]:#x}"), counter)


# (ELF type, field size, PC-relative)
_RELOC_FIELDS = ((1, 8, False), (2, 4, True), (4, 4, True), (10, 4, False), (11, 4, False))


def relocation_mismatches(image, exclude_lo, exclude_hi):
    """(checked, [(field address, symbol index, addend)]) of relocations whose
    field no longer holds S + A (absolute) or S + A - P (PC-relative), outside
    the excluded ranges (tables sorted after the link, whose relocations the
    build itself leaves stale)."""
    sy = image.symtab
    checked, bad = 0, []
    for rel in image.relocations.values():
        sec = rel.target
        if not sec.is_alloc or sec.type == 8 or not len(rel):
            continue
        for rtype, size, pcrel in _RELOC_FIELDS:
            sel = np.nonzero((rel.type == rtype) & (rel.sym != 0))[0]
            if not len(sel):
                continue
            off = rel.offset[sel]
            ok = (off >= np.uint64(sec.addr)) & (off + np.uint64(size) <= np.uint64(sec.end))
            if len(exclude_lo):
                k = np.searchsorted(exclude_lo, off, side="right").astype(np.int64) - 1
                kc = np.maximum(k, 0)
                ok &= ~((k >= 0) & (off < exclude_hi[kc]))
            sel, off = sel[ok], off[ok]
            if not len(sel):
                continue
            pos = (off - np.uint64(sec.addr)).astype(np.int64) + sec.offset
            raw = image.data[pos[:, None] + np.arange(size)[None, :]].copy()
            val = raw.view("<u8" if size == 8 else "<u4").ravel().astype(np.uint64)
            want = (sy["value"][rel.sym[sel]].astype(np.int64) + rel.addend[sel]).astype(np.uint64)
            if pcrel:
                want = want - off
            if size == 4:
                want &= np.uint64(0xFFFFFFFF)
            checked += len(sel)
            for i in np.nonzero(val != want)[0].tolist():
                bad.append((int(off[i]), int(rel.sym[sel[i]]), int(rel.addend[sel[i]])))
    return checked, bad


def _check_relocations(old, new, octx, findings, counter, report):
    lo, hi = _sorted_table_ranges(octx)
    _, bad_old = relocation_mismatches(old, lo, hi)
    checked, bad_new = relocation_mismatches(new, lo, hi)
    report.extra["equivalence_relocations_checked"] = checked
    if len(bad_new) <= len(bad_old):
        return
    names, _ = new.symbol_table()
    old_names, _ = old.symbol_table()
    # by symbol name, not index: a block-level layout inserts local `.cold`
    # symbols, which shifts the index of every global after them
    old_keys = {(old_names[s], a) for _, s, a in bad_old}
    fresh = [b for b in bad_new if (names[b[1]], b[2]) not in old_keys] or bad_new
    _add(findings, "error", "equiv.relocation", fresh,
         lambda b: (b[0], f"field at {b[0]:#x} no longer holds what its relocation says "
                    f"({names[b[1]] or 'section ' + str(b[1])} + {b[2]:#x})"), counter)


def _check_regions(old, new, of, nf, oi, ni, findings, counter):
    """Every function stays inside the region (between the same boundary labels)."""
    from ..image.functions import regions
    ro = regions(old)
    rn = {r.name: r for r in regions(new)}
    outside = []
    for r in ro:
        n = rn.get(r.name)
        sel = (of.start[oi] >= np.uint64(r.start)) & (of.start[oi] < np.uint64(r.end))
        if n is None:
            if sel.any():
                outside.append((r.name, int(sel.sum()), None))
            continue
        ns, ne = nf.start[ni[sel]], nf.end[ni[sel]]
        bad = (ns < np.uint64(n.start)) | (ne > np.uint64(n.end))
        if bad.any():
            outside.append((r.name, int(bad.sum()), int(ns[bad][0])))
    _add(findings, "error", "equiv.region", outside,
         lambda o: (o[2], f"{o[1]} function(s) left region {o[0]}"), counter)


_EMPTY = np.zeros(0, np.uint64)
_NO_SPLIT = ((_EMPTY, _EMPTY), (_EMPTY, _EMPTY))      # split_ranges of a function-level layout


def _within(addrs, ranges):
    """True where an address lies in one of the (sorted, disjoint) [lo, hi) ranges."""
    from ..image.intervals import containing
    return containing(ranges[0], ranges[1], addrs) >= 0


def _check_orc_lookup(octx, nctx, amap, split_ranges, findings, counter):
    """A block-level layout adds ORC entries at moved pieces and compacts the
    table (an entry equal to the one before it is redundant), so the IPs no longer
    match as a multiset; what must hold is what the unwinder sees: the lookup at
    every translated instruction of a function moved whole gives the original's
    entry (split functions are checked piece by piece in blocks.py)."""
    lo, ln = _orc_lookup(octx), _orc_lookup(nctx)
    if lo is None or ln is None:
        return
    od = octx.disasm
    # int3/nop fill between code is not compared: relayout drops and inserts it
    fill = _fill_instructions(octx, od)
    a = od.addr[~_within(od.addr, split_ranges[0]) & ~fill]
    b = amap.map(a)

    def key(orc, x):
        i = np.searchsorted(orc[0], x, side="right").astype(np.int64) - 1
        return np.where(i >= 0, orc[1][np.maximum(i, 0)], -1)
    bad = np.nonzero(key(lo, a) != key(ln, b))[0]
    _add(findings, "error", "equiv.orc", bad.tolist(),
         lambda k: (int(b[k]), f"ORC lookup at {int(b[k]):#x} ({octx.symbol_at(int(a[k]))}) "
                    "differs from the original's"), counter)


def _check_orc(eo, en, amap, nctx, findings, counter):
    """ORC IPs translate as a multiset, except that relayout may drop entries the
    unwinder can never find (another entry has the same IP) to make room for
    'undefined' entries at the start of the int3 padding it inserts."""
    want = np.sort(amap.map(eo["ip"]))
    got = np.sort(en["ip"])
    wv, wc = np.unique(want, return_counts=True)
    gv, gc = np.unique(got, return_counts=True)
    allv = np.union1d(wv, gv)
    wn = np.zeros(len(allv), np.int64)
    gn = np.zeros(len(allv), np.int64)
    wn[np.searchsorted(allv, wv)] = wc
    gn[np.searchsorted(allv, gv)] = gc
    lost = allv[(gn < wn) & (gn == 0)]              # an IP the unwinder can no longer find
    added = allv[gn > wn]
    problems = [(int(a), "lost") for a in lost.tolist()]
    if len(added):
        ent = en[np.isin(en["ip"], added)]
        undefined = (ent["bits"] & 0xF) == 0
        first = np.array([nctx.image.read(int(a), 1)[0] if nctx.in_code([a])[0] else 0
                          for a in ent["ip"].tolist()], dtype=np.uint8)
        at_padding = (first == 0xCC) | nctx.code_section_ends(ent["ip"])
        problems += [(int(a), "added") for a in ent["ip"][~(undefined & at_padding)].tolist()]
    _add(findings, "error", "equiv.orc", problems,
         lambda p: (p[0], f"orc_unwind: IP {p[0]:#x} " + (
             "of the original has no entry any more" if p[1] == "lost" else
             "is new but not an undefined entry at inserted padding")), counter)


def read_layout_map(path):
    """relayout's layout map (TSV: function, old, new, size) as [(name, old, new)]."""
    rows = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip() or line.startswith("#"):
                    continue
                parts = line.rstrip("\n").split("\t")
                try:
                    rows.append((parts[0], int(parts[1], 16), int(parts[2], 16)))
                except (IndexError, ValueError):
                    raise BadInput(f"{path}:{n}: not a layout map line "
                                   "(function, old, new, size)") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}") from None
    return rows


def _check_layout_map(rows, of, nf, oi, ni, findings, counter, report):
    """The layout map must say what the symbol tables say: each listed
    function's new address."""
    truth = dict(zip(of.start[oi].tolist(), nf.start[ni].tolist()))
    wrong = [(new, name, old, truth[old]) for name, old, new in rows
             if old in truth and truth[old] != new]
    report.extra["equivalence_layout_map_rows"] = len(rows)
    _add(findings, "error", "equiv.layout-map", wrong,
         lambda w: (w[0], f"layout map says {w[1]} ({w[2]:#x}) moved to {w[0]:#x}, the "
                    f"image has it at {w[3]:#x}"), counter)


def _check_eh_frame(old, new, amap, octx, findings, counter, block_rows=None, report=None):
    """Userspace unwind info: every FDE's pc_begin translates (as a multiset).

    Block-level layouts: the new FDEs are the translated ones plus one per cold
    part, starting at the part's first piece; and the unwind state at every
    piece of a split function (and at every original CFI row inside a copied
    piece) is the original's (relayout/eh_frame_split.py: check_split_cfi)."""
    so, sn = old.section(".eh_frame"), new.section(".eh_frame")
    if so is None or sn is None or not so.size:
        return
    from ..relayout.eh_frame import parse_eh_frame
    try:
        eo = parse_eh_frame(old.section_bytes(so), so.addr)
        en = parse_eh_frame(new.section_bytes(sn), sn.addr)
    except LinepackError:
        return                      # standalone verify already reports unsupported encodings
    want = np.sort(amap.map(eo.pc_begin))
    got = np.sort(en.pc_begin)
    if block_rows is not None and len(got) > len(want):
        cold = block_rows[(block_rows["part"] == bm.PART_COLD) & (block_rows["new_len"] > 0)]
        starts = {}
        for f, a in zip(cold["func"].tolist(), cold["new"].tolist()):
            starts[f] = min(a, starts.get(f, a))
        want = np.sort(np.concatenate([want, np.array(sorted(starts.values()), np.uint64)]))
        from ..relayout.eh_frame_split import check_split_cfi
        bad_cfi, seen = check_split_cfi(old, new, block_rows)
        _add(findings, "error", "equiv.eh_frame-part", bad_cfi, lambda b: b, counter)
        from ..relayout.eh_frame_split import check_split_lsda
        bad_lsda, seen_lsda = check_split_lsda(old, new, block_rows)
        _add(findings, "error", "equiv.lsda-part", bad_lsda, lambda b: b, counter)
        if report is not None:
            report.extra["equivalence_eh_frame_part_states"] = seen
            report.extra["equivalence_lsda_part_lookups"] = seen_lsda
    if len(want) != len(got):
        bad = [(None, f".eh_frame has {len(got)} FDEs, the original {len(want)}")]
    else:
        idx = np.nonzero(want != got)[0]
        bad = [(int(want[i]), f".eh_frame: no FDE starts at {int(want[i]):#x} (the translated "
                f"start of an original FDE)") for i in idx.tolist()]
    _add(findings, "error", "equiv.eh_frame", bad, lambda b: b, counter)


ADDRESS_COLUMNS = {"code", "target", "addr", "ip", "insn", "fixup", "instr", "value"}


def _added_cold(old, new, cold_names):
    """(name, address) of the `name.cold` symbols a block-level layout inserted
    (after the locals of OLD's symtab, as _check_symbols finds them)."""
    so, sn = old.symtab, new.symtab
    if not cold_names or len(sn) <= len(so):
        return []
    first_global = next(s.info for s in old.sections if s.type == SHT_SYMTAB)
    extra = len(sn) - len(so)
    names_new, _ = new.symbol_table()
    return [(names_new[k], int(sn["value"][k])) for k in range(first_global, first_global + extra)
            if names_new[k] in cold_names]


def _check_tables(octx, nctx, amap, findings, counter, split_ranges=None,
                  cold_names=frozenset(), added_cold=(), moved_data=None):
    address_columns = ADDRESS_COLUMNS
    od_addr = octx.disasm.addr
    moved_any = bool(len(od_addr)) and bool((amap.map(od_addr) != od_addr).any())
    for cls in TABLES:
        t_old, t_new = cls(), cls()
        if t_old.locate(octx) is None:
            continue
        if t_new.locate(nctx) is None:
            _add(findings, "error", "equiv.table-missing", [cls.name],
                 lambda n: (None, f"{n} is missing from the new image"), counter)
            continue
        eo, en = t_old.parse(octx), t_new.parse(nctx)
        if cls.name == "kallsyms" and cold_names:
            # a block-level layout adds a `name.cold` symbol per split function, each
            # at its cold part (gcc's own cold parts may carry the same names: the
            # added ones are told apart by their address)
            from collections import Counter
            want = Counter(added_cold)
            keep = []
            for nm, a in zip(t_new.names, en["addr"].tolist()):
                if want[(nm, a)] > 0:
                    want[(nm, a)] -= 1
                    keep.append(False)
                else:
                    keep.append(True)
            missing = sorted(p for p, k in want.items() for _ in range(k))
            _add(findings, "error", "equiv.kallsyms-cold", missing,
                 lambda p: (p[1], f"kallsyms has no entry for {p[0]} at {p[1]:#x}: backtraces "
                            "and kprobes name its cold code after the symbol before it"), counter)
            keep = np.array(keep, dtype=bool)
            en = en[keep]
            t_new.names = [nm for nm, k in zip(t_new.names, keep.tolist()) if k]
        if len(eo) != len(en):
            _add(findings, "error", "equiv.table-count", [(cls.name, len(eo), len(en))],
                 lambda c: (None, f"{c[0]}: {c[1]} entries before, {c[2]} after"), counter)
            continue
        if cls.name == "orc_unwind":
            # What the unwinder sees must not change: the lookup at every
            # translated instruction gives the original's entry. Relayout adds an
            # entry at every moved piece and compacts the table, so IPs match as a
            # multiset only where nothing moved.
            if not moved_any:
                _check_orc(eo, en, amap, nctx, findings, counter)
            _check_orc_lookup(octx, nctx, amap, split_ranges or _NO_SPLIT, findings, counter)
            continue
        for colname in eo.dtype.names:
            # kallsyms is checked below by (name, address) pairs, which also
            # knows which names are region labels rather than functions
            if colname not in address_columns or cls.name == "kallsyms":
                continue
            want = np.sort(amap.map(eo[colname]))
            got = np.sort(en[colname])
            if not np.array_equal(want, got):
                nbad = int((want != got).sum())
                first = int(np.nonzero(want != got)[0][0])
                _add(findings, "error", "equiv.table", [(cls.name, colname, nbad, int(want[first]))],
                     lambda c: (c[3], f"{c[0]}.{c[1]}: {c[2]} entries do not translate "
                                f"(first expected {c[3]:#x})"), counter)
        if cls.name == "kallsyms":
            from ..image.functions import KERNEL_REGION_LABELS
            mapped = amap.map(eo["addr"]).tolist()
            for k, nm in enumerate(t_old.names):
                if nm in KERNEL_REGION_LABELS:
                    v = nctx.image.symbol_address(nm)
                    mapped[k] = v if v is not None else mapped[k]
                elif moved_data and nm in moved_data:
                    mapped[k] = moved_data[nm]
            o_pairs = sorted(zip(t_old.names, mapped))
            n_pairs = sorted(zip(t_new.names, en["addr"].tolist()))
            if o_pairs != n_pairs:
                diff = [p for p, q in zip(o_pairs, n_pairs) if p != q]
                _add(findings, "error", "equiv.kallsyms", diff,
                     lambda p: (p[1], f"kallsyms {p[0]} should be at {p[1]:#x}"), counter)


def _check_symbols(old, new, octx, amap, findings, counter, cold_names=frozenset()):
    so, sn = old.symtab, new.symtab
    if cold_names and len(sn) > len(so):
        # a block-level layout inserts its `name.cold` symbols after the locals
        first_global = next(s.info for s in old.sections if s.type == SHT_SYMTAB)
        extra = len(sn) - len(so)
        names_new, _ = new.symbol_table()
        added = names_new[first_global:first_global + extra]
        if all(nm in cold_names for nm in added):
            sn = np.concatenate([sn[:first_global], sn[first_global + extra:]])
    if len(so) != len(sn):
        _add(findings, "error", "equiv.symtab", [(len(so), len(sn))],
             lambda c: (None, f"symbol table has {c[1]} entries, the original {c[0]}"), counter)
        return
    code_secs = np.array([s.index for s in old.sections if s.is_code and s.is_alloc], dtype=np.int64)
    sel = np.isin(so["shndx"].astype(np.int64), code_secs) & ((so["info"] & 0xF) != STT_SECTION)
    idx = np.nonzero(sel)[0]
    want = amap.map(so["value"][idx])
    got = sn["value"][idx]
    ok = want == got
    ok |= amap.translates(so["value"][idx], got) & amap.point(so["value"][idx])[0]
    bad = idx[~ok]
    names, _ = old.symbol_table()
    _add(findings, "error", "equiv.symbol", bad.tolist(),
         lambda i: (int(sn["value"][i]), f"symbol {names[i]} is at {int(sn['value'][i]):#x}, "
                    f"expected {int(amap.map(np.array([so['value'][i]], np.uint64))[0]):#x}"), counter)


# Callees that never return: the byte after a call to one is no successor.
NORETURN = ("__stack_chk_fail", "panic", "do_exit", "do_group_exit", "make_task_dead",
            "rewind_stack_and_make_dead", "kthread_exit", "__module_put_and_kthread_exit",
            "machine_real_restart", "usercopy_abort", "BUG_func", "fortify_panic",
            "__ubsan_handle_builtin_unreachable", "cpu_startup_entry", "do_task_dead",
            "stop_this_cpu", "play_dead", "hlt_play_dead", "sev_es_terminate", "snp_abort",
            "nmi_panic_self_stop", "panic_smp_self_stop", "ex_handler_msr_mce",
            "cpu_bringup_and_idle", "start_kernel", "arch_call_rest_init", "__invalid_creds",
            "__x64_sys_exit", "__x64_sys_exit_group", "x86_64_start_kernel",
            "x86_64_start_reservations", "xen_start_kernel", "abort", "exit", "_exit",
            "__assert_fail", "longjmp", "__longjmp_chk", "__cxa_throw", "_Unwind_Resume")
BUGFLAG_WARNING = 1


def _cold_names(of, split):
    return frozenset(of.name[i] + ".cold" for i in np.nonzero(split)[0].tolist())


def _cold_parts(new):
    """{name.cold: [(start, end)]} of NEW's cold-part symbols."""
    names, syms = new.symbol_table()
    out = {}
    is_func = (syms["info"] & 0xF) == STT_FUNC
    for k in np.nonzero(is_func)[0].tolist():
        if names[k].endswith(".cold"):
            v = int(syms["value"][k])
            out.setdefault(names[k], []).append((v, v + int(syms["size"][k])))
    return out


def _split_ranges(of, nf, split, oi, ni, new, cold_names):
    """(old ranges, new part ranges) of the split functions, each as sorted (lo, hi)."""
    if not split.any():
        return None
    idx = np.nonzero(split)[0]
    old_lo, old_hi = of.start[idx], of.end[idx]
    j_of = dict(zip(oi.tolist(), ni.tolist()))
    lo, hi = [], []
    for i in idx.tolist():
        j = j_of.get(i)
        if j is not None:
            lo.append(int(nf.start[j]))
            hi.append(int(nf.end[j]))
    for parts in _cold_parts(new).values():
        for a, b in parts:
            lo.append(a)
            hi.append(b)
    o = np.argsort(old_lo)
    n = np.argsort(np.array(lo, np.uint64))
    return ((old_lo[o], old_hi[o]),
            (np.array(lo, np.uint64)[n], np.array(hi, np.uint64)[n]))


def _orc_lookup(ctx):
    """(sorted IPs, one comparable key per entry) of an image's ORC table, or None."""
    from ..kernel.orc import OrcTable
    t = OrcTable()
    if t.locate(ctx) is None:
        return None
    e = t.parse(ctx)
    e = e[np.argsort(e["ip"], kind="stable")]
    key = (e["sp_offset"].astype(np.int64) & 0xFFFF) | \
        ((e["bp_offset"].astype(np.int64) & 0xFFFF) << 16) | (e["bits"].astype(np.int64) << 32)
    return e["ip"].astype(np.uint64), key


def _add_block_findings(found, stats, findings, counter, report):
    by_check = {}
    for f in found:
        by_check.setdefault(f.check, []).append(f)
    for check, items in sorted(by_check.items()):
        _add(findings, "error", check, items, lambda f: (f.address, f.message), counter)
    report.extra["equivalence_blocks"] = stats


def _block_results(octx, nctx, rows, split, oi, ni, amap, data_moves=None):
    """Block-level equivalence of the split functions (tools/verify/blocks.py):
    (findings, stats), added to the report by _add_block_findings."""
    from .blocks import SplitFunction, check_blocks
    old, new = octx.image, nctx.image
    of, nf = octx.functions, nctx.functions
    j_of = dict(zip(oi.tolist(), ni.tolist()))
    cold = _cold_parts(new)
    pieces = rows[rows["old_len"] > 0]
    p_func = of.find(pieces["old"].astype(np.uint64))
    funcs = []
    for i in np.nonzero(split)[0].tolist():
        parts = []
        j = j_of.get(i)
        if j is not None:
            parts.append((bm.PART_HOT, int(nf.start[j]), int(nf.end[j])))
        mine = pieces[(p_func == i) & (pieces["part"] == bm.PART_COLD)]
        cands = cold.get(of.name[i] + ".cold", [])
        if len(mine) and cands:
            # static functions share names: the .cold symbol that holds this one's pieces
            first = int(mine["new"].min())
            parts.append((bm.PART_COLD,) + next(((a, b) for a, b in cands if a <= first < b),
                                                cands[0]))
        funcs.append(SplitFunction(of.name[i], int(of.start[i]), int(of.end[i]), parts))
    tables = []
    for cls in TABLES:
        if cls.name in ("orc_unwind", "kallsyms"):
            continue
        t_old, t_new = cls(), cls()
        if t_old.locate(octx) is None or t_new.locate(nctx) is None:
            continue
        eo, en = t_old.parse(octx), t_new.parse(nctx)
        for col in eo.dtype.names:
            if col in ADDRESS_COLUMNS and col in en.dtype.names:
                tables.append((f"{cls.name}.{col}", eo[col], en[col]))
    no_fall = set()
    from ..kernel.bug_table import BugTable
    bt = BugTable()
    if bt.locate(octx) is not None:
        be = bt.parse(octx)
        no_fall = set(be["addr"][(be["flags"] & BUGFLAG_WARNING) == 0].tolist())
    noreturn = set()
    for nm in NORETURN:
        noreturn |= octx.symbol_addresses().get(nm, set())
    patch_sites = {}
    from ..kernel.alternatives import Alternatives
    alt = Alternatives()
    if alt.locate(octx) is not None:
        ae = alt.parse(octx)
        ends = (ae["instr"] + ae["instrlen"].astype(np.uint64)).tolist()
        for e, a in zip(ends, ae["instr"].tolist()):
            patch_sites[e] = min(a, patch_sites.get(e, a))
    orc_old, orc_new = _orc_lookup(octx), _orc_lookup(nctx)
    return check_blocks(rows, funcs, old.read, new.read, amap.base.map, orc_old, orc_new,
                        tables=tables, no_fallthrough=frozenset(no_fall),
                        noreturn=frozenset(noreturn), data_moves=data_moves,
                        patch_sites=patch_sites)
