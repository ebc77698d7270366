"""`linepack profile --merge`: per-workload normalisation, weights, tables, fdata inputs, errors."""

import numpy as np
import pytest

from helpers import run_linepack
from linepack.errors import BadInput
from linepack.profile.merge import MERGED_LOOPS, merge_profiles
from linepack.profile.model import KIND_CALL, KIND_INTRA, Profile
from test_perf_import import compile_hotloop, func_lookup


def _prof(funcs, loops=10, build_id="ab" * 20, edges=(), blocks=(), metric="insns",
          source="qemu", workload=None):
    """funcs: {name: (addr, insns)}; edges: (from, to, count, kind); blocks: (addr, size, n, count)."""
    names = sorted(funcs, key=lambda n: funcs[n][0])
    n = len(names)
    ins = np.array([funcs[k][1] for k in names], np.uint64)
    arrays = {"func_addr": np.array([funcs[k][0] for k in names], np.uint64),
              "func_size": np.full(n, 0x40, np.uint64), "func_local": np.zeros(n, np.uint8),
              "func_entries": ins // 10, "func_blocks": ins // 5, "func_insns": ins,
              "func_samples": ins if metric == "samples" else np.zeros(n, np.uint64)}
    if edges:
        e = np.array(edges, np.uint64)
        arrays.update({"edge_from": e[:, 0], "edge_to": e[:, 1], "edge_count": e[:, 2],
                       "edge_mispred": np.zeros(len(e), np.uint64),
                       "edge_kind": e[:, 3].astype(np.uint8)})
    if blocks:
        b = np.array(blocks, np.uint64)
        arrays.update({"block_addr": b[:, 0], "block_size": b[:, 1].astype(np.uint32),
                       "block_insns": b[:, 2].astype(np.uint32), "block_count": b[:, 3]})
    meta = {"source": source, "metric": metric, "build_id": build_id, "loops": loops,
            "workload": workload, "image": "vmlinux"}
    return Profile(meta, arrays, names)


A = _prof({"a_hot": (0x1000, 900), "shared": (0x2000, 100)}, workload="short",
          edges=[(0x1000, 0x2000, 10, KIND_CALL)], blocks=[(0x1000, 0x10, 4, 225)])
B = _prof({"shared": (0x2000, 10_000), "b_hot": (0x3000, 90_000)}, workload="long",
          edges=[(0x1000, 0x2000, 30, KIND_CALL), (0x3000, 0x3010, 50, KIND_INTRA)],
          blocks=[(0x1000, 0x10, 4, 100), (0x3000, 0x10, 9, 10_000)])


def _share(p, name):
    c = p.function_counts("insns")
    return c.get(name, 0) / p.total("insns")


def test_each_workload_gets_the_same_share_whatever_its_length():
    m = merge_profiles([A, B])
    # A is 100x shorter than B, yet each holds half of the merged total
    assert _share(m, "a_hot") == pytest.approx(0.45, abs=1e-6)
    assert _share(m, "b_hot") == pytest.approx(0.45, abs=1e-6)
    assert _share(m, "shared") == pytest.approx(0.05 + 0.05, abs=1e-6)   # 10% of each
    assert m.func_name == ["a_hot", "shared", "b_hot"]
    assert list(m.func_addr) == [0x1000, 0x2000, 0x3000]
    # per "average iteration": total per iteration = mean of the inputs' (100 and 10,000)
    assert m.meta["loops"] == MERGED_LOOPS
    assert m.total("insns") == pytest.approx(5050 * MERGED_LOOPS, rel=1e-6)
    assert m.meta["workload"] == "short+long"
    assert [d["workload"] for d in m.meta["merged"]] == ["short", "long"]


def test_weights_set_the_shares():
    m = merge_profiles([A, B], weights=[3, 1])
    assert _share(m, "a_hot") == pytest.approx(0.75 * 0.9, abs=1e-6)
    assert _share(m, "b_hot") == pytest.approx(0.25 * 0.9, abs=1e-6)
    zero = merge_profiles([A, B], weights=[0, 1])
    assert "a_hot" not in zero.func_name               # all its counts scaled to 0
    assert _share(zero, "b_hot") == pytest.approx(0.9, abs=1e-6)


def test_edges_and_blocks_are_scaled_with_their_profile_and_summed():
    m = merge_profiles([A, B])
    fa, fb = m.meta["merged"][0]["scale"], m.meta["merged"][1]["scale"]
    assert fa == pytest.approx(100 * fb)
    edges = {(int(f), int(t)): (int(c), int(k)) for f, t, c, k in
             zip(m.edge_from, m.edge_to, m.edge_count, m.edge_kind)}
    assert edges[(0x1000, 0x2000)] == (round(10 * fa) + round(30 * fb), KIND_CALL)
    assert edges[(0x3000, 0x3010)] == (round(50 * fb), KIND_INTRA)
    blocks = {int(a): int(c) for a, c in zip(m.block_addr, m.block_count)}
    assert blocks == {0x1000: round(225 * fa) + round(100 * fb), 0x3000: round(10_000 * fb)}
    assert m.meta["instructions"] == int((m.block_count * m.block_insns).sum())


def test_merged_profile_saves_reproducibly_and_relayout_reads_it(tmp_path):
    m = merge_profiles([A, B])
    m.save(tmp_path / "a.lpprof")
    merge_profiles([A, B]).save(tmp_path / "b.lpprof")
    assert (tmp_path / "a.lpprof").read_bytes() == (tmp_path / "b.lpprof").read_bytes()
    back = Profile.load(str(tmp_path / "a.lpprof"))
    assert back.function_counts() == m.function_counts()
    from linepack.relayout.driver import load_profile
    hot, build_id, _ = load_profile(str(tmp_path / "a.lpprof"))
    assert build_id == "ab" * 20 and hot["a_hot"] == pytest.approx(_share(m, "a_hot") * 5050, rel=1e-3)


