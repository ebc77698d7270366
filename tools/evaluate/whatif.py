"""What-if replay: record a workload's kernel block trace once, then replay it
through an L1i model under any layout plan, without rewriting or booting.

Recording (``record_trace``) boots the stock kernel once with the plugin
loaded several times (QEMU accepts many ``-plugin`` options; each instance is
a copy of the .so so they do not share state):

- the measuring instance: the workload's region of interest (``start=``
  ``linepack_roi_begin``, ``stop=`` ``linepack_roi_end``), the L1i model on,
  ``tbtrace=`` writing every executed kernel block in order;
- a warm-up instance: ``tbtrace=`` from the workload's ``_start`` to
  ``linepack_roi_begin`` (the cache model runs before the window in the
  plugin too, so replay needs the blocks that warmed it; the workload's own
  set-up is enough to reach the exact same LRU state);
- one more instance per extra cache model, for validation numbers.

The trace is stored compactly (``BlockTrace``): the distinct blocks (vaddr,
size, instruction count) and the execution sequence as uint32 indices.

Replay (``replay``) maps each distinct block's byte range through the plan's
AddressMap (function-relative: a block moves with the unit holding it) and
derives its cache lines; a block is one contiguous run of instructions, so
its merged line list is every line from its first byte to its last, which is
exactly the plugin's per-instruction rule (an instruction straddling a line
touches both). The C core in ``replay.c`` then runs the sequence.
"""

import hashlib
import json
import os
import time

import numpy as np

from ..errors import BadInput
from ..io import atomic_output
from .cachemodel import CacheState, LineTable

TRACE_FORMAT = "linepack-blocktrace"
TRACE_VERSION = 1


class BlockTrace:
    """Distinct blocks + execution sequence (warm-up and measured window)."""

    def __init__(self, blocks, warm, ids, meta):
        self.blocks = blocks          # structured: vaddr u8, size u4, ninsns u4
        self.warm = np.ascontiguousarray(warm, dtype=np.uint32)
        self.ids = np.ascontiguousarray(ids, dtype=np.uint32)
        self.meta = dict(meta)

    @property
    def executions(self):
        return len(self.ids)

    def block_counts(self):
        """Executions of each distinct block inside the window."""
        return np.bincount(self.ids, minlength=len(self.blocks)).astype(np.uint64)

    @property
    def instructions(self):
        return int(np.dot(self.block_counts(), self.blocks["ninsns"].astype(np.uint64)))

    @classmethod
    def from_records(cls, warm_rec, roi_rec, meta):
        """From raw tbtrace records (TBTRACE_DTYPE arrays)."""
        allr = np.concatenate([warm_rec, roi_rec])
        if not len(allr):
            raise BadInput("empty block trace: no kernel block ran inside the workload's window")
        # unique on (vaddr, size, ninsns) through a u64 key: vaddr rank, size, ninsns
        va_u, va_inv = np.unique(allr["vaddr"], return_inverse=True)
        key = ((va_inv.astype(np.uint64) << np.uint64(32)) |
               (allr["size"].astype(np.uint64) << np.uint64(12)) |
               allr["ninsns"].astype(np.uint64))
        if (allr["size"] >= (1 << 20)).any() or (allr["ninsns"] >= (1 << 12)).any():
            raise BadInput("block trace with an implausible block (size >= 1 MiB)")
        ukey, ids = np.unique(key, return_inverse=True)
        blocks = np.zeros(len(ukey), dtype=[("vaddr", "<u8"), ("size", "<u4"), ("ninsns", "<u4")])
        blocks["vaddr"] = va_u[(ukey >> np.uint64(32)).astype(np.int64)]
        blocks["size"] = ((ukey >> np.uint64(12)) & np.uint64(0xFFFFF)).astype(np.uint32)
        blocks["ninsns"] = (ukey & np.uint64(0xFFF)).astype(np.uint32)
        ids = ids.astype(np.uint32)
        nw = len(warm_rec)
        return cls(blocks, ids[:nw], ids[nw:], meta)

    def save(self, path):
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        meta = dict(self.meta, format=TRACE_FORMAT, version=TRACE_VERSION)
        with atomic_output(path) as f:
            np.savez(f, blocks=self.blocks, warm=self.warm, ids=self.ids,
                     meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8))

    @classmethod
    def load(cls, path):
        try:
            z = np.load(path, allow_pickle=False)
            meta = json.loads(bytes(z["meta"]).decode())
            if meta.get("format") != TRACE_FORMAT or meta.get("version") != TRACE_VERSION:
                raise ValueError("not a linepack block trace of this version")
            return cls(z["blocks"], z["warm"], z["ids"], meta)
        except (OSError, ValueError, KeyError) as e:
            raise BadInput(f"{path}: not a linepack block trace ({e})") from None


