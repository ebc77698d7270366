"""verify --against, steps 1 and 2: every instruction of OLD sits at its mapped
address in NEW with the same length, and every byte that differs belongs to an
address field (branch/call displacement, RIP-relative displacement, absolute
immediate) whose target, translated through the map, is what NEW encodes."""

import numpy as np

import capstone

from .. import timings
from ..image.disasm import (ANY_PREFIX, Disassembly, has_operand_size_prefix, other_branch_targets,
                            skip_prefixes, unchecked_branch_targets)
from .findings import add_findings as _add

# rows per slice when OLD's and NEW's instruction bytes are compared
_COMPARE_ROWS = 1 << 15
# OLD's instructions per slice of compare_instructions
_COMPARE_INSNS = 1 << 20


def check_code(ctx, out):
    """Steps 1 and 2 (compare_instructions) on the instructions of OLD outside
    split functions."""
    prepare_code(ctx)
    timings.phase("against: instructions")
    _check_code(ctx, out)


def prepare_code(ctx):
    """What check_code needs from the parent before it runs (in a forked child,
    code_results): OLD's decode taken over (ctx.use_old_decode), and so decoded."""
    ctx.use_old_decode()
    timings.phase("against: decode OLD")
    ctx.octx.disasm


def code_results(ctx):
    """check_code's Sink, computed on its own (forked: beside the other checks, after
    prepare_code in the parent)."""
    from .findings import Sink
    out = Sink()
    _check_code(ctx, out)
    return out


def add_code_results(ctx, out, result):
    out.findings.extend(result.findings)
    out.counter.update(result.counter)
    out.extra.update(result.extra)


def _check_code(ctx, out):
    octx, of, oi = ctx.octx, ctx.of, ctx.oi
    od = octx.disasm
    same_size = np.ones(len(of), dtype=bool)
    same_size[oi[ctx.size_diff]] = False
    matched_func = np.zeros(len(of), dtype=bool)
    matched_func[oi] = True
    use = compared_instructions(octx, od, matched_func, same_size)
    for lo in range(0, len(use), _COMPARE_ROWS):      # (slices: no int64 copy of every row)
        fidx = od.func[lo:lo + _COMPARE_ROWS]
        # split functions: block-level checks
        use[lo:lo + _COMPARE_ROWS] &= ~((fidx >= 0) & ctx.split[np.maximum(fidx, 0)])
    out.extra.update(compare_instructions(octx, ctx.nctx, ctx.amap, use, ctx.kernel, out.findings,
                                          out.counter, ctx.data_moves))


