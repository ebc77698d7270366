"""Booted measurement: run a workload on each kernel under the TCG plugin's
L1i model and report kernel-mode fetches, misses, instructions and text size.

Deterministic by construction (QEMU -icount, fixed RTC; the plugin counts only
between the workload's loop markers), so one run per image is enough to compare
layouts; ``repeat`` re-runs anyway and reports the spread.
"""

import os
import statistics

import numpy as np

from ..image.elf import ElfImage

# Executed kernel instructions must agree across layouts to this relative
# tolerance, else the layouts did not run the same work. Repeat runs of one
# image agree exactly (-icount). Different layouts boot with different
# instruction counts (e.g. sorting tables by address); the RNG is seeded from
# the TSC (= instruction count under -icount), so slab freelist order differs,
# and time-driven work (RCU callbacks, CRNG reseeds) lands a little differently
# in the loop even with the workload's fixed-time start and norandmaps.
# Measured on VFS-mix: 0.002-0.04 % at 1000 loops, up to 0.2 % at 2000 loops
# (blake2s, rcu_do_batch, kmem_cache_free). MPKI (misses per 1000 kernel
# instructions) in the table normalises for it.
INSTRUCTION_TOLERANCE = 5e-3
# A layout whose hot blocks are reordered runs fewer (or more) jmps: jmps to the
# block placed next disappear, broken fall-throughs gain one. Measured on VFS-mix
# (2000 loops): blocks-ext-tsp -0.54% kernel instructions vs stock, 263 fewer per
# loop than blocks-original (an estimate from the profile: ~265 jmps fewer per loop).
BLOCK_LEVEL_TOLERANCE = 2e-2


def instruction_tolerance(strategy):
    """How far a layout of ``strategy`` (a spec such as 'blocks:0.5', or a label whose
    last word is one: '7.3 blocks') may move the kernel instruction count of the same work."""
    from .layouts import BLOCK_LEVEL
    words = str(strategy).split() or [""]
    return BLOCK_LEVEL_TOLERANCE if words[-1].split(":")[0] in BLOCK_LEVEL \
        else INSTRUCTION_TOLERANCE


def executed_lines(trace, line=64):
    """Distinct cache lines covered by the executed translation blocks."""
    run = trace.tb_execs > 0
    start = trace.tb_addr[run].astype(np.uint64)
    size = trace.tb_size[run].astype(np.uint64)
    if not len(start):
        return 0
    first = start // np.uint64(line)
    last = (start + np.maximum(size, 1) - np.uint64(1)) // np.uint64(line)
    n = (last - first + np.uint64(1)).astype(np.int64)
    rep = np.repeat(first, n)
    offs = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
    return int(len(np.unique(rep + offs.astype(np.uint64))))


def text_size(path):
    from ..image.functions import text_size as image_text_size
    return image_text_size(ElfImage(path))


def code_growth(base_path, path):
    """.text growth of ``path`` over ``base_path`` in bytes, as relayout reports it (how
    far the end of the moved code went, per run of regions), read from the two images;
    0 for the base itself; None when ``path`` is not a rewrite of the base (another
    build-id, or no function table): then there is no growth to speak of."""
    if os.path.realpath(base_path) == os.path.realpath(path):
        return 0
    from ..errors import LinepackError
    try:
        a, b = ElfImage(base_path).build_id, ElfImage(path).build_id
        if a != b:
            return None
        return text_growth_between(base_path, path)
    except LinepackError:
        return None


