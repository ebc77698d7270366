"""``blocks``: hot/cold splitting at basic-block level, then ``pack`` placement.

Each hot function whose blocks can be placed apart (see image/cfg.py REASONS)
is split into its hot blocks (at the function's symbol, entry first, in ext-TSP
order or, with ``block_order = "original"``, in their original order) and a
cold part ``name.cold`` placed in its region's cold area; the hot parts (and
the functions moved whole) are placed by ``pack`` with its 64 B rules. The
driver does the split (relayout/blocks.py); this class carries the options and
places units exactly as ``pack`` does.
"""

from .pack import Pack


class Blocks(Pack):
    name = "blocks"
    block_level = True

    positional = "block_min_count"      # evaluate --layout blocks:0.5

    # ext-TSP by default: booted VFS-mix (2000 loops, 500-loop profile) -42.5% /
    # -52.1% L1i misses vs stock on intel-32k-8w / amd-64k-2w, original order
    # -41.2% / -49.3%; verify --against clean, the split kernel boots
    block_order = "ext-tsp"

    def __init__(self, min_count=1, block_min_count=0.3, cold_min=8, use_blocks=True,
                 strict=False, invert_jcc=True, block_order=None, order="first",
                 split_hot_align=1, split_noinstr=False, order_whole=True, whole_hot_align=1,
                 inline_cold_max=16, prefix_padding="template", **kw):
        # strict = false: a hot part starts where it adds the fewest lines holding hot
        # bytes (it is hot throughout, so 64 B alignment mostly adds padding)
        # order = "first": hot units in the order they first ran, when the executed
        # blocks say (evaluate's traces); else by heat / call edges as pack.
        # What-if, Debian 6.1 vfs-mix (docs/evaluate.md, the gap to dense packing),
        # misses vs stock intel-32k-8w / amd-64k-2w: heat order -33.6% / -47.6%,
        # first-run order -44.5% / -51.8%
        super().__init__(min_count=min_count, use_blocks=use_blocks, strict=strict, order=order,
                         **kw)
        # split_hot_align: alignment of a split function's hot part (None: the
        # function's own, 16 B on x86-64 gcc). A hot part is new code, like the cold
        # part (which was never aligned); the function's padding in the loop's lines
        # costs lines: with first-run order, 1 gives -45.6% / -54.4% (what-if)
        self.split_hot_align = None if split_hot_align in (None, "none", 0) \
            else int(split_hot_align)
        # whole_hot_align: the same for a hot function moved whole (not pinned, no
        # prefix): its 16 B alignment is padding in the loop's lines too. What-if,
        # Debian 6.1 vfs-mix, misses vs stock intel-32k-8w / amd-64k-2w: none -49.69% /
        # -62.98%, 1 -50.07% / -65.13% (loop lines 1,379 -> 1,363)
        self.whole_hot_align = None if whole_hot_align in (None, "none", 0) \
            else int(whole_hot_align)
        # a block is hot when it runs at least this often per workload iteration; below 1:
        # a block that runs in a third of the iterations costs a miss each time it runs
        # from the cold area (measured: 0.3 -38.2% misses on intel-32k-8w, 1.0 -25.0%)
        self.block_min_count = float(min_count if block_min_count is None else block_min_count)
        self.cold_min = int(cold_min)
        # split noinstr functions too: both parts stay in the noinstr region (a cold
        # part is placed in its parent's region), so the instrumentation boundary
        # (__noinstr_text_start/end) holds
        self.split_noinstr = str(split_noinstr).lower() in ("1", "true", "yes", "on")
        # jcc inversion (relayout/blocks.py build_parts): what-if misses -0.9 points on
        # intel-32k-8w and -0.8 on amd-64k-2w; verify --against and the boot test clean
        self.invert_jcc = bool(invert_jcc)
        # order of a split function's hot blocks: "original" or "ext-tsp"
        # (relayout/block_order.py); the entry block stays first either way
        from ..block_order import ORDERS
        order = type(self).block_order if block_order is None else str(block_order)
        if order not in ORDERS:
            raise TypeError(f"block_order {order!r} (known: {', '.join(ORDERS)})")
        self.block_order = order
        # userspace: a hot function with nothing (or under cold_min bytes) to split
        # still gets its hot blocks in ext-TSP order, the rest after them (one part),
        # as BOLT orders every hot function's blocks; a kernel keeps such functions
        # whole (its tables name functions, not parts: not measured there)
        self.order_whole = bool(order_whole)
        # inline_cold_max: a cold block of at most this many bytes stays in the hot
        # part where that makes the hot part smaller (relayout/blocks.py
        # keep_small_cold: a jcc into the cold part is 6 bytes, one close by 2); 0: never.
        # What-if, Debian 6.1 vfs-mix, misses vs stock intel-32k-8w / amd-64k-2w: 0
        # -50.54% / -64.88%, 16 -50.73% / -65.97% (loop lines 1,360 -> 1,353)
        self.inline_cold_max = int(inline_cold_max)
        # prefix_padding (6.2+ kernels with __pfx_ paddings): "template" keeps only the
        # call-depth thunk's size of a split function's padding (9 of 16 bytes on
        # Debian 6.12 / 7.3) and aligns its hot part as split_hot_align says, since
        # the kernel needs those NOPs and not the alignment (kernel/prefixes.py); a hot
        # prefixed function with nothing to split moves in one part with its prefix
        # trimmed too. "full" keeps all 16 bytes and the 16 B alignment. "none" (opt-in,
        # never the default) keeps none of a hot function's padding: the output must not
        # be booted with retbleed=stuff (relayout warns; verify names each such function).
        # What-if vfs-mix, points to dense:20 (intel-32k-8w / amd-64k-2w): 6.12 9.8 /
        # 24.8 -> 4.9 / 16.7 (template); none, measured the same hour: 2.6 / 17.7 -> -1.6 / 7.8
        if prefix_padding not in PREFIX_PADDING:
            raise TypeError(f"prefix_padding {prefix_padding!r} (known: "
                            f"{', '.join(PREFIX_PADDING)})")
        self.prefix_padding = prefix_padding


