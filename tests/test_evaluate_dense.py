"""evaluate's dense reference (dense:N) and per-set load (--sets), on small
synthetic traces with exact expected numbers, and the CLI's refusals."""

import json

import numpy as np
import pytest

from helpers import run_linepack
from linepack.errors import BadInput
from linepack.evaluate import dense
from linepack.evaluate.cachemodel import LineTable
from linepack.evaluate.table import format_rows
from linepack.evaluate.whatif import BlockTrace, replay, translate

PNG = b"\x89PNG\r\n\x1a\n"
TOY = {"name": "toy", "size": 256, "ways": 1, "line": 64}     # 4 sets, direct-mapped


def _trace(rows, ids, loops, warm=()):
    b = np.zeros(len(rows), dtype=[("vaddr", "<u8"), ("size", "<u4"), ("ninsns", "<u4")])
    for i, (a, s) in enumerate(rows):
        b[i] = (a, s, 1)
    return BlockTrace(b, np.array(warm, np.uint32), np.array(ids, np.uint32), {"loops": loops})


def test_parse_names_and_bad_n():
    assert dense.parse("dense") == ("dense:20", "address", 20)
    assert dense.parse("Dense_Hot:1") == ("dense-hot:1", "hot", 1)
    assert dense.parse("dense-first=5") == ("dense-first:5", "first", 5)
    assert dense.parse("pack") is None and dense.parse("blocks") is None
    for bad in ("dense:0", "dense:x", "dense:-1"):
        with pytest.raises(BadInput):
            dense.parse(bad)


def _toy():
    # 10 iterations. Block 0 and 1 touch and merge into [0x1000, 0x1018); block 2 runs
    # once in the window (once per 10 iterations); block 3 only in the warm-up;
    # block 4 (cold, once) overlaps the start of the first interval.
    rows = [(0x1000, 16), (0x1010, 8), (0x2000, 4), (0x3000, 8), (0x0FF0, 0x18)]
    ids = [2] + [0, 1] * 10 + [4]
    return _trace(rows, ids, loops=10, warm=[3])


def test_dense_intervals_addresses_and_split():
    bt = _toy()
    d = dense.DenseLayout(bt, every=10)                 # block 2 and 4 run once: in
    # block 4 runs once too: [0xff0, 0x1008) merges with the first interval
    assert d.intervals == 2 and d.bytes == (0x1018 - 0xFF0) + 4
    assert d.base == 0x200000                          # 2 MiB above the traced code
    t = d.table(bt.blocks, 64)
    assert t.block(4).tolist() == [0x200000 >> 6]     # [0xff0, 0x1008) packed first
    assert t.block(0).tolist() == [0x200010 >> 6]
    assert t.block(1).tolist() == [0x200020 >> 6]
    assert t.block(2).tolist() == [0x200028 >> 6]     # right after the first interval
    assert t.block(3).tolist() == [0x3000 >> 6]       # never in the window: stays

    d1 = dense.DenseLayout(bt, every=1)               # only blocks 0 and 1 (10 runs)
    assert (d1.intervals, d1.bytes) == (1, 0x18)
    t1 = d1.table(bt.blocks, 64)
    # the cold block overlapping it is split: its first 16 bytes stay, the rest moves
    assert t1.block(4).tolist() == [0xFF0 >> 6, 0x200000 >> 6]
    assert t1.block(2).tolist() == [0x2000 >> 6]


def test_dense_orders_hot_and_first():
    # interval A at 0x1000 runs 2x, B at 0x5000 5x, C at 0x9000 4x; C runs first, then B
    rows = [(0x1000, 32), (0x5000, 100), (0x9000, 8)]
    ids = [2, 1, 0] + [1] * 4 + [2] * 3 + [0]
    bt = _trace(rows, ids, loops=1)
    order = {}
    for name in ("dense", "dense-hot", "dense-first"):
        _, o, n = dense.parse(name + ":1")
        d = dense.DenseLayout(bt, every=n, order=o)
        t = d.table(bt.blocks, 1)                      # 1-byte "lines": exact addresses
        order[name] = [int(t.block(b)[0]) - d.base for b in range(3)]
    assert order["dense"] == [0, 32, 132]              # address order A B C
    assert order["dense-hot"] == [108, 0, 100]         # B (5) C (4) A (2)
    assert order["dense-first"] == [108, 8, 0]         # first runs: C, B, A
    assert (t.cnt == [32, 100, 8]).all()


def test_dense_removes_the_conflict_misses():
    # two 64 B blocks 256 B apart: both on set 0 of a direct-mapped 4-set cache,
    # alternating, so every fetch misses in place; packed they take sets 0 and 1
    bt = _trace([(0x1000, 64), (0x1100, 64)], [0, 1] * 50, loops=50)
    stock = replay(bt, translate(bt.blocks, None, 64)[0], TOY)
    assert (stock["fetches"], stock["misses"]) == (100, 100)
    d = dense.DenseLayout(bt, every=1)
    packed = replay(bt, d.table(bt.blocks, 64), TOY)
    assert (packed["fetches"], packed["misses"]) == (100, 2)