def text_growth_between(base_path, new_path):
    """relayout's ".text growth" (bytes) of ``new_path`` (a relayout output of
    ``base_path``) from the two images alone: the plan relayout placed is rebuilt and
    measured the way relayout measures it (per run of movable regions, how far the end
    of laid-out code moved).

    Each unit of the base starts where its first function starts in the new image (the
    output keeps the symbol table's order, except that a block-level layout inserts its
    ``name.cold`` locals before the globals). A block-level output's block map
    (``.linepack.blockmap``) gives each split function's hot and cold part, which are
    placed as two units, as relayout's planning table has them."""
    from types import SimpleNamespace

    from ..image import blockmap as bm
    from ..image.addrmap import plan_extents
    from ..image.elf import SHT_SYMTAB
    from ..image.functions import FunctionTable
    from ..relayout.blocks import planning_units
    from ..relayout.plan import LayoutPlan, run_growth
    from ..relayout.units import build_units
    from ..relayout.user.segment import ORIG_TEXT
    base, new = ElfImage(base_path), ElfImage(new_path)
    fa, fb = FunctionTable(base), FunctionTable(new)
    units, _ = build_units(base, fa)
    # old symbol index -> new one: the inserted .cold locals shift every global
    inserted = len(new.symtab) - len(base.symtab)
    first_global = int(next(x for x in base.sections if x.type == SHT_SYMTAB).info)
    b_by_sym = dict(zip(fb.sym_index.tolist(), fb.start.tolist()))
    new_sym = lambda i: i + inserted if i >= first_global else i        # noqa: E731
    unit_new = units.start.copy()
    for ui in range(len(units)):
        if not units.members[ui]:
            continue          # code outside any function: no symbol tells where it went
        fi, off = units.members[ui][0]
        b = b_by_sym.get(new_sym(int(fa.sym_index[fi])))
        if b is not None:
            unit_new[ui] = b - off
    rows = bm.read_blockmap(new)
    splits, part_at = [], {}
    if rows is not None and len(rows):
        for func in np.unique(rows["func"]).tolist():
            r = rows[(rows["func"] == func) & (rows["new_len"] > 0)]
            u = int(units.find([int(rows["old"][rows["func"] == func].min())])[0])
            sizes, starts = [], []
            for part in (bm.PART_HOT, bm.PART_COLD):
                q = r[r["part"] == part]
                sizes.append(int(q["new_len"].astype(np.int64).sum()))
                starts.append(int(q["new"].min()) if len(q) else None)
            splits.append(SimpleNamespace(unit=u, sizes=tuple(sizes), name=units.name[u]))
            part_at[u] = starts
    if splits:
        table, _, parent, part = planning_units(units, np.zeros(len(units)), splits)
        new_start = unit_new[parent].copy()
        for k, (u, pt) in enumerate(zip(parent.tolist(), part.tolist())):
            if u in part_at:
                at = part_at[u][pt]
                # a part with no bytes: where the other part starts (it ends no run)
                new_start[k] = at if at is not None else part_at[u][1 - pt]
        units = table
    else:
        new_start = unit_new
    plan = LayoutPlan(units, new_start, [r.start for r in units.regions], None, None)
    if new.section(ORIG_TEXT) is not None:      # the code went to a new segment
        plan.relocated = {base.section(".text").index}
    growth = 0
    for lo, hi in plan_extents(plan)[0]:
        m = (units.start >= np.uint64(lo)) & (units.start < np.uint64(hi)) & ~units.pinned
        if m.any():
            growth += run_growth(plan, m)
    return growth


class Measurement:
    """One image's numbers (medians over repeats, with spread)."""

    def __init__(self, label, path, runs):
        self.label, self.path, self.runs = label, path, runs

    def median(self, key):
        return statistics.median(r[key] for r in self.runs)

    def spread(self, key):
        vals = [r[key] for r in self.runs]
        m = statistics.median(vals)
        return (max(vals) - min(vals)) / m if m else 0.0

    def as_dict(self):
        keys = ("instructions", "fetches", "misses", "miss_rate", "hot_lines", "text_size", "wall")
        d = {"label": self.label, "image": os.path.abspath(self.path), "repeats": len(self.runs)}
        for k in keys:
            d[k] = self.median(k)
            d[k + "_spread"] = self.spread(k)
        d["result_line"] = self.runs[0]["result_line"]
        return d


def _run_dict(tr, res, tsize, wall):
    return {"instructions": tr.kernel_instructions, "fetches": tr.fetches, "misses": tr.misses,
            "miss_rate": tr.misses / tr.fetches if tr.fetches else 0.0,
            "hot_lines": executed_lines(tr), "text_size": tsize, "wall": wall,
            "result_line": res.result_line}


