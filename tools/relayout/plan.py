"""LayoutPlan: where every unit goes.

A plan maps each unit (see ``units.py``) to a new start address. Regions are
laid out one after another in address order: a region keeps its start unless
the region before it grew into it; pinned regions (and pinned units) never
move, and a layout that would run into a pinned region is refused.

Strategies (``strategies/``) decide the order and alignment of the units of
one region; they see hotness as a plain mapping ``{function name or start
address: count}`` so any profile source can feed them.
"""

import bisect
import re

import numpy as np

from ..errors import LinepackError

LINE = 64


class LayoutError(LinepackError):
    """The layout does not fit (it would run into pinned code).

    ``fact`` says what does not fit; ``advice`` (or None) what the user may do
    about it. A caller with other means (a new segment) logs the fact alone."""

    def __init__(self, fact, advice=None):
        super().__init__(f"{fact}; {advice}" if advice else fact)
        self.fact, self.advice = fact, advice


# the advice for a layout that outgrows the space it must fit in
LESS_PADDING = "use a strategy with less padding"


def align_up(x, a):
    return (x + a - 1) // a * a


def place(cursor, unit_align, phase, want_align=1):
    """Smallest address >= cursor with the unit's alignment (and phase) and want_align."""
    a = max(int(unit_align), 1)
    phase = int(phase)
    cursor = int(cursor)
    if phase:
        # A glued unit whose start is not at its members' largest alignment:
        # keep the same phase modulo that alignment.
        m = 16
        p = align_up(cursor - phase, m) + phase
        return p if p >= cursor else p + m
    return align_up(cursor, max(a, int(want_align)))


class RegionView:
    """What a strategy sees of one region: its units and their heat."""

    def __init__(self, units, region_index, heat, skip=0, members=None, index=None):
        self.region = units.regions[region_index]
        if index is not None:
            # ``index``: the units themselves (a group of regions laid out as one)
            self.index = np.asarray(index, np.int64)
        else:
            # ``members``: the region's unit indices in ascending order, when the caller
            # has them (_make_plan: all regions' at once)
            self.index = (np.nonzero(units.region == region_index)[0] if members is None
                          else members)[skip:]
        self.start = units.start[self.index].astype(object)
        self.size = units.size[self.index].astype(np.int64)
        self.align = units.align[self.index]
        self.phase = units.phase[self.index]
        self.heat = heat[self.index]
        self.names = [units.name[i] for i in self.index.tolist()]

    def __len__(self):
        return len(self.index)


class LayoutPlan:
    """New start address of every unit, plus region placement and provenance."""

    def __init__(self, units, new_start, region_new_start, strategy, heat):
        self.units = units
        self.new_start = np.asarray(new_start, dtype=np.uint64)
        self.new_end = self.new_start + units.size
        self.region_new_start = list(region_new_start)
        self.strategy = strategy
        self.heat = heat
        self.kept_regions = []        # regions that kept their original layout (make_plan)
        self.compact_regions = []     # regions in the strategy's order, unpadded (make_plan)
        self.relocated = set()        # sections whose movable code went to a new segment
        # (first, last) region indexes laid out as one around their pinned units
        # (cut_groups): units move across the pinned regions inside
        self.groups = []

    @property
    def moved(self):
        return self.new_start != self.units.start

    def is_identity(self):
        return not bool(self.moved.any())

    def region_new_end(self, ri):
        """New address of the region's end label (start of the next region)."""
        regs = self.units.regions
        if ri + 1 < len(regs) and regs[ri + 1].section == regs[ri].section:
            return self.region_new_start[ri + 1]
        return regs[ri].end

    def summary(self, functions=None):
        u = self.units
        hot = self.heat > 0
        out = {
            "strategy": self.strategy,
            "units": int(len(u)),
            "units_moved": int(self.moved.sum()),
            "functions_moved": int(sum(len(u.members[i]) for i in np.nonzero(self.moved)[0])),
            "hot_units": int(hot.sum()),
            "hot_text_bytes": int(u.size[hot].sum()),
        }
        return out


