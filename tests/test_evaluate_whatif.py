"""evaluate: what-if replay (cache model, translation, traces), sweeps, outputs, CLI errors."""

import csv
import json
import random

import numpy as np
import pytest

from helpers import run_linepack
from linepack.errors import BadInput
from linepack.evaluate.cachemodel import CacheState, LineTable, reference_replay
from linepack.evaluate.whatif import BlockTrace, translate
from linepack.image.addrmap import AddressMap
from linepack.profile.trace import TBTRACE_DTYPE

PNG = b"\x89PNG\r\n\x1a\n"
LOOPS = 20


def _random_blocks(rng, n, span_lines):
    blocks = []
    for _ in range(n):
        first = rng.randrange(span_lines)
        k = rng.choice([1, 1, 1, 2, 2, 3, 5])
        blocks.append(list(range(first, first + k)))
    return blocks


@pytest.mark.parametrize("size,ways,line", [(32768, 8, 64), (65536, 2, 64), (4096, 1, 64),
                                            (2048, 4, 32)])
def test_cache_model_matches_python_lru(size, ways, line):
    rng = random.Random(size + ways)
    blocks = _random_blocks(rng, 300, 3 * size // line)
    ids = [rng.randrange(len(blocks)) if rng.random() < 0.3 else rng.randrange(40)
           for _ in range(20000)]
    cnt = np.array([len(b) for b in blocks])
    table = LineTable(np.cumsum(cnt) - cnt, cnt, np.concatenate(blocks).astype(np.uint64))
    st = CacheState({"size": size, "ways": ways, "line": line}).replay(np.array(ids), table)
    assert (st.fetches, st.misses) == reference_replay(ids, blocks, size, ways, line)
    assert 0 < st.misses < st.fetches


def test_cache_model_phases_and_per_block_sums():
    rng = random.Random(7)
    blocks = _random_blocks(rng, 100, 2000)
    cnt = np.array([len(b) for b in blocks])
    table = LineTable(np.cumsum(cnt) - cnt, cnt, np.concatenate(blocks).astype(np.uint64))
    ids = np.array([rng.randrange(100) for _ in range(5000)], dtype=np.uint32)
    whole = CacheState({"size": 8192, "ways": 4, "line": 64}).replay(ids, table)
    split = CacheState({"size": 8192, "ways": 4, "line": 64})
    pb = (np.zeros(100, np.uint64), np.zeros(100, np.uint64))
    split.replay(ids[:2000], table, count=False)
    split.replay(ids[2000:], table, per_block=pb)
    ref = CacheState({"size": 8192, "ways": 4, "line": 64})
    ref.replay(ids[:2000], table)
    assert split.misses == whole.misses - ref.misses       # warm state carries over
    assert int(pb[0].sum()) == split.fetches and int(pb[1].sum()) == split.misses


def test_line_table_straddle_and_fetch_merge():
    # a 4-byte block at 0x3e touches lines 0 and 1; a block starting in the
    # line where the previous one ended does not fetch that line again
    t = LineTable.from_ranges([0x3E, 0x70, 0x100], [4, 8, 1], 64)
    assert t.block(0).tolist() == [0, 1]
    assert t.block(1).tolist() == [1]
    st = CacheState({"size": 4096, "ways": 2, "line": 64}).replay(np.array([0, 1, 2, 0]), t)
    # fetches: 0,1 | (1 merged) | 4 | 0,1 -> 5; misses: 0,1,4 cold -> 3
    assert (st.fetches, st.misses) == (5, 3)


def test_poisoned_state_reports_unknown_ways():
    t = LineTable.from_ranges([0], [64], 64)
    st = CacheState({"size": 1024, "ways": 2, "line": 64}).poison()
    assert st.unknown_ways() == 16
    st.replay(np.array([0]), t, count=False)
    assert st.unknown_ways() == 15


def _blocks(rows):
    b = np.zeros(len(rows), dtype=[("vaddr", "<u8"), ("size", "<u4"), ("ninsns", "<u4")])
    for i, (a, s, n) in enumerate(rows):
        b[i] = (a, s, n)
    return b


def test_translate_moves_blocks_with_their_unit():
    blocks = _blocks([(0x1000, 16, 3), (0x1008, 0x30, 5), (0x2000, 8, 1)])
    amap = AddressMap([0x1000, 0x1040], [0x1040, 0x1080], [0x5030, 0x1040],
                      extents=[(0x1000, 0x1080)])
    table, stats = translate(blocks, amap, 64)
    assert table.block(0).tolist() == [0x5030 >> 6]
    assert table.block(1).tolist() == [0x5038 >> 6, 0x5067 >> 6]      # now straddles
    assert table.block(2).tolist() == [0x2000 >> 6]                     # outside: in place
    assert stats["split_blocks"] == 0
    ident, _ = translate(blocks, AddressMap.identity(), 64)
    assert ident.lines.tolist() == [0x40, 0x40, 0x80]


def test_translate_splits_a_block_across_units():
    blocks = _blocks([(0x1038, 16, 4)])       # runs from unit A into unit B
    amap = AddressMap([0x1000, 0x1040], [0x1040, 0x1080], [0x2000, 0x9000],
                      extents=[(0x1000, 0x1080)])
    table, stats = translate(blocks, amap, 64)
    assert stats["split_blocks"] == 1
    assert table.block(0).tolist() == [0x2038 >> 6, 0x9000 >> 6]


def test_block_trace_roundtrip(tmp_path):
    rec = np.zeros(6, TBTRACE_DTYPE)
    rec["vaddr"] = [0xffffffff81000000, 0xffffffff81000040, 0xffffffff81000000,
                    0xffffffff81000000, 0xffffffff81000040, 0xffffffff81000010]
    rec["size"] = [16, 8, 16, 20, 8, 4]
    rec["ninsns"] = [3, 2, 3, 4, 2, 1]
    bt = BlockTrace.from_records(rec[:2], rec[2:], {"loops": 1})
    assert len(bt.blocks) == 4 and len(bt.warm) == 2 and bt.executions == 4
    assert bt.instructions == 3 + 4 + 2 + 1
    p = tmp_path / "t.npz"
    bt.save(str(p))
    bt2 = BlockTrace.load(str(p))
    assert (bt2.ids == bt.ids).all() and (bt2.blocks == bt.blocks).all() and bt2.meta["loops"] == 1
    (tmp_path / "bad.npz").write_bytes(b"nope")
    with pytest.raises(BadInput):
        BlockTrace.load(str(tmp_path / "bad.npz"))


def test_parse_sweep_ten_points():
    from linepack.evaluate.modes import parse_sweep
    assert parse_sweep("align-all:1,2,4,...,512") == ("align-all",
                                                      [1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    assert parse_sweep("align-all:16,64")[1] == [16, 64]
    for bad in ("pack:1,2", "align-all:3", "align-all:1,...", "align-all:", "align-all:1024",
                "align-all:x"):
        with pytest.raises(BadInput):
            parse_sweep(bad)


def test_plots_are_png(tmp_path):
    pytest.importorskip("matplotlib")
    from linepack.evaluate import plots
    rows = [{"layout": s, "cache": c, "misses": m} for c in ("a", "b")
            for s, m in (("stock", 1000), ("pack", 900))]
    plots.bar_chart(rows, str(tmp_path / "bar.png"))
    sw = [{"align": a, "cache": c, "misses": 1000 - a, "text_growth_pct": a / 10}
          for c in ("a", "b") for a in (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    plots.sweep_plot(sw, str(tmp_path / "sweep.png"))
    lines = np.arange(1000, 3000, 3, dtype=np.uint64)
    plots.heatmap([("stock", lines, np.ones(len(lines))),
                   ("pack", lines[:100], np.full(100, 10.0))], str(tmp_path / "heat.png"))
    for n in ("bar", "sweep", "heat"):
        assert (tmp_path / f"{n}.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("args,needle", [
    (["--kernel", "a", "--kernel", "b", "--layout", "stock"], "exactly one --kernel"),
    (["--kernel", "a", "--whatif"], "--whatif"),
    (["--kernel", "a", "--sweep", "align-all:3"], "power of two"),
    (["--kernel", "a", "--layout", "stock", "--sweep", "align-all:1"], "do not go together"),
    (["--kernel", "a", "--cache", "nosuch"], "unknown cache model"),
    (["--kernel", "a", "--repeat", "0"], "--repeat"),
    (["--kernel", "/nonexistent/vmlinux"], "no such file"),
    (["--kernel", "a", "--layout", "bogus"], "unknown strategy"),
    (["--kernel", "a", "--booted"], "--booted"),
])
def test_bad_arguments_one_line_exit_2(args, needle):
    p = run_linepack("evaluate", *args, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


# ---- on the real kernel, booted under QEMU ----

@pytest.mark.qemu
@pytest.mark.realkernel
def test_replay_equals_plugin_misses_on_stock(debian_vmlinux):
    from linepack.evaluate.whatif import record_trace, whatif
    caches = ["intel-32k-8w", "amd-64k-2w"]
    bt = record_trace(debian_vmlinux, "vfs-mix", LOOPS, caches, cache=False)
    rs = whatif(bt, None, caches, "stock")
    for r in rs:
        booted = bt.meta["booted"][r["cache"]]
        assert r["misses"] == booted["misses"], r
        assert r["fetches"] == booted["fetches"], r
        assert r["warm_unknown_ways"] == 0


@pytest.mark.qemu
@pytest.mark.realkernel
def test_identity_plan_replays_like_stock(debian_vmlinux):
    from linepack.evaluate.layouts import Layouts, PlanMap
    from linepack.evaluate.whatif import record_trace, whatif
    from linepack.relayout import strategies
    from linepack.relayout.plan import make_heat, make_plan
    bt = record_trace(debian_vmlinux, "vfs-mix", LOOPS, ["intel-32k-8w"])
    units, functions = Layouts(debian_vmlinux)._build_units()
    plan = make_plan(units, strategies.get("stock"), make_heat(units, functions, {}),
                     functions=functions)
    pm = PlanMap.from_plan(plan)
    a = whatif(bt, pm.amap, ["intel-32k-8w"])[0]
    b = whatif(bt, None, ["intel-32k-8w"])[0]
    assert (a["misses"], a["fetches"], a["hot_lines"]) == (b["misses"], b["fetches"], b["hot_lines"])
    assert pm.growth == 0


@pytest.mark.qemu
@pytest.mark.realkernel
def test_sweep_cli_ten_points_json_csv_png(debian_vmlinux, tmp_path):
    pytest.importorskip("matplotlib")
    j, c, png = tmp_path / "s.json", tmp_path / "s.csv", tmp_path / "s.png"
    p = run_linepack("evaluate", "--kernel", debian_vmlinux, "--sweep", "align-all:1,2,4,...,512",
                     "--loops", LOOPS, "--cache", "intel-32k-8w", "--cache", "amd-64k-2w",
                     "--json", j, "--csv", c, "--plot", png)
    assert p.returncode == 0, p.stderr
    doc = json.loads(j.read_text())
    for cache in ("intel-32k-8w", "amd-64k-2w"):
        rs = [r for r in doc["results"] if r["cache"] == cache]
        assert len(rs) == 11                      # stock + ten alignments
        assert sorted(r["align"] for r in rs) == [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
        assert all(r["misses"] > 0 and r["mode"] == "whatif" for r in rs)
    with open(c) as f:
        assert len(list(csv.DictReader(f))) == 22
    assert png.read_bytes()[:8] == PNG
    assert "align-all:512" in p.stdout


@pytest.mark.qemu
@pytest.mark.realkernel
def test_layouts_whatif_cli_bar_and_heatmap(debian_vmlinux, tmp_path):
    pytest.importorskip("matplotlib")
    j, bar, heat = tmp_path / "l.json", tmp_path / "bar.png", tmp_path / "heat.png"
    p = run_linepack("evaluate", "--kernel", debian_vmlinux, "--layout", "stock", "--layout",
                     "align-all:64", "--layout", "pack", "--whatif", "--loops", LOOPS,
                     "--json", j, "--plot", bar, "--heatmap", heat)
    assert p.returncode == 0, p.stderr
    rs = json.loads(j.read_text())["results"]
    assert [r["layout"] for r in rs] == ["stock", "align-all:64", "pack"]
    assert rs[0]["misses"] == rs[0]["booted_misses"]
    assert len({r["instructions"] for r in rs}) == 1
    assert rs[1]["text_growth_pct"] > rs[2]["text_growth_pct"]
    assert bar.read_bytes()[:8] == PNG and heat.read_bytes()[:8] == PNG


def test_layout_cache_is_pruned_oldest_first(tmp_path, monkeypatch):
    import os
    from linepack.evaluate.layouts import prune_images
    d = tmp_path / "buildid"
    d.mkdir()
    paths = []
    for k in range(5):
        p = d / f"l{k}.vmlinux"
        p.write_bytes(b"x")
        os.utime(p, ns=(10**18 + k, 10**18 + k))
        paths.append(p)
    (d / "l0.plan.npz").write_bytes(b"plan")
    monkeypatch.setenv("LINEPACK_LAYOUT_CACHE_MAX", "3")
    prune_images(str(tmp_path), keep=str(paths[0]))
    left = sorted(p.name for p in d.iterdir())
    # l0 is kept (just produced), l1 and l2 are the oldest others; plans stay
    assert left == ["l0.plan.npz", "l0.vmlinux", "l3.vmlinux", "l4.vmlinux"]
