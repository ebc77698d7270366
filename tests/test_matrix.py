"""Generalization matrix (`linepack evaluate --train ... --test ...`): merging, formatting,
the heat map and argument errors. (The boots and replays are the evaluate machinery tested
elsewhere; the end-to-end run is in README's measurement.)"""

import json

import pytest

from helpers import run_linepack
from linepack.errors import BadInput
from linepack.evaluate.matrix import (change, format_matrix, heatmap_png, matrix_json,
                                      merge_hotness)


def test_merge_hotness_gives_each_workload_the_same_weight():
    small = {"a": 90.0, "shared": 10.0}             # 100 per iteration
    big = {"shared": 1000.0, "b": 9000.0}           # 10,000 per iteration
    m = merge_hotness([small, big])
    total = sum(m.values())
    assert total == pytest.approx((100 + 10_000) / 2)     # the mean per-iteration total
    assert m["a"] / total == pytest.approx(0.45) and m["b"] / total == pytest.approx(0.45)
    assert m["shared"] / total == pytest.approx(0.10)
    w = merge_hotness([small, big], [3, 1])
    assert w["a"] / sum(w.values()) == pytest.approx(0.675)
    with pytest.raises(BadInput):
        merge_hotness([small, {}])


def _m():
    def cell(misses):
        return {"misses": misses, "fetches": 10 * misses, "instructions": 1000}
    cells = {}
    for w, base in (("epoll", 1000), ("pipe", 400)):
        cells[("stock", w, "intel-32k-8w")] = cell(base)
    for (lay, w), v in {("pack[epoll]", "epoll"): 800, ("pack[epoll]", "pipe"): 404,
                        ("pack[merged]", "epoll"): 850, ("pack[merged]", "pipe"): 300}.items():
        cells[(lay, w, "intel-32k-8w")] = cell(v)
    return {"layouts": ["stock", "pack[epoll]", "pack[merged]"], "test": ["epoll", "pipe"],
            "train": ["epoll", "pipe"], "strategy": "pack", "caches": ["intel-32k-8w"],
            "cells": cells, "loops": {"epoll": 10, "pipe": 10}}


def test_change_format_and_json():
    m = _m()
    assert change(m, "pack[epoll]", "epoll", "intel-32k-8w") == pytest.approx(-0.2)
    assert change(m, "pack[epoll]", "pipe", "intel-32k-8w") == pytest.approx(0.01)
    text = format_matrix(m)
    lines = text.splitlines()
    assert "intel-32k-8w" in lines[0]
    row = next(ln for ln in lines if ln.startswith("pack[epoll]"))
    assert row.split()[1:] == ["-20.00%", "+1.00%"]
    assert next(ln for ln in lines if ln.startswith("stock")).split()[1:] == ["1,000", "400"]
    j = matrix_json(m)
    json.dumps(j)
    merged_pipe = [c for c in j["cells"] if c["layout"] == "pack[merged]" and c["workload"] == "pipe"]
    assert merged_pipe[0]["change_vs_stock"] == pytest.approx(-0.25)


def test_heatmap_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "m.png"
    heatmap_png(_m(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, words", [
    (("--train", "epoll"), "go together"),
    (("--train", "epoll", "--test", "nope"), "unknown workload 'nope'"),
    (("--train", "epoll", "--test", "pipe", "--weights", "1,x"), "comma-separated"),
    (("--train", "epoll", "--test", "pipe", "--layout", "pack"), "do not go with"),
])
def test_matrix_argument_errors(tmp_path, args, words):
    k = tmp_path / "vmlinux"
    k.write_bytes(b"\x7fELF")
    p = run_linepack("evaluate", "--kernel", k, *args)
    assert p.returncode == 2, p.stderr
    assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1
