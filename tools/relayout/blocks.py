"""Hot/cold splitting of functions at basic-block level (the ``blocks`` strategy).

Per split function: its hot blocks (run >= ``min_count`` times per workload
iteration; the entry block always) form the hot part, which stays at the
function's symbol, in their original relative order or (``block_order =
"ext-tsp"``, relayout/block_order.py) in the order that maximizes the ext-TSP
objective, the entry first; the other blocks form the cold part ``name.cold``
in their original order. Parts are made of pieces:

- copied bytes (a block's instructions, bar a re-encoded last branch);
- re-encoded branches: a direct jmp/jcc or static-key site whose target is a
  block of the same function gets the shortest form that reaches the target;
  a jmp to the block placed right after it disappears;
- inserted jmps where the split broke a fall-through.

Branch sizes inside a part are relaxed to a fixpoint (start short, grow what
does not reach, repeat: sizes only grow, so it ends); a branch to the other
part is long (the parts' distance is unknown until placement). Static-key
sites keep their semantics (a nop stays a nop, a jmp a jmp); 2-byte sites only
on kernels >= 5.14 (arch/x86/kernel/jump_label.c accepts nop2/jmp8 there).

The hot part replaces the function's unit in the normal (pack) placement; the
cold part is a new cold unit right after it in unit order, so the strategy
puts it in the region's cold area after the hot text.

A function with a prefix (``__pfx_<fn>``, 6.2+ kernels: the 16 NOP bytes where
call-depth tracking writes the function's accounting thunk at boot) is one unit
of prefix + function (relayout/units.py). It splits like a lone function: the
prefix is the hot part's first block (``SplitFunction.head`` bytes) and the
entry block follows it, so the padding still ends at the entry; the cold part
gets none (it is only reached by jumps from its hot part: no call lands there,
so no thunk is patched before it, and no ENDBR is needed at its start).
With ``prefix_keep`` (the call-depth template's size, kernel/prefixes.py) the hot
part keeps only that many bytes of the padding, right before the entry: the
dropped front is a PAD_DROPPED piece (no new bytes; it maps to where the kept
padding starts), and the prefix symbol shrinks to what was kept.
"""

import numpy as np

from ..image import blockmap as bm
from ..image.disasm import skip_prefixes
from ..image.cfg import (R_CALL_INSIDE, R_GLUED, R_TRAILING_CODE, R_INDIRECT, R_NO_COLD, R_NOINSTR, R_NOT_HOT, R_PINNED, REASONS, TERM_JCC,
                         TERM_JMP, TERM_KEY)
from .units import PADDING_BYTES, PREFIX, UnitTable, _func_map

NOP2 = bytes.fromhex("6690")
NOP5 = bytes.fromhex("0f1f440000")
# piece kinds inside a part (the block map's kinds)
COPY, BRANCH, INSERTED, REMOVED, PAD_DROPPED = bm.KIND_COPIED, bm.KIND_BRANCH, \
    bm.KIND_JMP_INSERTED, bm.KIND_JMP_REMOVED, bm.KIND_PAD_DROPPED
# branch forms: (short size, long size)
FORM_JMP, FORM_JCC, FORM_KEY_NOP, FORM_KEY_JMP = 0, 1, 2, 3
SIZES = {FORM_JMP: (2, 5), FORM_JCC: (2, 6), FORM_KEY_NOP: (2, 5), FORM_KEY_JMP: (2, 5)}


class Piece:
    __slots__ = ("old", "old_len", "kind", "form", "cc", "target_block", "long", "size", "off",
                 "block", "inverted")

    def __init__(self, old, old_len, kind, block, form=None, cc=0, target_block=-1):
        self.old, self.old_len, self.kind, self.block = old, old_len, kind, block
        self.form, self.cc, self.target_block = form, cc, target_block
        self.long = False
        self.size = old_len if kind == COPY else 0
        self.off = 0
        self.inverted = False


class SplitFunction:
    """One split function: unit index, function index, parts (lists of Pieces)."""

    def __init__(self, unit, func, name, hot_blocks, cold_blocks, sym=0):
        self.unit, self.func, self.name, self.sym = unit, func, name, sym
        self.parts = [[], []]
        self.blocks = (hot_blocks, cold_blocks)
        self.sizes = [0, 0]
        self.new_start = [0, 0]
        self.block_part = {}
        self.order_score = None       # ext-TSP objective (original, chosen order), if ordered
        self.head = 0                 # bytes of the hot part before the function's entry (prefix)
        self.prefix_sym = -1          # symbol index of its __pfx_ symbol (a trimmed prefix)
        self.whole = False            # reordered in one part, nothing cold (order_whole)

    @property
    def prefix_trimmed(self):
        """The hot part starts with the dropped front of the prefix (trim_prefix)."""
        return bool(self.parts and self.parts[0]) and self.parts[0][0].kind == PAD_DROPPED

    @property
    def hot_size(self):
        """Bytes of the function's own hot part (its symbol's new size)."""
        return self.sizes[0] - self.head


def _cond(raw, skip):
    """Condition code of a jcc (low nibble), from its bytes."""
    op = raw[skip]
    return int(raw[skip + 1] & 0xF) if op == 0x0F else int(op & 0xF)