def compare_instructions(octx, nctx, amap, use, kernel, findings, counter, data_moves=None):
    """Steps 1 and 2 for the instructions of OLD selected by ``use``: each sits
    at its mapped address in NEW with the same length, and every byte that
    differs is a translated address field (or a field relocated against a moved
    data symbol, ``data_moves`` from data.data_moves, that moved with it). Cost
    follows ``use``, so the mutation test runs it on one instruction at a time.

    OLD's instructions are taken a slice at a time (_COMPARE_INSNS): each step
    makes arrays as long as its instructions, which over a whole kernel (5 M
    instructions) were a few hundred MB at once. The findings are gathered over
    the slices and added in the order one pass adds them."""
    missing, wrong_target, unexplained, stale_operand = [], [], [], []
    # branches behind prefixes the decoders do not read: checked on their own (a
    # lookup of the few in ``use``, not a set operation over every selected row)
    odd = octx.disasm.unchecked_branches()
    odd = odd[use[odd]] if len(odd) else odd
    unproven = _unchecked_branches(octx.disasm, nctx.disasm, amap, odd, missing) if len(odd) else []
    if len(odd):
        use = use.copy()
        use[odd] = False
    sel = np.nonzero(use)[0]
    totals = {"equivalence_instructions": 0, "equivalence_translated_branches": 0,
              "equivalence_translated_fields": 0}
    for lo in range(0, len(sel), _COMPARE_INSNS):
        got = _compare_slice(octx, nctx, amap, sel[lo:lo + _COMPARE_INSNS], kernel, data_moves,
                             missing, wrong_target, unexplained, stale_operand)
        for k, v in got.items():
            totals[k] += v
    _add(findings, "error", "equiv.instruction", missing,
         lambda m: (m[1], f"instruction of {octx.symbol_at(m[0])} has no "
                    f"same-length counterpart at {m[1]:#x}"), counter)
    _add(findings, "error", "equiv.branch-target", wrong_target,
         lambda w: (w[1], f"branch at {octx.symbol_at(w[0])} went to {octx.symbol_at(w[2])}, "
                    f"now goes to {w[3]:#x}" if w[3] is not None else
                    f"branch at {octx.symbol_at(w[0])} is no longer a branch"), counter)
    _add(findings, "error", "equiv.operand-target", stale_operand,
         lambda w: (w[1], f"{octx.symbol_at(w[0])}: the {'EIP' if w[4] else 'RIP'}-relative "
                    f"operand designated {octx.symbol_at(w[2])}, now {w[3]:#x} (its bytes did "
                    f"not change, the instruction moved by {w[1] - w[0]:+#x})"), counter)
    _add(findings, "error", "equiv.unchecked-branch", unproven,
         lambda u: (u[1], f"{octx.symbol_at(u[0])}: '{u[2]}' has prefixes no branch decoder of "
                    f"linepack reads ({u[3]}), and {u[4]}"), counter)
    _add(findings, "error", "equiv.instruction-bytes", unexplained,
         lambda u: (u[0], f"{octx.symbol_at(u[0])}: '{u[1]}' changed in a way that is not a "
                    "translated address"), counter)
    return totals


