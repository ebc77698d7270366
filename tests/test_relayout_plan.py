"""LayoutPlan, strategies and AddressMap on synthetic unit tables."""

import numpy as np
import pytest

from linepack.errors import LinepackError
from linepack.image.addrmap import AddressMap
from linepack.relayout import strategies
from linepack.relayout.plan import hot_lines, make_plan
from linepack.relayout.units import Region, UnitTable, inferred_align

BASE = 0x401000


def table(sizes, gap=16, pinned_region=False, region_end=None, aligns=16):
    starts, cur = [], BASE
    for s in sizes:
        starts.append(cur)
        cur = (cur + s + aligns - 1) // aligns * aligns
    end = region_end or cur + 4096 * 4
    regs = [Region("r0", BASE, end, 1, pinned_region)]
    return UnitTable(starts, sizes, [0] * len(sizes), regs)


def lay(t, strat, heat=None):
    h = np.zeros(len(t)) if heat is None else np.asarray(heat, float)
    return make_plan(t, strategies.get(strat), h)


def test_inferred_alignment_caps_at_16():
    assert inferred_align([0x1000, 0x1008, 0x1001, 0xffffffff81000040]).tolist() == [16, 8, 1, 16]


def test_stock_is_identity():
    t = table([10, 100, 33, 64, 5])
    p = lay(t, "stock", [5, 0, 3, 0, 9])
    assert p.is_identity()


def test_align_all_keeps_order_and_aligns():
    t = table([10, 100, 33, 64, 5])
    p = lay(t, "align-all 64")
    assert (p.new_start % 64 == 0).all()
    assert (np.diff(p.new_start.astype(np.int64)) > 0).all()
    p1 = lay(t, "align-all 1")
    assert p1.is_identity()        # inferred 16 B alignment keeps original places


def test_align_all_never_below_inferred_alignment():
    regs = [Region("r0", BASE, BASE + 4096, 1)]
    t = UnitTable([BASE, BASE + 0x21, BASE + 0x48], [0x21, 0x27, 8], [0, 0, 0], regs)
    p = lay(t, "align-all 1")
    assert p.new_start.tolist() == [BASE, BASE + 0x21, BASE + 0x48]
    p = lay(t, "align-all 4")
    assert p.new_start.tolist() == [BASE, BASE + 0x24, BASE + 0x50]


def test_align_all_rejects_bad_n():
    for bad in ("align-all 3", "align-all 1024", "align-all x"):
        with pytest.raises(LinepackError):
            strategies.get(bad)


def test_unknown_strategy():
    with pytest.raises(strategies.UnknownStrategy):
        strategies.get("fancy")


def test_hot64_hot_first_cold_in_order():
    t = table([10, 100, 33, 64, 5, 20])
    heat = [0, 5, 0, 9, 0, 1]
    p = lay(t, "hot64", heat)
    order = np.argsort(p.new_start).tolist()
    assert order[:3] == [3, 1, 5]
    assert order[3:] == [0, 2, 4]
    assert all(int(p.new_start[k]) % 64 == 0 for k in (3, 1, 5))


def test_pack_big_aligned_small_not_straddling_and_gaps_filled():
    sizes = [100, 20, 200, 30, 40, 10, 16, 300, 8]
    heat = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    t = table(sizes + [50, 60], region_end=None)
    p = lay(t, "pack", heat + [0, 0])
    for k, s in enumerate(sizes):
        a = int(p.new_start[k])
        if s > 64:
            assert a % 64 == 0
        else:
            assert a // 64 == (a + s - 1) // 64, k
        assert a % 16 == 0
    # The hot area is denser than hot64's.
    hot = np.arange(len(sizes))
    ph = lay(t, "hot64", heat + [0, 0])
    assert hot_lines(p.new_start[hot], t.size[hot]) <= hot_lines(ph.new_start[hot], t.size[hot])
    # Cold units keep their order after the hot ones.
    assert p.new_start[9] < p.new_start[10]
    assert p.new_start[9] > p.new_start[:9].max()


def test_pack_call_graph_affinity_groups_caller_and_callee():
    from linepack.relayout.plan import RegionView
    t = table([40, 40, 40, 40])
    heat = np.array([10.0, 9, 8, 7])
    view = RegionView(t, 0, heat)
    view.edges = [(0, 3, 100)]
    order = strategies.get("pack").order(view)
    assert order.index(3) == order.index(0) + 1


