"""Order of a split function's hot blocks: ``original`` or ``ext-tsp``.

``ext-tsp`` maximizes the extended TSP objective of Newell and Pupyrev
("Improved Basic Block Reordering", IEEE TC 2020; the model behind BOLT's and
LLVM's ``ext-tsp`` block layout). For an order, every control-flow edge
s -> t of weight w (times it is taken per workload iteration) scores

- w * 1.0 when t starts where s ends (a fall-through; 1.05 when the edge is an
  unconditional one: a jmp that disappears, or a fall-through that would
  otherwise need an inserted jmp, while a jcc can be inverted either way);
- w * 0.1 * (1 - d / 1024) for a forward jump of d < 1024 bytes;
- w * 0.1 * (1 - d / 640) for a backward jump of d < 640 bytes (d measured
  from the end of s to the start of t);
- nothing for longer jumps.

The search is greedy chain merging: every block starts as a chain; the pair of
chains (joined by an edge) whose merge adds the most score is merged, trying
X+Y, Y+X and, with X cut in two where one of its blocks would then fall into Y
(or Y into it), X1+Y+X2, Y+X2+X1 and X2+X1+Y; until no merge adds score. The
remaining chains follow the entry's chain by execution density. The entry
block is always first (it stays at the function's symbol). Deterministic: ties
go to the lower chain ids, and nothing depends on hash order.

Edge weights come from the CFG (tools/image/cfg.py) and the profile
(``branch_weights``): a block's count goes to its fall-through (TERM_FALL) or
its jmp target (TERM_JMP); a jcc or static-key site splits its count between
target and fall-through by the profile's taken-branch count for that branch
instruction (QEMU edges: the source is the last instruction of a translation
block; perf LBR and BOLT fdata: the branch), the rest falling through. A
profile without such edges (QEMU profiles recorded without edges, evaluate's
traces) splits it in proportion to the two successors' own counts (exact when
one of them never runs).
"""

import heapq
import itertools

import numpy as np

from ..image.cfg import TERM_FALL, TERM_JCC, TERM_JMP, TERM_KEY

ORDERS = ("original", "ext-tsp")

FALL_WEIGHT = 1.0
FALL_WEIGHT_UNCOND = 1.05
JUMP_WEIGHT = 0.1
FORWARD_DISTANCE = 1024
BACKWARD_DISTANCE = 640
# chains longer than this are not cut (the cuts tried grow with the length)
SPLIT_MAX = 128
EPS = 1e-9


class ExecutedBlocks(tuple):
    """(address, size, count per iteration) of a profile's executed ranges, as
    the block-level strategy takes them, plus ``edges``: (branch instruction,
    target, count per iteration) of the profile's intra-function taken branches,
    or None when the profile has none (or records source blocks, not branches);
    ``first``: per range, where its first execution falls in the recorded window
    (an index into the execution sequence, or a fraction of it for merged runs),
    or None when unknown (a profile of perf or fdata, or written before profiles
    kept it: ``Profile.block_first``)."""

    edges = None
    first = None

    def __new__(cls, blocks, edges=None, first=None):
        self = super().__new__(cls, blocks)
        self.edges, self.first = edges, first
        return self


def executed_blocks(profile, blocks):
    """``blocks`` (relayout.plan.profile_blocks of ``profile``) with the
    profile's intra-function branch edges attached (ExecutedBlocks)."""
    if blocks is None:
        return None
    edges = None
    if len(getattr(profile, "edge_from", ())) and profile.meta.get("edge_from") == "insn":
        from ..profile.model import KIND_INTRA
        m = profile.edge_kind == KIND_INTRA
        loops = float(profile.meta.get("loops") or 1)
        edges = (profile.edge_from[m].astype(np.uint64), profile.edge_to[m].astype(np.uint64),
                 profile.edge_count[m].astype(np.float64) / loops)
    first = getattr(profile, "block_first", None)
    if first is None or not len(first) or len(first) != len(blocks[0]):
        first = None                     # the profile records no order
    return ExecutedBlocks(blocks, edges, first=first)


