"""Layouts of one base image: plans (for what-if) and rewritten images (for
booting), computed on demand and cached under ``cache_dir()/layouts/``.

Cache key: (image build-id, strategy spec, profile hash, relayout code hash),
so a changed profile or a changed strategy implementation never reuses a stale
layout. Files per key: ``<key>.plan.npz`` (the AddressMap's pieces, extents and
anchors plus .text growth), ``<key>.vmlinux`` (the rewritten image) and
``<key>.json`` (the relayout summary).
"""

import glob
import hashlib
import json
import os
import re

import numpy as np

from ..errors import BadInput, LinepackError
from ..io import atomic_output

NEEDS_PROFILE = ("hot64", "pack", "blocks", "blocks-original", "blocks-ext-tsp", "blocks-sets",
                 "blocks-nopad")
# block-level layouts: their map comes from the rewrite (block map), not the plan
BLOCK_LEVEL = ("blocks", "blocks-original", "blocks-ext-tsp", "blocks-sets", "blocks-nopad")


def normalize_spec(spec):
    """'align-all:64', 'align-all 64', 'align_all=64' -> 'align-all:64'; validates it."""
    from ..relayout import strategies
    s = str(spec).strip()
    if not s:
        raise BadInput("empty layout name")
    try:
        strat = strategies.get(s)
    except LinepackError as e:
        raise BadInput(f"--layout {spec}: {e}") from None
    name, _, arg = s.replace("=", " ").replace(":", " ").partition(" ")
    name = name.strip().lower().replace("_", "-")
    arg = arg.strip()
    if name == "align-all":
        arg = str(strat.align)
    return f"{name}:{arg}" if arg else name


# what makes a layout: the rewriter, the image and kernel-table code it calls, the
# DWARF rewrite, and the strategies' configs
LAYOUT_SOURCES = ("relayout", "image", "kernel", "dwarf")


def code_hash():
    """Hash of the sources a cached layout was made by (LAYOUT_SOURCES and
    configs/relayout): a change to any of them makes layouts again."""
    from ..resources import source_hash
    return source_hash(LAYOUT_SOURCES, data=("relayout",))[:10]


def hotness_hash(hotness, calls=(), blocks=None):
    if not hotness:
        return "noprof"
    items = sorted((str(k), float(v)) for k, v in hotness.items())
    h = hashlib.sha256(json.dumps([items, [list(map(str, c)) for c in calls]]).encode())
    for a in (blocks or ()):
        h.update(np.ascontiguousarray(a).tobytes())
    for a in (getattr(blocks, "edges", None) or ()):      # a profile's branch edges
        h.update(np.ascontiguousarray(a).tobytes())
    if getattr(blocks, "first", None) is not None:        # a trace's first executions
        h.update(b"first" + np.ascontiguousarray(blocks.first).tobytes())
    return h.hexdigest()[:12]


def hotness_from_trace(bt, image_path):
    """Per-iteration function counts from a BlockTrace (what a profile of that run holds)."""
    from ..image.elf import ElfImage
    from ..profile.model import Profile
    from ..relayout.driver import function_hotness
    counts = bt.block_counts()
    ran = counts > 0
    b = bt.blocks[ran]
    prof = Profile.from_blocks(ElfImage(image_path), b["vaddr"], b["size"], b["ninsns"],
                               counts[ran], meta={"loops": bt.meta.get("loops")})
    loops = float(bt.meta.get("loops") or 1)
    return {k: v / loops for k, v in function_hotness(prof).items()}


def blocks_from_trace(bt):
    """(address, size, count per iteration) of the blocks a BlockTrace ran: the
    executed ranges a block-level layout needs when no profile is given, with
    ``first``: where each first ran in the window (the order ``blocks`` lays hot
    code in, see relayout/strategies/pack.py)."""
    from ..relayout.block_order import ExecutedBlocks
    from .dense import _first_seen
    counts = bt.block_counts()
    ran = counts > 0
    b = bt.blocks[ran]
    loops = float(bt.meta.get("loops") or 1)
    first = _first_seen(bt.ids, len(bt.blocks), ran)[ran]
    return ExecutedBlocks((b["vaddr"].astype(np.uint64), b["size"].astype(np.uint64),
                           counts[ran].astype(np.float64) / loops), first=first)


