"""A region cut around pinned units (an unexplained reference pins its target's
unit: relayout/kernel/recovered.py pin_units) is laid out as one: hot units from every
piece gather at the region's start, the pinned units stay, cold units fill the
holes before and after them (relayout/plan.py cut_groups, _flow_around)."""

import numpy as np

from linepack.image.addrmap import AddressMap, plan_extents
from linepack.relayout.kernel.recovered import pin_units
from linepack.relayout import strategies
from linepack.relayout.plan import cut_groups, make_plan
from linepack.relayout.units import Region, UnitTable

BASE = 0xFFFFFFFF81200000


def _table(n=400, pinned=(50, 120, 121, 300), gap=0):
    rng = np.random.default_rng(7)
    sizes = rng.integers(8, 300, n)
    starts, cur = [], BASE
    for s in sizes.tolist():
        starts.append(cur)
        cur = (cur + s + gap + 15) // 16 * 16
    end = cur + 1024        # some slack before the next pinned region, as in a kernel
    regs = [Region(".text:r", BASE, end, 1), Region(".text:__kprobes_text_start", end, end + 64,
                                                    1, True)]
    t = UnitTable(starts, sizes, [0] * n, regs)
    pin_units(t, np.array(pinned))
    return t


def test_cut_region_is_one_group():
    t = _table()
    names = [r.name for r in t.regions]
    assert names[0] == ".text:r" and any(n.startswith(".text:r+") for n in names)
    groups = cut_groups(t.regions)
    (a, b), = groups.items()
    assert a == 0 and t.regions[b + 1].name == ".text:__kprobes_text_start"


def test_hot_units_gather_across_pinned_units():
    t = _table()
    heat = np.zeros(len(t))
    hot = [10, 200, 250, 350, 399]              # spread over the pieces
    heat[hot] = [50, 40, 30, 20, 10]
    plan = make_plan(t, strategies.get("pack"), heat)
    assert plan.groups == [(0, len(t.regions) - 2)]
    pinned = np.nonzero(t.pinned)[0]
    assert (plan.new_start[pinned] == t.start[pinned]).all()
    # every hot unit lands before the first pinned unit (the region's start)
    first_pin = int(t.start[pinned].min())
    assert all(int(plan.new_start[u] + t.size[u]) <= first_pin for u in hot)
    # nothing overlaps a pinned unit or another unit; everything stays in the region
    s = plan.new_start.astype(np.int64)
    e = s + t.size.astype(np.int64)
    o = np.argsort(s)
    assert (e[o][:-1] <= s[o][1:]).all()
    assert s.min() >= BASE - 2**64 and e.max() <= t.regions[-1].start - 2**64
    assert (s % 16 == 0).all()
    # one rewritten extent over the whole group, pinned units inside
    (lo, hi), = plan_extents(plan)[0]
    assert lo == BASE and hi == t.regions[-1].start
    amap = AddressMap.from_plan(plan)
    new, ok = amap.map(t.start)
    assert ok.all() and (new == plan.new_start).all()


def test_without_cuts_no_group():
    t = _table(pinned=())
    assert cut_groups(t.regions) == {}


def test_stock_keeps_its_pieces():
    """The identity stays the identity: stock does not flow around pinned units."""
    t = _table(gap=40)                        # padding between units: stock keeps it
    plan = make_plan(t, strategies.get("stock"), np.zeros(len(t)))
    assert plan.groups == [] and plan.is_identity()


def test_retries_reuse_the_group_layout(monkeypatch):
    """A retry (a region after the group gets no room before pinned code) lays the
    group out again only if it starts elsewhere: the group's layout is reused, and
    the plan is the one a fresh layout of the group gives."""
    import linepack.relayout.plan as P
    n, m = 400, 40
    rng = np.random.default_rng(7)
    sizes = np.concatenate([rng.integers(8, 300, n), np.full(m, 70)])
    starts, cur = [], BASE
    for s in sizes.tolist():
        starts.append(cur)
        cur = (cur + s + 15) // 16 * 16
    split = starts[n]
    regs = [Region(".text:r", BASE, split, 1), Region(".text:s", split, cur, 1),
            Region(".text:__kprobes_text_start", cur, cur + 64, 1, True)]
    t = UnitTable(starts, sizes, [0] * n + [1] * m, regs)
    pin_units(t, np.array([50, 120, 121, 300]))
    heat = np.zeros(len(t))
    heat[[10, 200, 350]] = [50, 40, 30]
    heat[n:] = 5.0              # hot, 70 bytes each at 64 B lines: no room in a tight .text:s
    calls = []
    real = P._layout_group

    def counted(*a, **k):
        calls.append(int(a[8]))               # rstart
        return real(*a, **k)
    monkeypatch.setattr(P, "_layout_group", counted)
    logged = []
    plan = make_plan(t, strategies.get("pack"), heat, log=logged.append)
    assert any(".text:s" in x for x in logged)  # the retry happened
    assert len(calls) == len(set(calls)) == 1
    # the same plan as laying the group out on every try
    monkeypatch.setattr(P, "_regions_independent", lambda s: False)
    again = make_plan(t, strategies.get("pack"), heat)
    assert (again.new_start == plan.new_start).all()
    assert again.compact_regions == plan.compact_regions and again.kept_regions == plan.kept_regions


def test_region_after_a_group_takes_the_room_the_group_left():
    """Debian's 6.12: the cut main text, laid out as one, ends before its original end
    (here the gaps between its units go); the region after it needs more than its
    own span (hot 70-byte units on 64 B lines) before pinned kprobes text. It starts
    right after the group instead: the group stays one, nothing keeps its original
    layout or loses its alignment."""
    n, m = 400, 6
    rng = np.random.default_rng(7)
    sizes = np.concatenate([rng.integers(8, 300, n), np.full(m, 70)])
    starts, cur = [], BASE
    for k, s in enumerate(sizes.tolist()):
        starts.append(cur)
        cur = (cur + s + (20 if k < n else 0) + 15) // 16 * 16
    split = starts[n]
    regs = [Region(".text:r", BASE, split, 1), Region(".text:s", split, cur, 1),
            Region(".text:__kprobes_text_start", cur, cur + 64, 1, True)]
    t = UnitTable(starts, sizes, [0] * n + [1] * m, regs)
    pin_units(t, np.array([50, 120, 121, 300]))
    s_index = [r.name for r in t.regions].index(".text:s")
    heat = np.zeros(len(t))
    heat[[10, 200, 350]] = [50, 40, 30]
    heat[n:] = 5.0
    logged = []
    plan = make_plan(t, strategies.get("pack"), heat, log=logged.append)
    assert plan.groups == [(0, s_index - 1)]
    assert plan.kept_regions == [] and plan.compact_regions == []
    assert any("start right after the code before them" in x for x in logged)
    assert plan.region_new_start[s_index] < t.regions[s_index].start
    hot_s = np.arange(n, n + m)
    assert (plan.new_start[hot_s] % 64 == 0).all()         # the strategy's own layout
    pinned = np.nonzero(t.pinned)[0]
    assert (plan.new_start[pinned] == t.start[pinned]).all()
    assert int(plan.new_end.max()) <= t.regions[-1].start