class BranchWeights:
    """Per CFG block: how often control goes to its fall-through successor and
    to its direct target (per iteration), from block counts and, where the
    profile has them, taken-branch edges."""

    def __init__(self, cfg, counts, edges=None):
        self.cfg, self.counts = cfg, np.asarray(counts, np.float64)
        self.falls = cfg.falls_through()
        self.taken = None
        self._edge = None
        if edges is not None and len(edges[0]):
            f, t, c = (np.asarray(x) for x in edges)
            o = np.lexsort((t, f))
            self.e_from, self.e_to, self.e_count = f[o], t[o], c[o]
            self.taken = True
        self.source = "profile branch edges" if self.taken else \
            "block counts (the profile has no branch edges)"

    def _taken_count(self, branch_addr, target_addr):
        if self._edge is None:
            # (from, to) -> count; the first of repeated pairs, as a search of the
            # sorted edges finds it
            self._edge = {}
            for f, t, c in zip(self.e_from.tolist(), self.e_to.tolist(),
                               self.e_count.tolist()):
                self._edge.setdefault((f, t), float(c))
        return self._edge.get((branch_addr, target_addr), 0.0)

    def of_function(self, a, z):
        """[(block, successor, weight, unconditional)] for blocks [a, z); a
        successor is a block of the same function."""
        cfg = self.cfg
        # the function's columns as lists (a numpy element read per block cost more
        # than the work), indexed by block - a
        c, term, target_block, falls = (x[a:z].tolist() for x in (
            self.counts, cfg.term, cfg.target_block, np.asarray(self.falls, bool)))
        out = []
        for b in range(a, z):
            w = float(c[b - a])
            if w <= 0:
                continue
            t = int(term[b - a])
            nxt = b + 1 if falls[b - a] and b + 1 < z else -1
            tb = int(target_block[b - a]) if t in (TERM_JMP, TERM_JCC, TERM_KEY) else -1
            if tb >= 0 and not a <= tb < z:
                tb = -1
            if t == TERM_FALL:
                if nxt >= 0:
                    out.append((b, nxt, w, True))
                continue
            if t == TERM_JMP:
                if tb >= 0:
                    out.append((b, tb, w, True))
                continue
            if t not in (TERM_JCC, TERM_KEY):
                continue
            if tb == nxt:
                if nxt >= 0:
                    out.append((b, nxt, w, t == TERM_KEY))
                continue
            if tb < 0:
                taken = 0.0
            elif self.taken:
                li = int(cfg.insn_last[b])
                taken = min(w, self._taken_count(int(cfg.dis.addr[li]), int(cfg.start[tb])))
            else:
                ct = float(c[tb - a])
                cf = float(c[nxt - a]) if nxt >= 0 else 0.0
                taken = w * ct / (ct + cf) if ct + cf > 0 else 0.0
            if tb >= 0 and taken > 0:
                out.append((b, tb, taken, False))
            if nxt >= 0 and w - taken > 0:
                # a static-key fall-through broken by the order needs an inserted jmp
                out.append((b, nxt, w - taken, t == TERM_KEY))
        return out


def edge_score(w, uncond, src_end, dst_start):
    """ext-TSP score of one edge: source block ends at ``src_end``, target starts
    at ``dst_start``."""
    if dst_start == src_end:
        return w * (FALL_WEIGHT_UNCOND if uncond else FALL_WEIGHT)
    if dst_start > src_end:
        d = dst_start - src_end
        return w * JUMP_WEIGHT * (1.0 - d / FORWARD_DISTANCE) if d < FORWARD_DISTANCE else 0.0
    d = src_end - dst_start
    return w * JUMP_WEIGHT * (1.0 - d / BACKWARD_DISTANCE) if d < BACKWARD_DISTANCE else 0.0


def score(order, sizes, edges):
    """ext-TSP score of ``order`` (node indices) for nodes of ``sizes`` and
    ``edges`` [(src, dst, weight, unconditional)]; edges from or to a node not
    in ``order`` do not count."""
    addr, pos = {}, 0
    for v in order:
        addr[v] = pos
        pos += sizes[v]
    s = 0.0
    for a, b, w, u in edges:
        if a != b and a in addr and b in addr:
            s += edge_score(w, u, addr[a] + sizes[a], addr[b])
    return s


def ext_tsp_order(sizes, edges, counts=None, entry=0, split_max=SPLIT_MAX, native=True):
    """Node order (a permutation of range(len(sizes))) by greedy chain merging
    on the ext-TSP objective; ``entry`` first. ``edges``: [(src, dst, weight,
    unconditional)] over nodes; ``counts``: node execution counts (the density
    that orders the chains left at the end; default: the edge weights).
    ``native``: the search in C (ext_tsp.c, built at first use) when it can be
    built, else in Python: the same order either way."""
    n = len(sizes)
    if n <= 1:
        return list(range(n))
    # parallel edges merged (a jcc to the next block is one edge)
    agg = {}
    for a, b, w, u in edges:
        if a == b or w <= 0:
            continue
        k = (a, b)
        if k in agg:
            agg[k] = (agg[k][0] + w, agg[k][1] or u)
        else:
            agg[k] = (float(w), bool(u))
    elist = [(a, b, w, u) for (a, b), (w, u) in sorted(agg.items())]   # input order irrelevant
    if counts is None:
        counts = [0.0] * n
        for a, b, w, _ in elist:
            counts[a] += w
    if native:
        got = _native_order(sizes, elist, counts, entry, split_max)
        if got is not None:
            return got
    return _python_order(sizes, elist, counts, entry, split_max)


