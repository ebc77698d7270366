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


def _row_ranges(dis, funcs):
    """Per function of ``funcs``: [lo, hi) of OLD's decoded rows ``dis`` in its
    original range (decoded once for every check, not again here)."""
    lo = np.searchsorted(dis.addr, np.array([f.old_start for f in funcs], np.uint64), "left")
    hi = np.searchsorted(dis.addr, np.array([f.old_end for f in funcs], np.uint64), "left")
    return lo, hi


def ud2_sites(dis, funcs):
    """Addresses of the ud2 instructions in the original ranges of ``funcs``."""
    from ..image.cfg import classify
    from ..image.disasm import Disassembly
    if not funcs or not len(dis):
        return set()
    lo, hi = _row_ranges(dis, funcs)
    depth = np.zeros(len(dis) + 1, np.int64)
    np.add.at(depth, lo, 1)
    np.add.at(depth, hi, -1)
    # the rows inside the functions holding a 0x0b byte (ud2 is 0f 0b), then classified
    rows = np.nonzero(np.cumsum(depth[:-1]) > 0)[0]
    rows = rows[(dis.raw[rows] == 0x0B).any(axis=1)]
    few = Disassembly(dis.addr[rows], dis.size[rows], dis.func[rows], dis.raw[rows], None)
    return set(few.addr[classify(few) == 4].tolist())


def fall_off_findings(image, dis, funcs):
    """A split function of a program whose original code ends in an indirect call
    that may return (its link relocation names no function known not to return:
    image/noreturn.py) ran into the next function's bytes after it; NEW has moved
    them apart (``equiv.fall-off``). relayout splits such a function only on that
    evidence, so this names a wrong noreturn claim. ``dis``: OLD's decoded rows."""
    import capstone
    from ..image.noreturn import call_site_names, indirect_calls, is_program_noreturn
    from .blocks import BlockFinding
    out = []
    if not funcs or not len(dis):
        return out
    lo, hi = _row_ranges(dis, funcs)
    lasts = [(f, int(h) - 1) for f, l, h in zip(funcs, lo.tolist(), hi.tolist()) if h > l]
    if not lasts:
        return out
    icall = indirect_calls(dis, [k for _, k in lasts])
    lasts = [x for x, c in zip(lasts, icall.tolist()) if c]
    if not lasts:
        return out
    addr = [int(dis.addr[k]) for _, k in lasts]
    size = [int(dis.size[k]) for _, k in lasts]
    names = call_site_names(image, addr, size)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for (f, _), a, n, nm in zip(lasts, addr, size, names):
        if nm.split("@", 1)[0] in NORETURN or is_program_noreturn(nm):
            continue
        insn = next(cs.disasm_lite(bytes(image.read(a, n)), a), None)   # the message's text
        if insn is None or insn[2] != "call":
            continue
        out.append(BlockFinding("equiv.fall-off", a, f"{f.name}: ends in '{insn[2]} {insn[3]}' "
                                f"at {a:#x} (to {nm or 'a target no relocation names'}, not "
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
        no_fall |= ud2_sites(octx.disasm, funcs)
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
        found = list(found) + fall_off_findings(old, octx.disasm, funcs)
    return found, stats
