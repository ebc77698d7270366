"""The ext-TSP chain merging of relayout/block_order.py as first written: every
merge re-scans the sorted pairs of chains. tests/test_block_order.py checks that
the faster search picks the same merges (the same order) on many graphs."""

from linepack.relayout.block_order import EPS, SPLIT_MAX, edge_score


def ext_tsp_order(sizes, edges, counts=None, entry=0, split_max=SPLIT_MAX):
    """relayout/block_order.py's search as it was before its pairs were kept in a
    heap (a scan of the sorted pairs per merge): the oracle for the order it finds.

    Node order (a permutation of range(len(sizes))) by greedy chain merging
    on the ext-TSP objective; ``entry`` first. ``edges``: [(src, dst, weight,
    unconditional)] over nodes; ``counts``: node execution counts (the density
    that orders the chains left at the end; default: the edge weights)."""
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
        s = 0.0
        for a, b, w, u in edges_:
            s += edge_score(w, u, addr(a) + sizes[a], addr(b))
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

    while True:
        best = None
        for key in sorted(between):
            if key not in gain_cache:
                a, b = key
                g1 = best_merge(a, b)
                g2 = best_merge(b, a)
                gain_cache[key] = (g1[0], (a, b, g1[1])) if g1[0] >= g2[0] else \
                    (g2[0], (b, a, g2[1]))
            g, how = gain_cache[key]
            if how[2] is not None and (best is None or g > best[0]):
                best = (g, how)
        if best is None:
            break
        x, y, how = best[1]
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
        # pairs with the merged chains now pair with ``keep``
        for key in list(between):
            if gone in key or keep in key:
                gain_cache.pop(key, None)
            if gone in key:
                other = key[0] if key[1] == gone else key[1]
                es = between.pop(key)
                nk = (min(keep, other), max(keep, other))
                between.setdefault(nk, []).extend(es)
                gain_cache.pop(nk, None)
    first = chain[entry]

    def density(c):
        sz = size_of[c]
        return sum(counts[v] for v in nodes[c]) / sz if sz else 0.0
    rest = sorted((c for c in nodes if c != first), key=lambda c: (-density(c), min(nodes[c])))
    out = list(nodes[first])
    for c in rest:
        out += nodes[c]
    return out
