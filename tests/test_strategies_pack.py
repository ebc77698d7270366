"""Layout strategies (pack, hot64, align-all) on synthetic unit tables: the layout
rules, cold order, growth bound, determinism, block-aware placement and the
profile helpers of plan.py."""

import os
import random

import numpy as np
import pytest

from linepack.relayout import strategies
from linepack.relayout.plan import (LINE, block_line_metric, hot_lines, make_plan,
                                    profile_blocks, profile_calls, unit_hot_ranges)
from linepack.relayout.units import Region, UnitTable

BASE = 0xffffffff81001000
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def table(sizes, aligns=16, slack=1 << 16, phases=None):
    starts, cur = [], BASE
    for s in sizes:
        starts.append(cur)
        cur = (cur + s + aligns - 1) // aligns * aligns
    regs = [Region("r0", BASE, cur + slack, 1)]
    return UnitTable(starts, sizes, [0] * len(sizes), regs, phase=phases)


def random_table(seed, n=300):
    rng = random.Random(seed)
    sizes = [rng.choice([rng.randint(1, 64), rng.randint(65, 2000)]) for _ in range(n)]
    heat = [rng.choice([0, 0, 0, rng.uniform(0.01, 0.99), rng.uniform(1, 1e4)]) for _ in range(n)]
    return table(sizes), np.asarray(heat)


def plan_of(t, spec, heat, **kw):
    return make_plan(t, strategies.get(spec), np.asarray(heat, float), **kw)


def check_rules(t, p, heat, min_count=1.0):
    """Big hot units start on a line, small hot ones do not straddle one."""
    for k in range(len(t)):
        if heat[k] < min_count:
            continue
        a, s = int(p.new_start[k]), int(t.size[k])
        if s > LINE:
            assert a % LINE == 0, (k, hex(a), s)
        else:
            assert a // LINE == (a + s - 1) // LINE, (k, hex(a), s)


def cold_order(t, p, heat, min_count=1.0):
    cold = [k for k in range(len(t)) if heat[k] < min_count]
    return sorted(cold, key=lambda k: int(p.new_start[k])) == cold


def growth(t, p):
    return int(p.new_end.max()) - int(t.end.max())


@pytest.mark.parametrize("seed", range(5))
def test_pack_rules_cold_order_growth(seed):
    t, heat = random_table(seed)
    p = plan_of(t, "pack", heat)
    check_rules(t, p, heat)
    assert cold_order(t, p, heat)
    hot = heat >= 1
    # Padding is bounded: < one line per hot unit (plus nothing for cold ones).
    assert growth(t, p) < LINE * int(hot.sum())
    # Hot units come first, all of them before any cold one.
    assert int(p.new_start[hot].max()) < int(p.new_start[~hot].min())


@pytest.mark.parametrize("seed", range(3))
def test_hot64_rules(seed):
    t, heat = random_table(seed)
    p = plan_of(t, "hot64", heat)
    assert all(int(p.new_start[k]) % 64 == 0 for k in np.nonzero(heat >= 1)[0])
    assert cold_order(t, p, heat)


def test_pack_is_deterministic():
    t, heat = random_table(7)
    a = plan_of(t, "pack", heat).new_start
    b = plan_of(t, "pack", heat).new_start
    assert (a == b).all()


def test_pack_fills_holes_with_small_units():
    # Big (96 B) units leave two 32 B holes; two of the 20 B hot units go there.
    t = table([96, 96, 96, 20, 20, 20])
    heat = [50, 40, 30, 3, 2, 1]
    p = plan_of(t, "pack", heat)
    check_rules(t, p, heat)
    end_big = max(int(p.new_end[k]) for k in range(3))
    assert sum(int(p.new_start[k]) < end_big for k in range(3, 6)) == 2
    assert growth(t, p) <= 0


def test_pack_density_order_option():
    t = table([1000, 40])
    heat = [100, 90]            # the small one is far denser
    assert int(plan_of(t, "pack", heat).new_start[0]) < int(plan_of(t, "pack", heat).new_start[1])
    dens = make_plan(t, strategies.get({"strategy": "pack", "order": "density"}),
                     np.asarray(heat, float))
    assert int(dens.new_start[1]) < int(dens.new_start[0])
    with pytest.raises(Exception):
        strategies.get({"strategy": "pack", "order": "nope"})


def test_pack_min_count_threshold():
    t = table([100, 100, 100])
    heat = [0.5, 2, 0]
    lo = make_plan(t, strategies.get({"strategy": "pack", "min_count": 0.1}), np.asarray(heat))
    hi = make_plan(t, strategies.get({"strategy": "pack", "min_count": 1}), np.asarray(heat))
    assert int(lo.new_start[0]) % 64 == 0          # hot at 0.1: aligned
    assert int(hi.new_start[1]) == BASE            # only unit 1 hot at 1: first
    assert int(hi.new_start[0]) < int(hi.new_start[2])