def build_parts(cfg, f_unit, unit_index, name, hot_mask, short_keys, sym=0, falls=None,
                invert_jcc=False, hot_order=None, hot_only=False):
    """Pieces of both parts of one function (blocks [a, z) of ``cfg``).

    ``invert_jcc``: a jcc whose taken target comes next in its part and whose
    fall-through went elsewhere branches on the opposite condition instead of
    getting an appended jmp. ``hot_order``: the hot blocks in the order to
    place them (the entry first; default: original order). ``hot_only``: the hot
    part's pieces and size only (the cold part left empty: a size to compare)."""
    a, z = cfg.blocks_of(f_unit)
    in_f = np.asarray(hot_mask[a:z])
    hot = (np.nonzero(in_f)[0] + a).tolist() if hot_order is None else list(hot_order)
    cold = (np.nonzero(in_f == 0)[0] + a).tolist()
    sf = SplitFunction(unit_index, f_unit, name, hot, cold, sym)
    dis = cfg.dis
    falls = cfg.falls_through() if falls is None else falls
    for part, order in ((0, hot), (1, cold)):
        for b in order:
            sf.block_part[b] = part
    # the blocks' columns as lists over [lo, hi) (every block named here): the loop
    # reads them per block, where one-element numpy reads cost more than the work
    lo, hi = min([a] + hot), max([z] + [b + 1 for b in hot])
    li_of = cfg.insn_last[lo:hi]
    start_of, end_of = cfg.start[lo:hi].tolist(), cfg.end[lo:hi].tolist()
    term_of, tb_of = cfg.term[lo:hi].tolist(), cfg.target_block[lo:hi].tolist()
    atomic_of, intra_of = cfg.insn_atomic[li_of].tolist(), cfg.insn_intra[li_of].tolist()
    last_addr_of, falls_of, li_of = dis.addr[li_of].tolist(), \
        np.asarray(falls[lo:hi]).tolist(), li_of.tolist()
    for part, order in ((0, hot),) if hot_only else ((0, hot), (1, cold)):
        pieces = sf.parts[part]
        for k, b in enumerate(order):
            nxt = order[k + 1] if k + 1 < len(order) else -1
            j = b - lo
            start, end = start_of[j], end_of[j]
            li = li_of[j]
            t = term_of[j]
            tb = tb_of[j]
            reencode = tb >= 0 and t in (TERM_JMP, TERM_JCC, TERM_KEY) and \
                not atomic_of[j] and (t == TERM_KEY or intra_of[j])
            body_end = last_addr_of[j] if reencode else end
            if body_end > start:
                pieces.append(Piece(start, body_end - start, COPY, b))
            if reencode:
                blen = int(dis.size[li])
                raw = dis.raw[li]
                skip = 0
                while raw[skip] in (0x2E, 0x3E, 0xF2):
                    skip += 1
                if t == TERM_KEY:
                    is_nop = bytes(raw[:2]) == NOP2 or bytes(raw[:5]) == NOP5
                    form = FORM_KEY_NOP if is_nop else FORM_KEY_JMP
                    p = Piece(body_end, blen, BRANCH, b, form, 0, tb)
                    p.long = not short_keys
                elif t == TERM_JMP:
                    # (a jmp with int3 padding after it stays: the padding would
                    # sit between the block and its target)
                    if tb == nxt and body_end + blen == end:
                        p = Piece(body_end, blen, REMOVED, b, target_block=tb)
                    else:
                        p = Piece(body_end, blen, BRANCH, b, FORM_JMP, 0, tb)
                else:
                    if raw[skip] == 0xE3:          # jrcxz has no long form
                        return None
                    p = Piece(body_end, blen, BRANCH, b, FORM_JCC, _cond(raw, skip), tb)
                    if invert_jcc and tb == nxt and falls_of[j] and b + 1 < z and b + 1 != nxt and \
                            body_end + blen == end and \
                            (0x70 <= raw[skip] <= 0x7F or raw[skip] == 0x0F):
                        # jcc inversion: the taken target follows in this part and the
                        # fall-through went elsewhere: branch on the opposite condition
                        # to the old fall-through and fall into the old target (no jmp)
                        p = Piece(body_end, blen, BRANCH, b, FORM_JCC, _cond(raw, skip) ^ 1,
                                  b + 1)
                        p.inverted = True
                if p.kind == BRANCH and sf.block_part[p.target_block] != part:
                    p.long = True
                pieces.append(p)
                if body_end + blen < end:          # int3 padding after the branch stays
                    pieces.append(Piece(body_end + blen, end - body_end - blen, COPY, b))
            if falls_of[j] and b + 1 < z and (b + 1) != nxt and not (pieces and pieces[-1].inverted):
                p = Piece(start_of[j + 1], 0, INSERTED, b, FORM_JMP, 0, b + 1)
                p.long = sf.block_part[b + 1] != part
                pieces.append(p)
    if hot_only:
        _relax_parts(sf, (0,))
    else:
        _relax(sf)
    return sf


def _relax(sf):
    """Branch sizes inside each part to a fixpoint; offsets of every piece."""
    _relax_parts(sf, (0, 1))