def make_heat(units, functions, hotness):
    """Per-unit heat (max count over its member functions) from {name|addr: count}."""
    heat = np.zeros(len(units), dtype=np.float64)
    if not hotness:
        return heat
    for key, count in hotness.items():
        if isinstance(key, str):
            fi = functions.index_of(key)
            if fi is None and key.startswith("0x"):
                key = int(key, 16)
            else:
                if fi is None:
                    continue
                ui = int(units.funcs[fi]) if units.funcs is not None else -1
                if ui >= 0:
                    heat[ui] = max(heat[ui], float(count))
                continue
        if isinstance(key, (int, np.integer)):
            ui = int(units.find([int(key)])[0])
            if ui >= 0:
                heat[ui] = max(heat[ui], float(count))
    return heat


class _PinnedOverflow(LayoutError):
    """The regions before pinned region ``index`` grew past its start."""

    def __init__(self, fact, index, needed):
        super().__init__(fact, LESS_PADDING)
        self.index, self.needed = index, needed


def make_plan(units, strategy, heat, calls=(), functions=None, blocks=None, hot_ranges=None,
              log=None, relocate=None):
    """Lay out every region with ``strategy``; returns a LayoutPlan.

    When the regions before a pinned one (kprobes text, entry text) outgrow the
    space they had (a tightly linked kernel has no slack there: 6.12's lock text
    ends 8 bytes before its kprobes text, and 64 B alignment of its hot spin locks
    needs more; with call-depth tracking's 16-byte padding before every function a
    small kernel's main text has no slack at all), the movable region nearest to
    it is laid out "compact" instead: the strategy's order without its alignment
    padding (units one after another at their own alignment, so it needs no more
    room than its original layout), then the next nearest, ...; a region whose
    strategy has no order of its own (or no hot unit) keeps its original layout,
    as does a compact one when all are compact and the room is still short.
    ``plan.compact_regions`` and ``plan.kept_regions`` name them.

    ``relocate``: {section index: new start} for sections whose movable code goes
    to a new place with no end (a userspace executable's new segment,
    relayout/user/segment.py): their movable regions are laid out one after
    another from there, their pinned regions stay where they are.
    """
    keep, compact, pulled = set(), set(), set()
    calls = _call_units(units, calls, functions)     # by name once, not once per region
    # a retry lays out again every region the kept one does not change: a region's
    # layout is a function of the region and where it starts, kept from try to try
    memo = {} if _regions_independent(strategy) else None
    # Each run of movable regions between pinned ones is laid out on its own then
    # too: all runs' overflows are found in one plan and each run gets its next
    # kept region at once (the same keep sets as one run at a time, fewer plans)
    together = memo is not None
    in_group = {k for a, b in cut_groups(units.regions).items() for k in range(a, b + 1)} \
        if getattr(strategy, "flows_around_pinned", False) else set()
    while True:
        over = [] if together else None
        try:
            plan = _make_plan(units, strategy, heat, calls, functions, blocks, hot_ranges, keep,
                              relocate or {}, memo, overflows=over, compact=compact,
                              pulled=pulled)
        except _PinnedOverflow as e:
            over = [(e.index, str(e), e.needed)]
        if over:
            regs = units.regions
            # first the room the code before it left unused: its regions start right
            # after the code before them instead of at their own starts
            pull = set()
            for index, _, _ in over:
                pull.update(_run_before(regs, index, in_group))
            pull -= pulled
            if pull:
                pulled |= pull
                if log:
                    log(f"{len(pull)} regions before {len(over)} pinned region(s) start right "
                        f"after the code before them (the {strategy.name} layout does not fit "
                        f"before pinned {regs[over[0][0]].name})")
                continue
            stuck = []
            for index, msg, needed in over:
                cands = [i for i in _run_before(regs, index, in_group) if (units.region == i).any()]
                # each region nearest-first: its order without padding, or its original
                # layout when the strategy has no order of its own; then, still no
                # room, the original layout of the compact ones, nearest first
                new = [i for i in cands if i not in keep and i not in compact]
                again = [i for i in cands if i in compact]
                if new:
                    i = new[0]
                    has_order = strategy.compact_order(RegionView(units, i, heat)) is not None
                    (compact if has_order else keep).add(i)
                elif again:
                    i = again[0]
                    compact.discard(i)
                    keep.add(i)
                else:
                    stuck.append((index, msg, needed))
                    continue
                if log:
                    what = ("keeps its original layout" if i in keep else
                            f"{strategy.name}'s order without its alignment padding")
                    log(f"{regs[i].name}: {what} (the {strategy.name} layout does not fit "
                        f"before pinned {regs[index].name})")
            if stuck and len(stuck) == len(over):
                err = LayoutError(stuck[0][1], LESS_PADDING)
                err.pinned_region = stuck[0][0]     # block level: relayout/passes.py retries
                err.pinned_regions = [i for i, _, _ in stuck]
                # bytes each is short with every region before it at its original layout
                err.shortfalls = {i: n for i, _, n in stuck}
                raise err from None
            continue
        plan.kept_regions = sorted(units.regions[i].name for i in keep)
        plan.compact_regions = sorted(units.regions[i].name for i in compact)
        plan.relocated = set(relocate or ())
        return plan


