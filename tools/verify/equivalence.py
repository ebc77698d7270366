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
"""

import numpy as np

import capstone

from ..image.elf import ElfImage, STT_SECTION
from ..kernel import TABLES
from ..kernel.base import Finding, ImageContext

MAX_REPORT = 20


class _Map:
    """Old -> new address map from matched functions (piecewise, numpy)."""

    def __init__(self, old_start, old_end, new_start):
        order = np.argsort(old_start, kind="stable")
        self.old_start = old_start[order]
        self.old_end = old_end[order]
        self.new_start = new_start[order]

    def map(self, addrs):
        """Mapped addresses; an address inside (or exactly at the end of) a function
        moves with it; anything else maps to itself."""
        a = np.asarray(addrs, dtype=np.uint64)
        i = np.searchsorted(self.old_start, a, side="right").astype(np.int64) - 1
        ic = np.maximum(i, 0)
        inside = (i >= 0) & (a <= self.old_end[ic])
        # an address equal to a function's end that is also the next function's start
        # was caught by searchsorted as that next function: correct.
        delta = self.new_start[ic].astype(np.int64) - self.old_start[ic].astype(np.int64)
        return np.where(inside, (a.astype(np.int64) + delta).astype(np.uint64), a)


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


def _field_value(raw_bytes, off, size, signed):
    return int.from_bytes(bytes(raw_bytes[off:off + size]), "little", signed=signed)


def verify_against(report, new_path, old_path, layout_map=None, log=None):
    """Add equivalence findings to ``report`` (a VerifyReport of NEW)."""
    log = log or (lambda m: None)
    findings = report.findings
    counter = {}
    old = ElfImage(old_path)
    new = ElfImage(new_path)
    octx, nctx = ImageContext(old, log=log), ImageContext(new, log=log)
    of, nf = octx.functions, nctx.functions
    oi, ni, missing = match_functions(octx, nctx)
    _add(findings, "error", "equiv.function-missing", missing,
         lambda i: (int(of.start[i]), f"function {of.name[i]} of the original is missing"), counter)
    size_diff = np.nonzero(of.size[oi] != nf.size[ni])[0]
    _add(findings, "error", "equiv.function-size", size_diff.tolist(),
         lambda k: (int(nf.start[ni[k]]), f"{of.name[oi[k]]} changed size "
                    f"{int(of.size[oi[k]])} -> {int(nf.size[ni[k]])}"), counter)
    amap = _Map(of.start[oi], of.end[oi], nf.start[ni])
    moved = int((of.start[oi] != nf.start[ni]).sum())
    log(f"{len(oi)} functions matched, {moved} moved")

    # 1. instruction boundaries and lengths
    od, nd = octx.disasm, nctx.disasm
    same_size = np.ones(len(of), dtype=bool)
    same_size[oi[size_diff]] = False
    matched_func = np.zeros(len(of), dtype=bool)
    matched_func[oi] = True
    use = matched_func[od.func] & same_size[od.func]
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
    report.extra["equivalence_instructions"] = int(found.sum())

    # 2. differing bytes must be translated address fields
    o_idx_all = np.nonzero(use)[0][found]          # old disasm index
    n_idx_all = nic[found]
    o_raw, n_raw = od.raw[o_idx_all], nd.raw[n_idx_all]
    sizes = od.size[o_idx_all].astype(np.int64)
    col = np.arange(16)[None, :]
    differs = ((o_raw != n_raw) & (col < sizes[:, None])).any(axis=1)
    k_diff = np.nonzero(differs)[0]
    # branches: compare decoded targets
    ob_i, ob_t, _ = od.branch_targets()
    nb_i, nb_t, _ = nd.branch_targets()
    o_bt = dict(zip(ob_i.tolist(), ob_t.tolist()))
    n_bt = dict(zip(nb_i.tolist(), nb_t.tolist()))
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True
    unexplained, wrong_target = [], []
    branch_fixed = field_fixed = 0
    for k in k_diff.tolist():
        oj, nj = int(o_idx_all[k]), int(n_idx_all[k])
        oa, na = int(od.addr[oj]), int(nd.addr[nj])
        if oj in o_bt:
            t_old = o_bt[oj]
            t_new = n_bt.get(nj)
            if t_new is None or int(amap.map(np.array([t_old], np.uint64))[0]) != t_new:
                wrong_target.append((oa, na, t_old, t_new))
            else:
                branch_fixed += 1
            continue
        size = int(sizes[k])
        ob = bytes(o_raw[k][:size])
        nb = bytes(n_raw[k][:size])
        try:
            ins = next(cs.disasm(ob, oa, 1))
        except StopIteration:
            unexplained.append((oa, "undecodable"))
            continue
        diff_pos = {p for p in range(size) if ob[p] != nb[p]}
        ok = True
        covered = set()
        end_o, end_n = oa + size, na + size
        rip_mem = any(op.type == capstone.x86.X86_OP_MEM and op.mem.base == capstone.x86.X86_REG_RIP
                      for op in ins.operands)
        if ins.disp_size and diff_pos & set(range(ins.disp_offset, ins.disp_offset + ins.disp_size)):
            off, sz = ins.disp_offset, ins.disp_size
            dv_o, dv_n = _field_value(ob, off, sz, True), _field_value(nb, off, sz, True)
            if rip_mem:
                t_o, t_n = end_o + dv_o, end_n + dv_n
            else:
                t_o, t_n = dv_o & (2**64 - 1), dv_n & (2**64 - 1)
            ok &= int(amap.map(np.array([t_o & (2**64 - 1)], np.uint64))[0]) == (t_n & (2**64 - 1))
            covered |= set(range(off, off + sz))
        if ins.imm_size and diff_pos & set(range(ins.imm_offset, ins.imm_offset + ins.imm_size)):
            off, sz = ins.imm_offset, ins.imm_size
            signed = sz < 8
            t_o = _field_value(ob, off, sz, signed) & (2**64 - 1)
            t_n = _field_value(nb, off, sz, signed) & (2**64 - 1)
            ok &= int(amap.map(np.array([t_o], np.uint64))[0]) == t_n
            covered |= set(range(off, off + sz))
        if diff_pos - covered or not ok:
            unexplained.append((oa, f"{ins.mnemonic} {ins.op_str}"))
        else:
            field_fixed += 1
    _add(findings, "error", "equiv.branch-target", wrong_target,
         lambda w: (w[1], f"branch at {octx.symbol_at(w[0])} went to {octx.symbol_at(w[2])}, "
                    f"now goes to {w[3]:#x}" if w[3] is not None else
                    f"branch at {octx.symbol_at(w[0])} is no longer a branch"), counter)
    _add(findings, "error", "equiv.instruction-bytes", unexplained,
         lambda u: (u[0], f"{octx.symbol_at(u[0])}: '{u[1]}' changed in a way that is not a "
                    "translated address"), counter)
    report.extra["equivalence_translated_branches"] = branch_fixed
    report.extra["equivalence_translated_fields"] = field_fixed

    # 3. data: relocated pointers translate; nothing stale
    _check_data_relocs(old, new, amap, octx, findings, counter)

    # 4. tables and symbols
    _check_tables(octx, nctx, amap, findings, counter)
    _check_symbols(old, new, octx, amap, findings, counter)
    report.extra["equivalence_moved_functions"] = moved
    report.extra["against"] = old_path
    log("equivalence: " + (", ".join(f"{k} {v}" for k, v in counter.items()) or "no problems"))
    return report


def _code_ranges(image):
    return [(s.addr, s.end) for s in image.sections if s.is_code and s.is_alloc and s.size]


def _check_data_relocs(old, new, amap, octx, findings, counter):
    """Every absolute pointer field (R_X86_64_64) in NEW's data sections holds the
    translated value of the same field in OLD."""
    stale = []
    checked = 0
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
        bad = np.nonzero(want != v_new)[0]
        checked += len(offs)
        for b in bad.tolist():
            stale.append((int(offs[b]), int(v_old[b]), int(v_new[b]), int(want[b]), tgt.name))
    _add(findings, "error", "equiv.data-pointer", stale,
         lambda s: (s[0], f"pointer at {s[0]:#x} in {s[4]} holds {s[2]:#x}; the original pointed "
                    f"at {octx.symbol_at(s[1])}, now at {s[3]:#x}"), counter)


def _check_tables(octx, nctx, amap, findings, counter):
    address_columns = {"code", "target", "addr", "ip", "insn", "fixup", "instr", "value"}
    for cls in TABLES:
        t_old, t_new = cls(), cls()
        if t_old.locate(octx) is None:
            continue
        if t_new.locate(nctx) is None:
            _add(findings, "error", "equiv.table-missing", [cls.name],
                 lambda n: (None, f"{n} is missing from the new image"), counter)
            continue
        eo, en = t_old.parse(octx), t_new.parse(nctx)
        if len(eo) != len(en):
            _add(findings, "error", "equiv.table-count", [(cls.name, len(eo), len(en))],
                 lambda c: (None, f"{c[0]}: {c[1]} entries before, {c[2]} after"), counter)
            continue
        for colname in eo.dtype.names:
            if colname not in address_columns:
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
            o_pairs = sorted(zip(t_old.names, amap.map(eo["addr"]).tolist()))
            n_pairs = sorted(zip(t_new.names, en["addr"].tolist()))
            if o_pairs != n_pairs:
                diff = [p for p, q in zip(o_pairs, n_pairs) if p != q]
                _add(findings, "error", "equiv.kallsyms", diff,
                     lambda p: (p[1], f"kallsyms {p[0]} should be at {p[1]:#x}"), counter)


def _check_symbols(old, new, octx, amap, findings, counter):
    so, sn = old.symtab, new.symtab
    if len(so) != len(sn):
        _add(findings, "error", "equiv.symtab", [(len(so), len(sn))],
             lambda c: (None, f"symbol table has {c[1]} entries, the original {c[0]}"), counter)
        return
    code_secs = np.array([s.index for s in old.sections if s.is_code and s.is_alloc], dtype=np.int64)
    sel = np.isin(so["shndx"].astype(np.int64), code_secs) & ((so["info"] & 0xF) != STT_SECTION)
    idx = np.nonzero(sel)[0]
    want = amap.map(so["value"][idx])
    got = sn["value"][idx]
    bad = idx[want != got]
    names, _ = old.symbol_table()
    _add(findings, "error", "equiv.symbol", bad.tolist(),
         lambda i: (int(sn["value"][i]), f"symbol {names[i]} is at {int(sn['value'][i]):#x}, "
                    f"expected {int(amap.map(np.array([so['value'][i]], np.uint64))[0]):#x}"), counter)