def test_set_load_exact():
    # lines 0, 4 (set 0), 1 (set 1), 7 (set 3) of a 4-set cache; 10 iterations
    bt = _trace([(0, 64), (4 * 64, 64), (64, 128), (7 * 64, 64)],
                [0] * 30 + [1] * 10 + [2] * 5 + [3] * 20, loops=10)
    t = LineTable.from_ranges(bt.blocks["vaddr"], bt.blocks["size"], 64)
    lines, acc = dense.set_load(bt, t, TOY)
    # block 2 spans lines 1 and 2 and runs 0.5 times per iteration: not a loop line
    assert lines.tolist() == [2, 0, 0, 1]
    assert acc.tolist() == [4.0, 0.5, 0.5, 2.0]
    s = dense.summarize_sets(lines, acc, 1)
    assert (s["loop_lines"], s["lines_max"], s["sets_over_ways"], s["lines_over_ways"]) == \
        (3, 2, 1, 1)
    assert s["busiest"][0] == (0, 2, 4.0) and s["busiest"][1] == (3, 1, 2.0)
    assert s["lines_std"] == pytest.approx(np.std([2, 0, 0, 1]))
    txt = dense.format_set_summary([("stock", "toy", 1, s)])
    assert "0:2:4" in txt and "stock" in txt


def test_table_column_to_dense():
    rows = [{"layout": n, "cache": "c", "mode": "whatif", "misses": m, "fetches": 1000,
             "miss_rate": m / 1000, "instructions": 10000, "hot_lines": 10,
             "text_growth_pct": g, "time_s": 0.1}
            for n, m, g in (("stock", 1000, 0.0), ("blocks", 680, 0.1), ("dense:20", 572, None))]
    out = format_rows(rows)
    assert "to dense:20" in out
    got = {ln.split()[0]: ln.split()[-1] for ln in out.splitlines()[3:]}
    assert got == {"stock": "+42.8pt", "blocks": "+10.8pt", "dense:20": "+0.0pt"}
    assert "to dense" not in format_rows(rows[:2])          # no reference: no column


def test_set_load_plot_png(tmp_path):
    pytest.importorskip("matplotlib")
    from linepack.evaluate import plots
    sets = [{"layout": n, "workload": "w", "cache": "toy", "ways": 1, "lines_max": 2,
             "lines_over_ways": 1, "loop_lines_per_set": [2, 0, 0, 1],
             "accesses_per_set": [4.0, 0.5, 0.5, 2.0]} for n in ("stock", "dense:1")]
    plots.set_load_plot(sets, str(tmp_path / "s.png"))
    assert (tmp_path / "s.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("args,needle", [
    (["--kernel", "a", "--layout", "stock", "--layout", "dense"], "what-if only"),
    (["--kernel", "a", "--layout", "dense:0", "--whatif"], "N >= 1"),
    (["--kernel", "a", "--layout", "stock", "--sets"], "--sets/--sets-plot need --whatif"),
    (["--kernel", "a", "--sweep", "align-all:1", "--sets"], "--sets goes with --layout"),
    (["--kernel", "a", "--layout", "dense", "--layout", "dense:20", "--whatif"], "twice"),
])
def test_bad_arguments_one_line_exit_2(args, needle):
    p = run_linepack("evaluate", *args, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


@pytest.mark.qemu
@pytest.mark.realkernel
def test_dense_and_sets_on_the_real_kernel(debian_vmlinux, tmp_path):
    """The 20-loop vfs-mix trace: dense beats stock, packs fewer lines than stock
    executes, its per-set load is flatter, and the JSON holds every set."""
    j = tmp_path / "d.json"
    p = run_linepack("evaluate", "--kernel", debian_vmlinux, "--layout", "stock", "--layout",
                     "dense:1", "--whatif", "--loops", 20, "--sets", "--json", j)
    assert p.returncode == 0, p.stderr
    doc = json.loads(j.read_text())
    st, de = doc["results"]
    assert de["layout"] == "dense:1" and de["misses"] < st["misses"]
    assert de["instructions"] == st["instructions"] and de["text_growth_pct"] is None
    assert de["hot_lines"] < st["hot_lines"]
    s_st, s_de = doc["sets"]
    assert len(s_st["loop_lines_per_set"]) == 64          # intel-32k-8w: 64 sets
    assert s_de["lines_over_ways"] < s_st["lines_over_ways"]
    assert "to dense:1" in p.stdout and "per-set load" in p.stdout