def _relax_parts(sf, parts):
    """_relax for the parts listed only."""
    block_part = sf.block_part
    for part in parts:
        pieces = sf.parts[part]
        # the branches (re-encoded or appended), the only pieces whose size changes
        branches = [p for p in pieces if p.kind == BRANCH or p.kind == INSERTED]
        changed = True
        while changed:
            changed = False
            for p in branches:
                p.size = SIZES[p.form][1 if p.long else 0]
            off = 0
            first = {}
            for p in pieces:
                if p.kind == REMOVED:
                    p.size = 0
                p.off = off
                if p.block not in first:
                    first[p.block] = off
                off += p.size
            sf.sizes[part] = off
            for p in branches:
                if not p.long:
                    if block_part[p.target_block] != part:
                        p.long = changed = True
                        continue
                    d = first[p.target_block] - (p.off + p.size)
                    if not -128 <= d <= 127:
                        p.long = changed = True
        sf.first = getattr(sf, "first", [None, None])
        sf.first[part] = first


class PartColumns:
    """The blocks of some functions of a CFG as parts.c reads them, computed for all
    of them at once (HotPartSizer takes a function's out): per block the bytes copied
    before its terminator (``copy_len``), the padding after a re-encoded branch
    (``trail``), its target block (``target``; ``reenc``: the branch is re-encoded),
    the branch kind (``kind``: 0 none, 1 static key, 2 jmp, 3 jcc) and ``flags`` (1:
    the branch ends the block, 2: a jrcxz, 4: a jcc with a long form, 8: the block
    falls through). ``ranges``: the functions' blocks, [(a, z)] (CFG.blocks_of)."""

    def __init__(self, cfg, falls, ranges):
        ranges = [(int(a), int(z)) for a, z in ranges]
        self.first, n = {}, 0           # a function's first block -> its row here
        for a, z in ranges:
            self.first[a] = n
            n += z - a
        b = np.concatenate([np.arange(a, z) for a, z in ranges] + [np.zeros(0, np.int64)])
        dis = cfg.dis
        end = cfg.end[b].astype(np.int64)
        li = cfg.insn_last[b]
        t = cfg.term[b]
        self.target = tb = cfg.target_block[b].astype(np.int64)
        self.reenc = reenc = (tb >= 0) & np.isin(t, (TERM_JMP, TERM_JCC, TERM_KEY)) & \
            ~cfg.insn_atomic[li] & ((t == TERM_KEY) | cfg.insn_intra[li])
        blen = dis.size[li].astype(np.int64)
        body_end = np.where(reenc, dis.addr[li].astype(np.int64), end)
        kind = np.zeros(len(b), np.uint8)
        kind[reenc & (t == TERM_KEY)] = 1
        kind[reenc & (t == TERM_JMP)] = 2
        kind[reenc & (t == TERM_JCC)] = 3
        flags = np.where(reenc & (body_end + blen == end), 1, 0).astype(np.uint8)
        jcc = np.nonzero(kind == 3)[0]
        if len(jcc):
            # the opcode after the jcc's prefixes (2E 3E F2), as build_parts reads it
            raw = dis.raw[li[jcc]]
            pre = np.logical_and.accumulate((raw == 0x2E) | (raw == 0x3E) | (raw == 0xF2), axis=1)
            op = raw[np.arange(len(jcc)), np.minimum(pre.sum(axis=1), raw.shape[1] - 1)]
            flags[jcc] |= np.where(op == 0xE3, 2, 0).astype(np.uint8)
            flags[jcc] |= np.where(((op >= 0x70) & (op <= 0x7F)) | (op == 0x0F), 4, 0) \
                .astype(np.uint8)
        flags |= np.where(np.asarray(falls, bool)[b], 8, 0).astype(np.uint8)
        self.kind, self.flags = kind, flags
        self.trail = np.where(reenc, end - body_end - blen, 0)
        self.copy_len = body_end - cfg.start[b].astype(np.int64)


