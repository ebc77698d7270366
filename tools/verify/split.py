"""verify --against at block level: the functions a ``.linepack.blockmap`` splits
are checked block by block (tools/verify/blocks.py), in a child process beside
the other checks."""

import numpy as np

from ..image import blockmap as bm
from ..image.noreturn import VERIFY_NORETURN
from ..kernel import TABLES
from ..kernel.alternatives import Alternatives
from ..kernel.bug_table import BugTable
from .blocks import SplitFunction, blocks_in_halves
from .symbols import cold_parts
from .tables import ADDRESS_COLUMNS, orc_lookup

NORETURN = VERIFY_NORETURN        # kernel and program names: tools/image/noreturn.py
BUGFLAG_WARNING = 1


def add_block_findings(ctx, out, result):
    """The block-level findings (block_results' answer) and stats, into ``out``."""
    found, stats = result
    by_check = {}
    for f in found:
        by_check.setdefault(f.check, []).append(f)
    for check, items in sorted(by_check.items()):
        out.add(check, items, lambda f: (f.address, f.message))
    out.extra["equivalence_blocks"] = stats


def split_functions(octx, nctx, rows, split, oi, ni):
    """SplitFunction per function of OLD that ``split`` marks: its original range
    and its parts in NEW (hot: the matched symbol; cold: the ``name.cold`` symbol
    that holds its cold pieces)."""
    of, nf = octx.functions, nctx.functions
    j_of = dict(zip(oi.tolist(), ni.tolist()))
    cold = cold_parts(nctx.image)
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
    return funcs


def ud2_sites(image, funcs):
    """Addresses of the ud2 instructions in the original ranges of ``funcs``."""
    import capstone
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    out = set()
    for f in funcs:
        code = bytes(image.read(f.old_start, f.old_end - f.old_start))
        if b"\x0f\x0b" not in code:
            continue
        out.update(a for a, _, m, _ in cs.disasm_lite(code, f.old_start) if m == "ud2")
    return out


def _immediate(op_str):
    """True for a direct call's operand (Capstone prints its target: "0x401000", "0")."""
    try:
        int(op_str, 0)
    except ValueError:
        return False
    return True


def fall_off_findings(image, funcs):
    """A split function of a program whose original code ends in an indirect call
    that may return (its link relocation names no function known not to return:
    image/noreturn.py) ran into the next function's bytes after it; NEW has moved
    them apart (``equiv.fall-off``). relayout splits such a function only on that
    evidence, so this names a wrong noreturn claim."""
    import capstone
    from ..image.noreturn import call_site_names, is_program_noreturn
    from .blocks import BlockFinding
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    out, lasts = [], []
    for f in funcs:
        last = None
        for a, size, m, ops in cs.disasm_lite(bytes(image.read(f.old_start, f.old_end -
                                                                f.old_start)), f.old_start):
            last = (a, size, m, ops)
        if last is not None and last[2] == "call" and not _immediate(last[3]):
            lasts.append((f, last))
    if not lasts:
        return out
    names = call_site_names(image, [x[1][0] for x in lasts], [x[1][1] for x in lasts])
    for (f, (a, size, m, ops)), nm in zip(lasts, names):
        if nm.split("@", 1)[0] not in NORETURN and not is_program_noreturn(nm):
            out.append(BlockFinding("equiv.fall-off", a, f"{f.name}: ends in '{m} {ops}' at "
                                    f"{a:#x} (to {nm or 'a target no relocation names'}, not "
                                    "known not to return) and is split: its fall-through, the "
                                    f"code at {f.old_end:#x}, no longer follows it"))
    return out


def split_mask(octx, rows):
    """True for each function of OLD that holds a piece of the block map ``rows``."""
    of = octx.functions
    split = np.zeros(len(of), bool)
    f = of.find(rows["old"][rows["old_len"] > 0].astype(np.uint64))
    split[f[f >= 0]] = True
    return split


def block_results(ctx):
    """Block-level equivalence of the split functions (tools/verify/blocks.py):
    (findings, stats), added to the report by add_block_findings."""
    octx, nctx, rows, split, oi, ni, amap = (ctx.octx, ctx.nctx, ctx.rows, ctx.split, ctx.oi,
                                             ctx.ni, ctx.amap)
    old, new = octx.image, nctx.image
    funcs = split_functions(octx, nctx, rows, split, oi, ni)
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
    bt = BugTable()
    if bt.locate(octx) is not None:
        be = bt.parse(octx)
        no_fall = set(be["addr"][(be["flags"] & BUGFLAG_WARNING) == 0].tolist())
    if not octx.is_kernel:
        # a program's ud2 raises SIGILL: nothing resumes after it (a kernel's WARN
        # ud2 does, its bug table says which); relayout's CFG ends a block there
        no_fall |= ud2_sites(old, funcs)
    noreturn = set()
    for nm in NORETURN:
        noreturn |= octx.symbol_addresses().get(nm, set())
    patch_sites = {}
    alt = Alternatives()
    if alt.locate(octx) is not None:
        ae = alt.parse(octx)
        ends = (ae["instr"] + ae["instrlen"].astype(np.uint64)).tolist()
        for e, a in zip(ends, ae["instr"].tolist()):
            patch_sites[e] = min(a, patch_sites.get(e, a))
    orc_old, orc_new = orc_lookup(octx), orc_lookup(nctx)
    found, stats = blocks_in_halves(rows, funcs, old.read, new.read, amap.base.map, orc_old,
                                    orc_new, tables=tables, no_fallthrough=frozenset(no_fall),
                                    noreturn=frozenset(noreturn), data_moves=ctx.data_moves,
                                    patch_sites=patch_sites)
    if not octx.is_kernel:
        found = list(found) + fall_off_findings(old, funcs)
    return found, stats
