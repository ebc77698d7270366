"""Merge profiles of several workloads into one (``linepack profile --merge``).

A distro ships one kernel for every workload, so its layout should come from all
of them. Each input is **normalised to the same total** (its metric: instructions
for QEMU, taken branches for LBR/fdata, samples for IP sampling) before the
weighted sum, so a workload whose loop runs 30x more instructions does not drown
the others; ``weights`` (default all 1) then set each workload's share::

    merged = merge_profiles([Profile.load(a), Profile.load(b)], weights=[2, 1])

Input i contributes the fraction w_i / sum(w) of the merged total. Every counter
of an input (function counters, block, edge and sample counts) is scaled by the
same factor and rounded to an integer, so each input's internal proportions are
kept. When every input knows its loop count, the merged profile is expressed per
"average iteration" (total per iteration = the inputs' mean) over ``MERGED_LOOPS``
iterations, so per-iteration hotness thresholds (relayout's ``min_count``) keep
their meaning; otherwise the merged total is ``UNSCALED_TOTAL`` with no loop count.

Where every input records where its blocks first ran (``block_first``), input i's
positions become i + their fraction of its window (``first_window``) and a block
keeps the earliest: the first input's hot code in the order it first ran, then
the code the second input adds, and so on (the rule of evaluate's merged matrix
layouts, ``merge_blocks``).

All inputs must belong to the same image (build-id) and measure hotness with the
same metric (BadInput otherwise). ``meta["merged"]`` records each input's
workload, loops, weight, total and scale factor.
"""

import os

import numpy as np

from ..errors import BadInput
from .model import ARRAYS, GROUPS, OPTIONAL, Profile, _aggregate, first_window, min_per_key

MERGED_LOOPS = 1000
UNSCALED_TOTAL = 10 ** 9

_SCALED = ("func_entries", "func_blocks", "func_insns", "func_samples", "block_count",
           "edge_count", "edge_mispred", "sample_count")


def _first_rows(keys):
    """Row indices that keep, for each distinct key tuple (sorted), its first occurrence."""
    order = np.lexsort(keys[::-1])
    n = len(order)
    first = np.ones(n, dtype=bool)
    if n > 1:
        diff = np.zeros(n - 1, dtype=bool)
        for k in keys:
            ks = k[order]
            diff |= ks[1:] != ks[:-1]
        first[1:] = diff
    return order[first]


def _label(p, i):
    return str(p.meta.get("workload") or p.meta.get("label") or f"profile{i + 1}")