class HotPartSizer:
    """``size(mask, order)``: ``build(mask, order, True).sizes[0]`` (None where that
    build is None) for one function's blocks, computed in C (parts.c: the same pieces
    and fixpoint without a Piece per piece) when the native core is there, else by
    ``build`` itself. ``build``: build_parts for this function (keep_small_cold's).
    ``columns``: PartColumns holding this function's blocks (choose_splits makes them
    once for every function it may split; default: the function's own)."""

    def __init__(self, cfg, f_unit, short_keys, falls, invert_jcc, build, native=True,
                 columns=None):
        self.build = build
        self.args = (cfg, f_unit, short_keys, falls, invert_jcc, columns) if native else None
        self.lib = None

    def _prepare(self, cfg, f_unit, short_keys, falls, invert_jcc, columns):
        """The function's blocks as parts.c reads them (at the first size asked)."""
        from .block_order import _native_lib
        lib = _native_lib()
        if lib is None:
            return
        a, z = cfg.blocks_of(f_unit)
        nb = z - a
        if columns is None or a not in columns.first:
            columns = PartColumns(cfg, falls, [(a, z)])
        lo = columns.first[a]
        hi = lo + nb
        reenc, tb = columns.reenc[lo:hi], columns.target[lo:hi]
        if reenc.any() and not ((tb[reenc] >= a) & (tb[reenc] < z)).all():
            return                          # a target outside the function: build decides
        self.a, self.nb, self.lib = a, nb, lib
        self.copy_len = np.ascontiguousarray(columns.copy_len[lo:hi], np.int64)
        self.trail = np.ascontiguousarray(columns.trail[lo:hi], np.int64)
        self.tb = np.ascontiguousarray(np.where(reenc, tb - a, -1), np.int32)
        self.kind = np.ascontiguousarray(columns.kind[lo:hi])
        self.flags = np.ascontiguousarray(columns.flags[lo:hi])
        # their addresses, taken once (a size is asked for many tries)
        self.columns = tuple(x.ctypes.data for x in (self.copy_len, self.trail, self.tb,
                                                      self.kind, self.flags))
        self.short_keys, self.invert_jcc = int(bool(short_keys)), int(bool(invert_jcc))

    def size(self, mask, order):
        if self.args is not None:
            args, self.args = self.args, None
            self._prepare(*args)
        if self.lib is None:
            got = self.build(mask, order, True)
            return None if got is None else got.sizes[0]
        a, nb = self.a, self.nb
        part = np.full(nb, 2, np.int8)
        o = np.asarray(order, np.int64) - a
        if len(o) and (int(o.min()) < 0 or int(o.max()) >= nb):
            got = self.build(mask, order, True)
            return None if got is None else got.sizes[0]
        part[o] = 0
        part[~np.asarray(mask[a:a + nb], bool)] = 1
        o32 = np.ascontiguousarray(o, np.int32)
        got = self.lib.lp_hot_part_size(nb, o32.ctypes.data, len(o32), part.ctypes.data,
                                        *self.columns, self.short_keys, self.invert_jcc)
        if got >= 0:
            return int(got)
        if got == -1:
            return None
        got = self.build(mask, order, True)     # what build_parts says (or raises) there
        return None if got is None else got.sizes[0]


# what a branch into the other part costs over its short form (long minus short size)
_GROWTH = {FORM_JMP: 3, FORM_JCC: 4, FORM_KEY_NOP: 3, FORM_KEY_JMP: 3}


def keep_small_cold(cfg, f_unit, sf, hot_mask, falls, max_size, build, fixed=1,
                    hot_size=None):
    """``sf`` with some small cold blocks kept in the hot part: a cold block of at most
    ``max_size`` bytes that a hot block branches or falls into goes into the hot part
    when that makes the hot part smaller (a jcc to the cold part is 6 bytes where a
    jcc to a block close by is 2: a 2-4 byte cold block such as a lone ``jmp`` or
    ``xor eax, eax; jmp`` costs fewer hot bytes inline than the longer branch does).
    Each candidate is tried at the end of the hot order, right after a hot block
    that reaches it and right before the hot block it continues into; the hot part's
    exact size (build_parts, branches relaxed) decides. The cold part keeps at least
    one block, and the first ``fixed`` blocks of the hot order stay first (the entry,
    after its prefix block when it has one: the symbol and its ENDBR stay there).
    ``hot_mask`` (per CFG block) is updated for the blocks kept; ``build(mask, order,
    hot_only)`` builds the function's parts for a mask and a hot order (its hot part
    only when ``hot_only``); ``hot_size(mask, order)``: the hot part's size such a
    build has (HotPartSizer; default: from ``build``)."""
    a, z = cfg.blocks_of(f_unit)
    hot = list(sf.blocks[0])
    cold = set(sf.blocks[1])
    if len(cold) < 2:
        return sf
    sizes = (cfg.end[a:z] - cfg.start[a:z]).tolist()     # this function's blocks only

    def size(b):
        return sizes[b - a]
    # hot blocks reaching each small cold block: by a re-encodable branch or by falling
    preds = {}
    for part_pieces in sf.parts[:1]:
        for p in part_pieces:
            if p.kind in (BRANCH, INSERTED) and p.target_block in cold and p.long and \
                    size(p.target_block) <= max_size:
                preds.setdefault(p.target_block, []).append((p.block, _GROWTH[p.form]))
    best = sf
    for c in sorted(preds):
        if c not in cold or len(cold) < 2:
            continue
        # about the most it can save: every long branch into it made short (an
        # appended jmp that disappears, or branches the shorter part brings into rel8
        # reach, save a little more); it costs at least its bytes bar a jmp that may
        # disappear (5 bytes at most)
        if size(c) - 5 >= sum(g for _, g in preds[c]):
            continue
        # c and the cold blocks it continues into (falling or by a jmp) while they fit:
        # a 4-byte ``mov`` falling into a cold ``jmp`` to the return thunk moves as one
        run, total = [c], size(c)
        while True:
            b, t = run[-1], int(cfg.term[run[-1]])
            nxt = b + 1 if falls[b] and b + 1 < z else \
                int(cfg.target_block[b]) if t == TERM_JMP else -1
            if nxt < 0 or nxt not in cold or nxt in run or total + size(nxt) > max_size:
                break
            run.append(nxt)
            total += size(nxt)
        chosen_size, chosen_order = best.sizes[0], None
        for n in range(1, len(run) + 1):
            if len(cold) - n < 1:
                break
            seq = run[:n]
            last, t = seq[-1], int(cfg.term[seq[-1]])
            succ = [x for x in (last + 1 if falls[last] and last + 1 < z else -1,
                                int(cfg.target_block[last]) if t == TERM_JMP else -1)
                    if x >= 0 and x not in cold]
            spots = {len(hot)} | {hot.index(b) + 1 for b, _ in preds[c] if b in hot} | \
                {hot.index(x) for x in succ if x in hot}
            spots = {k for k in spots if k >= fixed}
            hot_mask[seq] = True
            for k in sorted(spots):
                order = hot[:k] + seq + hot[k:]
                if hot_size is None:
                    got = build(hot_mask, order, True)
                    got = None if got is None else got.sizes[0]
                else:
                    got = hot_size(hot_mask, order)
                if got is not None and got < chosen_size:
                    chosen_size, chosen_order, chosen_seq = got, order, seq
            hot_mask[seq] = False
        if chosen_order is None:
            continue
        hot_mask[chosen_seq] = True
        full = build(hot_mask, chosen_order, False)
        if full is None:
            hot_mask[chosen_seq] = False
            continue
        best, hot = full, chosen_order
        cold.difference_update(chosen_seq)
    if best is not sf:
        best.order_score = sf.order_score
    return best


