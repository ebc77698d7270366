"""``linepack evaluate --report DIR``: tables and plots from evaluate's result files.

Every evaluate run can write its table as data (``--json FILE``, ``--csv FILE``:
one row per layout or program, workload and cache model). This renders such
files again, without booting or replaying anything: each ``*.json`` in DIR (and
each ``*.csv`` without a JSON file of the same name) becomes the table evaluate
printed; ``--plot PNG`` draws the bar chart of all their rows. A generalization
matrix file (``evaluate --train ... --test ... --json FILE``) is printed as the
matrix, and ``--plot PNG`` then draws its heat map instead.
"""

import csv
import json
import os

from ..errors import BadInput

NUMERIC = ("misses", "fetches", "miss_rate", "instructions", "hot_lines", "text_size",
           "text_growth_pct", "text_growth_bytes", "time_s", "repeats", "misses_spread",
           "instructions_spread", "program_misses", "program_instructions", "code_bytes",
           "booted_misses", "exit_status", "stdout_bytes", "align", "placements", "misses_min",
           "misses_max", "misses_stdev")


def _number(v):
    if v in ("", None):
        return None
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in str(v) and "e" not in str(v).lower() else f


def _csv_rows(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in list(r):
            if k in NUMERIC:
                r[k] = _number(r[k])
            elif r[k] in ("True", "False"):
                r[k] = r[k] == "True"
            elif r[k] == "":
                r[k] = None
    return rows


def load(directory):
    """(results, matrices) of the evaluate files in ``directory``, by name: results are
    [(file name, rows)], matrices [(file name, generalization matrix)]."""
    if not os.path.isdir(directory):
        raise BadInput(f"--report {directory}: not a directory")
    names = sorted(os.listdir(directory))
    out, matrices = [], []
    for n in names:
        path = os.path.join(directory, n)
        stem, ext = os.path.splitext(n)
        if ext == ".json":
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError) as e:
                raise BadInput(f"--report: {path}: not readable JSON ({e})") from None
            if isinstance(doc, dict) and isinstance(doc.get("cells"), list) and "layouts" in doc:
                from .matrix import matrix_from_json
                matrices.append((n, matrix_from_json(doc, path)))
                continue
            rows = doc.get("results") if isinstance(doc, dict) else None
            if not isinstance(rows, list):
                raise BadInput(f"--report: {path}: not an evaluate result file (no \"results\")")
        elif ext == ".csv" and stem + ".json" not in names:
            try:
                rows = _csv_rows(path)
            except (OSError, csv.Error, UnicodeDecodeError) as e:
                raise BadInput(f"--report: {path}: not readable CSV ({e})") from None
        else:
            continue
        need = ("cache", "misses")
        bad = [r for r in rows if not isinstance(r, dict) or any(k not in r for k in need)
               or not ("layout" in r or "program" in r)]
        if bad or not rows:
            raise BadInput(f"--report: {path}: rows without layout/program, cache and misses")
        out.append((n, rows))
    if not out and not matrices:
        raise BadInput(f"--report {directory}: no evaluate result files (*.json, *.csv)")
    return out, matrices


def render(loaded):
    """The tables of every result file (``load``'s answer), as evaluate printed them."""
    from .table import format_rows
    from .user import format_rows as format_program_rows
    from .matrix import format_matrix
    parts = []
    results, matrices = loaded
    for name, m in matrices:
        parts.append(f"== {name}\n{format_matrix(m)}")
    for name, rows in results:
        try:
            table = format_program_rows(rows) if "program" in rows[0] else format_rows(rows)
        except (KeyError, TypeError, ValueError) as e:
            # a hand-edited or foreign file: rows lack a column or hold text for a number
            raise BadInput(f"--report: {name}: not an evaluate result table "
                           f"({type(e).__name__}: {e})") from None
        parts.append(f"== {name}\n{table}")
    return "\n\n".join(parts)


def plot(loaded, path, title):
    """A bar chart of the misses of every row of every file (``load``'s answer; one
    bar group per layout, or per layout and workload when there are several)."""
    from . import plots
    results, matrices = loaded
    if matrices and not results:
        from .matrix import heatmap_png
        heatmap_png(matrices[0][1], path)
        return
    rows = []
    for name, rs in results:
        many = len({r.get("workload") for r in rs}) > 1
        for r in rs:
            label = r.get("layout") or r.get("program")
            if many:
                label += f" ({r.get('workload')})"
            rows.append(dict(r, layout=label))
    plots.bar_chart(rows, path, title=title)


__all__ = ["load", "render", "plot"]
