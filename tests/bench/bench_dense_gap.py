#!/usr/bin/env python3
"""Where a block-level layout's gap to the dense reference comes from (docs/evaluate.md).

From a recorded trace (evaluate caches them under ~/.cache/linepack/evaluate/traces) and a
layout's plan (``<key>.plan.npz`` under ~/.cache/linepack/layouts/<build-id>/, written by
``evaluate --layout blocks``): no image, no boot, a few seconds.

- what the layout's loop lines (lines run at least once per iteration) hold, byte by byte:
  hot code (blocks run at least once per N iterations), code run more rarely, code that
  never ran, re-encoded or inserted branches, padding;
- misses of the layout, of dense:N, and of the layout's own hot code packed end to end in
  the layout's order (what the layout would give without dilution).

    python3 tests/bench/bench_dense_gap.py TRACE.npz PLAN.npz [--every 20] [--cache M ...]
"""

import argparse

import numpy as np

from linepack.evaluate import dense
from linepack.evaluate.layouts import PlanMap
from linepack.evaluate.whatif import BlockTrace, line_heat, replay, translate
from linepack.profile.trace import cache_config

PAD, BRANCH, NEVER, RARE, HOT, IN_PLACE = range(6)
KINDS = ("padding", "re-encoded/inserted branches", "code never run", "code run more rarely",
         "hot code", "code left in place (pinned)")


def merged(lo, hi):
    """Union of [lo, hi) ranges as two sorted arrays."""
    o = np.argsort(lo, kind="stable")
    lo, hi = lo[o], hi[o]
    reach = np.maximum.accumulate(hi)
    new = np.ones(len(lo), bool)
    new[1:] = lo[1:] > reach[:-1]
    g = np.cumsum(new) - 1
    out_hi = np.zeros(int(g[-1]) + 1, lo.dtype) if len(lo) else hi[:0]
    np.maximum.at(out_hi, g, hi)
    return lo[new], out_hi


def covered(iv, a, z):
    """Bool per byte of [a, z): inside one of the merged ranges ``iv``."""
    lo, hi = iv
    out = np.zeros(z - a, bool)
    i = int(np.searchsorted(hi, a, side="right"))
    while i < len(lo) and lo[i] < z:
        out[max(int(lo[i]), a) - a:min(int(hi[i]), z) - a] = True
        i += 1
    return out