PREFIX_PADDING = ("template", "full", "none")


class BlocksOriginal(Blocks):
    """``blocks`` with the hot blocks in their original order (a layout name for
    evaluate, whatever the default)."""
    name = "blocks-original"
    block_order = "original"


class BlocksExtTsp(Blocks):
    """``blocks`` with the hot blocks in ext-TSP order."""
    name = "blocks-ext-tsp"
    block_order = "ext-tsp"


class BlocksNoPad(Blocks):
    """``blocks`` with ``prefix_padding = "none"`` (a layout name for evaluate's
    what-if tables): hot functions keep none of their prefix padding, so the output
    must not be booted with retbleed=stuff (docs/relayout.md)."""
    name = "blocks-nopad"

    def __init__(self, **kw):
        kw.setdefault("prefix_padding", "none")
        super().__init__(**kw)


class BlocksSets(Blocks):
    """``blocks`` with set-aware placement for one cache model, ``blocks-sets:MODEL``
    (a configs/cache name or TOML path): each region's hot area starts where its hot
    lines overflow the model's sets least (Pack._spread_over_sets). What-if on
    Debian 6.1 VFS-mix (docs/evaluate.md), heat order: amd-64k-2w -47.6% -> -49.6%
    misses vs stock, intel-32k-8w -33.6% -> -34.0%, .text +0.44%; with first-run
    order: -54.4% -> -55.3% and -45.6% -> -46.2%."""
    name = "blocks-sets"
    positional = "set_spread"

    def __init__(self, set_spread=None, **kw):
        if not set_spread:
            from ...errors import LinepackError
            raise LinepackError("blocks-sets needs a cache model: blocks-sets:MODEL "
                                "(e.g. blocks-sets:amd-64k-2w)")
        super().__init__(set_spread=set_spread, **kw)
