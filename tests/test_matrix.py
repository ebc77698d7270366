"""Generalization matrix (`linepack evaluate --train ... --test ...`): merging, formatting,
the heat map and argument errors. (The boots and replays are the evaluate machinery tested
elsewhere; the end-to-end run is in README's measurement.)"""

import json

import numpy as np
import pytest

from helpers import run_linepack
from linepack.errors import BadInput
from linepack.evaluate.matrix import (change, format_matrix, heatmap_png, matrix_json,
                                      merge_hotness, null_units, verdict)


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
    (("--train", "epoll", "--test", "pipe", "--layout", "pack"),
     "--layout does not go with --train/--test"),
])
def test_matrix_argument_errors(tmp_path, args, words):
    k = tmp_path / "vmlinux"
    k.write_bytes(b"\x7fELF")
    p = run_linepack("evaluate", "--kernel", k, *args)
    assert p.returncode == 2, p.stderr
    assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_merge_blocks_scales_and_sums_shared_blocks():
    from linepack.evaluate.matrix import merge_blocks, merge_factors
    a = (np.array([0x1000, 0x2000], np.uint64), np.array([16, 32], np.uint64),
         np.array([2.0, 1.0]))
    b = (np.array([0x2000, 0x3000], np.uint64), np.array([32, 8], np.uint64),
         np.array([10.0, 30.0]))
    f = merge_factors([{"x": 3.0}, {"y": 40.0}])        # totals 3 and 40, mean 21.5
    assert f == pytest.approx([0.5 * 21.5 / 3, 0.5 * 21.5 / 40])
    addr, size, cnt = merge_blocks([a, b], f)
    got = {(int(x), int(s)): c for x, s, c in zip(addr, size, cnt)}
    assert set(got) == {(0x1000, 16), (0x2000, 32), (0x3000, 8)}
    assert got[(0x2000, 32)] == pytest.approx(1.0 * f[0] + 10.0 * f[1])
    assert got[(0x3000, 8)] == pytest.approx(30.0 * f[1])


def test_merge_blocks_orders_first_runs_workload_by_workload():
    from linepack.evaluate.matrix import merge_blocks
    from linepack.relayout.block_order import ExecutedBlocks
    a = ExecutedBlocks((np.array([0x1000, 0x2000], np.uint64), np.array([16, 32], np.uint64),
                        np.array([2.0, 1.0])), first=np.array([0, 99]))
    b = ExecutedBlocks((np.array([0x2000, 0x3000], np.uint64), np.array([32, 8], np.uint64),
                        np.array([10.0, 30.0])), first=np.array([3, 0]))
    m = merge_blocks([a, b], [1.0, 1.0])
    # run i: i + the fraction of its window: a 0/100, 99/100; b 1 + 3/4, 1 + 0/4;
    # 0x2000 keeps a's 0.99 (the first run's code first, then what the second adds)
    assert m.first.tolist() == [0.0, 0.99, 1.0]
    plain = merge_blocks([a, tuple(b)], [1.0, 1.0])     # one without first runs: none
    assert getattr(plain, "first", None) is None


class _Units:
    def __init__(self):
        self.start = np.array([0, 100, 300, 5000, 10000], np.uint64)
        self.size = np.array([100, 200, 40, 5000, 300], np.int64)
        self.end = self.start + self.size.astype(np.uint64)
        self.pinned = np.array([True, False, False, False, False])

    def find(self, addrs):
        from linepack.image.intervals import containing
        return containing(self.start, self.end, addrs)


def test_null_units_never_pick_code_that_ran_pinned_tiny_or_huge_units():
    u = _Units()
    # unit 0 pinned, 2 too small (< 64 B), 3 too big (> 4 KiB); 4 ran (an address inside it)
    assert null_units(u, np.array([10050], np.uint64), 5, seed=1) == [1]
    assert null_units(u, np.array([150], np.uint64), 5, seed=1) == [4]
    assert null_units(u, np.array([150, 10001], np.uint64), 5, seed=1) == []
    assert null_units(u, np.array([], np.uint64), 1, seed=7) == null_units(
        u, np.array([], np.uint64), 1, seed=7)                 # seeded: reproducible


def test_floor_and_verdict_in_the_table_and_json():
    m = _m()
    m["floor"] = {("epoll", "intel-32k-8w"): [-0.05, 0.08, 0.02],
                  ("pipe", "intel-32k-8w"): [0.0, 0.004]}
    worse, beyond = verdict(m, "intel-32k-8w")
    # pack[epoll] on pipe is +1.00% exactly: not worse than the 1% bar
    assert worse == [] and beyond == []
    m["cells"][("pack[merged]", "epoll", "intel-32k-8w")]["misses"] = 1050    # +5%: inside floor
    m["cells"][("pack[epoll]", "pipe", "intel-32k-8w")]["misses"] = 420       # +5%: beyond +0.4%
    worse, beyond = verdict(m, "intel-32k-8w")
    assert [(a, b) for a, b, _ in worse] == [("pack[epoll]", "pipe"), ("pack[merged]", "epoll")]
    assert [(a, b) for a, b, _ in beyond] == [("pack[epoll]", "pipe")]
    text = format_matrix(m)
    floor = next(ln for ln in text.splitlines() if ln.startswith("floor"))
    assert floor.split()[-2:] == ["-5.0%..+8.0%", "+0.0%..+0.4%"]
    assert "cells worse than stock by more than 1%: 2 of 4; beyond the workload's " \
           "perturbation floor: 1" in text
    assert "  pack[epoll] on pipe: +5.00%" in text.splitlines()
    j = matrix_json(m)
    assert {f["workload"]: f["changes"] for f in j["floor"]}["pipe"] == [0.0, 0.004]