def _run_before(regs, index, in_group):
    """Indexes of the movable regions between pinned region ``index`` and the pinned
    region before it in its section (the pinned units of a group ``in_group`` are
    laid out with it, they do not end the run)."""
    out = []
    for i in range(index - 1, -1, -1):
        if regs[i].section != regs[index].section:
            break
        if regs[i].pinned:
            if i in in_group:
                continue
            break
        out.append(i)
    return out


def _regions_independent(strategy):
    """True when the strategy's layout of a region depends on that region alone (no
    state carried from region to region: pack's is for set-aware placement only)."""
    return not hasattr(strategy, "begin_plan") or getattr(strategy, "set_spread", True) is None


def _make_plan(units, strategy, heat, calls, functions, blocks, hot_ranges, keep, relocate,
               memo=None, overflows=None, compact=(), pulled=()):
    """make_plan with the regions in ``keep`` (indexes) at their original layout,
    those in ``compact`` in the strategy's order without alignment padding.
    ``overflows``: None (an outgrown pinned region raises _PinnedOverflow) or a
    list that collects (index, message) of every outgrown one; a plan with
    any is not returned (None).

    ``memo``: {(region, pinned prefix, start): placements} of earlier tries, and
    {("group", first, last, start): (units, new starts, cursor)} of cut groups (None:
    lay out every region).

    ``calls``: _call_units' arrays of the call edges (by unit);
    ``blocks``: optional (address, size, count per iteration) arrays of the
    profile's executed blocks; strategies that look at bytes inside units
    (``pack``) get them as ``view.hot_ranges`` (see ``unit_hot_ranges``).
    """
    regs = units.regions
    if hasattr(strategy, "begin_plan"):
        strategy.begin_plan()          # a strategy that carries state across regions
    ranges = hot_ranges if getattr(strategy, "use_blocks", False) else None
    if ranges is None and blocks is not None and getattr(strategy, "use_blocks", False):
        ranges = unit_hot_ranges(units, blocks, getattr(strategy, "block_min", 0.0))
    new_start = units.start.copy()
    region_new_start = [r.start for r in regs]
    by_region = np.argsort(units.region, kind="stable")       # ascending within a region
    cuts = np.searchsorted(units.region[by_region], np.arange(len(regs) + 1))
    prev_section, cursor = None, None
    groups = {} if relocate or not getattr(strategy, "flows_around_pinned", False) else \
        {a: b for a, b in cut_groups(regs).items()
         if not (keep | set(compact)) & set(range(a, b + 1))}
    laid_groups, skip_to = [], -1
    for ri, reg in enumerate(regs):
        if ri <= skip_to:
            continue                   # laid out with its group
        if reg.section != prev_section:
            if prev_section is not None and prev_section not in relocate:
                _check_section_end(regs[ri - 1], cursor)
            cursor = relocate.get(reg.section, reg.start)
            prev_section = reg.section
        moved_away = reg.section in relocate
        if ri in groups:
            if cursor > reg.start and reg.pinned:
                msg = (f"layout does not fit: the code before {reg.name} needs "
                       f"{cursor - reg.start} more bytes than the space before it "
                       f"(pinned at {reg.start:#x})")
                if overflows is None:
                    raise _PinnedOverflow(msg, ri, cursor - reg.start)
                overflows.append((ri, msg, cursor - reg.start))
            rstart = reg.start if reg.pinned else _region_start(reg, ri, cursor, pulled)
            region_new_start[ri] = rstart
            skip_to = groups[ri]
            laid_groups.append((ri, skip_to))
            gkey = ("group", ri, skip_to, int(rstart))
            hit = memo.get(gkey) if memo is not None else None
            if hit is None:
                cursor, moved = _layout_group(units, strategy, heat, calls, functions, ranges,
                                              ri, skip_to, rstart, new_start)
                if memo is not None:
                    memo[gkey] = (moved, new_start[moved].copy(), cursor)
            else:
                moved, addrs, cursor = hit
                new_start[moved] = addrs
            continue
        if reg.pinned and moved_away:
            continue                   # stays; the movable code is elsewhere
        if reg.pinned:
            if cursor > reg.start:
                msg = (f"layout does not fit: the code before {reg.name} needs "
                       f"{cursor - reg.start} more bytes than the space before it "
                       f"(pinned at {reg.start:#x})")
                if overflows is None:
                    raise _PinnedOverflow(msg, ri, cursor - reg.start)
                overflows.append((ri, msg, cursor - reg.start))
            cursor = reg.end
            continue
        rstart = align_up(cursor, _region_align(reg.start)) if moved_away else \
            _region_start(reg, ri, cursor, pulled)
        region_new_start[ri] = rstart
        members = by_region[cuts[ri]:cuts[ri + 1]]
        view = RegionView(units, ri, heat, members=members)
        if not len(view):
            cursor = rstart            # an empty region: its labels only
            continue
        if ri in keep:
            # original layout, moved as one block if an earlier region pushed it. Units
            # go in address order, each at its shifted original place or, where the one
            # before grew into it, right after (aligned): a block-level layout's cold part
            # has its parent's start + 1 as ``start`` (an order, not a place)
            idx = view.index[np.argsort(units.start[view.index], kind="stable")]
            shift = rstart - reg.start
            at = rstart
            for u in idx.tolist():
                a = max(int(units.start[u]) + shift, align_up(at, max(int(units.align[u]), 1)))
                new_start[u] = a
                at = a + int(units.size[u])
            cursor = max(at, rstart)
            continue
        pinned = units.pinned[view.index]
        if pinned.any():
            # Pinned units must be a prefix of the region (kernel head code, SRSO
            # thunks): they stay, the rest is laid out after them.
            npin = int(np.argmin(pinned)) if not pinned.all() else len(pinned)
            first_pinned = int(units.start[view.index[0]])
            if pinned[npin:].any():
                raise LayoutError(f"region {reg.name} holds pinned code after movable code")
            if rstart > first_pinned and not moved_away:
                raise LayoutError(
                    f"layout does not fit: the code before {units.name[view.index[0]]} "
                    f"(pinned at {first_pinned:#x}) needs {rstart - first_pinned} more bytes")
            new_start[view.index[:npin]] = units.start[view.index[:npin]]
            if not moved_away:
                cursor = int(units.end[view.index[npin - 1]])
            if npin == len(pinned):
                continue
            view = RegionView(units, ri, heat, skip=npin, members=members)
            rstart = cursor if not moved_away else rstart
        else:
            npin = 0
        key = (ri, npin, int(rstart), ri in compact)
        placed = memo.get(key) if memo is not None else None
        if placed is None:
            view.edges = _edges(view, units, calls, functions)
            if ranges is not None:
                view.hot_ranges = [ranges.get(int(i)) for i in view.index.tolist()]
            if ri in compact:
                placed, _ = strategy.sequential(view, strategy.compact_order(view), rstart)
            else:
                placed = strategy.layout(view, rstart)
            if memo is not None:
                memo[key] = placed
        idx = [p[0] for p in placed]
        if sorted(idx) != list(range(len(view))):
            raise RuntimeError(f"strategy {strategy.name} did not place every unit of {reg.name}")
        ks = np.array(idx, np.int64)
        addrs = np.array([int(p[1]) for p in placed], np.uint64)
        new_start[view.index[ks]] = addrs
        if getattr(reg, "label_at_first", False) and not npin:
            # a unit kept first (its region's label may mean it): padding the layout put
            # before it goes before the label (a block-level hot part is placed for its
            # lines, not at the region's start)
            first = int(units.start[view.index].argmin())
            head = int(addrs[ks == first][0])
            if head == int(addrs.min()):
                region_new_start[ri] = head
        region_end = int((addrs + view.size[ks].astype(np.uint64)).max())
        cursor = max(region_end, rstart)
    if overflows:
        return None                 # overlaps are expected where it overflowed
    if regs and regs[-1].section not in relocate:
        _check_section_end(regs[-1], cursor)
    _check_overlaps(units, new_start)
    plan = LayoutPlan(units, new_start, region_new_start, strategy.name, heat)
    plan.groups = laid_groups
    return plan


