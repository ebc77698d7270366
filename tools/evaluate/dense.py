"""The dense reference: a what-if layout that cannot boot, for measuring how far a
real layout is from packing the loop's code perfectly.

``dense:N`` takes every block a workload's trace executes at least once per N
iterations of its loop (count x N >= loops), merges their byte ranges into
intervals and lays the intervals end to end at one fresh address (above all
traced code, 2 MiB aligned): no gaps, no alignment, no cold bytes between them.
Everything else stays where it is. Orders: ``dense`` (original address order),
``dense-hot`` (most executed interval first), ``dense-first`` (order of first
execution in the window).

It is a reference, not a bound: an LRU cache can do better on another packing,
and it ignores everything that keeps real code in place (pinned entry code,
sections, the region a function lives in, alignment the code needs).

Also here: per-set load of a layout (``set_load``): how many executed lines and
how many line executions fall on each cache set.
"""

import numpy as np

from ..errors import BadInput
from .cachemodel import LineTable

ORDERS = {"dense": "address", "dense-hot": "hot", "dense-first": "first"}
DEFAULT_EVERY = 20
FRESH_ALIGN = 1 << 21


def parse(spec):
    """'dense', 'dense:20', 'dense-hot:1' -> (name, order, N); None when not a dense spec."""
    name, _, arg = str(spec).strip().lower().replace("_", "-").replace("=", ":").partition(":")
    name = name.strip()
    if name not in ORDERS:
        return None
    arg = arg.strip()
    if not arg:
        n = DEFAULT_EVERY
    elif arg.isdigit() and int(arg) >= 1:
        n = int(arg)
    else:
        raise BadInput(f"--layout {spec}: expected {name}:N with N >= 1 (the code run at least "
                       "once per N loop iterations)")
    return f"{name}:{n}", ORDERS[name], n


def is_dense(spec):
    return parse(spec) is not None


class DenseLayout:
    """The dense packing of one trace's hot code (see the module docstring)."""

    def __init__(self, bt, every=DEFAULT_EVERY, order="address"):
        counts = bt.block_counts()
        loops = int(bt.meta.get("loops") or 1)
        hot = counts.astype(np.float64) * every >= loops
        hot &= counts > 0
        b = bt.blocks
        start = b["vaddr"].astype(np.uint64)
        end = start + np.maximum(b["size"].astype(np.uint64), np.uint64(1))
        self.every, self.order = int(every), order
        # first execution of each block: a sort of the whole window, only when asked
        seen = _first_seen(bt.ids, len(b), hot) if order == "first" else np.zeros(len(b), np.int64)
        lo, hi, heat, first = _merge(start[hot], end[hot], counts[hot], seen[hot])
        if order == "hot":
            k = np.lexsort((lo, -heat))
        elif order == "first":
            k = np.lexsort((lo, first))
        else:
            k = np.arange(len(lo))
        lo, hi = lo[k], hi[k]
        sizes = hi - lo
        top = int(end.max()) if len(end) else 0
        self.base = (top + FRESH_ALIGN - 1) // FRESH_ALIGN * FRESH_ALIGN
        new = np.uint64(self.base) + np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64) \
            if len(sizes) else np.zeros(0, np.uint64)
        a = np.argsort(lo, kind="stable")         # the map wants address order
        self.old_lo, self.old_hi, self.new_lo = lo[a], hi[a], new[a]
        self.bytes = int(sizes.sum())
        self.intervals = len(lo)

    def lines(self, line):
        """Cache lines the packed code spans."""
        return -(-self.bytes // int(line)) if self.bytes else 0

    def table(self, blocks, line):
        """LineTable of ``blocks`` (a trace's distinct blocks) under this layout.

        A block inside one interval moves with it; a block outside every interval
        stays; a block partly inside (a cold block overlapping hot code) is split
        at the interval bounds."""
        va = blocks["vaddr"].astype(np.uint64)
        end = va + np.maximum(blocks["size"].astype(np.uint64), np.uint64(1))
        lo, hi, nl = self.old_lo, self.old_hi, self.new_lo
        i = np.searchsorted(lo, va, side="right").astype(np.int64) - 1
        ic = np.maximum(i, 0)
        inside = (i >= 0) & (va < hi[ic]) & (end <= hi[ic]) if len(lo) else np.zeros(len(va), bool)
        # untouched: no interval overlaps [va, end)
        j = np.searchsorted(lo, end, side="left").astype(np.int64) - 1     # last lo < end
        jc = np.maximum(j, 0)
        overlaps = (j >= 0) & (hi[jc] > va) if len(lo) else np.zeros(len(va), bool)
        new = va.copy()
        if len(lo):
            new[inside] = nl[ic[inside]] + (va[inside] - lo[ic[inside]])
        table = LineTable.from_ranges(new, end - va, line)
        odd = np.nonzero(overlaps & ~inside)[0]
        if not len(odd):
            return table
        shift = int(line).bit_length() - 1
        lists = [None] * len(va)
        for b in odd.tolist():
            lists[b] = self._split_lines(int(va[b]), int(end[b]), shift)
        cnt = table.cnt.astype(np.int64).copy()
        for b in odd.tolist():
            cnt[b] = len(lists[b])
        off = np.cumsum(cnt) - cnt
        lines = np.empty(int(cnt.sum()), np.uint64)
        keep = np.ones(len(va), bool)
        keep[odd] = False
        src = np.repeat(keep, table.cnt.astype(np.int64))
        dst = np.repeat(keep, cnt)
        lines[dst] = table.lines[src]
        for b in odd.tolist():
            lines[off[b]:off[b] + cnt[b]] = lists[b]
        return LineTable(off, cnt, lines)

    def _split_lines(self, a, e, shift):
        out = []
        lo, hi, nl = self.old_lo, self.old_hi, self.new_lo
        while a < e:
            i = int(np.searchsorted(lo, np.uint64(a), side="right")) - 1
            if i >= 0 and a < int(hi[i]):
                stop, delta = min(e, int(hi[i])), int(nl[i]) - int(lo[i])
            else:
                stop, delta = (min(e, int(lo[i + 1])) if i + 1 < len(lo) else e), 0
            for ln in range((a + delta) >> shift, ((stop - 1 + delta) >> shift) + 1):
                if not out or out[-1] != ln:
                    out.append(ln)
            a = stop
        return out

    def describe(self):
        return (f"{self.bytes:,} bytes in {self.intervals:,} intervals "
                f"({self.lines(64):,} 64 B lines), blocks run at least once per {self.every} "
                f"iterations, {self.order} order, at {self.base:#x}")


def _first_seen(ids, n, need=None, chunk=1 << 20):
    """Index of each block's first execution in the window (len(ids) if never),
    scanning the window in chunks until every block in ``need`` has been seen
    (the loop's blocks all run in its first iterations)."""
    first = np.full(n, len(ids), dtype=np.int64)
    todo = int(need.sum()) if need is not None else n
    for a in range(0, len(ids), chunk):
        u, at = np.unique(ids[a:a + chunk], return_index=True)
        u = u.astype(np.int64)
        new = first[u] == len(ids)
        first[u[new]] = at[new] + a
        if need is not None:
            todo -= int(need[u[new]].sum())
            if todo <= 0:
                break
    return first


def _merge(start, end, counts, first):
    """Union of [start, end) ranges: (lo, hi, heat, first) per merged interval, where
    heat is the largest execution count of a block in it and first its earliest
    first execution."""
    if not len(start):
        z = np.zeros(0, np.uint64)
        return z, z, np.zeros(0, np.uint64), np.zeros(0, np.int64)
    o = np.lexsort((end, start))
    s, e, c, f = start[o], end[o], counts[o], first[o]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), bool)
    new[1:] = s[1:] > reach[:-1]          # touching ranges merge too (no gap to keep)
    grp = np.cumsum(new) - 1
    n = int(grp[-1]) + 1
    lo = s[new]
    hi = np.zeros(n, np.uint64)
    np.maximum.at(hi, grp, e)
    heat = np.zeros(n, np.uint64)
    np.maximum.at(heat, grp, c.astype(np.uint64))
    fst = np.full(n, np.iinfo(np.int64).max, np.int64)
    np.minimum.at(fst, grp, f)
    return lo, hi, heat, fst