class PlanMap:
    """What replay needs of a plan: the AddressMap, plus size facts."""

    def __init__(self, amap, growth, padding, strategy, moved):
        self.amap, self.growth, self.padding = amap, int(growth), int(padding)
        self.strategy, self.moved = strategy, int(moved)

    def save(self, path):
        a = self.amap
        with atomic_output(path) as f:
            extra = {}
            if a.new_end is not None:
                extra = {"new_end": a.new_end, "collapse": a.collapse,
                         "occ_lo": a.occupied[0], "occ_hi": a.occupied[1]}
            np.savez(f, old_start=a.old_start, old_end=a.old_end, new_start=a.new_start,
                     ext_lo=a.ext_lo, ext_hi=a.ext_hi, anchor_old=a.anchor_old,
                     anchor_new=a.anchor_new, **extra,
                     info=np.frombuffer(json.dumps({"growth": self.growth, "padding": self.padding,
                                                    "strategy": self.strategy,
                                                    "moved": self.moved}).encode(), np.uint8))

    @classmethod
    def load(cls, path):
        from ..image.addrmap import AddressMap
        z = np.load(path, allow_pickle=False)
        info = json.loads(bytes(z["info"]).decode())
        amap = AddressMap(z["old_start"], z["old_end"], z["new_start"],
                          list(zip(z["ext_lo"].tolist(), z["ext_hi"].tolist())),
                          dict(zip(z["anchor_old"].tolist(), z["anchor_new"].tolist())),
                          new_end=z["new_end"] if "new_end" in z else None,
                          collapse=z["collapse"] if "collapse" in z else None)
        if "occ_lo" in z:
            amap.occupied = (z["occ_lo"], z["occ_hi"])
        return cls(amap, info["growth"], info["padding"], info["strategy"], info["moved"])

    @classmethod
    def from_plan(cls, plan):
        from ..image.addrmap import AddressMap, plan_extents
        from ..relayout.plan import run_growth
        u = plan.units
        growth = padding = 0
        for lo, hi in plan_extents(plan)[0]:
            m = (u.start >= np.uint64(lo)) & (u.start < np.uint64(hi)) & ~u.pinned
            if m.any():
                growth += run_growth(plan, m)
                span = int(plan.new_end[m].max()) - int(plan.new_start[m].min())
                padding += span - int(u.size[m].sum())
        return cls(AddressMap.from_plan(plan), growth, padding, plan.strategy,
                   int(plan.moved.sum()))


def prune_images(root, keep=None, log=None):
    """Keep the layout cache bounded: at most $LINEPACK_LAYOUT_CACHE_MAX (default 12)
    rewritten images under ``root``, the least recently used ones go first
    (their small plan files stay: what-if replays do not need the image)."""
    limit = int(os.environ.get("LINEPACK_LAYOUT_CACHE_MAX", "12"))
    images = glob.glob(os.path.join(root, "*", "*.vmlinux"))
    if len(images) <= limit:
        return
    excess = len(images) - limit
    if keep:
        images = [p for p in images if os.path.abspath(p) != os.path.abspath(keep)]
    images.sort(key=lambda p: os.stat(p).st_mtime_ns)
    for path in images[:excess]:
        try:
            os.unlink(path)
            if log:
                log(f"pruned cached image {os.path.basename(path)}")
        except OSError:
            pass