def _compare_slice(octx, nctx, amap, sel, kernel, data_moves, missing, wrong_target, unexplained,
                   stale_operand):
    """compare_instructions on OLD's instructions ``sel`` (ascending indices):
    what fails is appended to the four lists; returns the counts."""
    def moved_by(field_addr, old_value, new_value, size):
        """The field designates a moved data symbol and moved with it."""
        return data_moves is not None and data_moves.explains(field_addr, old_value, new_value,
                                                               size)
    od, nd = octx.disasm, nctx.disasm
    # step 1 and the byte comparison of step 2 in slices of _COMPARE_ROWS: the
    # matched rows (old and new disasm index, int32 while the rows allow) and whether
    # their bytes differ are filled in place; the per-row temporaries of a whole
    # slice at once (addresses, their map, the (rows, 16) byte matrices) were
    # verify's peak on an executable (zstd: 12 MiB over it)
    col = np.arange(16)[None, :]
    index = np.int32 if max(len(od.addr), len(nd.addr)) < 2**31 else np.int64
    o_idx_all = np.empty(len(sel), index)       # old disasm index
    n_idx_all = np.empty(len(sel), index)
    differs = np.empty(len(sel), bool)
    matched = 0
    for lo in range(0, len(sel), _COMPARE_ROWS):
        oi = sel[lo:lo + _COMPARE_ROWS]
        o_addr, o_size = od.addr[oi], od.size[oi]
        n_addr = amap.map(o_addr)
        ni_idx = np.searchsorted(nd.addr, n_addr)
        nic = np.minimum(ni_idx, len(nd.addr) - 1)
        found = (ni_idx < len(nd.addr)) & (nd.addr[nic] == n_addr) & (nd.size[nic] == o_size)
        missing.extend(zip(o_addr[~found].tolist(), n_addr[~found].tolist()))
        oi, nic = oi[found], nic[found]
        sizes = o_size[found].astype(np.int64)
        end = matched + len(oi)
        differs[matched:end] = ((od.raw[oi] != nd.raw[nic]) & (col < sizes[:, None])).any(axis=1)
        o_idx_all[matched:end], n_idx_all[matched:end] = oi, nic
        matched = end

    # 2. differing bytes must be translated address fields
    o_idx_all, n_idx_all, differs = o_idx_all[:matched], n_idx_all[:matched], differs[:matched]
    k_diff = np.nonzero(differs)[0]
    ob_i, ob_t, ob_k = all_branch_targets(od)    # loop, jecxz, xbegin too
    # the same bytes: a PC-relative field then names its old target plus the
    # distance moved, right only where the target moved with it (or both stayed)
    k_same = np.nonzero(~differs)[0]
    kept_pc_relative(od, nd, amap, o_idx_all[k_same], n_idx_all[k_same], ob_i, ob_t, kernel,
                     moved_by, wrong_target, stale_operand)
    # only the changed rows' bytes are looked at again
    o_raw, n_raw = od.raw[o_idx_all[k_diff]], nd.raw[n_idx_all[k_diff]]
    sizes_diff = od.size[o_idx_all[k_diff]].astype(np.int64)
    # branches: compare decoded targets, all at once (most changed instructions are
    # calls and jumps to moved functions)
    jo, jn = o_idx_all[k_diff], n_idx_all[k_diff]
    po = np.minimum(np.searchsorted(ob_i, jo), max(len(ob_i) - 1, 0))
    is_br = (ob_i[po] == jo) if len(ob_i) else np.zeros(len(jo), bool)
    # NEW's targets only for the changed rows (NEW's rows may be patched in place
    # by the mutation test, so nothing is cached for them)
    sub_i, sub_t, _ = Disassembly(nd.addr[jn], nd.size[jn], nd.func[jn], nd.raw[jn], []).branch_targets()
    more_i, more_t, _ = other_branch_targets(nd.raw[jn], nd.addr[jn], nd.size[jn])
    sub_i, sub_t = np.concatenate([sub_i.astype(np.int64), more_i]), \
        np.concatenate([sub_t.astype(np.uint64), more_t])
    new_br = np.zeros(len(jn), bool)
    new_br[sub_i] = True
    t_old = ob_t[po] if len(ob_i) else np.zeros(len(jo), np.uint64)
    t_new = np.zeros(len(jn), np.uint64)
    t_new[sub_i] = sub_t
    # the same branch: every byte before the displacement (opcode, prefixes) equal
    # (a jcc made a jmp, or a loop a jcc, to the translated target is no translation)
    width = ob_k[po].astype(np.int64) if len(ob_i) else np.zeros(len(jo), np.int64)
    head_same = ~((o_raw != n_raw) & (col < (sizes_diff - width)[:, None])).any(axis=1)
    br_ok = is_br & new_br & (amap.map(t_old) == t_new)
    recoded = br_ok & ~head_same
    br_ok &= head_same
    branch_fixed = int(br_ok.sum())
    if recoded.any():
        cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        for k in np.nonzero(recoded)[0].tolist():
            oa, size = int(od.addr[jo[k]]), int(sizes_diff[k])
            ins = next(cs.disasm(bytes(o_raw[k][:size]), oa, 1), None)
            unexplained.append((oa, f"{ins.mnemonic} {ins.op_str}" if ins else "undecodable"))
    is_br_bad = is_br & ~br_ok & ~recoded
    wrong_target.extend((int(od.addr[o]), int(nd.addr[n]), int(t), int(tn) if nb else None)
                    for o, n, t, tn, nb in zip(jo[is_br_bad].tolist(), jn[is_br_bad].tolist(),
                                               t_old[is_br_bad].tolist(),
                                               t_new[is_br_bad].tolist(),
                                               new_br[is_br_bad].tolist()))
    # every other changed instruction: each changed byte must lie in an address
    # field (displacement or immediate) whose value translates; the field layout
    # comes from Capstone, once per distinct instruction header (fields.py)
    from .fields import FieldLayouts, field_values
    rows = k_diff[~is_br]
    r_raw_o, r_raw_n = o_raw[~is_br], n_raw[~is_br]
    r_size = sizes_diff[~is_br]
    r_oa = od.addr[o_idx_all[rows]]
    r_na = nd.addr[n_idx_all[rows]]
    decoded, d_off, d_sz, i_off, i_sz, rip, eip = FieldLayouts().layouts(r_raw_o, r_size, r_oa,
                                                                         eip=True)
    diff = (r_raw_o != r_raw_n) & (col < r_size[:, None])
    in_disp = (col >= d_off[:, None]) & (col < (d_off + d_sz)[:, None])
    in_imm = (col >= i_off[:, None]) & (col < (i_off + i_sz)[:, None])
    # a RIP-relative displacement is checked whenever the instruction moved, changed
    # or not: another field of it (a relocated immediate) may be what changed
    has_disp = (d_sz > 0) & ((diff & in_disp).any(axis=1) | (rip & (r_oa != r_na)))
    has_imm = (i_sz > 0) & (diff & in_imm).any(axis=1)
    covered = (has_disp[:, None] & in_disp) | (has_imm[:, None] & in_imm)
    all_covered = decoded & ~(diff & ~covered).any(axis=1)
    # the fields to translate, in the order the instructions come (disp before imm)
    dv_o, dv_n = field_values(r_raw_o, d_off, d_sz), field_values(r_raw_n, d_off, d_sz)
    end_o = r_oa + r_size.astype(np.uint64)
    end_n = r_na + r_size.astype(np.uint64)
    dv_o = np.where(rip, end_o + dv_o, dv_o)
    dv_n = np.where(rip, end_n + dv_n, dv_n)
    # an EIP-based operand (67 prefix) addresses end + disp truncated to 32 bits, as
    # kept_pc_relative computes it for unchanged bytes
    low32 = np.uint64(0xFFFFFFFF)
    dv_o = np.where(eip, dv_o & low32, dv_o)
    dv_n = np.where(eip, dv_n & low32, dv_n)
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
    if not passed.all():
        cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        for k in np.nonzero(~passed)[0].tolist():
            oa, size = int(r_oa[k]), int(r_size[k])
            ins = next(cs.disasm(bytes(r_raw_o[k][:size]), oa, 1), None)
            unexplained.append((oa, "undecodable" if ins is None or not decoded[k] else
                                f"{ins.mnemonic} {ins.op_str}"))
    return {"equivalence_instructions": int(matched),
            "equivalence_translated_branches": branch_fixed,
            "equivalence_translated_fields": field_fixed}