def merge_profiles(profiles, weights=None, labels=None):
    """One Profile from ``profiles`` (see the module docstring)."""
    profiles = list(profiles)
    if len(profiles) < 2:
        raise BadInput("--merge needs at least two profiles")
    weights = [1.0] * len(profiles) if weights is None else [float(w) for w in weights]
    if len(weights) != len(profiles):
        raise BadInput(f"{len(weights)} weights for {len(profiles)} profiles")
    if any(not np.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise BadInput("weights must be non-negative numbers, not all zero")
    labels = list(labels) if labels else [_label(p, i) for i, p in enumerate(profiles)]
    first = profiles[0]
    metric = first.metric
    build_ids = {p.meta.get("build_id") for p in profiles if p.meta.get("build_id")}
    if len(build_ids) > 1:
        raise BadInput(f"profiles belong to different builds (build-ids "
                       f"{', '.join(sorted(b[:16] + '...' for b in build_ids))}): merge profiles "
                       "of one image only")
    for p, lab in zip(profiles, labels):
        if p.metric != metric:
            raise BadInput(f"cannot merge a '{metric}' profile ({labels[0]}) with a "
                           f"'{p.metric}' profile ({lab}): record or import them the same way")
    totals = [p.total(metric) for p in profiles]
    for t, lab in zip(totals, labels):
        if t <= 0:
            raise BadInput(f"profile {lab} counts nothing ({metric} total is 0)")
    loops = [p.meta.get("loops") for p in profiles]
    if all(isinstance(n, int) and n > 0 for n in loops):
        per_iter = float(np.mean([t / n for t, n in zip(totals, loops)]))
        target, out_loops = per_iter * MERGED_LOOPS, MERGED_LOOPS
    else:
        target, out_loops = float(UNSCALED_TOTAL), None
    wsum = float(sum(weights))
    factors = [w / wsum * target / t for w, t in zip(weights, totals)]

    cat = {name: np.concatenate([getattr(p, name) for p in profiles]).astype(dt)
           if name not in _SCALED else
           np.concatenate([np.rint(getattr(p, name).astype(np.float64) * f)
                           for p, f in zip(profiles, factors)]).astype(np.uint64)
           for name, dt in ARRAYS.items() if name not in OPTIONAL}
    names = [n for p in profiles for n in p.func_name]
    arrays = {}
    # functions: one row per address; size, binding and name from the first input having it
    rows = _first_rows((cat["func_addr"],))
    (fa,), sums = _aggregate((cat["func_addr"],), *(cat[c] for c in GROUPS["func"][3:]))
    arrays.update({"func_addr": fa, "func_size": cat["func_size"][rows],
                   "func_local": cat["func_local"][rows]})
    arrays.update(dict(zip(GROUPS["func"][3:], sums)))
    func_name = [names[i] for i in rows.tolist()]
    keep = np.zeros(len(fa), dtype=bool)          # drop functions whose counts all rounded to 0
    for c in GROUPS["func"][3:]:
        keep |= arrays[c] > 0
    for c in GROUPS["func"]:
        arrays[c] = arrays[c][keep]
    func_name = [n for n, k in zip(func_name, keep.tolist()) if k]
    # blocks, edges, samples: summed per key
    (ba, bs, bi), (bc,) = _aggregate((cat["block_addr"], cat["block_size"].astype(np.uint64),
                                      cat["block_insns"].astype(np.uint64)), cat["block_count"])
    arrays.update({"block_addr": ba, "block_size": bs.astype(np.uint32),
                   "block_insns": bi.astype(np.uint32), "block_count": bc})
    ordered = all(len(p.block_first) and len(p.block_first) == len(p.block_addr)
                  for p in profiles)
    if ordered and len(ba):
        frac = np.concatenate([i + p.block_first / float(p.meta.get("first_window") or
                                                         first_window(p.block_first))
                               for i, p in enumerate(profiles)])
        arrays["block_first"] = min_per_key((cat["block_addr"], cat["block_size"].astype(np.uint64),
                                             cat["block_insns"].astype(np.uint64)), frac)
    erows = _first_rows((cat["edge_from"], cat["edge_to"]))
    (ef, et), (ec, em) = _aggregate((cat["edge_from"], cat["edge_to"]), cat["edge_count"],
                                    cat["edge_mispred"])
    arrays.update({"edge_from": ef, "edge_to": et, "edge_count": ec, "edge_mispred": em,
                   "edge_kind": cat["edge_kind"][erows]})
    (sa,), (sc,) = _aggregate((cat["sample_addr"],), cat["sample_count"])
    arrays.update({"sample_addr": sa, "sample_count": sc})

    meta = {k: first.meta.get(k) for k in ("source", "build_id", "image", "image_path", "metric",
                                           "edge_from", "kaslr_offset")}
    if len({p.source for p in profiles}) > 1:
        meta["source"] = first.source
        meta["merged_sources"] = sorted({p.source for p in profiles})
    meta.update({
        "workload": "+".join(labels), "loops": out_loops, "cmdline": None,
        "merged": [{"workload": lab, "loops": p.meta.get("loops"), "weight": w, "total": int(t),
                    "scale": f, "path": p.meta.get("path")}
                   for p, lab, w, t, f in zip(profiles, labels, weights, totals, factors)],
        "unmapped": int(round(sum(float(p.meta.get("unmapped") or 0) * f
                                  for p, f in zip(profiles, factors)))),
        "edges": int(len(ef)),
    })
    if "block_first" in arrays:
        meta["first_window"] = float(len(profiles))
    if len(ba):
        meta.update({"blocks": int(len(ba)), "block_executions": int(bc.sum()),
                     "instructions": int((bc * bi).sum()) + meta["unmapped"]
                     if metric == "insns" else int((bc * bi).sum())})
    if len(sa):
        meta["samples"] = int(sc.sum())
    if any(p.meta.get("branches") for p in profiles):
        meta["branches"] = int(ec.sum())
    return Profile(meta, arrays, func_name)


def load_any(path, image=None, log=None):
    """A Profile from a linepack profile, a BOLT .fdata file or ``perf script`` text
    (the last two need ``image``)."""
    path = os.fspath(path)
    try:
        p = Profile.load(path)
    except BadInput as e:
        if "not a linepack profile" not in str(e) or not os.path.isfile(path):
            raise
        if image is None:
            raise BadInput(f"{path}: not a linepack profile; to merge .fdata or perf script "
                           "files give --image") from None
        with open(path, "rb") as f:
            head = f.read(4096)
        if path.endswith(".fdata") or head.startswith(b"no_lbr") or \
                head[:2] in (b"0 ", b"1 ", b"2 ") or head.startswith(b"boltedcollection"):
            from .fdata import import_fdata
            p = import_fdata(path, image, {"workload": os.path.basename(path)}, log=log)
        else:
            from .perf_script import import_perf_script
            p = import_perf_script(path, image, None, {"workload": os.path.basename(path)}, log=log)
    p.meta["path"] = os.path.abspath(path)
    return p


__all__ = ["merge_profiles", "load_any", "MERGED_LOOPS", "UNSCALED_TOTAL"]