# ---- per-set load ------------------------------------------------------------------

def set_load(bt, table, cfg):
    """Per cache set: (loop lines, accesses per iteration).

    loop lines: distinct lines executed at least once per iteration on average;
    accesses: executions of every line of the set per iteration (a block execution
    counts once for each line it spans)."""
    sets = int(cfg["size"]) // (int(cfg["ways"]) * int(cfg["line"]))
    loops = float(bt.meta.get("loops") or 1)
    counts = bt.block_counts()
    reps = np.repeat(counts, table.cnt.astype(np.int64)).astype(np.float64)
    lines, inv = np.unique(table.lines, return_inverse=True)
    heat = np.bincount(inv.ravel(), weights=reps, minlength=len(lines)) / loops
    s = (lines % np.uint64(sets)).astype(np.int64)
    loop_lines = np.bincount(s[heat >= 1.0], minlength=sets)
    access = np.bincount(s, weights=heat, minlength=sets)
    return loop_lines, access


def summarize_sets(loop_lines, access, ways, top=5):
    """Dict of the per-set load's summary numbers (see format_set_summary)."""
    over = np.maximum(loop_lines - int(ways), 0)
    busiest = np.argsort(-access, kind="stable")[:top]
    return {"sets": int(len(loop_lines)), "loop_lines": int(loop_lines.sum()),
            "lines_mean": float(loop_lines.mean()), "lines_max": int(loop_lines.max()),
            "lines_std": float(loop_lines.std()),
            "sets_over_ways": int((loop_lines > ways).sum()), "lines_over_ways": int(over.sum()),
            "access_mean": float(access.mean()), "access_max": float(access.max()),
            "access_std": float(access.std()),
            "busiest": [(int(i), int(loop_lines[i]), float(access[i])) for i in busiest]}


def format_set_summary(items):
    """items: (label, cache name, ways, summary dict). One text table."""
    hdr = (f"{'layout':<16} {'cache':<14} {'loop lines':>10} {'lines/set':>9} {'max':>4} "
           f"{'std':>5} {'sets>ways':>9} {'lines>ways':>10} {'acc/set':>8} {'max':>8} "
           f"{'std':>7}  busiest sets (set:lines:accesses)")
    out = ["per-set load (loop lines: executed at least once per iteration; accesses: line "
           "executions per iteration)", hdr, "-" * len(hdr)]
    for label, cache, _ways, s in items:
        busy = " ".join(f"{i}:{n}:{a:,.0f}" for i, n, a in s["busiest"][:3])
        out.append(f"{label:<16} {cache:<14} {s['loop_lines']:>10,} {s['lines_mean']:>9.2f} "
                   f"{s['lines_max']:>4} {s['lines_std']:>5.2f} {s['sets_over_ways']:>9,} "
                   f"{s['lines_over_ways']:>10,} {s['access_mean']:>8,.0f} "
                   f"{s['access_max']:>8,.0f} {s['access_std']:>7,.0f}  {busy}")
    return "\n".join(out)