def prefix_heads(units, functions):
    """Per unit: the length of its function's prefix when the unit is exactly a
    prefix (``__pfx_<fn>``, at the unit's start) and the function right after it, or
    the function's padding without a prefix symbol (an assembly function: units.py);
    0 for every other unit."""
    head = np.zeros(len(units), np.int64)
    fstart, fend = functions.start, functions.end
    for u, mem in enumerate(units.members):
        if len(mem) == 1 and mem[0][1] == PADDING_BYTES and \
                units.name[u] == functions.name[mem[0][0]]:
            head[u] = PADDING_BYTES      # an assembly function's padding, no prefix symbol
            continue
        if len(mem) != 2 or mem[0][1] != 0:
            continue
        (p, _), (f, off) = mem
        if functions.name[p].startswith(PREFIX) and int(fend[p]) == int(fstart[f]) and \
                int(fstart[p]) == int(units.start[u]) and off == int(fend[p] - fstart[p]):
            head[u] = off
    return head


def trim_prefix(sf, keep):
    """Keep only the last ``keep`` bytes of split function ``sf``'s prefix padding
    (its hot part's first piece, ``sf.head`` NOP bytes): the front becomes a
    PAD_DROPPED piece (all of it with ``keep`` 0: the entry starts the hot part).
    False (``sf`` unchanged) when the first piece is not that."""
    pieces = sf.parts[0]
    if not pieces or not 0 <= keep < sf.head:
        return False
    p0 = pieces[0]
    if p0.kind != COPY or p0.old_len != sf.head:
        return False
    drop = sf.head - keep
    pieces[0:1] = [Piece(p0.old, drop, PAD_DROPPED, p0.block)] + \
        ([Piece(p0.old + drop, keep, COPY, p0.block)] if keep else [])
    _relax_parts(sf, (0,))
    sf.head = keep
    return True


def _note_prefix_sym(sf, units, functions):
    """Remember the __pfx_ symbol of a trimmed split function (it gets the kept size)."""
    mem = units.members[sf.unit]
    if len(mem) == 2:
        sf.prefix_sym = int(functions.sym_index[mem[0][0]])


def _whole_trimmed(cfg, u, units, functions, hot_block, short_keys, falls, head, keep):
    """A hot prefixed function with nothing worth splitting, moved whole but with its
    prefix trimmed to ``keep`` bytes: one part, every block in its original order (a
    SplitFunction with ``whole`` set and no cold part); None when it cannot be built."""
    a, z = cfg.blocks_of(u)
    mask = hot_block.copy()
    mask[a:z] = True
    fi = units.members[u][-1][0]
    sf = build_parts(cfg, u, u, functions.name[fi], mask, short_keys,
                     int(functions.sym_index[fi]), falls, False)
    if sf is None or sf.sizes[1]:
        return None
    sf.head, sf.whole = head, True
    if not trim_prefix(sf, keep):
        return None
    _note_prefix_sym(sf, units, functions)
    return sf


def _trailing_code(dis, units, functions, candidates):
    """Per unit: code that is not padding (NOPs, int3 fill) lies after its (last) function's end
    (an assembly label without a function symbol: relayout/units.py keeps it
    with the function before it)."""
    from .units import padding_instructions
    out = np.zeros(len(units), bool)
    for u in np.nonzero(candidates)[0].tolist():
        fe = int(functions.end[units.members[u][-1][0]])
        ue = int(units.end[u])
        if ue <= fe:
            continue
        lo, hi = np.searchsorted(dis.addr, [fe, ue])
        idx = np.arange(lo, hi)
        fill = padding_instructions(dis, idx) | ((dis.size[idx] == 1) & (dis.raw[idx, 0] == 0xCC))
        if len(idx) and not fill.all():
            out[u] = True
    return out