# the name a region cut around pinned units gets (relayout/kernel/recovered.py pin_units):
# its region's name and "+k" per cut
_CUT_SUFFIX = re.compile(r"(\+\d+)+")
# unplaced cold units tried per hole before a pinned unit (_flow_around)
FILL_WINDOW = 2048


def cut_groups(regs):
    """{first: last} region indexes of each movable region that was cut around
    pinned units (an unexplained reference pins its target's unit where it is:
    relayout/kernel/recovered.py pin_units) together with its pieces. Laid out as one
    (_layout_group), its units move across the pinned ones: otherwise each piece
    keeps its own units and the hot code stays spread over all of them (Debian's
    6.12 and 7.3: ~300 pinned units cut .text into ~400 pieces). Only for strategies
    whose cold units follow one another (``flows_around_pinned``: pack, blocks): the
    identity (``stock``) and fixed alignments (``align-all``) keep their pieces."""
    out, i = {}, 0
    while i < len(regs):
        base, j = regs[i], i
        while j + 1 < len(regs) and regs[j + 1].section == base.section and \
                regs[j + 1].start == regs[j].end and \
                regs[j + 1].name.startswith(base.name) and \
                _CUT_SUFFIX.fullmatch(regs[j + 1].name[len(base.name):]):
            j += 1
        members = range(i, j + 1)
        if j > i and any(regs[k].pinned for k in members) and \
                not all(regs[k].pinned for k in members):
            out[i] = j
        i = j + 1
    return out