def test_pinned_region_and_overflow():
    regs = [Region("a", BASE, BASE + 0x100, 1), Region("b", BASE + 0x100, BASE + 0x200, 1, True)]
    t = UnitTable([BASE, BASE + 0x40, BASE + 0x100], [0x30, 0x30, 0x10], [0, 0, 1], regs)
    p = lay(t, "align-all 64")
    assert p.new_start[2] == BASE + 0x100
    assert p.kept_regions == []
    # align-all 256 does not fit before the pinned region: region a keeps its layout
    p = lay(t, "align-all 256")
    assert p.new_start.tolist() == [BASE, BASE + 0x40, BASE + 0x100]
    assert p.kept_regions == ["a"]


def test_overflow_before_pinned_keeps_the_nearest_region_only():
    """Two movable regions before a pinned one: only the one whose growth does not
    fit keeps its layout; the first is still laid out by the strategy."""
    # a's layout ends where c starts: nothing for c to start earlier into
    regs = [Region("a", BASE, BASE + 0x80, 1), Region("c", BASE + 0x80, BASE + 0xc0, 1),
            Region("b", BASE + 0xc0, BASE + 0x200, 1, True)]
    t = UnitTable([BASE, BASE + 0x30, BASE + 0x80, BASE + 0xa0, BASE + 0xc0],
                  [0x30, 0x30, 0x20, 0x20, 0x10], [0, 0, 1, 1, 2], regs)
    p = lay(t, "align-all 64")
    assert p.kept_regions == ["c"]
    assert p.new_start.tolist() == [BASE, BASE + 0x40, BASE + 0x80, BASE + 0xa0, BASE + 0xc0]


def test_overflow_before_pinned_first_uses_the_room_left_before():
    """The region before a pinned one outgrows its space while the region before it
    ends early (its layout needs less than it had): the region starts right after
    that code (its labels move back) and keeps the strategy's layout; nothing is
    kept or compacted. Without the early end it keeps its original layout."""
    regs = [Region("a", BASE, BASE + 0x100, 1), Region("c", BASE + 0x100, BASE + 0x140, 1),
            Region("b", BASE + 0x140, BASE + 0x200, 1, True)]
    t = UnitTable([BASE, BASE + 0x30, BASE + 0x100, BASE + 0x120, BASE + 0x140],
                  [0x30, 0x30, 0x20, 0x20, 0x10], [0, 0, 1, 1, 2], regs)
    p = lay(t, "align-all 64")
    assert p.kept_regions == [] and p.compact_regions == []
    assert p.region_new_start == [BASE, BASE + 0x80, BASE + 0x140]
    assert p.new_start.tolist() == [BASE, BASE + 0x40, BASE + 0x80, BASE + 0xc0, BASE + 0x140]
    # a layout that fits leaves every region at its start
    assert lay(t, "align-all 16").region_new_start == [BASE, BASE + 0x100, BASE + 0x140]


def test_region_shift_when_previous_grows():
    regs = [Region("a", BASE, BASE + 0x60, 1), Region("b", BASE + 0x60, BASE + 0x1000, 1)]
    t = UnitTable([BASE, BASE + 0x30, BASE + 0x60], [0x30, 0x30, 0x10], [0, 0, 1], regs)
    p = lay(t, "align-all 64")
    assert p.new_start.tolist() == [BASE, BASE + 0x40, BASE + 0x80]
    assert p.region_new_start == [BASE, BASE + 0x80]


def test_hot_lines():
    assert hot_lines([0, 60], [10, 10]) == 2
    assert hot_lines([0, 10], [10, 10]) == 1
    assert hot_lines([60], [10]) == 2


def test_addressmap_pieces_ends_and_extents():
    m = AddressMap([0x100, 0x200], [0x150, 0x240], [0x300, 0x100],
                   extents=[(0x100, 0x400)], anchors={0x100: 0x100, 0x400: 0x400})
    new, ok = m.map(np.array([0x100, 0x14f, 0x150, 0x200, 0x23f, 0x240, 0x180, 0x500, 0x50],
                             np.uint64))
    assert new.tolist()[:6] == [0x300, 0x34f, 0x350, 0x100, 0x13f, 0x140]
    assert ok.tolist() == [True] * 6 + [False, True, True]
    assert new.tolist()[7:] == [0x500, 0x50]
    with pytest.raises(ValueError):
        m.map1(0x180)