# -- block-aware placement --------------------------------------------------------------

def blocks_for(t, spans):
    """(addr, size, count) arrays from [(unit, offset, size, count)]."""
    a = [int(t.start[k]) + o for k, o, _, _ in spans]
    return (np.asarray(a, np.uint64), np.asarray([s for _, _, s, _ in spans], np.uint64),
            np.asarray([c for *_, c in spans], float))


def test_unit_hot_ranges_merge_and_threshold():
    t = table([200, 50])
    b = blocks_for(t, [(0, 0, 10, 5), (0, 8, 10, 5), (0, 100, 4, 0.1), (1, 40, 20, 3)])
    r = unit_hot_ranges(t, b, 0.5)
    assert r == {0: [(0, 18)], 1: [(40, 50)]}          # merged; cold block dropped; clipped
    assert unit_hot_ranges(t, b, 0)[0] == [(0, 18), (100, 104)]


@pytest.mark.parametrize("seed", range(4))
def test_pack_blocks_strict_keeps_rules_and_never_worse(seed):
    t, heat = random_table(seed)
    rng = random.Random(seed)
    spans = []
    for k in np.nonzero(heat >= 1)[0].tolist():
        s = int(t.size[k])
        for _ in range(rng.randint(1, 4)):
            o = rng.randrange(s)
            spans.append((k, o, rng.randint(1, min(48, s - o)), rng.uniform(0.6, 100)))
    b = blocks_for(t, spans)
    plain = plan_of(t, "pack", heat)
    blk = plan_of(t, "pack", heat, blocks=b)
    check_rules(t, blk, heat)
    assert cold_order(t, blk, heat)
    assert growth(t, blk) < LINE * int((heat >= 1).sum())
    before = block_line_metric(plain, b)["block_lines_after"]
    after = block_line_metric(blk, b)["block_lines_after"]
    assert after <= before
    again = plan_of(t, "pack", heat, blocks=b)
    assert (again.new_start == blk.new_start).all()


def test_pack_blocks_free_shares_lines():
    # Unit 0: 100 B, hot to its end; unit 1: 200 B, only its first 16 B run.
    # strict starts unit 1 on a line; free lets it share unit 0's last line.
    t = table([100, 200])
    heat = [10, 5]
    b = blocks_for(t, [(0, 0, 100, 10), (1, 0, 16, 5)])
    strict = plan_of(t, "pack", heat, blocks=b)
    free = make_plan(t, strategies.get({"strategy": "pack", "strict": False}),
                     np.asarray(heat, float), blocks=b)
    assert int(strict.new_start[1]) % 64 == 0
    s = block_line_metric(strict, b)["block_lines_after"]
    f = block_line_metric(free, b)["block_lines_after"]
    assert f < s
    assert int(free.new_start[1]) < int(strict.new_start[1])


def test_pack_blocks_small_unit_goes_to_a_touched_line():
    # A 20 B hot unit fits in the hot line another unit already occupies.
    t = table([80, 20, 300])
    heat = [9, 1, 8]
    b = blocks_for(t, [(0, 0, 80, 9), (1, 0, 20, 1), (2, 0, 30, 8)])
    p = plan_of(t, "pack", heat, blocks=b)
    check_rules(t, p, heat)
    m = block_line_metric(p, b)
    assert m["block_lines_after"] <= m["block_lines_before"]


def test_block_line_metric_identity_for_stock():
    t = table([100, 30, 70])
    b = blocks_for(t, [(0, 0, 100, 1), (2, 10, 10, 2)])
    p = plan_of(t, "stock", [1, 0, 2])
    m = block_line_metric(p, b)
    assert m["block_lines_before"] == m["block_lines_after"] == hot_lines(b[0], b[1])


# -- call edges and config --------------------------------------------------------------

class _Funcs:
    def __init__(self, starts, sizes, names):
        self.start = np.asarray(starts, np.uint64)
        self.size = np.asarray(sizes, np.uint64)
        self.name = list(names)

    def find(self, addrs):
        a = np.asarray(addrs, np.uint64)
        i = np.searchsorted(self.start, a, side="right").astype(np.int64) - 1
        ok = (i >= 0) & (a < self.start[np.maximum(i, 0)] + self.size[np.maximum(i, 0)])
        return np.where(ok, i, -1)

    def index_of(self, n):
        return self.name.index(n) if n in self.name else None