_lib = False            # the C search (ext_tsp.c): False not tried yet, None not available


def _native_lib():
    global _lib
    if _lib is False:
        import ctypes
        import os
        from .. import native as nat

        def declare(lib):
            P, I = ctypes.c_void_p, ctypes.c_int
            lib.lp_ext_tsp.argtypes = [I, P, P, I, P, P, P, P, I, I, P]
            lib.lp_ext_tsp.restype = I
            lib.lp_hot_part_size.argtypes = [I, P, I, P, P, P, P, P, P, I, I]
            lib.lp_hot_part_size.restype = ctypes.c_int64
        here = os.path.dirname(os.path.abspath(__file__))
        # one object with the hot part sizing of keep_small_cold (parts.c)
        _lib = nat.optional_core("ext_tsp", [os.path.join(here, "ext_tsp.c"),
                                             os.path.join(here, "parts.c")],
                                 "ext_tsp", "the ext-TSP core", declare)
    return _lib


def _native_order(sizes, elist, counts, entry, split_max):
    """The C search's order (the same as _python_order's), or None without it."""
    lib = _native_lib()
    if lib is None:
        return None
    n, m = len(sizes), len(elist)
    sz = np.ascontiguousarray(sizes, np.int64)
    cn = np.ascontiguousarray(counts, np.float64)
    e = np.array([(a, b, u) for a, b, _, u in elist], np.int32).reshape(m, 3)
    ea, eb, eu = (np.ascontiguousarray(e[:, i]) for i in range(3))
    ew = np.ascontiguousarray([w for _, _, w, _ in elist], np.float64)
    out = np.zeros(n, np.int32)
    p = lambda a: a.ctypes.data   # noqa: E731
    if lib.lp_ext_tsp(n, p(sz), p(cn), m, p(ea), p(eb), p(ew), p(eu), int(entry),
                      int(split_max), p(out)) != 0:
        return None
    return out.tolist()