def test_addressmap_start_beats_end_of_previous():
    m = AddressMap([0x100, 0x150], [0x150, 0x160], [0x300, 0x100], extents=[(0x100, 0x200)])
    assert m.map1(0x150) == 0x100       # start of the next piece, not end of the previous
    assert m.map1(0x160) == 0x110       # end of the last piece


def test_addressmap_from_plan_kernel_addresses():
    base = 0xffffffff81000000
    regs = [Region("a", base, base + 0x1000, 1)]
    t = UnitTable([base, base + 0x30], [0x30, 0x30], [0, 0], regs)
    p = make_plan(t, strategies.get("align-all 64"), np.zeros(2))
    m = AddressMap.from_plan(p)
    assert m.map1(base + 0x35) == base + 0x45
    assert m.map1(base + 0x60) == base + 0x70   # end of the moved function


def test_overflows_of_separate_runs_found_in_one_plan():
    """Two runs of movable regions, each before its pinned region: each keeps the
    regions it alone needs (one run's keeps do not touch the other); when code
    outgrows its space even at its original layout (a block-level split grew it),
    the error names every such pinned region, so blocks un-splits them together."""
    B2 = BASE + 0x200
    regs = [Region("a", BASE, BASE + 0x80, 1), Region("c", BASE + 0x80, BASE + 0xc0, 1),
            Region("b", BASE + 0xc0, BASE + 0x200, 1, True),
            Region("d", B2, B2 + 0x80, 1), Region("e", B2 + 0x80, B2 + 0xc0, 1),
            Region("f", B2 + 0xc0, B2 + 0x200, 1, True)]
    starts = [BASE, BASE + 0x30, BASE + 0x80, BASE + 0xa0, BASE + 0xc0]
    sizes = [0x30, 0x30, 0x20, 0x20, 0x10]
    t = UnitTable(starts + [s + 0x200 for s in starts], sizes * 2,
                  [0, 0, 1, 1, 2, 3, 3, 4, 4, 5], regs)
    p = lay(t, "align-all 64")
    assert p.kept_regions == ["c", "e"]
    assert p.new_start.tolist()[5:] == [B2, B2 + 0x40, B2 + 0x80, B2 + 0xa0, B2 + 0xc0]
    # the last unit before each pinned region grew past it
    t = UnitTable(starts + [s + 0x200 for s in starts], [0x30, 0x30, 0x20, 0x30, 0x10] * 2,
                  [0, 0, 1, 1, 2, 3, 3, 4, 4, 5], regs)
    with pytest.raises(LinepackError) as e:
        lay(t, "align-all 16")
    assert e.value.pinned_regions == [2, 5] and e.value.pinned_region == 2


def test_no_room_for_alignment_gives_the_order_without_padding():
    """A region packed tight against pinned code (16-byte aligned units, as with
    call-depth tracking's padding): pack's 64 B alignment does not fit, its order
    does: hot units first, one after another, nothing past the pinned start."""
    n, size = 6, 0x48
    end = BASE + n * 0x50
    regs = [Region("a", BASE, end, 1), Region("b", end, end + 0x100, 1, True)]
    t = UnitTable([BASE + 0x50 * k for k in range(n)] + [end], [size] * n + [0x10],
                  [0] * n + [1], regs)
    p = lay(t, "pack", [0, 0, 0, 5, 0, 9, 0])
    assert p.kept_regions == [] and p.compact_regions == ["a"]
    assert p.new_start.tolist() == [BASE + 0x50 * k for k in (2, 3, 4, 1, 5, 0)] + [end]
    # align-all has no order of its own: the region keeps its layout
    p = lay(t, "align-all 64")
    assert p.kept_regions == ["a"] and p.compact_regions == [] and p.is_identity()