@pytest.mark.qemu
@pytest.mark.realkernel
def test_matrix_pack_and_blocks_on_debian_kernel(debian_vmlinux, tmp_path):
    """Two booted, traced workloads; pack and block-level rows, merged ones, the
    perturbation floor, JSON and heat map; --booted: every layout rewritten and
    booted on both workloads, with stock's result lines (20 loops: seconds per boot).
    (This boot found block-level layouts breaking static_cpu_has() fall-throughs:
    blocks[pipe] oopsed in __switch_to on epoll.)"""
    pytest.importorskip("matplotlib")
    j, png = tmp_path / "m.json", tmp_path / "m.png"
    p = run_linepack("evaluate", "--kernel", debian_vmlinux, "--train", "epoll,pipe",
                     "--test", "epoll,pipe", "--strategy", "pack,blocks", "--loops", 20,
                     "--booted", "-j", 2, "--json", j, "--plot", png)
    assert p.returncode == 0, p.stderr
    doc = json.loads(j.read_text())
    assert doc["layouts"] == ["stock", "pack[epoll]", "pack[pipe]", "pack[merged]",
                              "blocks[epoll]", "blocks[pipe]", "blocks[merged]"]
    cells = {(c["layout"], c["workload"]): c for c in doc["cells"]}
    assert len(cells) == 14
    for w in ("epoll", "pipe"):
        stock = cells[("stock", w)]
        assert stock["misses"] > 0
        # every layout replays the same recorded run: same instructions, other addresses
        assert {cells[(lay, w)]["instructions"] for lay in doc["layouts"]} == \
            {stock["instructions"]}
    # pipe's loop is a little larger than the cache; a block-level layout that saw it
    # (hot parts of its functions together) makes it fit: far fewer misses (-44% at 20
    # loops, where the first iterations' misses weigh; -99% at 5,000)
    for lay in ("blocks[pipe]", "blocks[merged]", "pack[pipe]", "pack[merged]"):
        assert cells[(lay, "pipe")]["misses"] < 0.8 * cells[("stock", "pipe")]["misses"], lay
    floor = {f["workload"]: f["changes"] for f in doc["floor"]}
    assert set(floor) == {"epoll", "pipe"} and all(len(v) == 5 for v in floor.values())
    assert any(c != 0 for v in floor.values() for c in v)   # the null layouts move code
    assert "floor (null layouts)" in p.stdout
    # booted: every cell, the same work and result line as stock (else exit 1, "problem:")
    assert doc["problems"] == [] and "problem:" not in p.stdout
    booted = {(c["layout"], c["workload"]): c for c in doc["booted_cells"]}
    assert set(booted) == set(cells)
    for w in ("epoll", "pipe"):
        # the what-if replay of stock is exact (same plugin model, same run)
        assert booted[("stock", w)]["misses"] == cells[("stock", w)]["misses"]
        assert {booted[(lay, w)]["result_line"] for lay in doc["layouts"]} == \
            {booted[("stock", w)]["result_line"]}
    assert booted[("blocks[pipe]", "pipe")]["misses"] < 0.8 * booted[("stock", "pipe")]["misses"]
    assert "BOOTED" in p.stdout and "booted vs what-if: largest difference" in p.stdout
    assert "cells worse than stock by more than 1%:" in p.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_renders_a_matrix_file_again(tmp_path):
    pytest.importorskip("matplotlib")
    m = _m()
    m["floor"] = {("epoll", "intel-32k-8w"): [-0.05, 0.08], ("pipe", "intel-32k-8w"): [0.01, 0.02]}
    d = tmp_path / "r"
    d.mkdir()
    (d / "m.json").write_text(json.dumps(matrix_json(m)))
    png = tmp_path / "h.png"
    p = run_linepack("evaluate", "--report", d, "--plot", png)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "== m.json\n" + format_matrix(m)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --plot onto a result file it reads: refused, the file unchanged
    before = (d / "m.json").read_bytes()
    p = run_linepack("evaluate", "--report", d, "--plot", d / "m.json")
    assert p.returncode == 2 and "never overwrites its input" in p.stderr
    assert (d / "m.json").read_bytes() == before
    doc = matrix_json(m)
    del doc["cells"][0]["misses"]
    (d / "m.json").write_text(json.dumps(doc))
    p = run_linepack("evaluate", "--report", d)
    assert p.returncode == 2 and "not a generalization matrix file" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