class _Prof:
    def __init__(self, efrom, eto, count, kind, loops=10):
        self.edge_from = np.asarray(efrom, np.uint64)
        self.edge_to = np.asarray(eto, np.uint64)
        self.edge_count = np.asarray(count, np.uint64)
        self.edge_kind = np.asarray(kind, np.uint8)
        self.block_addr = np.asarray([0x1000], np.uint64)
        self.block_size = np.asarray([4], np.uint32)
        self.block_count = np.asarray([20], np.uint64)
        self.meta = {"loops": loops}


def test_profile_calls_and_blocks():
    f = _Funcs([0x1000, 0x1100, 0x1200], [0x100, 0x100, 0x100], ["a", "b", "c"])
    prof = _Prof([0x1010, 0x1020, 0x1110, 0x1010, 0x1005], [0x1100, 0x1100, 0x1200, 0x1050, 0x1000],
                 [30, 10, 5, 7, 9], [1, 1, 1, 0, 1])
    assert profile_calls(prof, f) == [("a", "b", 4.0), ("b", "c", 0.5)]
    a, s, c = profile_blocks(prof)
    assert a.tolist() == [0x1000] and c.tolist() == [2.0]


def test_pack_with_call_edges_groups_caller_and_callee():
    t = table([100, 300, 100, 100])
    heat = [10, 9, 8, 7]
    f = _Funcs(t.start, t.size, [f"f{i}" for i in range(4)])
    t.funcs = np.arange(4)
    p = make_plan(t, strategies.get("pack"), np.asarray(heat, float),
                  calls=[("f0", "f3", 100.0)], functions=f)
    order = np.argsort(p.new_start).tolist()
    assert order.index(3) == order.index(0) + 1


