"""Generalization matrix: does a layout trained on some workloads help the others?

``linepack evaluate --kernel BASE --train W1,W2,... --test W1,W2,...``:

1. one booted, plugin-traced run of each workload named in --train or --test
   (``whatif.record_trace``, cached on disk like every evaluate trace);
2. a profile of each training workload derived from its run (per-iteration
   function counts, as evaluate derives them), and a merged one: each training
   profile normalised to the same per-iteration total (the mean of theirs)
   before the weighted sum, as ``linepack profile --merge`` does;
3. a layout per strategy (``--strategy``, default pack; ``pack,blocks`` for
   both) and training profile, one from the merged profile, and, when at least
   three workloads train, "leave-one-out" layouts merged from all training
   workloads but one. Each profile carries its run's executed blocks (per
   iteration, merged with the same normalisation), which ``pack`` uses to place
   small functions and block-level strategies need;
4. the what-if replay of every test workload's recorded run under every layout
   (and under stock): simulated misses per (layout, test workload) cell, as the
   change against stock. The what-if replay follows the booted measurement
   within ~1% on rewritten kernels (README, the evaluate table);
5. with ``booted`` (``--booted``), every layout is also rewritten and booted on
   every test workload under the plugin (what-if stays beside it): the matrix
   of booted misses, each workload's result line checked against stock's and
   its kernel instructions against stock's (as evaluate does for layouts);
6. the perturbation floor of each test workload: its replay under "null"
   layouts that move one function no workload of the matrix ran to the front of
   its region (shifting the code before it by the function's size, and nothing
   else). A workload whose loop nearly fits the cache changes by several percent
   under such a move (README); a cell inside the floor is not a layout effect.
"""

import numpy as np

from ..errors import BadInput


NULL_LAYOUTS = 5           # perturbation-floor layouts per matrix


def merge_factors(hots, weights=None):
    """Scale of each profile in a merge: weight share x (mean total / its total)."""
    weights = [1.0] * len(hots) if weights is None else [float(w) for w in weights]
    totals = [float(sum(h.values())) for h in hots]
    if any(t <= 0 for t in totals):
        raise BadInput("a training workload ran no kernel code inside its loop")
    mean = float(np.mean(totals))
    wsum = float(sum(weights))
    return [w / wsum * mean / t for w, t in zip(weights, totals)]


def merge_hotness(hots, weights=None):
    """One {function: per-iteration count} from several, each normalised to the same total."""
    out = {}
    for h, f in zip(hots, merge_factors(hots, weights)):
        for k, v in h.items():
            out[k] = out.get(k, 0.0) + v * f
    return out