def test_without_loop_counts_the_total_is_fixed():
    a = _prof({"x": (0x1000, 7)}, loops=None)
    b = _prof({"y": (0x2000, 70_000)}, loops=None)
    m = merge_profiles([a, b])
    assert m.meta["loops"] is None
    assert m.function_counts() == {"x": 500_000_000, "y": 500_000_000}


@pytest.mark.parametrize("bad, words", [
    (dict(build_id="cd" * 20), "different builds"),
    (dict(metric="samples", source="perf-ip"), "cannot merge"),
])
def test_incompatible_profiles_are_refused(bad, words):
    other = _prof({"y": (0x2000, 5)}, **bad)
    with pytest.raises(BadInput, match=words):
        merge_profiles([A, other])


def test_bad_weights_and_single_input_are_refused():
    with pytest.raises(BadInput, match="2 profiles"):
        merge_profiles([A, B], weights=[1])
    with pytest.raises(BadInput, match="non-negative"):
        merge_profiles([A, B], weights=[-1, 2])
    with pytest.raises(BadInput, match="at least two"):
        merge_profiles([A])


def _fdata(ft, t, counts):
    """Branch-mode fdata: crunch -> mix calls `counts[0]`, mix's entry loop `counts[1]`."""
    c, m = ft.name[t["crunch"]], ft.name[t["mix"]]
    return (f"1 {c} 10 1 {m} 0 0 {counts[0]}\n"
            f"1 {m} 8 1 {m} 0 0 {counts[1]}\n")


def test_cli_merges_fdata_files_and_exports_fdata(tmp_path):
    exe = compile_hotloop(tmp_path, pie=False)
    ft, t = func_lookup(exe)
    (tmp_path / "w1.fdata").write_text(_fdata(ft, t, (10, 90)))
    (tmp_path / "w2.fdata").write_text(_fdata(ft, t, (9000, 1000)))
    out = tmp_path / "m.lpprof"
    p = run_linepack("profile", "--merge", tmp_path / "w1.fdata", tmp_path / "w2.fdata",
                     "--weights", "1,1", "--image", exe, "-o", out)
    assert p.returncode == 0, p.stderr
    m = Profile.load(str(out))
    assert m.source == "fdata" and m.meta["loops"] is None
    # w1: mix gets 100% of its branches, w2: 100% too -> mix holds everything
    assert m.function_counts("blocks") == {ft.name[t["mix"]]: 1_000_000_000}
    calls = {(int(f), int(to)): int(c) for f, to, c in zip(m.edge_from, m.edge_to, m.edge_count)}
    assert sorted(calls.values()) == [50_000_000 + 450_000_000, 450_000_000 + 50_000_000]
    fd = tmp_path / "m.fdata"
    p = run_linepack("profile", "--export-fdata", out, "--image", exe, "-o", fd)
    assert p.returncode == 0, p.stderr
    assert "500000000" in fd.read_text()


def test_cli_errors_are_one_line(tmp_path):
    A.save(str(tmp_path / "a.lpprof"))
    B.save(str(tmp_path / "b.lpprof"))
    (tmp_path / "x.fdata").write_text("1 main 0 1 main 4 0 1\n")
    for args, status, words in [
        (("--merge", tmp_path / "a.lpprof", tmp_path / "b.lpprof"), 2, "--output is required"),
        (("--merge", tmp_path / "a.lpprof", tmp_path / "b.lpprof", "--weights", "1,x",
          "-o", tmp_path / "o"), 2, "comma-separated"),
        (("--merge", tmp_path / "a.lpprof", tmp_path / "x.fdata", "-o", tmp_path / "o"), 2,
         "give --image"),
        (("--show", tmp_path / "a.lpprof", "--weights", "1"), 2, None),
    ]:
        p = run_linepack("profile", *args)
        assert p.returncode == status, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
        if words:
            assert words in p.stderr, p.stderr


def test_merge_orders_first_runs_input_by_input(tmp_path):
    """Input i's positions become i + their fraction of its window; a block in both
    keeps the earliest (the first input's code first, then what the second adds);
    one input without first runs: the merge has none."""
    a = _prof({"a_hot": (0x1000, 900)}, blocks=[(0x1000, 0x10, 4, 10), (0x1010, 0x10, 4, 10)])
    b = _prof({"a_hot": (0x1000, 900)}, blocks=[(0x1000, 0x10, 4, 30), (0x2000, 0x10, 4, 30)])
    a.block_first, a.meta["first_window"] = np.array([0.0, 99.0]), 100.0
    b.block_first, b.meta["first_window"] = np.array([3.0, 0.0]), 4.0
    m = merge_profiles([a, b])
    assert m.block_addr.tolist() == [0x1000, 0x1010, 0x2000]
    assert m.block_first.tolist() == [0.0, 0.99, 1.0] and m.meta["first_window"] == 2.0
    m.save(tmp_path / "m.lpprof")                 # merged again: its positions scale by 2.0
    assert Profile.load(tmp_path / "m.lpprof").meta["first_window"] == 2.0
    c = _prof({"a_hot": (0x1000, 900)}, blocks=[(0x1000, 0x10, 4, 10)])
    assert len(merge_profiles([a, c]).block_first) == 0