# ---- recording ---------------------------------------------------------------

def _workload_entry(workload):
    """Address of ``_start`` in the workload's static binary (warm-up start marker)."""
    from elftools.elf.elffile import ELFFile

    from ..profile import workloads
    binary = workloads.build(workload)
    with open(binary, "rb") as f:
        elf = ELFFile(f)
        return int(elf["e_entry"]), os.path.basename(binary)


def _cache_cfgs(caches):
    from ..profile.trace import cache_config
    out = []
    for c in caches:
        out.append(c if isinstance(c, dict) else cache_config(c))
    return out


def trace_cache_path(kernel, workload, loops):
    """Where record_trace caches the trace of (kernel build, workload binary, loops, plugin,
    boot set-up)."""
    from ..image.elf import ElfImage
    from ..profile import plugin_build
    from ..targets import cache_dir
    bid = ElfImage(kernel).build_id or hashlib.sha256(os.path.abspath(kernel).encode()).hexdigest()
    _, wbin = _workload_entry(workload)
    so = plugin_build.build_plugin(log=lambda m: None)
    with open(so, "rb") as f:
        ptag = hashlib.sha256(f.read()).hexdigest()[:10]
    # the boot set-up (configs/kernel.toml: command line, memory, QEMU options) shapes the run
    from ..profile.qemu import kernel_defaults
    ktag = hashlib.sha256(json.dumps(kernel_defaults(), sort_keys=True).encode()).hexdigest()[:8]
    return os.path.join(cache_dir(), "evaluate", "traces", "w1-" +
                        f"{bid[:20]}-{wbin}-{loops}-{ptag}-{ktag}.npz")


WARM_START_SYMBOL = "free_initmem"


def warm_start(kernel, workload):
    """Where the warm-up trace starts: the kernel's ``free_initmem`` (late boot,
    right before /init runs) when it has one, else the workload's ``_start``."""
    from ..image.elf import ElfImage
    a = ElfImage(kernel).symbol_address(WARM_START_SYMBOL)
    return int(a) if a else _workload_entry(workload)[0]


def record_trace(kernel, workload="vfs-mix", loops=None, caches=("intel-32k-8w",), log=None,
                 timeout=1800, cache=True):
    """Boot ``kernel`` once and record the workload's block trace (cached on disk).

    Returns a BlockTrace whose ``meta["booted"][cache name]`` holds the plugin's
    own fetches/misses for each cache model simulated during that boot.
    """
    from ..profile import workloads
    log = log or (lambda m: None)
    wl = workloads.load(workload)
    loops = wl.default_loops if loops is None else int(loops)
    cfgs = _cache_cfgs(caches)
    path = trace_cache_path(kernel, workload, loops) if cache else None
    if path and os.path.exists(path):
        bt = BlockTrace.load(path)
        if all(c["name"] in bt.meta.get("booted", {}) for c in cfgs):
            log(f"block trace from cache {path}")
            return bt
    job = trace_job(kernel, workload, loops, cfgs)
    log(f"booting {os.path.basename(kernel)} once to record the {workload} block trace "
        f"({loops} loops)")
    from ..profile.runner import run_job
    bt = trace_from_result(job, run_job(job), cfgs)
    log(f"trace: {bt.executions:,} block executions ({len(bt.blocks):,} distinct blocks), "
        f"{len(bt.warm):,} warm-up; boot {bt.meta['boot_wall']:.1f} s")
    if path:
        bt.save(path)
    return bt