def merge_blocks(blocks, factors):
    """One (address, size, count) block list from several, counts scaled by ``factors``
    (merge_factors of the same profiles); a block in several runs sums its counts."""
    addr = np.concatenate([np.asarray(b[0], np.uint64) for b in blocks])
    size = np.concatenate([np.asarray(b[1], np.uint64) for b in blocks])
    cnt = np.concatenate([np.asarray(b[2], np.float64) * f for b, f in zip(blocks, factors)])
    key = np.stack([addr, size], axis=1)
    uniq, inv = np.unique(key, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    total = np.bincount(inv, weights=cnt, minlength=len(uniq))
    if any(getattr(b, "first", None) is None for b in blocks):
        return uniq[:, 0].copy(), uniq[:, 1].copy(), total
    # workload by workload: run i's first runs as i + a fraction of its window, and a
    # block in several runs takes the earliest: the first workload's hot code in the
    # order it first ran, then the code the second one adds, and so on (measured on the
    # eight-workload matrix, docs/evaluate.md: interleaving all workloads' code by the
    # fraction alone put a nearly fitting loop's lines on too few sets)
    frac = np.concatenate([i + np.asarray(b.first, np.float64) / (float(np.max(b.first)) + 1.0)
                           for i, b in enumerate(blocks)])
    first = np.full(len(uniq), np.inf)
    np.minimum.at(first, inv, frac)
    from ..relayout.block_order import ExecutedBlocks
    return ExecutedBlocks((uniq[:, 0].copy(), uniq[:, 1].copy(), total), first=first)


def null_units(units, ran_addresses, count, seed):
    """``count`` movable units (64 B .. 4 KiB) holding none of ``ran_addresses``
    (every block any workload of the matrix ran), chosen by a seeded draw."""
    ran = np.zeros(len(units.size), dtype=bool)
    ui = units.find(np.asarray(ran_addresses, dtype=np.uint64))
    ran[ui[ui >= 0]] = True
    ok = (~np.asarray(units.pinned, bool)) & ~ran & (units.size >= 64) & (units.size <= 4096)
    cand = np.nonzero(ok)[0]
    if not len(cand):
        return []
    rng = np.random.default_rng(seed)
    pick = rng.choice(len(cand), size=min(int(count), len(cand)), replace=False)
    return sorted(int(cand[i]) for i in pick)


def generalization_matrix(base, train, test, strategy="pack", caches=("intel-32k-8w",),
                          loops=None, weights=None, log=None, parallel=None, scheduler=None,
                          null_layouts=NULL_LAYOUTS, booted=False):
    """{"layouts": [...], "test": [...], "cells": {(layout, workload, cache): row},
    "floor": {(workload, cache): [change under each null layout]}, ...}.

    ``strategy``: one layout strategy or a list of them (each gets its rows)."""
    from . import whatif as wi
    from .layouts import Layouts, blocks_from_trace, hotness_from_trace
    log = log or (lambda m: None)
    strategies = [strategy] if isinstance(strategy, str) else list(dict.fromkeys(strategy))
    train, test = list(dict.fromkeys(train)), list(dict.fromkeys(test))
    if not train or not test:
        raise BadInput("--train and --test each need at least one workload")
    if not strategies:
        raise BadInput("--strategy needs at least one layout strategy")
    if weights is not None and len(weights) != len(train):
        raise BadInput(f"{len(weights)} weights for {len(train)} training workloads")
    loops = loops or {}
    from ..profile import workloads as wls
    names = list(dict.fromkeys(train + test))
    loops = {w: wls.load(w).default_loops if loops.get(w) is None else int(loops[w])
             for w in names}
    traces = wi.record_traces(base, names, loops, caches, log=log, parallel=parallel,
                              scheduler=scheduler)
    hot = {w: hotness_from_trace(traces[w], base) for w in train}
    blk = {w: blocks_from_trace(traces[w]) for w in train}
    wmap = dict(zip(train, weights)) if weights is not None else {w: 1.0 for w in train}

    def merged(ws):
        f = merge_factors([hot[w] for w in ws], [wmap[w] for w in ws])
        return (merge_hotness([hot[w] for w in ws], [wmap[w] for w in ws]),
                merge_blocks([blk[w] for w in ws], f))

    profiles = {w: (hot[w], blk[w]) for w in train}
    if len(train) > 1:
        profiles["merged"] = merged(train)
    if len(train) > 2:
        for w in train:
            profiles[f"all-{w}"] = merged([x for x in train if x != w])
    L = Layouts(base, log=log)              # one instance: the disassembly is shared
    amaps = {"stock": None}
    layouts = ["stock"]
    made = {}                               # label -> (strategy, hotness, blocks)
    for strat in strategies:
        for name, (h, b) in profiles.items():
            label = f"{strat}[{name}]"
            log(f"planning {label}")
            L.hotness, L.blocks = h, b
            pm = L.plan(strat)
            amaps[label] = pm.amap if pm else None
            layouts.append(label)
            made[label] = (strat, h, b)
    cells = {}
    for label in layouts:
        for w in test:
            for r in wi.whatif(traces[w], amaps[label], caches, label):
                cells[(label, w, r["cache"])] = r
    floor = perturbation_floor(L, traces, test, caches, null_layouts, log, cells)
    m = {"layouts": layouts, "test": test, "train": train, "strategy": ",".join(strategies),
         "caches": [c if isinstance(c, str) else c["name"] for c in caches], "cells": cells,
         "floor": floor, "loops": {w: traces[w].meta.get("loops") for w in traces}}
    if booted:
        m["booted"], m["problems"] = boot_cells(L, base, made, test, loops, caches, log,
                                                parallel, scheduler)
    return m


BOOT_BATCH = 8             # images rewritten, then booted, at a time (the layout cache keeps 12)


def boot_cells(L, base, made, test, loops, caches, log, parallel=None, scheduler=None):
    """Rewrite every layout and boot it on every test workload: ({(layout, workload,
    cache): {"misses", "fetches", "instructions", "result_line"}}, [problems])."""
    from .booted import instruction_tolerance, measure_many
    labels = ["stock"] + list(made)
    cells = {}
    for i in range(0, len(labels), BOOT_BATCH):
        images = []
        for label in labels[i:i + BOOT_BATCH]:
            if label == "stock":
                images.append((base, label))
                continue
            strat, h, b = made[label]
            L.hotness, L.blocks = h, b
            images.append((L.image_path(strat), label))
        for w in test:
            ms = measure_many(images, [w], loops[w], caches, log=log, parallel=parallel,
                              scheduler=scheduler)
            for (path, label, _), by_cache in ms.items():
                for cache, meas in by_cache.items():
                    cells[(label, w, cache)] = {
                        "misses": int(meas.median("misses")), "fetches": int(meas.median("fetches")),
                        "instructions": int(meas.median("instructions")),
                        "result_line": meas.runs[0]["result_line"]}
    problems = []
    cache = next(iter(cells))[2]
    for w in test:
        b = cells[("stock", w, cache)]
        for label in labels[1:]:
            r = cells[(label, w, cache)]
            tol = instruction_tolerance(made[label][0])
            d = (r["instructions"] - b["instructions"]) / b["instructions"] \
                if b["instructions"] else 0.0
            if abs(d) > tol:
                problems.append(f"{label} on {w}: {r['instructions']:,} kernel instructions vs "
                                f"{b['instructions']:,} on stock ({d:+.3%}): not the same work")
            if r["result_line"] != b["result_line"]:
                problems.append(f"{label} on {w}: workload result differs from stock's: "
                                f"{r['result_line']!r}")
    return cells, problems


def perturbation_floor(L, traces, test, caches, count, log, stock):
    """{(workload, cache): [change vs stock under each null layout]} (see the module doc);
    ``stock``: the matrix's cells, whose stock replays are the baseline."""
    from ..relayout import strategies
    from ..relayout.plan import make_plan
    from . import whatif as wi
    from .layouts import PlanMap
    if not count:
        return {}
    units, functions = L._build_units()
    ran = np.concatenate([bt.blocks["vaddr"].astype(np.uint64) for bt in traces.values()])
    picks = null_units(units, ran, count, seed=int(L.build_id[:8], 16))   # build-id: hex
    log(f"perturbation floor: {len(picks)} null layouts (one never-run function moved each)")
    out = {}
    for u in picks:
        heat = np.zeros(len(units.size), dtype=np.float64)
        heat[u] = 1.0
        pm = PlanMap.from_plan(make_plan(units, strategies.get("pack"), heat, functions=functions))
        for w in test:
            for r in wi.whatif(traces[w], pm.amap, caches, w):
                b = stock[("stock", w, r["cache"])]["misses"]
                out.setdefault((w, r["cache"]), []).append((r["misses"] - b) / b if b else 0.0)
    return out


def change(m, layout, workload, cache, source="cells"):
    """Misses of (layout, workload) relative to stock: -0.10 = 10% fewer.
    ``source``: "cells" (what-if replay) or "booted"."""
    base = m[source][("stock", workload, cache)]["misses"]
    got = m[source][(layout, workload, cache)]["misses"]
    return (got - base) / base if base else 0.0


BAR = 0.01                # the bar: no cell worse than stock by more than 1%


def floor_range(m, workload, cache):
    """(lowest, highest) change under the null layouts, or None without a floor."""
    f = (m.get("floor") or {}).get((workload, cache))
    return (min(f), max(f)) if f else None


def verdict(m, cache, bar=BAR, source="cells"):
    """Cells worse than stock by more than ``bar``; and those also beyond the
    workload's perturbation floor (worse than its worst null layout)."""
    worse, beyond = [], []
    for lay in m["layouts"]:
        if lay == "stock":
            continue
        for w in m["test"]:
            c = change(m, lay, w, cache, source)
            if c > bar:
                worse.append((lay, w, c))
                fr = floor_range(m, w, cache)
                if fr is None or c > max(fr[1], bar):
                    beyond.append((lay, w, c))
    return worse, beyond


def format_matrix(m):
    out = []
    sources = [("cells", "simulated kernel-mode misses vs stock, {cache} (what-if replay; rows: "
                         "layout trained on, columns: test workload)")]
    if m.get("booted"):
        sources.append(("booted", "kernel-mode misses vs stock, {cache}, BOOTED (every layout "
                                  "rewritten and booted on every test workload)"))
    for cache in m["caches"]:
        for source, title in sources:
            out += _format_one(m, cache, source, title.format(cache=cache))
            if source == "booted":
                gap = max((abs(change(m, lay, w, cache, "booted") - change(m, lay, w, cache))
                           for lay in m["layouts"][1:] for w in m["test"]), default=0.0)
                out.append(f"booted vs what-if: largest difference {100 * gap:.2f} points")
            out.append("")
    for p in m.get("problems") or ():
        out.append(f"problem: {p}")
    return "\n".join(out).rstrip("\n")


def _format_one(m, cache, source, title):
    out = [title]
    w0 = max(len(x) for x in m["layouts"] + ["floor (null layouts)"])
    cols = [f"{w:>14}" for w in m["test"]]
    out.append(f"{'layout':<{w0}} " + " ".join(cols))
    for lay in m["layouts"]:
        cells = []
        for w in m["test"]:
            if lay == "stock":
                cells.append(f"{m[source][(lay, w, cache)]['misses']:>14,}")
            else:
                cells.append(f"{change(m, lay, w, cache, source):>+14.2%}")
        out.append(f"{lay:<{w0}} " + " ".join(cells))
    if m.get("floor"):
        cells = []
        for w in m["test"]:
            fr = floor_range(m, w, cache)
            cells.append(f"{'' if fr is None else f'{fr[0]:+.1%}..{fr[1]:+.1%}':>14}")
        out.append(f"{'floor (null layouts)':<{w0}} " + " ".join(cells))
    worse, beyond = verdict(m, cache, source=source)
    n = (len(m["layouts"]) - 1) * len(m["test"])
    out.append(f"cells worse than stock by more than {BAR:.0%}: {len(worse)} of {n}"
               + (f"; beyond the workload's perturbation floor: {len(beyond)}"
                  if m.get("floor") else ""))
    for lay, w, c in beyond:
        out.append(f"  {lay} on {w}: {c:+.2%}")
    return out


def matrix_json(m):
    return {"train": m["train"], "test": m["test"], "strategy": m["strategy"],
            "caches": m["caches"], "layouts": m["layouts"], "loops": m["loops"],
            "floor": [{"workload": w, "cache": c, "changes": v}
                      for (w, c), v in sorted((m.get("floor") or {}).items())],
            "booted_cells": [dict(r, layout=lay, workload=w, cache=c,
                                  change_vs_stock=change(m, lay, w, c, "booted"))
                             for (lay, w, c), r in sorted((m.get("booted") or {}).items())],
            "problems": list(m.get("problems") or ()),
            "cells": [{"layout": lay, "workload": w, "cache": c, "misses": r["misses"],
                       "fetches": r["fetches"], "instructions": r["instructions"],
                       "change_vs_stock": change(m, lay, w, c)}
                      for (lay, w, c), r in sorted(m["cells"].items())]}


def matrix_from_json(doc, path="matrix"):
    """The matrix ``matrix_json`` wrote, back (for ``evaluate --report``)."""
    try:
        cells = {(c["layout"], c["workload"], c["cache"]):
                 {"misses": int(c["misses"]), "fetches": int(c["fetches"]),
                  "instructions": int(c["instructions"])} for c in doc["cells"]}
        floor = {(f["workload"], f["cache"]): [float(x) for x in f["changes"]]
                 for f in doc.get("floor", [])}
        booted = {(c["layout"], c["workload"], c["cache"]):
                  {"misses": int(c["misses"]), "fetches": int(c["fetches"]),
                   "instructions": int(c["instructions"]), "result_line": c.get("result_line")}
                  for c in doc.get("booted_cells", [])}
        m = {"layouts": list(doc["layouts"]), "test": list(doc["test"]),
             "train": list(doc["train"]), "strategy": doc.get("strategy", "?"),
             "caches": list(doc["caches"]), "cells": cells, "floor": floor,
             "loops": doc.get("loops", {}), "booted": booted,
             "problems": list(doc.get("problems", []))}
        for lay in m["layouts"]:
            for w in m["test"]:
                for c in m["caches"]:
                    cells[(lay, w, c)]          # every cell present
                    if booted:
                        booted[(lay, w, c)]
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"--report: {path}: not a generalization matrix file "
                       f"({type(e).__name__}: {e})") from None
    return m