def _layout_group(units, strategy, heat, calls, functions, ranges, first, last, rstart,
                  new_start):
    """Lay out the movable units of regions first..last as one region from
    ``rstart``, then flow them around the pinned units in between (_flow_around).
    Fills ``new_start``; returns the cursor after the group and the indexes of
    the units it placed."""
    grp = np.arange(first, last + 1)
    idx = np.nonzero(np.isin(units.region, grp))[0]
    idx = idx[np.argsort(units.start[idx], kind="stable")]
    pinned = units.pinned[idx] | np.array([units.regions[int(r)].pinned
                                           for r in units.region[idx]], bool)
    obstacles = sorted(zip(units.start[idx[pinned]].tolist(), units.end[idx[pinned]].tolist()))
    movable = idx[~pinned]
    end = rstart
    if len(movable):
        view = RegionView(units, first, heat, index=movable)
        view.edges = _edges(view, units, calls, functions)
        if ranges is not None:
            view.hot_ranges = [ranges.get(int(i)) for i in view.index.tolist()]
        placed = strategy.layout(view, rstart)
        if sorted(p[0] for p in placed) != list(range(len(view))):
            raise RuntimeError(f"strategy {strategy.name} did not place every unit of "
                               f"{units.regions[first].name}")
        hot = view.heat >= getattr(strategy, "min_count", 1.0)
        for k, addr in _flow_around(view, placed, obstacles, rstart, hot):
            new_start[view.index[k]] = addr
        end = int((new_start[movable] + units.size[movable]).max())
    if obstacles and obstacles[0][0] < rstart:
        raise LayoutError(f"layout does not fit: the code before {units.regions[first].name} "
                          f"runs past pinned code at {obstacles[0][0]:#x}")
    return max([end, rstart] + [e for _, e in obstacles]), movable