def record_traces(kernel, workloads, loops, caches, log=None, parallel=None, scheduler=None):
    """record_trace for several workloads, the boots as independent jobs (a process
    pool or a Dask cluster); ``loops``: {workload: loops}. Returns {workload: BlockTrace}."""
    from ..profile.runner import run_jobs
    log = log or (lambda m: None)
    cfgs = _cache_cfgs(caches)
    out, jobs = {}, []
    for w in workloads:
        path = trace_cache_path(kernel, w, loops[w])
        if os.path.exists(path):
            bt = BlockTrace.load(path)
            if all(c["name"] in bt.meta.get("booted", {}) for c in cfgs):
                log(f"block trace from cache {path}")
                out[w] = bt
                continue
        log(f"booting {os.path.basename(kernel)} to record the {w} block trace ({loops[w]} loops)")
        jobs.append((w, path, trace_job(kernel, w, loops[w], cfgs)))
    results = run_jobs([j for _, _, j in jobs], parallel=parallel, scheduler=scheduler, log=log)
    for (w, path, job), res in zip(jobs, results):
        bt = out[w] = trace_from_result(job, res, cfgs)
        log(f"{w} trace: {bt.executions:,} block executions ({len(bt.blocks):,} distinct "
            f"blocks), {len(bt.warm):,} warm-up; boot {bt.meta['boot_wall']:.1f} s")
        bt.save(path)
    return {w: out[w] for w in workloads}


def trace_job(kernel, workload, loops, cfgs, timeout=1800):
    """The QemuJob that records a block trace: the measuring instance (first cache
    model, loop window, tbtrace), the warm-up instance (tbtrace from late boot to
    the window) and one instance per further cache model."""
    from ..profile import workloads
    from ..profile.runner import SYSTEM, Plugin, QemuJob
    start, stop = workloads.roi_addresses(workload)
    entry = warm_start(kernel, workload)
    plugins = [Plugin(cache=cfgs[0], start=start, stop=stop, tbtrace=True),
               Plugin(start=entry, stop=start, tbtrace=True)]
    plugins += [Plugin(cache=c, start=start, stop=stop) for c in cfgs[1:]]
    return QemuJob(SYSTEM, kernel, plugins, workload=workload, loops=loops, timeout=timeout,
                   label=os.path.basename(kernel))


def trace_from_result(job, res, cfgs):
    """The BlockTrace of a finished trace_job."""
    from ..image.elf import ElfImage
    traces = [res.traces[0]] + res.traces[2:]
    booted = {}
    for c, tr in zip(cfgs, traces):
        booted[c["name"]] = {"fetches": tr.fetches, "misses": tr.misses,
                             "instructions": tr.kernel_instructions,
                             "size": c["size"], "ways": c["ways"], "line": c["line"]}
    roi = res.tbtraces[0]
    warm = res.tbtraces[1] if res.tbtraces[1] is not None else roi[:0]
    kernel, workload = job.image, job.workload
    meta = {"kernel": os.path.abspath(kernel), "build_id": ElfImage(kernel).build_id,
            "workload": workload, "workload_binary": _workload_entry(workload)[1],
            "loops": job.loops, "result_line": res.result_line, "boot_wall": res.wall,
            "booted": booted}
    return BlockTrace.from_records(warm, roi, meta)


# ---- translation through a layout ---------------------------------------------

