"""The L1i model used by what-if replay: a small C core compiled at run time.

``CacheState(cfg)`` holds one set-associative LRU cache (the plugin's model:
tags MRU first per set, set index = line mod sets) and the "last line"
register that implements the plugin's fetch definition (a block starting in
the line where the previous block ended does not fetch that line again).
``state.replay(ids, blocks, count=...)`` runs a sequence of executed blocks
through it; ``blocks`` is a :class:`LineTable` (per block, its distinct lines
in order). The core is ``replay.c`` next to this file, built with the system C
compiler into the linepack cache on first use (one shared object per source
hash), and called through ctypes.

``reference_replay`` is a plain-Python version of the same model, for tests.
"""

import ctypes
import os

import numpy as np

from .. import native

NO_LINE = np.uint64(0xFFFFFFFFFFFFFFFF)
_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "replay.c")
_lib = None


def library():
    """The compiled replay core (ctypes CDLL), built once per source version."""
    global _lib
    if _lib is not None:
        return _lib
    lib = native.build("replay", [_SRC], "evaluate", "what-if replay (the replay core)")
    P = ctypes.c_void_p
    lib.lp_replay.argtypes = [P, ctypes.c_int64, P, P, P, ctypes.c_uint64, ctypes.c_uint32, P, P,
                              ctypes.c_int, P, P, P]
    lib.lp_replay.restype = ctypes.c_int
    _lib = lib
    return lib


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p) if a is not None else None


class LineTable:
    """Per block: its distinct cache lines in execution order (flattened)."""

    def __init__(self, off, cnt, lines):
        self.off = np.ascontiguousarray(off, dtype=np.int64)
        self.cnt = np.ascontiguousarray(cnt, dtype=np.uint32)
        self.lines = np.ascontiguousarray(lines, dtype=np.uint64)

    def __len__(self):
        return len(self.cnt)

    @classmethod
    def from_ranges(cls, start, size, line):
        """Blocks that are one contiguous byte range each: lines first..last."""
        start = np.asarray(start, dtype=np.uint64)
        size = np.maximum(np.asarray(size, dtype=np.uint64), np.uint64(1))
        shift = np.uint64(int(line).bit_length() - 1)
        first = start >> shift
        last = (start + size - np.uint64(1)) >> shift
        cnt = (last - first + np.uint64(1)).astype(np.int64)
        off = np.cumsum(cnt) - cnt
        lines = np.repeat(first, cnt) + (np.arange(int(cnt.sum()), dtype=np.int64)
                                         - np.repeat(off, cnt)).astype(np.uint64)
        return cls(off, cnt, lines)

    def block(self, b):
        o = int(self.off[b])
        return self.lines[o:o + int(self.cnt[b])]


class CacheState:
    """One cache model's state: LRU tags and the last fetched line."""

    def __init__(self, cfg):
        if cfg.get("prefetch") or cfg.get("l2_size"):
            from ..errors import BadInput
            raise BadInput(f"cache model '{cfg.get('name')}': the what-if replay models a plain "
                           "L1 (no prefetch, no L2); measure it on booted kernels")
        self.cfg = dict(cfg)
        self.sets = int(cfg["size"]) // (int(cfg["ways"]) * int(cfg["line"]))
        self.ways = int(cfg["ways"])
        self.line = int(cfg["line"])
        if self.sets < 1 or self.sets & (self.sets - 1) or self.line & (self.line - 1):
            raise ValueError(f"bad cache geometry {cfg}")
        self.tags = np.full(self.sets * self.ways, NO_LINE, dtype=np.uint64)
        self.last = np.array([NO_LINE], dtype=np.uint64)
        self.totals = np.zeros(2, dtype=np.uint64)

    SENTINEL = np.uint64(1 << 62)

    def poison(self):
        """Fill the cache with sentinel tags (never real lines): after a warm-up,
        ``unknown_ways()`` counts the ways the warm-up did not overwrite, i.e. where
        the true state before the warm-up could still matter (0 = exact)."""
        self.tags[:] = np.arange(len(self.tags), dtype=np.uint64) + self.SENTINEL
        return self

    def unknown_ways(self):
        t = self.tags
        return int(((t >= self.SENTINEL) & (t < self.SENTINEL + np.uint64(len(t)))).sum())

    @property
    def fetches(self):
        return int(self.totals[0])

    @property
    def misses(self):
        return int(self.totals[1])

    def replay(self, ids, table, count=True, per_block=None):
        """Run executed blocks ``ids`` (uint32 indices into ``table``) through the model.

        per_block: optional (fetches, misses) uint64 arrays of len(table) to add to.
        """
        ids = np.ascontiguousarray(ids, dtype=np.uint32)
        if len(ids) and int(ids.max()) >= len(table):
            raise ValueError("block id out of range")
        bf = bm = None
        if per_block is not None:
            bf, bm = per_block
            assert bf.dtype == np.uint64 and bm.dtype == np.uint64 and len(bf) == len(table)
        rc = library().lp_replay(_ptr(ids), len(ids), _ptr(table.off), _ptr(table.cnt),
                                 _ptr(table.lines), self.sets, self.ways, _ptr(self.tags),
                                 _ptr(self.last), 1 if count else 0, _ptr(self.totals),
                                 _ptr(bf), _ptr(bm))
        if rc != 0:
            raise ValueError("a block without cache lines in the replay table")
        return self


def reference_replay(ids, blocks, size, ways, line):
    """Plain-Python LRU model (tests): blocks is a list of line lists.
    Returns (fetches, misses)."""
    sets = size // (ways * line)
    cache = [[] for _ in range(sets)]    # MRU first
    last = None
    fetches = misses = 0
    for b in ids:
        ls = blocks[b]
        for j, ln in enumerate(ls):
            if j == 0 and ln == last:
                continue
            fetches += 1
            s = cache[ln % sets]
            if ln in s:
                s.remove(ln)
            else:
                misses += 1
                if len(s) == ways:
                    s.pop()
            s.insert(0, ln)
        last = ls[-1]
    return fetches, misses