def _unchecked_branches(od, nd, amap, rows, missing):
    """OLD's direct branches ``rows`` behind prefixes the fast decoders skip
    (image/disasm.py unchecked_branches), one by one: NEW must hold the same
    prefixes and opcode at the mapped address with the translated target. With a
    66 prefix the target depends on the CPU (Intel ignores it, AMD takes 16 bits),
    so such a branch passes only where neither it nor its target moved and its
    bytes are the same. Appends to ``missing``; returns (old address, new address,
    text, bytes, why) for each that fails."""
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    o_addr, o_size = od.addr[rows], od.size[rows]
    n_addr = amap.map(o_addr)
    ni = np.minimum(np.searchsorted(nd.addr, n_addr), len(nd.addr) - 1)
    t_old = unchecked_branch_targets(od.raw, od.addr, od.size, rows)
    t_new = unchecked_branch_targets(nd.raw, nd.addr, nd.size, ni)
    t_want = amap.map(t_old)
    wide = has_operand_size_prefix(od.raw, rows)
    skip, _, _ = skip_prefixes(od.raw[rows], ANY_PREFIX, rounds=14)
    out = []
    for k in range(len(rows)):
        oa, na, size = int(o_addr[k]), int(n_addr[k]), int(o_size[k])
        if int(nd.addr[ni[k]]) != na or int(nd.size[ni[k]]) != size:
            missing.append((oa, na))
            continue
        ob, nb = bytes(od.raw[rows[k], :size]), bytes(nd.raw[ni[k], :size])
        ins = next(cs.disasm(ob, oa, 1), None)
        text = f"{ins.mnemonic} {ins.op_str}" if ins else ob.hex(" ")
        width = 1 if size - int(skip[k]) == 2 else 4
        if wide[k]:
            why = None if (na == oa and ob == nb and int(t_want[k]) == int(t_old[k])) else \
                "with 66 its target differs between Intel and AMD: it or its target moved"
        elif ob[:size - width] != nb[:size - width]:
            why = f"NEW holds {nb.hex(' ')}"
        elif int(t_new[k]) != int(t_want[k]):
            why = f"it now goes to {int(t_new[k]):#x}, not {int(t_want[k]):#x}"
        else:
            why = None
        if why:
            out.append((oa, na, text, ob.hex(" "), why))
    return out