def choose_splits(cfg, units, heat, block_count, min_count, functions, short_keys, cold_min=8,
                  invert_jcc=False, block_order="original", edges=None, log=None, heads=None,
                  split_noinstr=False, order_whole=False, inline_cold_max=0, prefix_keep=None):
    """SplitFunction list and per-unit reason codes (REASONS) for every unit.

    ``block_order``: "original" keeps the hot blocks in their original order,
    "ext-tsp" orders them by the ext-TSP objective (relayout/block_order.py)
    from ``block_count`` and ``edges`` (the profile's taken branches, or None).
    ``heads``: per unit, the length of a prefix before its function (prefix_heads):
    such a unit splits with its prefix block first in the hot part, its entry
    block right after. ``split_noinstr``: split noinstr functions too (both parts
    stay in the noinstr region: a cold part is placed in its parent's region).
    ``order_whole`` (ext-TSP only): a hot function with too little cold code to
    split still gets its hot blocks in ext-TSP order, its other blocks after them
    in the same part (a SplitFunction with an empty cold
    part, ``whole`` set), when that order scores better than the original.
    ``inline_cold_max``: cold blocks up to this size may stay in the hot part where
    that makes the hot part smaller (keep_small_cold); 0: never. ``prefix_keep``:
    a split function's prefix keeps only this many bytes before its entry
    (trim_prefix; 0 drops all of it); None: all of them."""
    nu = len(units)
    reason = np.array(cfg.reason, dtype=np.int8)
    reason = reason.copy()
    heads = np.zeros(nu, np.int64) if heads is None else np.asarray(heads, np.int64)
    single = np.array([len(m) == 1 for m in units.members]) | (heads > 0)
    noinstr = np.array(["noinstr" in units.regions[int(r)].name for r in units.region])
    pinned = units.pinned.copy()
    for i, reg in enumerate(units.regions):
        if reg.pinned:
            pinned |= units.region == i

    def mark(mask, r):
        sel = mask & (reason == 0)
        reason[sel] = r
    mark(pinned, R_PINNED)
    if not split_noinstr:
        mark(noinstr, R_NOINSTR)
    mark(~single, R_GLUED)
    mark(heat < min_count, R_NOT_HOT)
    mark(_trailing_code(cfg.dis, units, functions, reason == 0), R_TRAILING_CODE)
    hot_block = block_count >= min_count
    # the entry block of every function is hot (it stays at the symbol)
    hot_block[cfg.func_first[cfg.func_nblocks > 0]] = True
    falls = cfg.falls_through()
    if heads.any():
        # a direct call into a prefixed function after its entry: the kernel would patch
        # a call thunk into the 16 bytes before that block (callthunks.c), which a cold
        # part does not have
        bi, bt, _ = cfg.dis.branch_targets()
        # behind the prefixes branch_targets reads too (`cs call`: callthunks.c
        # patches every call its list names, prefixed or not)
        _, op, _ = skip_prefixes(cfg.dis.raw[bi], (0x2E, 0x3E, 0xF2, 0x67))
        call = op == 0xE8
        t = bt[call]
        tu = units.find(t)
        inside = (tu >= 0) & (t != units.start[np.maximum(tu, 0)] +
                              heads[np.maximum(tu, 0)].astype(np.uint64))
        mark(np.isin(np.arange(nu), tu[inside]) & (heads > 0), R_CALL_INSIDE)
    # a prefix unit: the prefix is its first block; the function's entry block too
    for u in np.nonzero((heads > 0) & (reason == 0))[0].tolist():
        a, z = cfg.blocks_of(u)
        entry = int(units.start[u]) + int(heads[u])
        if z - a < 2 or int(cfg.end[a]) != entry or int(cfg.start[a + 1]) != entry or \
                not falls[a]:
            reason[u] = R_GLUED          # the prefix is not one block falling into the entry
            continue
        hot_block[a + 1] = True
    splits = []
    weights = None
    columns = None             # PartColumns, made at the first use
    if block_order == "ext-tsp":
        from .block_order import BranchWeights
        weights = BranchWeights(cfg, block_count, edges)
        if log:
            log(f"hot blocks in ext-TSP order; edge weights from {weights.source}")
    elif block_order != "original":
        raise ValueError(f"block_order {block_order!r}")
    todo = np.nonzero(reason == 0)[0].tolist()
    for u in todo:
        a, z = cfg.blocks_of(u)
        if z - a < 2:
            reason[u] = R_NO_COLD
            continue
        cold_bytes = int((cfg.end[a:z] - cfg.start[a:z])[~hot_block[a:z]].sum())
        whole = cold_bytes < cold_min
        if whole and not (order_whole and weights is not None):
            reason[u] = R_NO_COLD
            if prefix_keep is not None and heads[u]:
                sf = _whole_trimmed(cfg, u, units, functions, hot_block, short_keys, falls,
                                    int(heads[u]), prefix_keep)
                if sf is not None:
                    splits.append(sf)
            continue
        head = int(heads[u])
        fi = units.members[u][-1][0]           # the function (after its prefix, if any)
        order, score, mask = None, None, hot_block
        if weights is not None:
            from .block_order import hot_block_order
            e = a + 1 if head else a           # ordered from the entry; the prefix stays first
            order, before, after = hot_block_order(cfg, e, z, hot_block, weights, block_count)
            if whole and after <= before:
                reason[u] = R_NO_COLD          # nothing to gain: the function stays as it is
                continue
            order = list(range(a, e)) + list(order)
            score = (before, after)
            if whole:
                # one part: the hot blocks in their order, then the others in theirs
                order += [b for b in range(a, z) if not hot_block[b]]
                mask = hot_block.copy()
                mask[a:z] = True
        sf = build_parts(cfg, u, u, functions.name[fi], mask, short_keys,
                         int(functions.sym_index[fi]), falls, invert_jcc, order)
        if sf is None:
            reason[u] = R_NO_COLD
            continue
        if inline_cold_max and not whole:
            def build(m, o, h, u=u, fi=fi):
                return build_parts(cfg, u, u, functions.name[fi], m, short_keys,
                                   int(functions.sym_index[fi]), falls, invert_jcc, o, h)
            if columns is None:
                # (the blocks of the functions this loop may split only: every
                # block's columns were 2 MiB more at zstd's peak)
                columns = PartColumns(cfg, falls, [cfg.blocks_of(v) for v in todo])
            sf = keep_small_cold(cfg, u, sf, hot_block, falls, inline_cold_max, build,
                                 fixed=2 if head else 1,
                                 hot_size=HotPartSizer(cfg, u, short_keys, falls, invert_jcc,
                                                       build, columns=columns).size)
        sf.order_score = score
        sf.head = head
        sf.whole = whole
        if prefix_keep is not None and head and trim_prefix(sf, prefix_keep):
            _note_prefix_sym(sf, units, functions)
        splits.append(sf)
    return splits, reason