def test_pack_config_matches_defaults():
    try:
        import tomllib
    except ImportError:
        import tomli as tomllib
    with open(os.path.join(ROOT, "configs", "relayout", "pack.toml"), "rb") as fh:
        cfg = tomllib.load(fh)
    a, b = strategies.get(dict(cfg)), strategies.get("pack")
    for attr in ("min_count", "line", "max_cluster", "order_by", "use_blocks", "block_min",
                 "strict"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert cfg["min_count"] == 1


def test_set_spread_shifts_a_region_off_the_sets_of_the_one_before(tmp_path):
    # an 8-set direct-mapped cache (512 B period); two regions 4 KiB apart, each
    # with one hot 256 B unit at its start: stock-like placement puts both on sets
    # 0..3; set-aware placement moves the second region's hot area to sets 4..7
    toy = tmp_path / "toy.toml"
    toy.write_text('name = "toy"\nsize = 512\nways = 1\nline = 64\npolicy = "lru"\n')
    r1 = BASE + 0x1000
    regs = [Region("r0", BASE, BASE + 0x800, 1), Region("r1", r1, r1 + 0x800, 1)]
    t = UnitTable([BASE, BASE + 0x100, r1, r1 + 0x100], [256, 64, 256, 64], [0, 0, 1, 1], regs)
    heat = np.array([10.0, 0.0, 5.0, 0.0])
    plain = make_plan(t, strategies.get("blocks"), heat)
    spread = make_plan(t, strategies.get(f"blocks-sets:{toy}"), heat)
    sets = lambda a: {(int(a) // 64 + i) % 8 for i in range(4)}    # noqa: E731
    assert sets(plain.new_start[0]) == sets(plain.new_start[2]) == {0, 1, 2, 3}
    assert int(spread.new_start[0]) == BASE                       # the first region: no shift
    assert int(spread.new_start[2]) == r1 + 256                   # padded by 4 lines
    assert sets(spread.new_start[2]) == {4, 5, 6, 7}
    assert int(spread.new_start[3]) >= int(spread.new_start[2]) + 256    # cold after hot
    # the same strategy object planned again starts from empty sets
    s = strategies.get(f"blocks-sets:{toy}")
    a, b = make_plan(t, s, heat), make_plan(t, s, heat)
    assert (a.new_start == b.new_start).all()


def test_set_spread_needs_a_cache_model():
    from linepack.errors import LinepackError
    with pytest.raises(LinepackError, match="needs a cache model"):
        strategies.get("blocks-sets")


def test_order_first_follows_first_runs_and_falls_back_to_heat():
    # four hot units: heat says 3, 2, 1, 0; the window first ran 1, then 3, then 0;
    # unit 2 never ran in the window (it goes after them, by heat)
    t = table([100, 100, 100, 100])
    heat = [5.0, 10.0, 20.0, 40.0]
    strat = strategies.get("pack", order="first")
    strat.first_run = {1: 10, 3: 25, 0: 70}
    p = make_plan(t, strat, np.asarray(heat))
    assert sorted(range(4), key=lambda k: int(p.new_start[k])) == [1, 3, 0, 2]
    strat.first_run = None                      # no first runs: by heat, as order = "heat"
    p2 = make_plan(t, strat, np.asarray(heat))
    assert sorted(range(4), key=lambda k: int(p2.new_start[k])) == [3, 2, 1, 0]
    assert strategies.get("blocks").order_by == "first"
    from linepack.errors import LinepackError
    with pytest.raises(LinepackError, match="'first'"):
        strategies.get("pack", order="random")


def test_planning_units_split_hot_align():
    # unit 1 is split (hot part 40 B, cold part 60 B): its hot part keeps the
    # function's 16 B alignment unless hot_align says otherwise; cold parts take 1
    from types import SimpleNamespace
    from linepack.relayout.blocks import planning_units
    t = table([64, 100, 32])
    splits = [SimpleNamespace(unit=1, sizes=(40, 60), name="u1")]
    heat = np.array([2.0, 3.0, 0.0])
    kept, _, parent, part = planning_units(t, heat, splits)
    assert parent.tolist() == [0, 1, 1, 2] and part.tolist() == [0, 0, 1, 0]
    assert kept.align.tolist() == [16, 16, 1, 16]
    one, _, _, _ = planning_units(t, heat, splits, hot_align=1)
    assert one.align.tolist() == [16, 1, 1, 16]       # only the split hot part changes
    pfx = UnitTable(t.start, t.size, [0] * 3, t.regions,
                    members=[[(0, 0)], [(1, 0), (2, 16)], [(3, 0)]])   # unit 1 has a prefix
    kept1, _, _, _ = planning_units(pfx, heat, splits, hot_align=1)
    assert kept1.align.tolist() == [16, 16, 1, 16]
    assert strategies.get("blocks").split_hot_align == 1
    assert strategies.get("blocks", split_hot_align="none").split_hot_align is None


def test_planning_units_whole_hot_align():
    # units 0 and 3 are hot and moved whole, unit 1 is split, unit 2 is cold, unit 4 is
    # hot but pinned, unit 5 hot with a prefix member: whole_align reaches only 0 and 3
    from types import SimpleNamespace
    from linepack.relayout.blocks import planning_for, planning_units
    t = table([64, 100, 32, 48, 16, 40])
    t.pinned[4] = True
    t.members[5] = [(5, 0), (6, 16)]
    splits = [SimpleNamespace(unit=1, sizes=(40, 60), name="u1")]
    heat = np.array([2.0, 3.0, 0.5, 1.0, 9.0, 4.0])
    kept, _, parent, part = planning_units(t, heat, splits, hot_align=1)
    assert parent.tolist() == [0, 1, 1, 2, 3, 4, 5]
    assert kept.align.tolist() == [16, 1, 1, 16, 16, 16, 16]       # without: their own
    one, _, _, _ = planning_units(t, heat, splits, hot_align=1, whole_align=1)
    assert one.align.tolist() == [1, 1, 1, 16, 1, 16, 16]
    # the hot threshold is the strategy's min_count: at 2 unit 3 (heat 1) is cold
    two, _, _, _ = planning_units(t, heat, splits, hot_align=1, whole_align=1, min_count=2)
    assert two.align.tolist() == [1, 1, 1, 16, 16, 16, 16]
    # the strategy carries both options (blocks: 1 and 1, "none" keeps the function's)
    strat = strategies.get("blocks")
    assert (strat.split_hot_align, strat.whole_hot_align) == (1, 1)
    via, _, _, _ = planning_for(t, heat, splits, strat)
    assert via.align.tolist() == one.align.tolist()
    off = strategies.get("blocks", whole_hot_align="none")
    assert off.whole_hot_align is None
    assert planning_for(t, heat, splits, off)[0].align.tolist() == kept.align.tolist()


def test_blocks_from_trace_first_runs():
    from linepack.evaluate.layouts import blocks_from_trace, hotness_hash
    from linepack.evaluate.whatif import BlockTrace
    b = np.zeros(3, dtype=[("vaddr", "<u8"), ("size", "<u4"), ("ninsns", "<u4")])
    b["vaddr"], b["size"] = [0x1000, 0x2000, 0x3000], 8
    # block 1 never runs in the window; block 2 runs first, block 0 second
    bt = BlockTrace(b, np.array([1], np.uint32), np.array([2, 0, 2, 0], np.uint32), {"loops": 2})
    blk = blocks_from_trace(bt)
    assert blk[0].tolist() == [0x1000, 0x3000] and blk[2].tolist() == [1.0, 1.0]
    assert blk.first.tolist() == [1, 0]
    other = blocks_from_trace(BlockTrace(b, bt.warm, np.array([0, 2, 2, 0], np.uint32), bt.meta))
    assert hotness_hash({"f": 1}, (), blk) != hotness_hash({"f": 1}, (), other)
