"""What every check of ``verify --against`` reads: one AgainstContext."""

from functools import cached_property

import numpy as np

from .. import timings
from ..image import blockmap as bm
from ..image.elf import ElfImage
from ..image.context import ImageContext
from .addrmap import (BlockAwareMap, FunctionMap, code_labels, code_ranges, match_functions,
                      piece_ends, region_points)
from .data import data_moves
from .symbols import cold_names


class AgainstContext:
    """The two images and their contexts (``old``/``octx``, ``new``/``nctx``), their
    function tables (``of``/``nf``), the matched functions (``oi``/``ni`` index
    pairs, ``missing``: unmatched old indices, ``size_diff``: indices into oi/ni
    of functions whose size changed), the block map's rows and the split
    functions (``rows``, ``split``: a bool per old function), the address map
    (``amap``), the data symbols a rewrite moved (``moved_data``, ``data_moves``)
    and the report (``report``) the findings go to.

    Built in the order the progress lines report it: functions matched, block
    map read, map rebuilt, data symbols compared.
    """

    def __init__(self, report, new_path, old_path, layout_map=None, log=None, old_decode=None):
        self.report = report
        self.log = log = log or (lambda m: None)
        self.old_path = old_path
        self.layout_map = layout_map
        self._old_decode = old_decode
        timings.phase("against: load OLD, match")
        self.old = old = ElfImage(old_path)
        # NEW was already decoded by the standalone verify that made ``report``
        self.nctx = nctx = report.context if getattr(report, "context", None) is not None else \
            ImageContext(ElfImage(new_path), log=log)
        self.new = new = nctx.image
        self.octx = octx = ImageContext(old, log=log)
        self.kernel = octx.is_kernel
        self.of, self.nf = of, nf = octx.functions, nctx.functions
        oi, ni, self.missing = match_functions(octx, nctx)
        self.oi, self.ni = oi, ni
        # a block-level layout: functions with pieces in the block map are split
        self.rows = rows = bm.read_blockmap(new)
        self.split = split = np.zeros(len(of), dtype=bool)
        if rows is not None and len(rows):
            fidx = of.find(rows["old"][rows["old_len"] > 0].astype(np.uint64))
            split[fidx[fidx >= 0]] = True
            log(f"block map: {len(rows)} pieces in {int(split.sum())} split functions")
            # a prefix the layout dropped whole (prefix_padding = "none": one
            # padding-dropped row, checked block by block) is no function in NEW
            pd = rows[rows["kind"] == bm.KIND_PAD_DROPPED]
            whole = set(zip(pd["old"].tolist(), pd["old_len"].tolist()))
            self.missing = [i for i in self.missing if not (
                of.name[i].startswith("__pfx_") and (int(of.start[i]), int(of.size[i])) in whole)]
        self.size_diff = np.nonzero((of.size[oi] != nf.size[ni]) & ~split[oi])[0]
        # Each function's piece runs to the next function (or its section's end), so
        # code between functions without a symbol moves with the function before it.
        amap = FunctionMap(of.start[oi], piece_ends(old, of)[oi], nf.start[ni],
                           *code_labels(old, new, of), points=region_points(old, new))
        if not self.kernel:
            amap.fixed = np.array(sorted(e for _, e in code_ranges(old)), np.uint64)
        self.amap = BlockAwareMap(amap, rows) if split.any() else amap
        self.moved = int((of.start[oi] != nf.start[ni]).sum())
        log(f"{len(oi)} functions matched, {self.moved} moved")
        self.bad_data_symbols, self.moved_data, self.data_moves = data_moves(old, new)

    @cached_property
    def cold_names(self):
        """The `name.cold` symbols a block-level layout added (empty at function level)."""
        return cold_names(self.of, self.split) if self.split.any() else frozenset()

    def use_old_decode(self):
        """Take OLD's decoding from the child that ran it beside NEW's (start_against),
        once; without one, OLD is decoded here when first used."""
        if self._old_decode is None:
            return
        timings.phase("against: decode OLD (wait)")
        cov, dis, tables = self._old_decode.result()
        self._old_decode = None
        octx = self.octx
        cov.image = octx.image
        octx._coverage, octx._disasm, octx._function_disasm = cov, dis, None
        if tables is not None:                          # what old_switch_tables finds
            octx.forget("switch_tables")
            octx.derived("switch_tables", lambda: tables)
        self.log(f"OLD: {len(dis)} instructions, decoded beside NEW")