def _python_order(sizes, elist, counts, entry, split_max):
    """ext_tsp_order's search in Python (the reference for ext_tsp.c)."""
    n = len(sizes)
    chain = list(range(n))                  # chain id of each node
    nodes = {i: [i] for i in range(n)}      # chain id -> nodes in order
    off = [0] * n                           # node offset inside its chain
    size_of = {i: sizes[i] for i in range(n)}
    inner = {i: [] for i in range(n)}       # chain id -> edges inside it
    between = {}                            # (lo id, hi id) -> edges between the two chains
    for e in elist:
        k = (min(e[0], e[1]), max(e[0], e[1]))
        between.setdefault(k, []).append(e)
    gain_cache = {}

    def cross_score(edges_, addr):
        # edge_score's expressions inlined (the same floats): this runs for every
        # edge of every arrangement tried, where a call per edge was a third of it
        s = 0.0
        for a, b, w, u in edges_:
            src_end, dst_start = addr(a) + sizes[a], addr(b)
            if dst_start == src_end:
                s += w * (FALL_WEIGHT_UNCOND if u else FALL_WEIGHT)
            elif dst_start > src_end:
                d = dst_start - src_end
                if d < FORWARD_DISTANCE:
                    s += w * JUMP_WEIGHT * (1.0 - d / FORWARD_DISTANCE)
            else:
                d = src_end - dst_start
                if d < BACKWARD_DISTANCE:
                    s += w * JUMP_WEIGHT * (1.0 - d / BACKWARD_DISTANCE)
        return s

    def best_merge(x, y):
        """(gain, (arrangement, cut)) of the best arrangement of chains x (may
        be cut) and y (kept whole), or (EPS, None) when none adds score."""
        X, Y = nodes[x], nodes[y]
        sx, sy = size_of[x], size_of[y]
        cross = between[(min(x, y), max(x, y))]
        ex, ey = chain[entry] == x, chain[entry] == y
        best = (EPS, None)

        def consider(gain, seq):
            nonlocal best
            if gain > best[0]:
                best = (gain, seq)
        # whole: X Y, Y X
        if not ey:
            consider(cross_score(cross, lambda v: off[v] + (0 if chain[v] == x else sx)), ("XY", 0))
        if not ex:
            consider(cross_score(cross, lambda v: off[v] + (sy if chain[v] == x else 0)),
                     ("YX", 0))
        if len(X) > 1 and len(X) <= split_max:
            cuts = set()
            for a, b, _, _ in cross:
                if chain[a] == x and b == Y[0]:
                    cuts.add(X.index(a) + 1)
                if a == Y[-1] and chain[b] == x:
                    cuts.add(X.index(b))
            for k in sorted(c for c in cuts if 0 < c < len(X)):
                cut = off[X[k]]
                in1 = set(X[:k])
                inner_cut = [e for e in inner[x] if (e[0] in in1) != (e[1] in in1)]
                before = cross_score(inner_cut, lambda v: off[v])
                both = cross + inner_cut
                # X1 Y X2
                if not ey:
                    consider(cross_score(both, lambda v: off[v] if chain[v] == x and v in in1
                                         else cut + off[v] if chain[v] == y
                                         else off[v] + sy) - before, ("X1YX2", k))
                if not ex:
                    # Y X2 X1
                    consider(cross_score(both, lambda v: off[v] if chain[v] == y
                                         else sy + off[v] - cut if v not in in1
                                         else sy + (sx - cut) + off[v]) - before, ("YX2X1", k))
                # X2 X1 Y
                if not ex and not ey:
                    consider(cross_score(both, lambda v: sx + off[v] if chain[v] == y
                                         else off[v] - cut if v not in in1
                                         else (sx - cut) + off[v]) - before, ("X2X1Y", k))
        return best

    def arrange(x, y, how):
        kind, k = how
        X, Y = nodes[x], nodes[y]
        return {"XY": lambda: X + Y, "YX": lambda: Y + X, "X1YX2": lambda: X[:k] + Y + X[k:],
                "YX2X1": lambda: Y + X[k:] + X[:k], "X2X1Y": lambda: X[k:] + X[:k] + Y}[kind]()

    # the pairs of chains that share edges, by chain: a merge touches only its
    # two chains' pairs, not every pair
    partners = {i: set() for i in range(n)}
    for a, b in between:
        partners[a].add(b)
        partners[b].add(a)
    # the best pair by a heap of (-gain, pair): the largest gain, the smallest pair
    # among equal gains (what a scan of the sorted pairs picks); entries of pairs
    # changed since are skipped by their stamp
    heap, stamp = [], itertools.count()

    def rate(key):
        a, b = key
        g1 = best_merge(a, b)
        g2 = best_merge(b, a)
        got = (g1[0], (a, b, g1[1])) if g1[0] >= g2[0] else (g2[0], (b, a, g2[1]))
        gain_cache[key] = got + (next(stamp),)
        if got[1][2] is not None:
            heapq.heappush(heap, (-got[0], key, gain_cache[key][2]))

    for key in sorted(between):
        rate(key)
    while heap:
        neg_gain, key, st = heapq.heappop(heap)
        if key not in between or gain_cache[key][2] != st:
            continue                        # a pair since merged or re-rated
        x, y, how = gain_cache[key][1]
        seq = arrange(x, y, how)
        keep, gone = min(x, y), max(x, y)
        merged_edges = inner[x] + inner[y] + between.pop((keep, gone))
        del nodes[gone], inner[gone], size_of[gone]
        nodes[keep], inner[keep] = seq, merged_edges
        size_of[keep] = sum(sizes[v] for v in seq)
        pos = 0
        for v in seq:
            chain[v], off[v] = keep, pos
            pos += sizes[v]
        gain_cache.pop((keep, gone), None)
        partners[keep].discard(gone)
        partners[gone].discard(keep)
        # pairs with the merged chains now pair with ``keep``: their edges join
        # keep's with that chain (keep's first, as before)
        for other in partners.pop(gone):
            es = between.pop((min(gone, other), max(gone, other)))
            gain_cache.pop((min(gone, other), max(gone, other)), None)
            partners[other].discard(gone)
            partners[other].add(keep)
            partners[keep].add(other)
            between.setdefault((min(keep, other), max(keep, other)), []).extend(es)
        for other in sorted(partners[keep]):
            rate((min(keep, other), max(keep, other)))
    first = chain[entry]

    def density(c):
        sz = size_of[c]
        return sum(counts[v] for v in nodes[c]) / sz if sz else 0.0
    rest = sorted((c for c in nodes if c != first), key=lambda c: (-density(c), min(nodes[c])))
    out = list(nodes[first])
    for c in rest:
        out += nodes[c]
    return out


def hot_block_order(cfg, a, z, hot_mask, weights, counts):
    """Hot blocks of blocks [a, z) (``a``, the entry, first) in ext-TSP order,
    and the objective of the original and the new order: (order, before, after)."""
    hot = [b for b in range(a, z) if hot_mask[b]]
    if len(hot) <= 2:
        return hot, 0.0, 0.0
    idx = {b: i for i, b in enumerate(hot)}
    sizes = [int(cfg.end[b] - cfg.start[b]) for b in hot]
    edges = [(idx[s], idx[t], w, u) for s, t, w, u in weights.of_function(a, z)
             if s in idx and t in idx]
    cnt = [float(counts[b]) for b in hot]
    order = ext_tsp_order(sizes, edges, cnt, entry=idx[a])
    before = score(range(len(hot)), sizes, edges)
    after = score(order, sizes, edges)
    if after <= before + EPS:        # nothing better found: keep the original order
        return hot, before, before
    return [hot[i] for i in order], before, after
