"""relayout's layout map (``--layout-map``), read and checked against the map
verify --against rebuilds from the two symbol tables."""

from ..errors import BadInput


def read_layout_map(path):
    """relayout's layout map (TSV: function, old, new, size) as [(name, old, new)]."""
    rows = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip() or line.startswith("#"):
                    continue
                parts = line.rstrip("\n").split("\t")
                try:
                    rows.append((parts[0], int(parts[1], 16), int(parts[2], 16)))
                except (IndexError, ValueError):
                    raise BadInput(f"{path}:{n}: not a layout map line "
                                   "(function, old, new, size)") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise BadInput(f"{path}: not a layout map (function, old, new, size): not text") from None
    return rows


def check_layout_map(ctx, out):
    """The layout map must say what the symbol tables say: each listed
    function's new address."""
    rows, of, nf, oi, ni = ctx.layout_map, ctx.of, ctx.nf, ctx.oi, ctx.ni
    truth = dict(zip(of.start[oi].tolist(), nf.start[ni].tolist()))
    wrong = [(new, name, old, truth[old]) for name, old, new in rows
             if old in truth and truth[old] != new]
    out.extra["equivalence_layout_map_rows"] = len(rows)
    out.add("equiv.layout-map", wrong,
            lambda w: (w[0], f"layout map says {w[1]} ({w[2]:#x}) moved to {w[0]:#x}, the "
                       f"image has it at {w[3]:#x}"))