def measure(path, label=None, workload="vfs-mix", loops=None, cache="intel-32k-8w", repeat=1,
            log=None):
    return measure_caches(path, label, workload, loops, [cache], repeat, log)[
        _cache_cfgs([cache])[0]["name"]]


def _cache_cfgs(caches):
    from ..profile.trace import cache_config
    return [c if isinstance(c, dict) else cache_config(c) for c in caches]


def caches_job(path, label=None, workload="vfs-mix", loops=None, caches=("intel-32k-8w",), run=0,
               timeout=1800, reuse=False):
    """The QemuJob of one booted measurement: one boot, one plugin instance per cache
    model, counting inside the workload's loop markers."""
    from ..profile import workloads
    from ..profile.runner import SYSTEM, Plugin, QemuJob
    try:
        start, stop = workloads.roi_addresses(workload)
    except Exception:   # noqa: BLE001 - a workload without markers: the whole run
        start = stop = None
    return QemuJob(SYSTEM, path, [Plugin(cache=c, start=start, stop=stop)
                                  for c in _cache_cfgs(caches)],
                   workload=workload, loops=loops, timeout=timeout,
                   label=label or os.path.basename(path), run=run, cache=reuse)


def run_caches(path, workload="vfs-mix", loops=None, caches=("intel-32k-8w",), timeout=1800):
    """One boot, one plugin instance per cache model. Returns ({cache name: PluginTrace},
    JobResult, wall)."""
    from ..profile.runner import run_job
    res = run_job(caches_job(path, None, workload, loops, caches, timeout=timeout))
    return ({c["name"]: tr for c, tr in zip(_cache_cfgs(caches), res.traces)}, res, res.wall)


def add_result(out, job, res, tsize, log=None, repeat=1):
    """Fold one finished caches_job into {cache name: Measurement}."""
    label = job.label
    trs = {p.cache["name"]: tr for p, tr in zip(job.plugins, res.traces)}
    for name, tr in trs.items():
        out.setdefault(name, Measurement(label, job.image, [])).runs.append(
            _run_dict(tr, res, tsize, res.wall))
    if log:
        log(f"{label} run {job.run + 1}/{repeat}: " + ", ".join(
            f"{n} {tr.misses:,} misses" for n, tr in trs.items()) +
            f"; {next(iter(trs.values())).kernel_instructions:,} instructions ({res.wall:.1f} s)")
    return out


def measure_caches(path, label=None, workload="vfs-mix", loops=None, caches=("intel-32k-8w",),
                   repeat=1, log=None):
    """Boot ``repeat`` times, several cache models at once: {cache name: Measurement}."""
    return measure_many([(path, label)], [workload], loops, caches, repeat, log=log,
                        parallel=1)[(path, label, workload)]


def measure_many(images, workloads, loops=None, caches=("intel-32k-8w",), repeat=1, log=None,
                 parallel=None, scheduler=None, reuse=False):
    """Every (image, workload) booted ``repeat`` times, as independent jobs (a
    process pool, or a Dask cluster at ``scheduler``). ``images``: [(path, label)].
    Returns {(path, label, workload): {cache name: Measurement}}; the numbers do not
    depend on how the jobs ran (each boot is deterministic under -icount)."""
    from ..profile.runner import run_jobs
    keys = [(path, label, w) for path, label in images for w in workloads for k in range(repeat)]
    jobs = [caches_job(path, label, w, loops, caches, run=k, reuse=reuse)
            for path, label in images for w in workloads for k in range(repeat)]
    results = run_jobs(jobs, parallel=parallel, scheduler=scheduler, log=log)
    tsize = {path: text_size(path) for path, _ in images}
    out = {}
    for key, job, res in zip(keys, jobs, results):   # folded in job order: as a sequential run
        add_result(out.setdefault(key, {}), job, res, tsize[job.image], log, repeat)
    return out