def composition(bt, amap, table, every, line=64):
    """Bytes of each kind (KINDS) in the layout's loop lines; (number of loop lines, counts)."""
    loops = int(bt.meta.get("loops") or 1)
    cnt = bt.block_counts()
    # addresses relative to a line-aligned base below everything: int64 arithmetic
    base = min(int(bt.blocks["vaddr"].min()), int(amap.old_start.min()),
               int(amap.new_start.min())) // line * line

    def rel(x):
        return (np.asarray(x, np.uint64) - np.uint64(base)).astype(np.int64)
    va = rel(bt.blocks["vaddr"])
    end = va + np.maximum(bt.blocks["size"].astype(np.int64), 1)
    iv_hot = merged(va[cnt * every >= loops], end[cnt * every >= loops])
    ran = merged(va[cnt > 0], end[cnt > 0])
    lines, heat = line_heat(bt, table)
    loop = (lines[heat >= loops].astype(np.uint64) - np.uint64(base // line)).astype(np.int64)
    where = {int(v): i for i, v in enumerate(loop.tolist())}
    paint = np.zeros(len(loop) * line, np.int8)
    shift = line.bit_length() - 1

    def put(s, e, v):
        for ln in range(s >> shift, ((e - 1) >> shift) + 1):
            i = where.get(ln)
            if i is None:
                continue
            a, z = max(s, ln << shift), min(e, (ln + 1) << shift)
            seg = slice(i * line + a - (ln << shift), i * line + z - (ln << shift))
            val = v if np.isscalar(v) else v[a - s:z - s]
            paint[seg] = np.maximum(paint[seg], val)
    os_, oe, ns = rel(amap.old_start), rel(amap.old_end), rel(amap.new_start)
    ne = rel(amap.new_end) if amap.new_end is not None else ns + (oe - os_)
    first = ns >> shift
    last = (ne - 1) >> shift
    inloop = np.isin(first, loop) | np.isin(last, loop) | ((last - first) > 1)
    for p in np.nonzero(inloop & (ne > ns))[0].tolist():
        s, e, o = int(ns[p]), int(ne[p]), int(os_[p])
        if e - s != int(oe[p]) - o:
            put(s, e, BRANCH)
            continue
        put(s, e, NEVER + covered(ran, o, o + e - s).astype(np.int8) +
            covered(iv_hot, o, o + e - s).astype(np.int8))
    for s, e in zip(rel(amap.occupied[0]).tolist(), rel(amap.occupied[1]).tolist()):
        put(s, e, BRANCH)
    # bytes no moved code covers: padding where moved code left (or was placed), else
    # code that did not move (pinned entry text, thunks)
    vacated = merged(os_[oe > os_], oe[oe > os_])
    for i in np.nonzero((paint.reshape(-1, line) == PAD).any(axis=1))[0].tolist():
        a = int(loop[i]) << shift
        seg = paint[i * line:(i + 1) * line]
        seg[(seg == PAD) & ~covered(vacated, a, a + line)] = IN_PLACE
    return len(loop), np.bincount(paint, minlength=len(KINDS))


class OwnOrder(dense.DenseLayout):
    """dense:N of the layout's own hot code, in the layout's address order."""

    def __init__(self, bt, amap, every):
        cnt = bt.block_counts()
        loops = int(bt.meta.get("loops") or 1)
        m = cnt * every >= loops
        new, _ = amap.map(bt.blocks["vaddr"].astype(np.uint64))
        self.moved = bt.blocks.copy()
        self.moved["vaddr"] = new
        start = self.moved["vaddr"].astype(np.uint64)
        end = start + np.maximum(self.moved["size"].astype(np.uint64), np.uint64(1))
        lo, hi, _, _ = dense._merge(start[m], end[m], cnt[m], np.zeros(int(m.sum()), np.int64))
        sizes = hi - lo
        self.base = (int(end.max()) + dense.FRESH_ALIGN - 1) // dense.FRESH_ALIGN * \
            dense.FRESH_ALIGN
        self.old_lo, self.old_hi = lo, hi
        self.new_lo = np.uint64(self.base) + \
            np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64)
        self.bytes, self.intervals, self.every, self.order = int(sizes.sum()), len(lo), every, \
            "layout"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("plan")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--cache", action="append", default=None)
    a = ap.parse_args()
    caches = [cache_config(c) for c in (a.cache or ["intel-32k-8w", "amd-64k-2w"])]
    bt = BlockTrace.load(a.trace)
    amap = PlanMap.load(a.plan).amap
    stock = translate(bt.blocks, None, 64)[0]
    layout = translate(bt.blocks, amap, 64)[0]
    d = dense.DenseLayout(bt, a.every)
    own = OwnOrder(bt, amap, a.every)
    rows = [("stock", stock), ("layout", layout), (f"dense:{a.every}", d.table(bt.blocks, 64)),
            (f"layout's own hot code packed ({own.bytes:,} B)", own.table(own.moved, 64))]
    base = {c["name"]: replay(bt, stock, c)["misses"] for c in caches}
    for label, t in rows:
        cells = []
        for c in caches:
            m = replay(bt, t, c)["misses"]
            ll, acc = dense.set_load(bt, t, c)
            cells.append(f"{c['name']} {m:,} ({100 * (m / base[c['name']] - 1):+.2f}%, "
                         f"{int(ll.sum()):,} loop lines, {int(np.maximum(ll - c['ways'], 0).sum()):,}"
                         " over ways)")
        print(f"{label}: " + "; ".join(cells))
    n, parts = composition(bt, amap, layout, a.every)
    print(f"the layout's {n:,} loop lines ({n * 64:,} B):")
    for k, v in zip(KINDS, parts.tolist()):
        print(f"  {k:32s} {v:8,} B  {100 * v / max(n * 64, 1):5.1f}%")


if __name__ == "__main__":
    main()