def translate(blocks, amap, line):
    """LineTable of the distinct blocks at their addresses under ``amap``.

    ``amap``: an AddressMap (None or identity: stock). Returns (table, stats)
    where stats counts blocks split across units and blocks in dropped padding.
    """
    va = blocks["vaddr"].astype(np.uint64)
    size = np.maximum(blocks["size"].astype(np.uint64), np.uint64(1))
    stats = {"split_blocks": 0, "padding_blocks": 0}
    if amap is None or not len(amap):
        return LineTable.from_ranges(va, size, line), stats
    end1 = va + size - np.uint64(1)
    p0, p1 = amap.piece(va), amap.piece(end1)
    in_ext0 = amap.in_extent(va)
    new, ok = amap.map(va)
    simple = (p0 == p1) & ((p0 >= 0) | ~(in_ext0 | amap.in_extent(end1)))
    new = new.astype(np.uint64)
    table = LineTable.from_ranges(new, size, line)
    if simple.all():
        return table, stats
    # Rare: a block crossing units or running in padding; split it at piece bounds.
    shift = int(line).bit_length() - 1
    lists = [table.block(b).tolist() for b in range(len(blocks))]
    for b in np.nonzero(~simple)[0].tolist():
        a, e = int(va[b]), int(va[b]) + int(size[b])
        out = []
        while a < e:
            i = int(np.searchsorted(amap.old_start, np.uint64(a), side="right")) - 1
            if i >= 0 and a < int(amap.old_end[i]):
                hi, delta = min(e, int(amap.old_end[i])), int(amap.new_start[i]) - int(amap.old_start[i])
            else:
                nxt = int(amap.old_start[i + 1]) if i + 1 < len(amap.old_start) else e
                hi = min(e, nxt)
                if bool(amap.in_extent(np.array([a], np.uint64))[0]) and i >= 0:
                    # dropped padding after unit i: assume it followed its unit
                    delta = int(amap.new_start[i]) - int(amap.old_start[i])
                    stats["padding_blocks"] += 1
                else:
                    delta = 0
            for ln in range((a + delta) >> shift, ((hi - 1 + delta) >> shift) + 1):
                if not out or out[-1] != ln:
                    out.append(ln)
            a = hi
        lists[b] = out
        stats["split_blocks"] += 1
    cnt = np.array([len(x) for x in lists], dtype=np.int64)
    off = np.cumsum(cnt) - cnt
    lines = np.fromiter((ln for x in lists for ln in x), dtype=np.uint64, count=int(cnt.sum()))
    return LineTable(off, cnt, lines), stats


# ---- replay ------------------------------------------------------------------------

def replay(bt, table, cfg, per_block=False):
    """Replay a BlockTrace through one cache model; returns a result dict."""
    st = CacheState(cfg).poison()
    t0 = time.perf_counter()
    if len(bt.warm):
        st.replay(bt.warm, table, count=False)
    unknown = st.unknown_ways()
    pb = None
    if per_block:
        pb = (np.zeros(len(table), np.uint64), np.zeros(len(table), np.uint64))
    st.replay(bt.ids, table, count=True, per_block=pb)
    out = {"fetches": st.fetches, "misses": st.misses,
           "miss_rate": st.misses / st.fetches if st.fetches else 0.0,
           "replay_s": time.perf_counter() - t0, "warm_unknown_ways": unknown}
    if per_block:
        out["block_fetches"], out["block_misses"] = pb
    return out


def line_heat(bt, table):
    """(line numbers, executions) of every cache line the window executed."""
    counts = bt.block_counts()
    reps = np.repeat(counts, table.cnt.astype(np.int64))
    lines, inv = np.unique(table.lines, return_inverse=True)
    heat = np.bincount(inv, weights=reps.astype(np.float64), minlength=len(lines))
    keep = heat > 0
    return lines[keep], heat[keep]


def hot_lines(bt, table):
    counts = bt.block_counts()
    ran = np.repeat(counts > 0, table.cnt.astype(np.int64))
    return int(len(np.unique(table.lines[ran])))


def whatif(bt, amap, caches, label="", text=None, tables=None):
    """Replay ``bt`` under ``amap`` for each cache model; returns a list of result dicts.

    tables: {line size: (LineTable, stats)} already translated (e.g. the dense
    reference, which is no AddressMap); missing line sizes are translated here."""
    cfgs = _cache_cfgs(caches)
    t0 = time.perf_counter()
    res = []
    tables = dict(tables or {})
    for c in cfgs:
        if c["line"] not in tables:
            tables[c["line"]] = translate(bt.blocks, amap, c["line"])
    translate_s = time.perf_counter() - t0
    instr = bt.instructions
    for c in cfgs:
        table, stats = tables[c["line"]]
        r = replay(bt, table, c)
        r.update({"label": label, "cache": c["name"], "instructions": instr,
                  "hot_lines": hot_lines(bt, table), "translate_s": translate_s})
        r.update(stats)
        if text:
            r.update(text)
        booted = bt.meta.get("booted", {}).get(c["name"])
        if booted and (amap is None or amap.is_identity()):
            r["booted_misses"] = booted["misses"]
        res.append(r)
    return res