def heatmap_png(m, path, cache=None):
    """A heat map of the change vs stock (rows: trained layouts, columns: test workloads)."""
    from ..io import atomic_output
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BadInput("--plot needs matplotlib (pip install matplotlib)") from None
    cache = cache or m["caches"][0]
    rows = [lay for lay in m["layouts"] if lay != "stock"]
    source = "booted" if m.get("booted") else "cells"
    data = np.array([[100.0 * change(m, lay, w, cache, source) for w in m["test"]]
                     for lay in rows])
    lim = max(1.0, float(np.abs(data).max())) if data.size else 1.0
    fig, ax = plt.subplots(figsize=(1.3 * len(m["test"]) + 3, 0.55 * len(rows) + 1.8))
    im = ax.imshow(data, cmap="RdYlGn_r", vmin=-lim, vmax=lim, aspect="auto")
    ticks = []
    for w in m["test"]:
        fr = floor_range(m, w, cache)
        ticks.append(w if fr is None else f"{w}\nfloor {100 * fr[0]:+.0f}..{100 * fr[1]:+.0f}%")
    ax.set_xticks(range(len(m["test"])), ticks, rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    for i in range(len(rows)):
        for j in range(len(m["test"])):
            ax.text(j, i, f"{data[i, j]:+.1f}%", ha="center", va="center", fontsize=8)
    ax.set_title(f"L1i misses vs stock, {cache} "
                 f"({'booted' if source == 'booted' else 'what-if'})")
    fig.colorbar(im, ax=ax, label="% change (negative = fewer misses)")
    fig.tight_layout()
    with atomic_output(path) as f:
        fig.savefig(f, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)


__all__ = ["generalization_matrix", "merge_hotness", "merge_blocks", "merge_factors",
           "null_units", "perturbation_floor", "verdict", "floor_range", "format_matrix",
           "matrix_json", "matrix_from_json", "heatmap_png", "change"]