def planning_units(units, heat, splits, hot_align=None, whole_align=None, min_count=1):
    """A UnitTable for placement: split units shrink to their hot part; each
    cold part is a new unit right after its parent (unit order = cold order).
    ``hot_align``: the alignment of split hot parts (None: their function's; cold
    parts take 1 either way: they are code the split made, which nothing aligns);
    a unit with a prefix (more than one member) keeps its own.
    ``whole_align``: the alignment of hot units (heat >= ``min_count``) moved whole
    that hold one function, are not pinned and keep no phase (None: their own).
    Neither takes a mangled (C++) function that was 2-aligned below 2 bytes.
    Returns (table, heat, parent index per planning unit, part per planning unit)."""
    n = len(units)
    by_unit = {sf.unit: sf for sf in splits}
    is_split = np.zeros(n, bool)
    hot_size = units.size.astype(np.int64)
    cold_size = np.zeros(n, np.int64)
    for u, sf in by_unit.items():
        # a function reordered whole (no cold part) gets no cold unit
        is_split[u], hot_size[u], cold_size[u] = not getattr(sf, "whole", False), sf.sizes[0], \
            sf.sizes[1]
    # every unit, and right after a split one its cold part
    par = np.repeat(np.arange(n, dtype=np.int64), 1 + is_split)
    part = np.zeros(len(par), np.int8)
    part[(np.cumsum(1 + is_split) - 1)[is_split]] = 1
    cold = part == 1
    st = units.start[par] + cold.astype(np.uint64)     # a sort key only: never an address
    sz = np.where(cold, cold_size[par], hot_size[par])
    rg = units.region[par]
    pn = np.where(cold, False, units.pinned[par])
    al = np.where(cold, 1, units.align[par])
    ph = np.where(cold, 0, units.phase[par])
    # a unit with a prefix member (6.12's __pfx_ padding, which call-depth tracking
    # rewrites at boot) keeps its alignment: it applies to the padding's start; but a
    # split one whose prefix was trimmed to the thunk's size (trim_prefix) takes
    # hot_align: the kernel needs the NOPs, not the alignment (kernel/prefixes.py)
    single = np.array([len(units.members[u]) <= 1 for u in range(n)], bool) \
        if hot_align is not None or whole_align is not None else None
    trimmed = np.zeros(n, bool)
    for u, sf in by_unit.items():
        # (evaluate's booted.py passes objects with sizes only)
        trimmed[u] = getattr(sf, "prefix_trimmed", False)
    if hot_align is not None:
        ordered = np.zeros(n, bool)
        ordered[list(by_unit)] = True
        hot_split = ~cold & ordered[par] & (single[par] | trimmed[par])
        al = np.where(hot_split, int(hot_align), al)
        ph = np.where(hot_split, 0, ph)
    if whole_align is not None:
        # a hot function moved whole: its 16 B alignment pads the loop's lines as a
        # split hot part's would (gcc's -falign-functions, not a need of the code)
        whole = ~cold & ~is_split[par] & single[par] & ~pn & (ph == 0) & \
            (np.asarray(heat, np.float64)[par] >= min_count)
        al = np.where(whole, np.minimum(al, int(whole_align)), al)
    if hot_align is not None or whole_align is not None:
        # C++: a pointer to member function marks a virtual one by the low bit of
        # its value (Itanium ABI), so gcc aligns member functions to 2 bytes; a
        # mangled function that was at an even address stays at one (at an odd
        # one, a call through such a pointer reads the vtable: yaml-cpp's tests)
        cxx = np.array([str(nm).startswith("_Z") for nm in units.name], bool)
        al = np.where(~cold & cxx[par], np.maximum(al, np.minimum(units.align[par], 2)), al)
    ht = np.where(cold, 0.0, np.asarray(heat, np.float64)[par])
    nm, mem = [], []
    for u, c in zip(par.tolist(), cold.tolist()):
        nm.append(by_unit[u].name + ".cold" if c else units.name[u])
        mem.append([] if c else units.members[u])
    t = UnitTable(st, sz, rg, units.regions, nm, pn, al, ph, members=mem)
    t.funcs = _func_map(t, len(units.funcs)) if units.funcs is not None else None
    return t, ht, par, part