def _flow_around(view, placed, obstacles, start, hot):
    """The strategy's placement ``placed`` ([(k, address)], made as if nothing were
    pinned) in address order, around the pinned ``obstacles`` [(start, end)]. Hot
    units keep their places relative to each other: one that would overlap the
    next pinned unit goes after it with every hot unit after it, by whole lines
    (each keeps its place in its line). Cold units follow one after another in
    the strategy's order. The hole a unit leaves before a pinned one is filled
    with the next cold units that fit, largest first. Returns [(k, new address)]."""
    order = sorted(placed, key=lambda t: t[1])
    size = view.size.astype(np.int64)
    align = np.maximum(view.align.astype(np.int64), 1)
    phase = view.phase.astype(np.int64)
    pool = np.array([k for k, _ in order if not hot[k]], np.int64)   # cold, in order
    done = np.zeros(len(view), bool)
    o_starts = [o for o, _ in obstacles]
    out, shift, cur, oi, pi = [], 0, int(start), 0, 0

    base = int(start) // LINE * LINE          # offsets from here fit int64; alignments hold

    def legal(cur, ks):
        """Each unit's first legal start at or after ``cur`` (place(), vectorised), as
        offsets from ``base``."""
        c = cur - base
        al, ph = align[ks], phase[ks]
        plain = (c + al - 1) // al * al
        p = (c - ph + 15) // 16 * 16 + ph
        p = np.where(p >= c, p, p + 16)
        return np.where(ph != 0, p, plain)

    align_l, phase_l = align.tolist(), phase.tolist()

    def legal_one(cur, k):
        """legal() of one unit, in plain ints (called once per cold unit)."""
        c, al, ph = cur - base, align_l[k], phase_l[k]
        if not ph:
            return (c + al - 1) // al * al
        p = (c - ph + 15) // 16 * 16 + ph
        return p if p >= c else p + 16

    def fill(cur, limit):
        nonlocal pi
        nxt = bisect.bisect_left(o_starts, cur)         # never over a pinned unit
        if nxt < len(o_starts):
            limit = min(limit, o_starts[nxt])
        while limit - cur >= 2:
            while pi < len(pool) and done[pool[pi]]:
                pi += 1
            w = pool[pi:pi + FILL_WINDOW]
            w = w[~done[w]]
            if not len(w):
                return cur
            p = legal(cur, w)
            fits = np.nonzero(p + size[w] <= limit - base)[0]
            if not len(fits):
                return cur
            b = fits[np.argmax(size[w][fits])]
            k = int(w[b])
            out.append((k, base + int(p[b])))
            done[k] = True
            cur = base + int(p[b]) + int(size[k])
        return cur

    hot_l, size_l = hot.tolist(), size.tolist()
    for k, pos in order:
        if done[k]:
            continue
        while True:
            a = int(pos) + shift if hot_l[k] else base + legal_one(cur, k)
            while oi < len(obstacles) and obstacles[oi][1] <= cur:
                oi += 1
            if oi == len(obstacles) or a + size_l[k] <= obstacles[oi][0]:
                break
            o_start, o_end = obstacles[oi]
            if a >= o_end:                 # the pinned unit lies in the gap before it
                cur = o_end
                continue
            done[k] = True                 # not a filler for its own hole
            cur = fill(cur, o_start)
            done[k] = False
            if hot_l[k]:
                # whole lines: the hot units after it keep their places in their lines
                moved = a + align_up(o_end - a, LINE)
                shift += moved - a
                done[k] = True
                cur = fill(o_end, moved)
                done[k] = False
            else:
                cur = o_end
        out.append((k, a))
        done[k] = True
        cur = a + size_l[k]
    return out


def unit_hot_ranges(units, blocks, min_count=0.0):
    """{unit index: [(offset, end), ...]}: merged byte ranges of each unit that
    hold a block executed at least ``min_count`` times (per iteration; 0: any
    block that ran).

    ``blocks``: (address, size, count) arrays, link-time addresses.
    """
    addr, size, count = (np.asarray(b) for b in blocks)
    count = np.asarray(count, dtype=np.float64)
    keep = (count > 0) & (count >= float(min_count)) & (size > 0)
    addr = addr[keep].astype(np.uint64)
    size = size[keep].astype(np.uint64)
    if not len(addr):
        return {}
    ui = units.find(addr)
    ok = ui >= 0
    ui, addr, size = ui[ok], addr[ok], size[ok]
    off = (addr - units.start[ui]).astype(np.int64)
    end = np.minimum(off + size.astype(np.int64), units.size[ui].astype(np.int64))
    order = np.lexsort((off, ui))
    out = {}
    for u, s, e in zip(ui[order].tolist(), off[order].tolist(), end[order].tolist()):
        r = out.setdefault(u, [])
        if r and s <= r[-1][1]:
            if e > r[-1][1]:
                r[-1] = (r[-1][0], e)
        else:
            r.append((s, e))
    return out


def profile_blocks(profile):
    """(address, size, count per iteration) of a profile model's blocks, or None."""
    if profile is None or not len(getattr(profile, "block_addr", ())):
        return None
    loops = float(profile.meta.get("loops") or 1)
    return (profile.block_addr.astype(np.uint64), profile.block_size.astype(np.uint64),
            profile.block_count.astype(np.float64) / loops)


