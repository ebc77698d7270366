"""Generalization matrix: does a layout trained on some workloads help the others?

``linepack evaluate --kernel BASE --train W1,W2,... --test W1,W2,...``:

1. one booted, plugin-traced run of each workload named in --train or --test
   (``whatif.record_trace``, cached on disk like every evaluate trace);
2. a profile of each training workload derived from its run (per-iteration
   function counts, as evaluate derives them), and a merged one: each training
   profile normalised to the same per-iteration total (the mean of theirs)
   before the weighted sum, as ``linepack profile --merge`` does;
3. a layout (``--strategy``, default pack) per training profile, one from the
   merged profile, and, when at least three workloads train, "leave-one-out"
   layouts merged from all training workloads but one;
4. the what-if replay of every test workload's recorded run under every layout
   (and under stock): simulated misses per (layout, test workload) cell, as the
   change against stock. The what-if replay follows the booted measurement
   within ~1% on rewritten kernels (README, the evaluate table).
"""

import numpy as np

from ..errors import BadInput


def merge_hotness(hots, weights=None):
    """One {function: per-iteration count} from several, each normalised to the same total."""
    weights = [1.0] * len(hots) if weights is None else [float(w) for w in weights]
    totals = [float(sum(h.values())) for h in hots]
    if any(t <= 0 for t in totals):
        raise BadInput("a training workload ran no kernel code inside its loop")
    mean = float(np.mean(totals))
    wsum = float(sum(weights))
    out = {}
    for h, w, t in zip(hots, weights, totals):
        f = w / wsum * mean / t
        for k, v in h.items():
            out[k] = out.get(k, 0.0) + v * f
    return out


def generalization_matrix(base, train, test, strategy="pack", caches=("intel-32k-8w",),
                          loops=None, weights=None, log=None, parallel=None, scheduler=None):
    """{"layouts": [...], "test": [...], "cells": {(layout, workload, cache): row}, ...}."""
    from . import whatif as wi
    from .layouts import Layouts, hotness_from_trace
    log = log or (lambda m: None)
    train, test = list(dict.fromkeys(train)), list(dict.fromkeys(test))
    if not train or not test:
        raise BadInput("--train and --test each need at least one workload")
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
    wmap = dict(zip(train, weights)) if weights is not None else {w: 1.0 for w in train}
    profiles = {f"{strategy}[{w}]": hot[w] for w in train}
    if len(train) > 1:
        profiles[f"{strategy}[merged]"] = merge_hotness([hot[w] for w in train],
                                                        [wmap[w] for w in train])
    if len(train) > 2:
        for w in train:
            rest = [x for x in train if x != w]
            profiles[f"{strategy}[all-{w}]"] = merge_hotness([hot[x] for x in rest],
                                                             [wmap[x] for x in rest])
    cells = {}
    layouts = ["stock"] + list(profiles)
    L = Layouts(base, log=log)              # one instance: the disassembly is shared
    amaps = {"stock": None}
    for label, h in profiles.items():
        log(f"planning {label}")
        L.hotness = h
        pm = L.plan(strategy)
        amaps[label] = pm.amap if pm else None
    for label in layouts:
        for w in test:
            for r in wi.whatif(traces[w], amaps[label], caches, label):
                cells[(label, w, r["cache"])] = r
    return {"layouts": layouts, "test": test, "train": train, "strategy": strategy,
            "caches": [c if isinstance(c, str) else c["name"] for c in caches], "cells": cells,
            "loops": {w: traces[w].meta.get("loops") for w in traces}}


def change(m, layout, workload, cache):
    """Misses of (layout, workload) relative to stock: -0.10 = 10% fewer."""
    base = m["cells"][("stock", workload, cache)]["misses"]
    got = m["cells"][(layout, workload, cache)]["misses"]
    return (got - base) / base if base else 0.0


def format_matrix(m):
    out = []
    for cache in m["caches"]:
        out.append(f"simulated kernel-mode misses vs stock, {cache} (what-if replay; rows: layout "
                   f"trained on, columns: test workload)")
        w0 = max(len(x) for x in m["layouts"])
        cols = [f"{w:>14}" for w in m["test"]]
        out.append(f"{'layout':<{w0}} " + " ".join(cols))
        for lay in m["layouts"]:
            cells = []
            for w in m["test"]:
                if lay == "stock":
                    cells.append(f"{m['cells'][(lay, w, cache)]['misses']:>14,}")
                else:
                    cells.append(f"{change(m, lay, w, cache):>+14.2%}")
            out.append(f"{lay:<{w0}} " + " ".join(cells))
        out.append("")
    return "\n".join(out).rstrip("\n")


def matrix_json(m):
    return {"train": m["train"], "test": m["test"], "strategy": m["strategy"],
            "caches": m["caches"], "layouts": m["layouts"], "loops": m["loops"],
            "cells": [{"layout": lay, "workload": w, "cache": c, "misses": r["misses"],
                       "fetches": r["fetches"], "instructions": r["instructions"],
                       "change_vs_stock": change(m, lay, w, c)}
                      for (lay, w, c), r in sorted(m["cells"].items())]}


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
    data = np.array([[100.0 * change(m, lay, w, cache) for w in m["test"]] for lay in rows])
    lim = max(1.0, float(np.abs(data).max())) if data.size else 1.0
    fig, ax = plt.subplots(figsize=(1.3 * len(m["test"]) + 3, 0.55 * len(rows) + 1.8))
    im = ax.imshow(data, cmap="RdYlGn_r", vmin=-lim, vmax=lim, aspect="auto")
    ax.set_xticks(range(len(m["test"])), m["test"], rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    for i in range(len(rows)):
        for j in range(len(m["test"])):
            ax.text(j, i, f"{data[i, j]:+.1f}%", ha="center", va="center", fontsize=8)
    ax.set_title(f"L1i misses vs stock, {cache} (what-if)")
    fig.colorbar(im, ax=ax, label="% change (negative = fewer misses)")
    fig.tight_layout()
    with atomic_output(path) as f:
        fig.savefig(f, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)


__all__ = ["generalization_matrix", "merge_hotness", "format_matrix", "matrix_json", "heatmap_png",
           "change"]