# instructions per slice in kept_pc_relative: its per-instruction temporaries for
# all of zstd's 240,000 at once raised verify's peak by 18 MiB, past llvm-bolt's
_KEPT_SLICE = 1 << 13


def kept_pc_relative(od, nd, amap, oi, ni, ob_i, ob_t, kernel, moved_by, wrong_target,
                     stale_operand):
    """_kept_pc_relative a slice of instructions at a time (the same findings, in
    the same order)."""
    for lo in range(0, len(oi), _KEPT_SLICE):
        _kept_pc_relative(od, nd, amap, oi[lo:lo + _KEPT_SLICE], ni[lo:lo + _KEPT_SLICE],
                          ob_i, ob_t, kernel, moved_by, wrong_target, stale_operand)


def _kept_pc_relative(od, nd, amap, oi, ni, ob_i, ob_t, kernel, moved_by, wrong_target,
                      stale_operand):
    """Instructions of OLD ``oi`` whose bytes NEW holds unchanged at ``ni`` (moved
    or not): a direct branch (``ob_i``/``ob_t``: all_branch_targets, loop/jecxz/
    xbegin included) or a RIP/EIP-relative operand designates its old
    target plus the distance the instruction moved. That must be where the map
    puts the target (a branch inside its own function, moved whole, is; a call to
    a static function of the same section, which has no relocation, is not when
    either moved and the bytes stayed). Appends (old address, new address, old
    target, new target) to ``wrong_target`` (branches), and that with "EIP-based"
    to ``stale_operand``."""
    o_addr, n_addr = od.addr[oi], nd.addr[ni]
    delta = n_addr - o_addr                                  # uint64: wraps like the CPU
    branch = np.zeros(len(oi), bool)
    if len(ob_i):
        po = np.minimum(np.searchsorted(ob_i, oi), len(ob_i) - 1)
        branch = ob_i[po] == oi
        t = ob_t[po[branch]]
        now = t + delta[branch]
        bad = np.nonzero(~amap.translates(t, now, kernel))[0]
        wrong_target.extend(zip(o_addr[branch][bad].tolist(), n_addr[branch][bad].tolist(),
                                t[bad].tolist(), now[bad].tolist()))
    # RIP/EIP-relative operands: a mod=00 rm=101 ModRM byte right before a 4-byte
    # displacement, then 0, 1, 2 or 4 immediate bytes. Each such reading gives the
    # target the operand would have; only rows where one does not translate are
    # decoded (Capstone decides whether the operand is there and where)
    raw, size = od.raw[oi], od.size[oi].astype(np.int64)
    rows_all = np.arange(len(oi))
    suspect = np.zeros(len(oi), bool)
    for imm in (0, 1, 2, 4):
        dpos = size - 4 - imm
        at = np.nonzero((dpos >= 1) & ~branch &
                        ((raw[rows_all, np.clip(dpos - 1, 0, 15)] & 0xC7) == 0x05))[0]
        if not len(at):
            continue
        disp = _s32_at(raw, at, dpos[at])
        end = size[at].astype(np.uint64)
        t, now = o_addr[at] + end + disp, n_addr[at] + end + disp
        suspect[at[~amap.translates(t, now, kernel)]] = True
    rows = np.nonzero(suspect)[0]
    if not len(rows):
        return
    from ..image.operands import ip_relative
    rip, eip, d_off = ip_relative(raw[rows], size[rows])
    has = rip | eip
    rows, eip, d_off = rows[has], eip[has], d_off[has]
    disp = _s32_at(raw, rows, d_off)
    end = size[rows].astype(np.uint64)
    t = o_addr[rows] + end + disp
    now = n_addr[rows] + end + disp
    t = np.where(eip, t & np.uint64(0xFFFFFFFF), t)
    now = np.where(eip, now & np.uint64(0xFFFFFFFF), now)
    for k in np.nonzero(~amap.translates(t, now, kernel))[0].tolist():
        r = rows[k]
        if not moved_by(int(o_addr[r] + d_off[k].astype(np.uint64)), int(t[k]), int(now[k]), 4):
            stale_operand.append((int(o_addr[r]), int(n_addr[r]), int(t[k]), int(now[k]),
                                  bool(eip[k])))