def profile_calls(profile, functions, per_loop=True):
    """[(caller name, callee name, count)] from a profile model's edges.

    Call edges (kind 1, landing on a function entry) from a block or branch in
    another function; counts per iteration when the profile knows its loops.
    """
    from ..profile.model import KIND_CALL
    if profile is None or not len(getattr(profile, "edge_from", ())):
        return []
    m = (profile.edge_kind == KIND_CALL)
    fa = functions.find(profile.edge_from[m])
    fb = functions.find(profile.edge_to[m])
    w = profile.edge_count[m].astype(np.float64)
    if per_loop and profile.meta.get("loops"):
        w = w / float(profile.meta["loops"])
    ok = (fa >= 0) & (fb >= 0) & (fa != fb)
    agg = {}
    for a, b, c in zip(fa[ok].tolist(), fb[ok].tolist(), w[ok].tolist()):
        agg[(a, b)] = agg.get((a, b), 0.0) + c
    return [(functions.name[a], functions.name[b], c) for (a, b), c in sorted(agg.items())]


def _check_section_end(last_region, cursor):
    if cursor > last_region.end:
        raise LayoutError(f"layout does not fit: the code needs {cursor - last_region.end} bytes "
                          f"more than its section has (ends at {last_region.end:#x})",
                          LESS_PADDING)


def _region_start(reg, ri, cursor, pulled):
    """Where a movable region starts after code ending at ``cursor``: its own start
    unless that code grew into it; a pulled region (make_plan) right after it."""
    at = align_up(cursor, _region_align(reg.start))
    return at if ri in pulled else max(reg.start, at)


def _region_align(addr):
    a = addr & -addr
    return min(a, LINE) if a else LINE


def _check_overlaps(units, new_start):
    order = np.argsort(new_start, kind="stable")
    s = new_start[order]
    e = s + units.size[order]
    bad = np.nonzero(e[:-1] > s[1:])[0]
    if len(bad):
        i = int(order[bad[0]])
        raise RuntimeError(f"layout overlaps at {units.name[i]} ({int(s[bad[0]]):#x})")


