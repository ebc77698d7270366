"""evaluate_layouts(): strategies on one base image, what-if (replay) or booted."""

import time

from ..errors import BadInput

from .layouts import NEEDS_PROFILE, Layouts, blocks_from_trace, hotness_from_trace


def _pct(growth, tsize):
    return 100.0 * growth / tsize if tsize else 0.0


def evaluate_layouts(base, specs, caches, workload="vfs-mix", loops=None, whatif=True,
                     profile=None, repeat=1, heatmap=None, skip_unfit=False, log=None,
                     workloads=None, parallel=None, scheduler=None, reuse=False, sets=False,
                     vmlinuz=None):
    """Rows (one per layout, workload and cache model) and extra facts for the JSON output.

    skip_unfit: a layout the planner refuses (it would run into pinned code) is
    left out with a note instead of failing the whole run (sweeps). ``workloads``:
    several workloads (default: ``workload``); a derived profile comes from the
    first one's recorded run. Boots and trace recordings run as independent jobs
    (``parallel`` processes, or the Dask cluster at ``scheduler``). ``dense:N`` specs
    (what-if only) are the dense reference of each workload's own trace (dense.py).
    sets: also the per-set load of every what-if row (``extra["sets"]``).
    vmlinuz: the base's boot image, for a base without link relocations.
    """
    from ..relayout.plan import LayoutError
    from . import dense
    from . import whatif as wi
    from .booted import measure_many, text_size
    log = log or (lambda m: None)
    from ..profile import workloads as wls
    workloads = list(workloads or [workload])
    workload = workloads[0]
    loops_of = {w: wls.load(w).default_loops if loops is None else int(loops) for w in workloads}
    loops = loops_of[workload]
    needs_prof = any(s.split(":")[0] in NEEDS_PROFILE for s in specs)
    L = Layouts(base, log=log, vmlinuz=vmlinuz)     # bad paths fail here, before any boot
    if any(s != "stock" and not dense.parse(s) for s in specs):
        L.check_references()
    bt = None
    t_rec = 0.0
    hot, build_id, calls, blocks, prof_src = {}, None, [], None, None
    if profile:     # a bad profile fails here, before any boot
        from ..image.context import ImageContext
        from ..image.elf import ElfImage
        from ..relayout.driver import check_profile, load_profile_full
        lp = load_profile_full(profile, base)
        im = ElfImage(base)
        check_profile(im, ImageContext.of(im).functions, lp.hotness, lp.build_id)
        if needs_prof:
            hot, build_id, calls, blocks = lp.hotness, lp.build_id, lp.calls, lp.blocks
            prof_src = profile
    traces = {}
    if whatif or heatmap or (needs_prof and not profile):
        t0 = time.time()
        traces = wi.record_traces(base, workloads if whatif else [workload], loops_of, caches,
                                  log=log, parallel=parallel, scheduler=scheduler)
        bt = traces[workload]
        t_rec = time.time() - t0
    if needs_prof:
        if not profile:
            hot = hotness_from_trace(bt, base)
            prof_src = f"derived from the recorded {workload} run ({loops} loops)"
            log(f"profile: {prof_src}, {len(hot)} functions")
    L.hotness, L.calls, L.profile_build_id, L.blocks = hot or {}, list(calls or ()), build_id, \
        blocks
    if blocks is None and bt is not None:
        # block-level layouts need executed blocks; function-level ones keep the
        # function counts they always had without a profile
        L.trace_blocks = blocks_from_trace(bt)
    tsize = text_size(base)
    rows, extra = [], {"json": {"base": base, "profile": prof_src, "loops": loops}}
    tables = {}
    extra["notes"] = []
    booted = []          # (spec, image, growth): booted after every layout is rewritten
    extra["sets"] = []
    line_sizes = list(dict.fromkeys(int(c["line"]) for c in caches))
    for spec in specs:
        t0 = time.perf_counter()
        label = spec
        ds = dense.parse(spec)
        if ds:
            if not whatif:
                raise BadInput(f"--layout {spec} is what-if only (the packing cannot boot): "
                               "add --whatif")
            for w in workloads:
                t0 = time.perf_counter()
                dl = dense.DenseLayout(traces[w], every=ds[2], order=ds[1])
                tabs = {n: (dl.table(traces[w].blocks, n), {"split_blocks": 0,
                                                            "padding_blocks": 0})
                        for n in line_sizes}
                plan_s = time.perf_counter() - t0
                rs = wi.whatif(traces[w], None, caches, spec, tables=tabs)
                for r in rs:
                    bmeta = traces[w].meta.get("booted", {}).get(r["cache"], {})
                    r.pop("booted_misses", None)
                    r.update({"layout": label, "mode": "whatif", "workload": w,
                              "instructions": bmeta.get("instructions", r["instructions"]),
                              "text_growth_bytes": None, "text_growth_pct": None,
                              "dense_bytes": dl.bytes, "dense_intervals": dl.intervals,
                              "plan_s": plan_s,
                              "time_s": plan_s + r["translate_s"] + r["replay_s"]})
                    rows.append(r)
                extra["notes"].append(f"{spec} ({w}): {dl.describe()}")
                if sets:
                    _set_rows(extra["sets"], traces[w], tabs, caches, label, w)
                if heatmap and w == workload and spec in (specs[0], specs[-1]):
                    tables[spec] = dl.table(bt.blocks, 64)
            continue
        try:
            pm = L.plan(spec)
        except LayoutError as e:
            if not skip_unfit:
                raise
            if whatif and spec.startswith("align-all:"):
                pm = L.relinked(spec)
                label = spec + "*"
                extra["notes"].append(
                    f"{label}: the rewriter cannot produce it ({e}); replayed as a hypothetical "
                    "relink that moves the pinned entry code along")
            else:
                extra["notes"].append(f"{spec}: left out: {e}")
                log(f"{spec}: left out: {e}")
                continue
        plan_s = time.perf_counter() - t0
        growth = pm.growth if pm else 0
        if whatif:
            for w in workloads:
                amap = pm.amap if pm else None
                t1 = time.perf_counter()
                tabs = {n: wi.translate(traces[w].blocks, amap, n) for n in line_sizes}
                translate_s = time.perf_counter() - t1
                rs = wi.whatif(traces[w], amap, caches, spec, tables=tabs)
                if sets:
                    _set_rows(extra["sets"], traces[w], tabs, caches, label, w)
                for r in rs:
                    bmeta = traces[w].meta.get("booted", {}).get(r["cache"], {})
                    r.update({"layout": label, "mode": "whatif",
                              "instructions": bmeta.get("instructions", r["instructions"]),
                              "text_growth_bytes": growth, "text_growth_pct": _pct(growth, tsize),
                              "plan_s": plan_s,
                              "time_s": plan_s + r["translate_s"] + r["replay_s"]})
                    r["workload"] = w
                    r["translate_s"] = translate_s
                    r["time_s"] += translate_s
                    if spec != "stock":
                        r.pop("booted_misses", None)
                    rows.append(r)
        else:
            img = L.image_path(spec)
            pm = L.plan(spec)
            booted.append((spec, img, pm.growth if pm else 0))
        if heatmap and spec in (specs[0], specs[-1]):
            tables[spec] = wi.translate(bt.blocks, pm.amap if pm else None, 64)[0]
    if booted:
        from .table import measurement_rows
        ms = measure_many([(img, spec) for spec, img, _ in booted], workloads, loops, caches,
                          repeat=repeat, log=log, parallel=parallel, scheduler=scheduler,
                          reuse=reuse)
        for spec, img, growth in booted:
            for w in workloads:
                for r in measurement_rows(ms[(img, spec, w)], spec, _pct(growth, tsize)):
                    r["text_growth_bytes"] = growth
                    r["workload"] = w
                    rows.append(r)
    if heatmap:
        from . import plots
        panels = []
        for spec in dict.fromkeys([specs[0], specs[-1]]):
            lines, heat = wi.line_heat(bt, tables[spec])
            panels.append((spec, lines, heat / float(loops)))
        plots.heatmap(panels, heatmap, title=f"executed kernel text lines, {workload}")
        log(f"wrote {heatmap}")
    if bt is not None:
        extra["json"]["trace"] = {"block_executions": bt.executions,
                                  "distinct_blocks": int(len(bt.blocks)),
                                  "warmup_executions": int(len(bt.warm)),
                                  "record_s": t_rec, "boot_wall": bt.meta.get("boot_wall"),
                                  "booted": bt.meta.get("booted")}
    return rows, extra


def _set_rows(out, bt, tabs, caches, label, workload):
    """Per-set load of one layout on one workload, each cache model (appended to out)."""
    from . import dense
    for c in caches:
        lines, acc = dense.set_load(bt, tabs[int(c["line"])][0], c)
        out.append({"layout": label, "workload": workload, "cache": c["name"],
                    "ways": int(c["ways"]), "loop_lines_per_set": lines.tolist(),
                    "accesses_per_set": [round(float(a), 3) for a in acc],
                    **dense.summarize_sets(lines, acc, int(c["ways"]))})


__all__ = ["evaluate_layouts"]