def planning_for(units, heat, splits, strategy):
    """planning_units with the strategy's alignment options."""
    return planning_units(units, heat, splits, getattr(strategy, "split_hot_align", None),
                          getattr(strategy, "whole_hot_align", None),
                          getattr(strategy, "min_count", 1))


def layout_rows(splits, plan, parent, part, image):
    """After placement: new part addresses, block map rows, part bytes.

    Returns (rows, {planning unit index: bytes}, cold symbol list).
    """
    index = {}
    for k in range(len(parent)):
        index[(int(parent[k]), int(part[k]))] = k
    names = ("old", "old_len", "new", "new_len", "kind", "part", "func")
    cols = tuple([] for _ in names)            # a list per column (tuples per row: +2 MiB)
    add_old, add_old_len, add_new, add_new_len, add_kind, add_part, add_func = \
        (c.append for c in cols)
    out_bytes = {}
    cold_syms = []
    # new start of every block's first piece, per split function
    for sf in splits:
        for p_ in (0, 1):
            k = index.get((sf.unit, p_))
            # a function reordered whole has no cold unit: its empty part ends the hot one
            sf.new_start[p_] = int(plan.new_start[k]) if k is not None else \
                sf.new_start[0] + sf.sizes[0]
    for sf in splits:
        bstart = {}
        for p_ in (0, 1):
            for b, off in sf.first[p_].items():
                bstart[b] = sf.new_start[p_] + off
        sym = sf.sym
        # the function's original bytes read once (one read per piece was most of this loop)
        copies = [p for part in sf.parts for p in part if p.kind == COPY]
        code, lo = None, 0
        if copies:
            lo = min(p.old for p in copies)
            try:
                code = bytes(image.read(lo, max(p.old + p.old_len for p in copies) - lo))
            except ValueError:
                code = None                 # not one file-backed section: read each piece
        for p_ in (0, 1):
            base = sf.new_start[p_]
            buf = bytearray(sf.sizes[p_])
            for p in sf.parts[p_]:
                new = base + p.off
                kind = p.kind
                add_old(p.old)
                add_old_len(p.old_len)
                add_new(new if kind != REMOVED else bstart[p.target_block])
                add_new_len(p.size)
                add_kind(kind)
                add_part(p_)
                add_func(sym)
                if kind == COPY:
                    buf[p.off:p.off + p.size] = bytes(image.read(p.old, p.old_len)) \
                        if code is None else code[p.old - lo:p.old - lo + p.old_len]
                elif kind == BRANCH or kind == INSERTED:
                    buf[p.off:p.off + p.size] = encode(p, new, bstart[p.target_block])
            if (sf.unit, p_) in index:
                out_bytes[index[(sf.unit, p_)]] = bytes(buf)
        if sf.sizes[1]:
            cold_syms.append((sf, sf.new_start[1], sf.sizes[1]))
    rows = bm.make_rows(**{k: np.array(v, dtype=np.uint64 if k in ("old", "new") else np.int64)
                           for k, v in zip(names, cols)})
    return rows, out_bytes, cold_syms


def encode(p, addr, target):
    """Bytes of a re-encoded branch (piece ``p`` at ``addr``) to ``target``."""
    n = p.size
    d = target - (addr + n)
    if p.form == FORM_KEY_NOP:
        return NOP2 if n == 2 else NOP5
    if p.form in (FORM_JMP, FORM_KEY_JMP):
        if n == 2:
            return bytes([0xEB]) + d.to_bytes(1, "little", signed=True)
        return bytes([0xE9]) + d.to_bytes(4, "little", signed=True)
    if n == 2:
        return bytes([0x70 | p.cc]) + d.to_bytes(1, "little", signed=True)
    return bytes([0x0F, 0x80 | p.cc]) + d.to_bytes(4, "little", signed=True)


# How a userspace summary names the reasons whose kernel text means nothing there.
USER_REASONS = {
    R_PINNED: "pinned code (a data field linepack cannot explain may designate it)",
    R_INDIRECT: "indirect jump whose targets are not known",
}


def reason_summary(reason, heat, min_count, userspace=False):
    """{reason text: count} over hot units (``userspace``: in a program's words)."""
    hot = heat >= min_count
    c = np.bincount(reason[hot], minlength=len(REASONS))
    text = {**dict(enumerate(REASONS)), **(USER_REASONS if userspace else {})}
    return {text[i]: int(c[i]) for i in range(len(REASONS)) if c[i]}