def hot_lines(starts, sizes, line=LINE):
    """Distinct cache lines touched by ranges [start, start+size)."""
    starts = np.asarray(starts, dtype=np.uint64)
    sizes = np.asarray(sizes, dtype=np.uint64)
    keep = sizes > 0
    if not keep.any():
        return 0
    first = (starts[keep] // np.uint64(line)).astype(np.uint64)
    last = ((starts[keep] + sizes[keep] - np.uint64(1)) // np.uint64(line)).astype(np.uint64)
    n = (last - first + np.uint64(1)).astype(np.int64)
    total = int(n.sum())
    rep = np.repeat(first, n)
    offs = np.arange(total, dtype=np.uint64) - np.repeat(np.cumsum(n) - n, n).astype(np.uint64)
    return int(len(np.unique(rep + offs)))


def hot_function_ranges(plan, functions, hot_funcs):
    """(old starts, new starts, sizes) of the given function indices under a plan."""
    u = plan.units
    fidx = np.asarray(sorted(hot_funcs), dtype=np.int64)
    if not len(fidx):
        z = np.zeros(0, np.uint64)
        return z, z, z
    uidx = u.funcs[fidx]
    ok = uidx >= 0
    fidx, uidx = fidx[ok], uidx[ok]
    old = functions.start[fidx].astype(np.uint64)
    new = plan.new_start[uidx] + (old - u.start[uidx])
    return old, new, functions.size[fidx].astype(np.uint64)


def line_metric(plan, functions, hotness, min_count=1):
    """Distinct 64 B lines touched by hot functions before and after the plan."""
    hot = set()
    for key, count in (hotness or {}).items():
        if count < min_count:
            continue
        fi = None
        if isinstance(key, str) and not key.startswith("0x"):
            fi = functions.index_of(key)
        else:
            a = int(key, 16) if isinstance(key, str) else int(key)
            f = int(functions.find([a])[0])
            fi = f if f >= 0 else None
        if fi is not None:
            hot.add(fi)
    old, new, size = hot_function_ranges(plan, functions, hot)
    return {"hot_functions": len(old), "hot_lines_before": hot_lines(old, size),
            "hot_lines_after": hot_lines(new, size)}


def block_line_metric(plan, blocks, min_count=0.0, line=LINE):
    """Distinct lines holding executed blocks (count >= min_count per iteration)
    before and after the plan: the static twin of evaluate's executed lines.

    Blocks move with the unit holding them; blocks outside every unit stay.
    """
    addr, size, count = (np.asarray(b) for b in blocks)
    count = np.asarray(count, dtype=np.float64)
    keep = (count > 0) & (count >= float(min_count)) & (size > 0)
    addr = addr[keep].astype(np.uint64)
    size = size[keep].astype(np.uint64)
    u = plan.units
    ui = u.find(addr)
    new = addr.copy()
    ok = ui >= 0
    new[ok] = plan.new_start[ui[ok]] + (addr[ok] - u.start[ui[ok]])
    return {"blocks": int(len(addr)), "block_lines_before": hot_lines(addr, size, line),
            "block_lines_after": hot_lines(new, size, line)}


def block_line_metric_amap(amap, start, end, counts, min_count=1.0, line=LINE):
    """block_line_metric for block-level layouts: CFG blocks (start, end, count
    per iteration) placed through the layout's AddressMap; each block keeps its
    size (a re-encoded last branch may differ by a few bytes)."""
    keep = np.asarray(counts) >= float(min_count)
    a = np.asarray(start, np.uint64)[keep]
    size = (np.asarray(end, np.uint64)[keep] - a).astype(np.uint64)
    new, _ = amap.map(a)
    return {"blocks": int(len(a)), "block_lines_before": hot_lines(a, size, line),
            "block_lines_after": hot_lines(new, size, line)}


def _call_units(units, calls, functions):
    """(caller unit, callee unit, count) arrays of the call edges [(caller,
    callee, count)] by function name whose both ends are functions of
    ``units``, in the order of ``calls``."""
    ua, ub, w = [], [], []
    if calls and functions is not None:
        for a, b, c in calls:
            ia, ib = functions.index_of(a), functions.index_of(b)
            if ia is None or ib is None or units.funcs[ia] < 0 or units.funcs[ib] < 0:
                continue
            ua.append(int(units.funcs[ia]))
            ub.append(int(units.funcs[ib]))
            w.append(float(c))
    return (np.array(ua, np.int64), np.array(ub, np.int64), np.array(w, np.float64))


def _edges(view, units, call_units, functions):
    """Call edges [(caller k, callee k, count)] between units of one region view
    (``call_units``: _call_units' arrays)."""
    ua, ub, w = call_units
    if not len(ua):
        return []
    local = np.full(len(units.start), -1, np.int64)
    local[view.index] = np.arange(len(view.index))
    ka, kb = local[ua], local[ub]
    m = np.nonzero((ka >= 0) & (kb >= 0))[0]
    return list(zip(ka[m].tolist(), kb[m].tolist(), w[m].tolist()))


def _movable_runs(plan):
    """A mask of the units of each movable run of the laid-out extents (pinned
    code splits a section into runs)."""
    from ..image.addrmap import plan_extents
    u = plan.units
    ext, _ = plan_extents(plan)
    for lo, hi in ext:
        m = (u.start >= np.uint64(lo)) & (u.start < np.uint64(hi)) & ~u.pinned
        if m.any():
            yield m


def text_growth(plan):
    """How far the end of laid-out code moved, summed over sections' movable runs
    (a run moved away whole, to a userspace executable's new segment: how much
    longer it is there)."""
    out = 0
    for m in _movable_runs(plan):
        out += run_growth(plan, m)
    return out


def run_growth(plan, m):
    """text_growth of one movable run (mask ``m`` of the units)."""
    u = plan.units
    lo, hi = int(u.start[m].min()), int(u.end[m].max())
    nlo, nhi = int(plan.new_start[m].min()), int(plan.new_end[m].max())
    away = getattr(plan, "relocated", ()) and \
        int(u.regions[int(u.region[np.argmax(m)])].section) in plan.relocated
    return (nhi - nlo) - (hi - lo) if away else nhi - hi


def padding(plan):
    """Bytes between laid-out units (alignment and gaps), summed over movable runs."""
    u = plan.units
    return sum(int(plan.new_end[m].max()) - int(plan.new_start[m].min()) - int(u.size[m].sum())
               for m in _movable_runs(plan))