def all_branch_targets(dis):
    """(indices, targets, displacement widths) of every direct PC-relative branch
    of ``dis`` (OLD's: the mutation test never patches it), loop/jecxz/xbegin
    included."""
    cached = getattr(dis, "_verify_branches", None)
    if cached is None:
        idx, tgt, kind = dis.pc_relative_branches()
        cached = dis._verify_branches = (idx.astype(np.int64), tgt.astype(np.uint64),
                                         kind.astype(np.int8))
    return cached


def _s32_at(raw, rows, pos):
    """The sign-extended 32-bit little-endian values at column ``pos`` of ``rows``,
    as uint64 (added to addresses, they wrap like the CPU's arithmetic)."""
    v = np.zeros(len(rows), np.uint64)
    for k in range(4):
        v |= raw[rows, np.clip(pos + k, 0, raw.shape[1] - 1)].astype(np.uint64) << np.uint64(8 * k)
    return np.where(v >= np.uint64(2**31), v | np.uint64(0xFFFFFFFF00000000), v)


def fill_instructions(octx, od):
    """True for int3/nop fill outside functions (the coverage's padding)."""
    from ..image.coverage import R_PADDING
    inside = od.func.astype(np.int64) >= 0
    extra = octx.coverage.extra
    if not len(extra.addr):
        return ~inside
    k = np.minimum(np.searchsorted(extra.addr, od.addr), len(extra.addr) - 1)
    return ~inside & (octx.coverage.reason[k] == R_PADDING)


def compared_instructions(octx, od, matched_func, same_size):
    """Which instructions of OLD are compared: those of matched functions that
    kept their size, and every instruction outside functions (``func`` -1:
    entry code, thunks, asm labels, .altinstr_replacement ...) except int3/nop
    padding (relayout drops and inserts fill), which must sit at its mapped
    address (it moves with the code symbol or function before it, or stays)
    with the same length and translated bytes."""
    from ..image.coverage import R_PADDING
    extra = octx.coverage.extra
    out = np.zeros(len(od.func), bool)
    for lo in range(0, len(out), _COMPARE_ROWS):      # (slices: small per-row temporaries)
        f = od.func[lo:lo + _COMPARE_ROWS]
        inside = f >= 0
        fc = np.where(inside, f, 0)
        k = np.minimum(np.searchsorted(extra.addr, od.addr[lo:lo + _COMPARE_ROWS]),
                       max(len(extra.addr) - 1, 0))
        padding = ~inside & (octx.coverage.reason[k] == R_PADDING) if len(extra.addr) \
            else ~inside
        out[lo:lo + _COMPARE_ROWS] = np.where(inside, matched_func[fc] & same_size[fc], ~padding)
    return out
