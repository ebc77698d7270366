"""Booted measurement: run a workload on each kernel under the TCG plugin's
L1i model and report kernel-mode fetches, misses, instructions and text size.

Deterministic by construction (QEMU -icount, fixed RTC; the plugin counts only
between the workload's loop markers), so one run per image is enough to compare
layouts; ``repeat`` re-runs anyway and reports the spread.
"""

import os
import statistics
import time

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
    from ..relayout.driver import text_growth_between
    try:
        a, b = ElfImage(base_path).build_id, ElfImage(path).build_id
        if a != b:
            return None
        return text_growth_between(base_path, path)
    except LinepackError:
        return None


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


def measure(path, label=None, workload="vfs-mix", loops=None, cache="intel-32k-8w", repeat=1,
            log=None):
    from ..profile.record import run_traced

    runs = []
    tsize = text_size(path)
    for k in range(repeat):
        t0 = time.time()
        tr, res = run_traced(path, workload=workload, loops=loops, cache=cache, edges=False,
                             log=None)
        runs.append({"instructions": tr.kernel_instructions, "fetches": tr.fetches,
                     "misses": tr.misses, "miss_rate": tr.misses / tr.fetches if tr.fetches else 0.0,
                     "hot_lines": executed_lines(tr), "text_size": tsize,
                     "wall": time.time() - t0, "result_line": res.result_line})
        if log:
            log(f"{label or os.path.basename(path)} run {k + 1}/{repeat}: {tr.misses:,} misses / "
                f"{tr.fetches:,} fetches, {tr.kernel_instructions:,} instructions")
    return Measurement(label or os.path.basename(path), path, runs)


def run_caches(path, workload="vfs-mix", loops=None, caches=("intel-32k-8w",), timeout=1800):
    """One boot, one plugin instance per cache model (each a copy of the .so, so
    they keep separate state). Returns ({cache name: PluginTrace}, QemuResult, wall)."""
    import shutil
    import tempfile

    from ..profile import plugin_build, qemu, trace, workloads

    so = plugin_build.build_plugin(log=lambda m: None)
    try:
        start, stop = workloads.roi_addresses(workload)
    except Exception:   # noqa: BLE001 - a workload without markers: the whole run
        start = stop = None
    cfgs = [c if isinstance(c, dict) else trace.cache_config(c) for c in caches]
    with tempfile.TemporaryDirectory(prefix="linepack-eval-") as tmp:
        outs = [os.path.join(tmp, f"c{k}.bin") for k in range(len(cfgs))]
        args = [trace.plugin_args(o, cache=c, start=start, stop=stop) for o, c in zip(outs, cfgs)]
        extra = []
        for k in range(1, len(cfgs)):
            so_k = os.path.join(tmp, f"plugin{k}.so")
            shutil.copy(so, so_k)
            extra += ["-plugin", trace.plugin_option(so_k, args[k])]
        t0 = time.time()
        res = qemu.run_workload(path, workload=workload, loops=loops, icount=True, plugin=so,
                                plugin_args=dict(a.split("=", 1) for a in args[0]),
                                extra_args=extra, timeout=timeout)
        wall = time.time() - t0
        return {c["name"]: trace.read_plugin_output(o) for c, o in zip(cfgs, outs)}, res, wall


def measure_caches(path, label=None, workload="vfs-mix", loops=None, caches=("intel-32k-8w",),
                   repeat=1, log=None):
    """Like measure() for several cache models at once: {cache name: Measurement}."""
    out = {}
    tsize = text_size(path)
    label = label or os.path.basename(path)
    for k in range(repeat):
        trs, res, wall = run_caches(path, workload, loops, caches)
        for name, tr in trs.items():
            out.setdefault(name, Measurement(label, path, [])).runs.append(
                {"instructions": tr.kernel_instructions, "fetches": tr.fetches,
                 "misses": tr.misses, "miss_rate": tr.misses / tr.fetches if tr.fetches else 0.0,
                 "hot_lines": executed_lines(tr), "text_size": tsize, "wall": wall,
                 "result_line": res.result_line})
        if log:
            log(f"{label} run {k + 1}/{repeat}: " + ", ".join(
                f"{n} {tr.misses:,} misses" for n, tr in trs.items()) +
                f"; {next(iter(trs.values())).kernel_instructions:,} instructions ({wall:.1f} s)")
    return out