def test_no_room_nearest_region_first():
    """Region c (nothing hot: no order of its own) overflows first and keeps its
    layout; a gets pack's order unpadded."""
    regs = [Region("a", BASE, BASE + 0xa0, 1), Region("c", BASE + 0xa0, BASE + 0x100, 1),
            Region("b", BASE + 0x100, BASE + 0x200, 1, True)]
    t = UnitTable([BASE, BASE + 0x50, BASE + 0xa0, BASE + 0xc0, BASE + 0x100],
                  [0x48, 0x48, 0x20, 0x20, 0x10], [0, 0, 1, 1, 2], regs)
    p = lay(t, "pack", [0, 9, 0, 0, 0])
    assert p.kept_regions == [] and p.compact_regions == []
    p = lay(t, "pack", [3, 9, 0, 0, 0])
    assert p.compact_regions == ["a"] and p.kept_regions == ["c"]
    assert p.new_start.tolist() == [BASE + 0x50, BASE, BASE + 0xa0, BASE + 0xc0, BASE + 0x100]
    # no room even unpadded: a keeps its layout too
    t = UnitTable([BASE, BASE + 0x50, BASE + 0xa0, BASE + 0xc0, BASE + 0x100],
                  [0x48, 0x48, 0x20, 0x20, 0x10], [0, 0, 1, 1, 2],
                  [Region("a", BASE, BASE + 0xa0, 1), Region("c", BASE + 0xa0, BASE + 0x100, 1),
                   Region("b", BASE + 0x100, BASE + 0x200, 1, True)],
                  align=[64, 16, 16, 16, 16])
    p = lay(t, "pack", [3, 9, 0, 0, 0])
    assert p.kept_regions == ["a", "c"] and p.compact_regions == [] and p.is_identity()


def test_stuck_overflow_names_the_bytes_short():
    """Code before a pinned region that does not fit even at its original layout
    (a block-level layout's split functions grew): the error names the region and
    how many bytes it is short, which the block-level retry un-splits just enough
    of (relayout/passes.py _unsplit_before)."""
    from linepack.relayout.plan import LayoutError
    regs = [Region("a", BASE, BASE + 0x100, 1), Region("b", BASE + 0x100, BASE + 0x200, 1, True)]
    t = UnitTable([BASE, BASE + 0x80, BASE + 0x100], [0x80, 0x90, 0x10], [0, 0, 1], regs)
    with pytest.raises(LayoutError) as e:
        lay(t, "align-all 64")
    assert e.value.pinned_regions == [1]
    assert e.value.shortfalls == {1: 0x10}


def test_unsplit_covers_the_shortfall_least_heat_per_byte_first(monkeypatch):
    """Block level, code before a pinned region short by N bytes at its original
    layout: the splits whose growth covers N move whole, least heat per byte of
    growth first; splits elsewhere, and those that did not grow, stay split."""
    from types import SimpleNamespace
    from linepack.image.cfg import R_NO_ROOM
    from linepack.relayout import blocks, passes
    regs = [Region("a", BASE, BASE + 0x1000, 1), Region("p", BASE + 0x1000, BASE + 0x1100, 1, True),
            Region("b", BASE + 0x1100, BASE + 0x2000, 1)]
    # units 0-4 in region a, 5 in the pinned one, 6 in region b
    starts = [BASE, BASE + 0x100, BASE + 0x200, BASE + 0x300, BASE + 0x400, BASE + 0x1000,
              BASE + 0x1100]
    orig = UnitTable(starts, [0x100] * 7, [0, 0, 0, 0, 0, 1, 2], regs)
    heat = np.array([10.0, 1.0, 4.0, 100.0, 0.5, 0, 0.1])
    # (unit, growth): heat per byte 10/20=.5, 1/10=.1, 4/10=.4, 100/20=5, 0.5/-4 (shrank)
    grew = {0: 20, 1: 10, 2: 10, 3: 20, 4: -4, 6: 30}
    splits = [SimpleNamespace(unit=u, sizes=(0x80, 0x80 + g)) for u, g in grew.items()]
    run = SimpleNamespace(orig_units=orig, orig_heat=heat, split={
        "splits": splits, "reason": np.zeros(7, np.int64)},
        strategy=SimpleNamespace(min_count=0.0), target=SimpleNamespace(kind="kernel"),
        split_stats=SimpleNamespace(), log=lambda m: None)
    monkeypatch.setattr(blocks, "planning_units", lambda *a: (orig, heat, None, None))
    monkeypatch.setattr(blocks, "reason_summary", lambda *a, **k: {})
    monkeypatch.setattr(passes, "_split_stats", lambda sp, o: SimpleNamespace())
    assert passes._unsplit_before(run, [1], {1: 15})
    kept = sorted(sf.unit for sf in run.split["splits"])
    assert kept == [0, 3, 4, 6]                 # units 1 and 2 (10 + 10 >= 15 bytes) moved whole
    assert run.split["reason"].tolist() == [0, R_NO_ROOM, R_NO_ROOM, 0, 0, 0, 0]
    # no shortfall known: every split before the pinned region moves whole
    assert passes._unsplit_before(run, [1])
    assert sorted(sf.unit for sf in run.split["splits"]) == [6]
