"""evaluate's result table: rows (one per layout or program, workload and cache
model), the text table, the cross-checks, and the one writer of the rows as
JSON and CSV (``--json``, ``--csv``; ``--report`` reads them back)."""

import csv
import io
import json

from ..io import write_atomic
from .booted import instruction_tolerance


def growth_cell(pct):
    """.text growth as relayout prints it (2 decimals); n/a for another build."""
    return "n/a" if pct is None else f"{pct:+.2f}%"


def is_dense_label(label):
    return str(label).split(":")[0] in ("dense", "dense-hot", "dense-first")


def format_rows(rows):
    """One table per cache model; the first layout of each is the baseline. With a
    dense reference row (what-if), a last column: each layout's distance to it, in
    points of the change against the baseline (the first dense row is the reference)."""
    out = []
    several = len({r.get("workload") for r in rows}) > 1
    for wl, cache in dict.fromkeys((r.get("workload"), r["cache"]) for r in rows):
        rs = [r for r in rows if r["cache"] == cache and r.get("workload") == wl]
        base = rs[0]
        dense = next((r for r in rs if is_dense_label(r["layout"])), None)
        mode = ", ".join(dict.fromkeys(r["mode"] for r in rs)) + (f", {wl}" if several else "")
        hdr = (f"{'layout':<16} {'L1i misses':>12} {'vs base':>8} {'fetches':>12} {'miss rate':>9} "
               f"{'MPKI':>7} {'kernel insns':>14} {'hot lines':>9} {'.text':>8} {'time s':>7}")
        if dense:
            hdr += f" {'to ' + dense['layout']:>14}"
        out += [f"kernel-mode L1i, {cache} ({mode})"]
        bases = list(dict.fromkeys(r["baseline"] for r in rs if r.get("baseline")))
        if bases:
            out.append(f"(vs base: against the first kernel of the same build: {', '.join(bases)})")
        out += [hdr, "-" * len(hdr)]
        by_label = {r["layout"]: r for r in rs}
        for r in rs:
            # rows of several builds: each against the first image of its build
            bm = by_label.get(r.get("baseline"), base)["misses"]
            sp = r.get("misses_spread")
            spread = f" ±{sp:.3%}" if sp else ""
            out.append(
                f"{r['layout']:<16} {r['misses']:>12,} {(r['misses'] - bm) / bm if bm else 0:>+8.2%} "
                f"{r['fetches']:>12,} {r['miss_rate']:>9.2%} "
                f"{1000.0 * r['misses'] / r['instructions'] if r['instructions'] else 0:>7.2f} "
                f"{r['instructions']:>14,} "
                f"{r['hot_lines']:>9,} {growth_cell(r.get('text_growth_pct', 0.0)):>8} "
                f"{r['time_s']:>7.2f}"
                + (f" {100.0 * (r['misses'] - dense['misses']) / bm if bm else 0:>+12.1f}pt"
                   if dense else "") + spread)
            if r.get("booted_misses") is not None and r["mode"] == "whatif":
                d = r["misses"] - r["booted_misses"]
                out.append(f"{'':<16} booted {r['booted_misses']:,} ({d:+,} replay vs boot)")
        out.append("")
    return "\n".join(out).rstrip("\n")


def measurement_rows(ms_by_cache, label, text_growth_pct=0.0):
    """Rows (one per cache model) of one booted image's measurements."""
    rows = []
    for cache, m in ms_by_cache.items():
        rows.append({"layout": label, "cache": cache, "mode": "booted",
                     "misses": m.median("misses"), "fetches": m.median("fetches"),
                     "miss_rate": m.median("miss_rate"), "instructions": m.median("instructions"),
                     "hot_lines": m.median("hot_lines"), "text_size": m.median("text_size"),
                     "text_growth_pct": text_growth_pct, "time_s": m.median("wall"),
                     "repeats": len(m.runs), "misses_spread": m.spread("misses"),
                     "instructions_spread": m.spread("instructions"),
                     "result_line": m.runs[0]["result_line"], "image": m.path})
    return rows


def cross_check_rows(rows):
    """Problems: different kernel work (instructions) or workload results across layouts."""
    problems = []
    for wl in dict.fromkeys(r.get("workload") for r in rows):
        problems += _cross_check_workload([r for r in rows if r.get("workload") == wl])
    return problems


def _cross_check_workload(rows):
    problems = []
    for cache in dict.fromkeys(r["cache"] for r in rows):
        rs = [r for r in rows if r["cache"] == cache and r["mode"] == "booted"]
        if not rs:
            continue
        by_label = {r["layout"]: r for r in rs}
        for r in rs[1:]:
            b = by_label.get(r.get("baseline"), rs[0])
            if b is r:
                continue
            bi, mi = b["instructions"], r["instructions"]
            tol = instruction_tolerance(r["layout"])
            if bi and abs(mi - bi) / bi > tol:
                problems.append(f"{r['layout']}: {mi:,} kernel instructions vs {bi:,} for "
                                f"{b['layout']} ({(mi - bi) / bi:+.3%}): not exactly the same work")
            if r.get("result_line") != b.get("result_line"):
                problems.append(f"{r['layout']}: workload result differs: {r.get('result_line')!r}")
        break       # one cache model is enough: all come from the same boots
    return problems


def write_results(json_path=None, csv_path=None, doc=None, rows=(), indent=2, sort_keys=False):
    """``doc`` as JSON to ``json_path`` and ``rows`` as CSV to ``csv_path`` (columns:
    every key of every row, in the order they first appear); None: not written."""
    if json_path:
        write_atomic(json_path, json.dumps(doc, indent=indent, sort_keys=sort_keys,
                                           default=str) + "\n")
    if csv_path:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        w.writeheader()
        w.writerows(rows)
        write_atomic(csv_path, buf.getvalue())

