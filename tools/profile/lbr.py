"""Fall-through ranges of LBR branch stacks -> executed basic blocks.

One LBR sample holds the last N taken branches. In execution order (oldest
first) branch k goes ``from_k -> to_k``, then the CPU ran sequentially from
``to_k`` up to and including the branch instruction at ``from_{k+1}``. That
stretch is a *fall-through range* (perf2bolt calls them traces). perf script
prints the branch stack **newest first**, so in text order (row i newer than
row i+1) the range of the pair is ``[to_{i+1}, from_i]``.

A range is kept only when it is plausible; the others are counted per reason
(``meta["lbr_ranges_invalid"]``):

- ``outside``: an end lies outside every function of the image;
- ``cross_function``: the ends lie in different functions;
- ``reversed``: start > end (LBR overflow/filtering, interrupts, or a
  recording with missing entries);
- ``too_long``: longer than ``MAX_RANGE`` bytes (4 KiB, like perf2bolt's
  sanity limit: such a range has likely lost branches in between);
- ``not_insn``: an end is not an instruction boundary of the disassembly.

Kept ranges are cut into basic blocks at every boundary the profile knows:
range starts, the address after each range's last instruction, every branch
target and the address after every branch source (both only where they are
instruction starts). A block ``[P[k], P[k+1])`` is executed once per range
covering it; blocks with a nonzero count become the profile's block table
(address, size, instructions, count). Instructions come from disassembling the
functions touched by kept ranges (Capstone, :mod:`linepack.image.disasm`).

What this does not see: the code run after the newest branch of each sample
up to the sample IP (not used, like perf2bolt), and not-taken conditional
branches inside a range (they do not end a block here unless some taken
branch makes their successor a boundary).

Everything is numpy over unique ranges; no object per record.
"""

import types

import numpy as np

from ..image.disasm import disassemble

MAX_RANGE = 4096
INVALID_KINDS = ("outside", "cross_function", "reversed", "too_long", "not_insn")


def pair_ranges(br_from, br_to, br_sample, br_pos):
    """(start, end) of the fall-through ranges between consecutive records of one sample.

    Arrays are in text order (newest first within a sample); ``br_sample`` is the
    sample (line) number, ``br_pos`` the record's index in its sample before any
    record was dropped, so ranges never bridge a dropped record. ``end`` is the
    address of the branch instruction that ends the range (inclusive).
    """
    if len(br_from) < 2:
        z = np.zeros(0, np.uint64)
        return z, z.copy()
    adj = (br_sample[1:] == br_sample[:-1]) & (br_pos[1:] == br_pos[:-1] + 1)
    return br_to[1:][adj], br_from[:-1][adj]


def _unique_pairs(a, b):
    """Unique (a, b) pairs (u64) and their multiplicities."""
    if not len(a):
        return a, b, np.zeros(0, np.uint64)
    keys = np.empty(len(a), dtype=[("a", "<u8"), ("b", "<u8")])
    keys["a"], keys["b"] = a, b
    u, cnt = np.unique(keys, return_counts=True)
    return u["a"].copy(), u["b"].copy(), cnt.astype(np.uint64)


def classify(sym, start, end, max_len=MAX_RANGE):
    """(function index or -1 per range, reason code per range: -1 valid, else index in INVALID_KINDS)."""
    fs, fe = sym.find(start), sym.find(end)
    reason = np.full(len(start), -1, dtype=np.int8)
    outside = (fs < 0) | (fe < 0)
    cross = ~outside & (fs != fe)
    rev = ~outside & ~cross & (start > end)
    long_ = ~outside & ~cross & ~rev & ((end - start) > np.uint64(max_len))
    for k, m in enumerate((outside, cross, rev, long_)):
        reason[m] = k
    return np.where(reason < 0, fs, -1), reason


def lbr_blocks(image, sym, br_from, br_to, br_sample, br_pos, max_len=MAX_RANGE, disasm=None):
    """Blocks executed according to the fall-through ranges of LBR samples (link-time addresses).

    Returns (blocks, stats): blocks is a dict of ``block_addr`` (u64), ``block_size``
    (u4), ``block_insns`` (u4), ``block_count`` (u8), sorted by address; stats has
    ``ranges`` (kept, with multiplicity), ``ranges_invalid`` ({reason: count}) and
    ``functions`` (functions disassembled). ``disasm``: a ready Disassembly covering
    the functions (tests), else the touched functions are decoded here.
    """
    start, end = pair_ranges(np.asarray(br_from, np.uint64), np.asarray(br_to, np.uint64),
                             np.asarray(br_sample), np.asarray(br_pos))
    s, e, c = _unique_pairs(start, end)
    fi, reason = classify(sym, s, e, max_len)
    ok = reason < 0
    ft = sym.functions
    touched = np.unique(fi[ok])
    if disasm is None and len(touched):
        disasm = disassemble(image, types.SimpleNamespace(start=ft.start[touched],
                                                          size=ft.size[touched]))
    if disasm is not None and len(disasm):
        i_end = disasm.containing(e)
        aligned = ok & (i_end >= 0) & disasm.is_boundary(e) & disasm.is_boundary(s)
    else:
        i_end = np.full(len(e), -1, np.int64)
        aligned = np.zeros(len(e), dtype=bool)
    reason[ok & ~aligned] = INVALID_KINDS.index("not_insn")
    ok = aligned
    invalid = {k: int(c[reason == n].sum()) for n, k in enumerate(INVALID_KINDS)}
    stats = {"ranges": int(c[ok].sum()), "ranges_invalid": invalid, "functions": int(len(touched))}
    empty = {"block_addr": np.zeros(0, np.uint64), "block_size": np.zeros(0, np.uint32),
             "block_insns": np.zeros(0, np.uint32), "block_count": np.zeros(0, np.uint64)}
    if not ok.any():
        return empty, stats
    s, e, c, ie = s[ok], e[ok], c[ok], i_end[ok]
    stop = e + disasm.size[ie].astype(np.uint64)           # first byte after the range
    # Block boundaries: range starts and stops, branch targets, after branch sources.
    ut = np.unique(np.asarray(br_to, np.uint64))
    uf = np.unique(np.asarray(br_from, np.uint64))
    jf = disasm.containing(uf)
    fok = (jf >= 0) & disasm.is_boundary(uf)
    after = uf[fok] + disasm.size[jf[fok]].astype(np.uint64)
    bounds = np.unique(np.concatenate([s, stop, ut[disasm.is_boundary(ut)], after]))
    ks = np.searchsorted(bounds, s)
    ke = np.searchsorted(bounds, stop)
    n = len(bounds)
    diff = np.zeros(n + 1, dtype=np.int64)
    np.add.at(diff, ks, c.astype(np.int64))
    np.subtract.at(diff, ke, c.astype(np.int64))
    cover = np.cumsum(diff)[:n - 1]
    k = np.nonzero(cover > 0)[0]
    ba, bend = bounds[k], bounds[k + 1]
    ninsn = np.searchsorted(disasm.addr, bend) - np.searchsorted(disasm.addr, ba)
    blocks = {"block_addr": ba, "block_size": (bend - ba).astype(np.uint32),
              "block_insns": ninsn.astype(np.uint32), "block_count": cover[k].astype(np.uint64)}
    return blocks, stats
