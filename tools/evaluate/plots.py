"""PNG pictures of evaluate results (matplotlib, Agg backend).

- ``bar_chart``: kernel L1i misses per layout, one bar group per layout, one
  bar per cache model, labelled with the change against the first layout;
- ``sweep_plot``: misses (relative to stock) and .text growth against the
  function alignment of an ``align-all`` sweep, one curve per cache model;
- ``heatmap``: executed 64 B lines of kernel text before/after a layout, as
  two grids of lines (one row = 256 lines = 16 KiB) coloured by executions per
  workload iteration (log scale; blank = never executed).
"""


import numpy as np

from ..errors import BadInput


def _plt():
    try:
        import matplotlib
    except ImportError:
        raise BadInput("plots need matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path):
    # through linepack.io: staged with the command's other outputs (evaluate --plot)
    from ..io import atomic_output
    with atomic_output(path) as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})


def bar_chart(rows, path, title="kernel-mode L1i misses per layout"):
    """rows: dicts with layout, cache, misses (first layout of each cache = baseline)."""
    plt = _plt()
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    get = {(r["layout"], r["cache"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(layouts) * max(1, len(caches)) / 1.5), 4.5))
    w = 0.8 / max(1, len(caches))
    x = np.arange(len(layouts))
    for ci, c in enumerate(caches):
        base = get.get((layouts[0], c), {}).get("misses")
        vals = [get.get((lay, c), {}).get("misses", 0) for lay in layouts]
        bars = ax.bar(x + (ci - (len(caches) - 1) / 2) * w, vals, w, label=c)
        for b, v in zip(bars, vals):
            txt = f"{v / 1e3:,.0f}k" if v >= 1e4 else f"{v:,}"
            if base and v and b is not bars[0]:
                txt += f"\n{(v - base) / base:+.1%}"
            ax.annotate(txt, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(layouts)
    ax.set_ylabel("L1i misses (kernel mode)")
    ax.set_title(title)
    ax.margins(y=0.18)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
    plt.close(fig)


def sweep_plot(rows, path, title="function alignment sweep (align-all N)"):
    """rows: dicts with align (int; 0 = stock), cache, misses, text_growth_pct."""
    plt = _plt()
    caches = list(dict.fromkeys(r["cache"] for r in rows))
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7.5, 6.5), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.3]})
    for c in caches:
        rs = sorted((r for r in rows if r["cache"] == c and r.get("align")), key=lambda r: r["align"])
        base = next((r["misses"] for r in rows if r["cache"] == c and not r.get("align")), None)
        xs = [r["align"] for r in rs]
        if base:
            ys = [100.0 * (r["misses"] - base) / base for r in rs]
            ax.plot(xs, ys, "o-", label=f"{c} (stock {base:,} misses)")
            for xv, yv in zip(xs, ys):
                ax.annotate(f"{yv:+.1f}", (xv, yv), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=7)
        else:
            ax.plot(xs, [r["misses"] for r in rs], "o-", label=c)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_ylabel("L1i misses vs stock (%)" if any(not r.get("align") for r in rows)
                  else "L1i misses")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    first = [r for r in rows if r["cache"] == caches[0] and r.get("align")] if caches else []
    first.sort(key=lambda r: r["align"])
    ax2.bar([r["align"] for r in first], [r.get("text_growth_pct", 0) for r in first],
            width=[r["align"] * 0.35 for r in first], color="tab:gray")
    ax2.set_ylabel(".text growth (%)")
    ax2.set_xlabel("function alignment (bytes)")
    ax2.set_xscale("log", base=2)
    ax2.set_xticks([r["align"] for r in first])
    ax2.set_xticklabels([str(r["align"]) for r in first])
    ax2.grid(alpha=0.3)
    _save(fig, path)
    plt.close(fig)


def heatmap(panels, path, line=64, per_row=256, title="executed kernel text lines"):
    """panels: [(label, line numbers, executions per iteration)]; shared address window."""
    plt = _plt()
    from matplotlib.colors import LogNorm
    allv = np.concatenate([p[1] for p in panels]) if panels else np.zeros(0, np.uint64)
    if not len(allv):
        raise BadInput("heat map: no executed lines")
    lo = int(allv.min()) // per_row * per_row
    hi = int(allv.max()) + 1
    nrows = (hi - lo + per_row - 1) // per_row
    vmax = max(float(p[2].max()) for p in panels if len(p[2]))
    vmin = max(min(float(p[2][p[2] > 0].min()) for p in panels if len(p[2])), vmax * 1e-6)
    fig, axs = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 7.5), squeeze=False)
    im = None
    for ax, (label, lines, heat) in zip(axs[0], panels):
        grid = np.full(nrows * per_row, np.nan)
        grid[(lines.astype(np.int64) - lo)] = np.maximum(heat, vmin)
        grid = grid.reshape(nrows, per_row)
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="inferno_r",
                       norm=LogNorm(vmin=vmin, vmax=vmax))
        hot = int((heat >= 1).sum())
        ax.set_title(f"{label}\n{len(lines):,} lines executed, {hot:,} >= 1x/iteration",
                     fontsize=9)
        kib = per_row * line // 1024
        ticks = np.linspace(0, nrows - 1, min(nrows, 9)).astype(int)
        ax.set_yticks(ticks)
        if ax is axs[0][0]:
            ax.set_yticklabels([f"{(lo + int(t) * per_row) * line:#x}" for t in ticks], fontsize=7)
        else:
            ax.set_yticklabels([])
        ax.set_xlabel(f"line within a {kib} KiB row")
    fig.colorbar(im, ax=axs[0].tolist(), label="executions per iteration (log)", shrink=0.8)
    fig.suptitle(title)
    _save(fig, path)
    plt.close(fig)


def set_load_plot(sets, path, title="per-set load"):
    """Per-set load (evaluate --sets-plot): for each cache model (and workload), loop
    lines per set (top, with the associativity as a dashed line) and line executions
    per iteration per set (bottom), one step curve per layout."""
    plt = _plt()
    if not sets:
        raise BadInput("--sets-plot: no per-set load to plot")
    groups = list(dict.fromkeys((s["workload"], s["cache"]) for s in sets))
    fig, axes = plt.subplots(2, len(groups), figsize=(6.5 * len(groups), 6.5), squeeze=False)
    for gi, (wl, cache) in enumerate(groups):
        top, bottom = axes[0][gi], axes[1][gi]
        for s in [s for s in sets if (s["workload"], s["cache"]) == (wl, cache)]:
            x = np.arange(len(s["loop_lines_per_set"]))
            top.step(x, s["loop_lines_per_set"], where="mid", lw=0.8,
                     label=f"{s['layout']} (max {s['lines_max']}, {s['lines_over_ways']} over)")
            bottom.step(x, s["accesses_per_set"], where="mid", lw=0.8, label=s["layout"])
            ways = s["ways"]
        top.axhline(ways, color="k", ls="--", lw=0.8)
        top.set_title(f"{wl}, {cache}", fontsize=9)
        top.set_ylabel("loop lines per set")
        bottom.set_ylabel("line executions / iteration")
        bottom.set_xlabel("cache set")
        top.legend(fontsize=7)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    fig.suptitle(title)
    _save(fig, path)
    plt.close(fig)