class Layouts:
    """Plans and rewritten images of strategies on one base image."""

    def __init__(self, base, hotness=None, calls=(), profile_build_id=None, log=None, blocks=None,
                 vmlinuz=None):
        from ..image.shared import elf_image
        from ..targets import cache_dir
        if not os.path.isfile(base):
            raise BadInput(f"{base}: no such kernel image")
        if vmlinuz is not None and not os.path.isfile(vmlinuz):
            raise BadInput(f"{vmlinuz}: no such boot image (--vmlinuz)")
        self.base = base
        # a base without link relocations: every layout is rewritten with the
        # references recovered from its boot image (relayout --vmlinuz)
        self.vmlinuz = vmlinuz
        self.image = elf_image(base)
        self.build_id = self.image.build_id or hashlib.sha256(
            os.path.abspath(base).encode()).hexdigest()
        self.hotness, self.calls = hotness or {}, list(calls or ())
        self.blocks = blocks
        self.trace_blocks = None     # executed blocks of the recorded run (block-level layouts)
        self.profile_build_id = profile_build_id
        self.log = log or (lambda m: None)
        self.dir = os.path.join(cache_dir(), "layouts", self.build_id[:20])
        self._units = None
        self._code = code_hash()

    def key(self, spec):
        spec = normalize_spec(spec)
        slug = re.sub(r"[^a-z0-9]+", "-", spec)
        prof = hotness_hash(self.hotness, self.calls, self._blocks_for(spec)) \
            if spec.split(":")[0] in NEEDS_PROFILE else "noprof"
        src = "-recovered" if self.vmlinuz else ""
        return spec, f"{slug}-{prof}-{self._code}{src}"

    def _blocks_for(self, spec):
        if self.blocks is None and spec.split(":")[0] in BLOCK_LEVEL:
            return self.trace_blocks
        return self.blocks

    def _check_profile(self, spec):
        if spec.split(":")[0] in NEEDS_PROFILE and not self.hotness:
            raise BadInput(f"layout {spec} needs a profile (--profile, or let evaluate derive "
                           "one from the recorded trace)")

    def check_references(self):
        """A base without link relocations needs its boot image (--vmlinuz): one
        clear line before any recording or boot."""
        from ..relayout.driver import NO_RELOCS
        if self.vmlinuz is None and not self.image.has_link_relocations():
            raise BadInput(NO_RELOCS.format(path=self.base))

    def _build_units(self):
        if self._units is None:
            from ..relayout.driver import NO_RELOCS, check_profile
            from ..relayout.units import units_of
            im = self.image
            if self.vmlinuz is not None:
                from ..image.elf import ElfImage
                from ..relayout.kernel.recovered import use_vmlinuz
                im = ElfImage(self.base)     # its own object: its relocations are replaced
                use_vmlinuz(im, self.vmlinuz, self.log)
            if not im.has_link_relocations():
                raise BadInput(NO_RELOCS.format(path=self.base))
            units, functions, _ = units_of(im, self.log)
            check_profile(im, functions, self.hotness, self.profile_build_id)
            self._units = (units, functions)
        return self._units

    def plan(self, spec):
        """PlanMap of a layout (None for stock), cached."""
        from ..relayout import strategies
        from ..relayout.plan import LayoutError, make_heat, make_plan
        spec, key = self.key(spec)
        if spec == "stock":
            return None
        self._check_profile(spec)
        path = os.path.join(self.dir, key + ".plan.npz")
        if os.path.exists(path):
            return PlanMap.load(path)
        if spec.split(":")[0] in BLOCK_LEVEL or self.vmlinuz is not None:
            # the block map exists only after the rewrite; recovered references pin
            # and check what only relayout's passes know
            self.image_path(spec)
            return PlanMap.load(path)
        self.check_references()
        units, functions = self._build_units()
        heat = make_heat(units, functions, self.hotness)
        try:
            plan = make_plan(units, strategies.get(spec), heat, calls=self.calls,
                             functions=functions, blocks=self.blocks)
        except LayoutError:
            # no room in place: relayout knows where the code goes (a userspace new
            # segment) or says why not
            self.image_path(spec)
            return PlanMap.load(path)
        pm = PlanMap.from_plan(plan)
        os.makedirs(self.dir, exist_ok=True)
        pm.save(path)
        return pm

    def relinked(self, spec):
        """What-if only: align-all:N as a linker would lay it out (see relinked_align_all)."""
        spec, key = self.key(spec)
        if not spec.startswith("align-all:"):
            raise BadInput(f"{spec}: only align-all has a relinked what-if form")
        path = os.path.join(self.dir, key + ".relinked.npz")
        if os.path.exists(path):
            return PlanMap.load(path)
        units, _ = self._build_units()
        pm = relinked_align_all(units, int(spec.split(":")[1]))
        os.makedirs(self.dir, exist_ok=True)
        pm.save(path)
        return pm

    def image_path(self, spec):
        """A bootable image of the layout (the base itself for stock), rewritten once."""
        from ..relayout import strategies
        from ..relayout.driver import relayout
        spec, key = self.key(spec)
        if spec == "stock":
            return self.base
        self._check_profile(spec)
        out = os.path.join(self.dir, key + ".vmlinux")
        if os.path.exists(out):
            os.utime(out)            # recently used (the cache is pruned by age)
            return out
        os.makedirs(self.dir, exist_ok=True)
        self.log(f"rewriting {os.path.basename(self.base)} with {spec} (cached as {out})")
        summary, plan, rw = relayout(self.base, out, strategies.get(spec), hotness=self.hotness,
                                     calls=self.calls, profile_build_id=self.profile_build_id,
                                     log=self.log, blocks=self._blocks_for(spec), debug="strip",
                                     vmlinuz=self.vmlinuz)
        if getattr(rw, "block_split", None) is not None:
            pm = PlanMap(rw.amap, summary["text_growth_bytes"], summary["padding_bytes"],
                         plan.strategy, int(plan.moved.sum()))
        else:
            pm = PlanMap.from_plan(plan)
        pm.save(os.path.join(self.dir, key + ".plan.npz"))
        with open(os.path.join(self.dir, key + ".json"), "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True, default=str)
        prune_images(os.path.dirname(self.dir), keep=out, log=self.log)
        return out


BIG_GAP = 1 << 16


def relinked_align_all(units, align):
    """A hypothetical ``-falign-functions=N`` relink for what-if only: every unit
    in original order, aligned to max(N, its own alignment), regions (even the
    pinned entry code, which the rewriter must keep in place) pushed along as a
    linker would. Used for sweep points the rewriter cannot produce. Returns a
    PlanMap whose strategy is ``align-all N (relinked)``."""
    from ..image.addrmap import AddressMap
    from ..relayout.plan import place
    order = np.argsort(units.start, kind="stable")
    new = units.start.copy()
    cursor = None
    head_pinned = units.pinned & (units.region == 0)
    lo = int(units.start[order[0]])
    prev_end = None
    for i in order.tolist():
        s = int(units.start[i])
        if head_pinned[i] or cursor is None:
            new[i] = s
            cursor = prev_end = int(units.end[i])
            continue
        if s - prev_end >= BIG_GAP:      # structural gaps (2 MiB-aligned sections) stay
            cursor += s - prev_end
        prev_end = int(units.end[i])
        pos = place(cursor, units.align[i], units.phase[i], align)
        new[i] = pos
        cursor = pos + int(units.size[i])
    hi = int(units.end[order[-1]])
    growth = cursor - hi
    padding = (cursor - lo) - int(units.size.sum())
    amap = AddressMap(units.start, units.end, new, [(lo, max(hi, cursor))], {})
    return PlanMap(amap, growth, padding, f"align-all {align} (relinked)",
                   int((new != units.start).sum()))
