"""Bulk disassembly of functions with Capstone, without per-instruction objects.

Capstone's Python wrapper builds an object per instruction (slow for the ~3M
instructions in vmlinux). Here we call the C ``cs_disasm`` through the wrapper's
ctypes handle, view the returned ``cs_insn`` array with a numpy dtype and keep
only the columns we need: address, length and the first bytes. A kernel's
functions are decoded by threads (the C loop runs without the GIL); a program's
by one (zstd's 1 MB: two threads saved 0.01 s and kept 2-4 MiB more resident).
"""

import ctypes
import os
import re

import numpy as np

import capstone

from .intervals import containing
from capstone import _cs

RAW = 16   # leading instruction bytes kept per instruction (x86 max is 15)

_INSN_SIZE = ctypes.sizeof(capstone._cs_insn)
_F = {name: getattr(capstone._cs_insn, name).offset for name, _ in capstone._cs_insn._fields_}
_INSN = np.dtype({
    "names": ["address", "size", "bytes"],
    "formats": ["<u8", "<u2", ("u1", 16)],
    "offsets": [_F["address"], _F["size"], _F["bytes"]],
    "itemsize": _INSN_SIZE,
})
# what decode() returns: the same fields, packed (a cs_insn is ~250 bytes, mostly text)
_ROW = np.dtype([("address", "<u8"), ("size", "<u2"), ("bytes", "u1", 16)])
_COLS = np.arange(16)[None, :]


class _Decoder:
    """A Capstone x86-64 handle used through the C API."""

    def __init__(self, mode=capstone.CS_MODE_64):
        self.handle = ctypes.c_size_t()
        status = _cs.cs_open(capstone.CS_ARCH_X86, mode, ctypes.byref(self.handle))
        if status != capstone.CS_ERR_OK:
            raise RuntimeError(f"capstone cs_open failed: {status}")
        self._insn = ctypes.POINTER(capstone._cs_insn)()

    def decode(self, code, address):
        """Decode as much of ``code`` (bytes) as decodes; returns a numpy record array."""
        count = _cs.cs_disasm(self.handle, code, len(code), address, 0, ctypes.byref(self._insn))
        if count == 0:
            return np.zeros(0, dtype=_ROW)
        try:
            buf = (ctypes.c_char * (count * _INSN_SIZE)).from_address(
                ctypes.addressof(self._insn.contents))
            view = np.frombuffer(buf, dtype=_INSN)        # Capstone's memory: copy out
            out = np.empty(count, _ROW)
            out["address"], out["size"], out["bytes"] = \
                view["address"], view["size"], view["bytes"]
            # Capstone leaves stale heap bytes after each instruction's own: zero them
            # (rows are the same on every run)
            out["bytes"][_COLS >= out["size"][:, None]] = 0
            return out
        finally:
            _cs.cs_free(self._insn, count)

    def close(self):
        _cs.cs_close(ctypes.byref(self.handle))


_TARGET_ROWS = 1 << 15      # rows per slice when branch targets are decoded


class Disassembly:
    """Instruction boundaries of a set of functions.

    Arrays, sorted by address: ``addr`` (u64), ``size`` (u8), ``func`` (index in
    the FunctionTable), ``raw`` (first 16 bytes, zero-padded). ``undecodable``
    lists (address, function index) where Capstone could not decode; decoding
    resumes one byte later so the rest of the function is still covered.
    """

    def __init__(self, addr, size, func, raw, undecodable):
        self.addr, self.size, self.func, self.raw = addr, size, func, raw
        self.undecodable = undecodable

    def __len__(self):
        return len(self.addr)

    def is_boundary(self, addrs):
        """True where an address is the start of a decoded instruction."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        i = np.searchsorted(self.addr, addrs)
        ic = np.minimum(i, len(self.addr) - 1)
        return (i < len(self.addr)) & (self.addr[ic] == addrs)

    def containing(self, addrs):
        """Index of the instruction covering each address, -1 where none."""
        if getattr(self, "_end", None) is None or len(self._end) != len(self.addr):
            self._end = self.addr + self.size.astype(np.uint64)
        return containing(self.addr, self._end, addrs)

    def inside_instruction(self, addrs):
        """True where an address falls strictly inside a decoded instruction."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        i = self.containing(addrs)
        ic = np.maximum(i, 0)
        return (i >= 0) & (self.addr[ic] != addrs)

    def branch_targets(self):
        """Direct jmp/jcc/call targets decoded from the raw bytes.

        Returns (index, target, kind) arrays; kind is 'rel8' or 'rel32' as 1 or 4.
        Instruction prefixes the kernel uses on branches (cs/ds segment hints,
        bnd) and ld's addr32 padding are skipped. Computed once per Disassembly (verify's standalone and
        --against passes share it).
        """
        cached = getattr(self, "_branch_targets", None)
        if cached is not None:
            return cached
        found = self._decode_branch_targets()
        for a in found:
            a.flags.writeable = False       # shared: callers must not edit in place
        self._branch_targets = found
        return found

    def pc_relative_branches(self):
        """branch_targets and other_branch_targets together (index, target, kind),
        sorted by index: every direct PC-relative branch, for the passes that must
        follow each one (relayout's branch fixing and rel8 glue, verify --against).
        branch_targets is looked up on the instance, so a caller's filtered
        override of it applies (block_rewriter)."""
        bi, bt, bk = self.branch_targets()
        other = getattr(self, "_other_branches", None)
        if other is None:
            parts = [other_branch_targets(self.raw[lo:lo + _TARGET_ROWS],
                                          self.addr[lo:lo + _TARGET_ROWS],
                                          self.size[lo:lo + _TARGET_ROWS])
                     for lo in range(0, len(self.addr), _TARGET_ROWS)]
            other = (np.concatenate([np.zeros(0, np.int64)] +
                                    [p[0] + lo for p, lo in
                                     zip(parts, range(0, len(self.addr), _TARGET_ROWS))]),
                     np.concatenate([np.zeros(0, np.uint64)] + [p[1] for p in parts]),
                     np.concatenate([np.zeros(0, np.int8)] + [p[2] for p in parts]))
            self._other_branches = other
        if not len(other[0]):
            return bi, bt, bk
        idx = np.concatenate([bi.astype(np.int64), other[0]])
        order = np.argsort(idx, kind="stable")
        return (idx[order], np.concatenate([bt.astype(np.uint64), other[1]])[order],
                np.concatenate([bk.astype(np.int8), other[2]])[order])

    def unchecked_branches(self):
        """Indices of the direct branches behind prefixes (prefixed_branches) that
        pc_relative_branches does not return: invisible to relayout's branch
        fixing and to verify's branch checks, so a layout that moves one or its
        target is refused (relayout) or named (verify). Computed once: verify's
        mutation test compares one instruction at a time against the same OLD."""
        cached = getattr(self, "_unchecked", None)
        if cached is None or len(self.addr) != getattr(self, "_unchecked_rows", -1):
            rows = prefixed_branches(self.raw, self.size)
            cached = rows[~np.isin(rows, self.pc_relative_branches()[0])]
            cached.flags.writeable = False
            self._unchecked, self._unchecked_rows = cached, len(self.addr)
        return cached

    def adopt_branch_targets(self, found):
        """Cache ``found`` as branch_targets() (a merge of disassemblies whose
        rows were decoded already: each row decodes alone)."""
        for a in found:
            a.flags.writeable = False
        self._branch_targets = found

    def _decode_branch_targets(self):
        # a slice of rows at a time: the per-row int64 temporaries over a whole
        # image's rows were a peak of their own (zstd's 240,000 rows: about 10 MiB)
        n = len(self.addr)
        if n <= _TARGET_ROWS:
            return self._branch_targets_of(0, n)
        parts = [self._branch_targets_of(lo, min(lo + _TARGET_ROWS, n))
                 for lo in range(0, n, _TARGET_ROWS)]
        return tuple(np.concatenate([p[k] for p in parts]) for k in range(3))

    def _branch_targets_of(self, lo, hi):
        """_decode_branch_targets of rows lo..hi-1 (row indices of the whole)."""
        raw, addr, size = self.raw[lo:hi], self.addr[lo:hi], self.size[lo:hi].astype(np.uint64)
        # (0x67 too: ld relaxes `call/jmp *f@GOTPCREL(%rip)` to a local f into
        # `addr32 call/jmp f`, whose target is computed as without the prefix)
        skip, op, op2 = skip_prefixes(raw, (0x2E, 0x3E, 0xF2, 0x67))
        # E3 behind 67 is jecxz: other_branch_targets' (pc_relative_branches had it twice)
        p67 = ((raw[:, :3] == 0x67) & (np.arange(3)[None, :] < skip[:, None])).any(axis=1)
        rel8 = (op == 0xEB) | ((op >= 0x70) & (op <= 0x7F)) | ((op == 0xE3) & ~p67)
        rel32 = (op == 0xE8) | (op == 0xE9) | ((op == 0x0F) & (op2 >= 0x80) & (op2 <= 0x8F))
        # Lengths must agree with the encoding, else it is not what we think it is.
        enc8 = rel8 & (size.astype(np.int64) == skip + 2)
        enc32 = rel32 & (size.astype(np.int64) == skip + np.where(op == 0x0F, 6, 5))
        idx8 = np.nonzero(enc8)[0]
        idx32 = np.nonzero(enc32)[0]
        end8 = addr[idx8] + size[idx8]
        d8 = raw[idx8, size[idx8].astype(np.int64) - 1].view(np.int8).astype(np.int64)
        end32 = addr[idx32] + size[idx32]
        pos = size[idx32].astype(np.int64) - 4
        d32 = np.zeros(len(idx32), dtype=np.int64)
        for k in range(4):
            d32 |= raw[idx32, pos + k].astype(np.int64) << (8 * k)
        d32 = np.where(d32 >= 1 << 31, d32 - (1 << 32), d32)
        index = np.concatenate([idx8, idx32])
        target = np.concatenate([(end8.astype(np.int64) + d8).astype(np.uint64),
                                 (end32.astype(np.int64) + d32).astype(np.uint64)])
        kind = np.concatenate([np.full(len(idx8), 1, np.int8), np.full(len(idx32), 4, np.int8)])
        order = np.argsort(index, kind="stable")
        return index[order] + lo, target[order], kind[order]


def byte_at(raw, col, usual=0):
    """raw[i, col[i]] per row (int64; col capped at the last column), gathering
    only the rows whose col is not the ``usual`` one."""
    out = raw[:, usual].astype(np.int64)
    other = np.nonzero(col != usual)[0]
    out[other] = raw[other, np.minimum(col[other], RAW - 1)]
    return out


def other_branch_targets(raw, addr, size):
    """The PC-relative branches ``Disassembly.branch_targets`` leaves out:
    loop/loope/loopne (E0-E2 rel8), jecxz (67 E3 rel8; a 67 prefix on a loop
    changes only the counter, not the target) and xbegin (C7 F8 rel32; with a 66
    prefix rel16, the fallback address truncated to 16 bits). Returns (rows,
    targets, kinds) of the rows of ``raw`` (n, 16) that hold one; jrcxz (E3 without 67)
    is branch_targets' already and not repeated here. Kind as branch_targets': 1
    rel8, 4 rel32, and 2 for the rel16 xbegin (relayout fixes only 1 and 4).

    Only the rows that can hold such an opcode are decoded (_other_branch_rows: a
    tenth of zstd's 240,000); _other_branch_targets decodes every row given."""
    rows = _other_branch_rows(raw)
    if len(rows) == len(raw):
        return _other_branch_targets(raw, addr, size)
    got, target, kind = _other_branch_targets(raw[rows], np.asarray(addr)[rows],
                                              np.asarray(size)[rows])
    return rows[got], target, kind


def _other_branch_rows(raw):
    """Rows of ``raw`` whose first byte is E0-E3 (loop, jecxz), C7 (xbegin) or one
    of the prefixes _other_branch_targets skips (2E 3E 66 67): it skips no other
    prefix, so for any other first byte that byte is the opcode it reads, and it is
    none of those."""
    return np.nonzero(_OTHER_FIRST[raw[:, 0]])[0]


_OTHER_FIRST = np.zeros(256, bool)
_OTHER_FIRST[[0xE0, 0xE1, 0xE2, 0xE3, 0xC7, 0x2E, 0x3E, 0x66, 0x67]] = True


def _other_branch_targets(raw, addr, size):
    """other_branch_targets decoded on every row of ``raw``."""
    size = np.asarray(size, np.int64)
    if not len(size):
        return np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, np.int8)
    skip, op, op2 = skip_prefixes(raw, (0x2E, 0x3E, 0x66, 0x67), rounds=4)
    pre = raw[:, :4]
    before = np.arange(4)[None, :] < skip[:, None]
    p66 = ((pre == 0x66) & before).any(axis=1)
    p67 = ((pre == 0x67) & before).any(axis=1)
    loop = ((op >= 0xE0) & (op <= 0xE2)) | ((op == 0xE3) & p67)
    rel8 = loop & ~p66 & (size == skip + 2)
    xb32 = (op == 0xC7) & (op2 == 0xF8) & ~p66 & (size == skip + 6)
    xb16 = (op == 0xC7) & (op2 == 0xF8) & p66 & (size == skip + 4)
    end = np.asarray(addr, np.uint64) + size.astype(np.uint64)
    target = np.zeros(len(size), np.uint64)
    r = np.nonzero(rel8)[0]
    target[r] = end[r] + raw[r, np.clip(size[r] - 1, 0, 15)].view(np.int8).astype(np.int64) \
        .astype(np.uint64)
    r = np.nonzero(xb32)[0]
    d32 = np.zeros(len(r), np.int64)
    for k in range(4):
        d32 |= raw[r, np.clip(size[r] - 4 + k, 0, 15)].astype(np.int64) << (8 * k)
    target[r] = end[r] + np.where(d32 >= 1 << 31, d32 - (1 << 32), d32).astype(np.uint64)
    r = np.nonzero(xb16)[0]
    rel16 = raw[r, np.clip(size[r] - 2, 0, 15)].astype(np.int64) | \
        (raw[r, np.clip(size[r] - 1, 0, 15)].astype(np.int64) << 8)
    target[r] = (end[r] + (rel16 - ((rel16 >= 1 << 15) << 16)).astype(np.uint64)) & \
        np.uint64(0xFFFF)
    rows = np.nonzero(rel8 | xb32 | xb16)[0]
    kind = np.where(rel8[rows], 1, np.where(xb32[rows], 4, 2)).astype(np.int8)
    return rows, target[rows], kind


# Every prefix the CPU accepts before an opcode: the legacy ones (lock, rep/bnd,
# segments, operand and address size) and REX.
LEGACY_PREFIXES = (0xF0, 0xF2, 0xF3, 0x2E, 0x36, 0x3E, 0x26, 0x64, 0x65, 0x66, 0x67)
ANY_PREFIX = LEGACY_PREFIXES + tuple(range(0x40, 0x50))
def prefixed_branches(raw, size):
    """Rows of ``raw`` (n, 16) holding a direct PC-relative branch (jmp, jcc,
    call, loop, jecxz/jrcxz, xbegin) behind one or more prefixes of any kind
    (legacy or REX), its length the encoding's. The decoders here read a few
    prefixes only (Disassembly.unchecked_branches: the others). With 66, a near
    branch is not even the same instruction on every CPU (Intel ignores the
    prefix, AMD takes a 16-bit displacement)."""
    size = np.asarray(size, np.int64)
    out = []
    for lo in range(0, len(size), _TARGET_ROWS):
        r, sz = raw[lo:lo + _TARGET_ROWS], size[lo:lo + _TARGET_ROWS]
        # a branch opcode where its length puts it (most rows start with a prefix:
        # REX), and a prefix first: a few rows, looked at closely below
        pre = np.nonzero(_IS_PREFIX[r[:, 0]])[0]
        shaped = np.zeros(len(pre), bool)
        for body in (2, 4, 5, 6):
            pos = sz[pre] - body
            ok = pos >= 1
            op = r[pre, np.clip(pos, 0, RAW - 1)]
            op2 = r[pre, np.clip(pos + 1, 0, RAW - 1)]
            shaped |= ok & _BRANCH_BODY[body][op, op2]
        pre = pre[shaped]
        if not len(pre):
            continue
        r, sz = r[pre], sz[pre]
        skip, op, op2 = skip_prefixes(r, ANY_PREFIX, rounds=14)
        jcc8 = (op >= 0x70) & (op <= 0x7F)
        shaped = ((jcc8 | (op == 0xEB) | ((op >= 0xE0) & (op <= 0xE3))) & (sz == skip + 2)) | \
            (((op == 0xE9) | (op == 0xE8)) & (sz == skip + 5)) | \
            ((op == 0x0F) & (op2 >= 0x80) & (op2 <= 0x8F) & (sz == skip + 6)) | \
            ((op == 0xC7) & (op2 == 0xF8) & ((sz == skip + 6) | (sz == skip + 4)))
        found = np.nonzero(shaped)[0]
        if len(found):
            out.append(pre[found] + lo)
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def _branch_bodies():
    """Per body length (opcode to end): (256, 256) tables of the (opcode, next
    byte) pairs that start a direct branch of that length."""
    t = {b: np.zeros((256, 256), bool) for b in (2, 4, 5, 6)}
    t[2][0x70:0x80, :] = True
    t[2][0xE0:0xE4, :] = True
    t[2][0xEB, :] = True
    t[4][0xC7, 0xF8] = True                 # xbegin rel16 (66)
    t[5][0xE8, :] = t[5][0xE9, :] = True
    t[6][0x0F, 0x80:0x90] = True
    t[6][0xC7, 0xF8] = True
    return t


_IS_PREFIX = np.zeros(256, bool)
_IS_PREFIX[list(ANY_PREFIX)] = True
_BRANCH_BODY = _branch_bodies()


def unchecked_branch_targets(raw, addr, size, rows):
    """Targets of ``rows`` (from unchecked_branches) as Capstone and Intel read
    them: every prefix skipped, the displacement the instruction's last 1, 2
    (a 66 xbegin) or 4 bytes. On AMD a 66 near branch goes elsewhere: callers
    refuse those whatever the target."""
    rows = np.asarray(rows, np.int64)
    r, sz = raw[rows], np.asarray(size, np.int64)[rows]
    skip, op, op2 = skip_prefixes(r, ANY_PREFIX, rounds=14)
    body = sz - skip
    width = np.where(body == 2, 1, np.where((op == 0xC7) & (body == 4), 2, 4))
    disp = np.zeros(len(rows), np.int64)
    for k in range(4):
        b = r[np.arange(len(rows)), np.clip(sz - width + k, 0, RAW - 1)].astype(np.int64)
        disp |= np.where(k < width, b << (8 * k), 0)
    sign = np.int64(1) << (8 * width - 1)
    disp = np.where(disp >= sign, disp - (sign << 1), disp)
    end = np.asarray(addr, np.uint64)[rows] + sz.astype(np.uint64)
    return (end.astype(np.int64) + disp).astype(np.uint64)


def has_operand_size_prefix(raw, rows):
    """True per row of ``rows`` whose prefixes include 66."""
    r = raw[np.asarray(rows, np.int64)]
    skip, _, _ = skip_prefixes(r, ANY_PREFIX, rounds=14)
    return ((r == 0x66) & (np.arange(r.shape[1])[None, :] < skip[:, None])).any(axis=1)


def skip_prefixes(raw, prefixes, rounds=3):
    """(skip, op, op2) per row: how many leading bytes (at most ``rounds``) are
    in ``prefixes``, the byte after them and the next one (int64)."""
    skip = np.zeros(len(raw), dtype=np.int64)
    active = np.arange(len(raw))
    is_prefix = np.zeros(256, bool)         # a byte's lookup: cheaper than np.isin
    is_prefix[list(prefixes)] = True
    for k in range(rounds):
        b = raw[:, 0] if k == 0 else raw[active, skip[active]]
        active = active[is_prefix[b]]
        skip[active] += 1
    return skip, byte_at(raw, skip), byte_at(raw, skip + 1, 1)


# Instructions newer than Capstone 5 knows, seen in kernels: (byte prefix, length, name).
# Decoded by pattern so boundaries after them stay exact.
KNOWN_UNDECODED = (
    (bytes.fromhex("0f01e8"), 3, "serialize"),
    (bytes.fromhex("f20f01ff"), 4, "pvalidate"),
    (bytes.fromhex("f30f01fe"), 4, "rmpadjust"),
    (bytes.fromhex("f30f01ff"), 4, "psmash"),
    (bytes.fromhex("f20f01fe"), 4, "rmpupdate"),
    (bytes.fromhex("c4e27849c0"), 5, "tilerelease"),
    (bytes.fromhex("0f01ca"), 3, "clac"),
    # 6.12: FRED's LKGS %di (native_lkgs, native_load_gs_index) and TDX's TDCALL
    (bytes.fromhex("f20f00f7"), 4, "lkgs"),
    (bytes.fromhex("660f01cc"), 4, "tdcall"),
    # 7.3: WRMSRNS (alternatives of wrmsr), AMD's INVLPGB / TLBSYNC (flush_tlb_mm_range),
    # and UDB (0xd6, the kernel's one-byte BUG_UDB: speculation stops after indirect
    # branches in the ITS thunks)
    (bytes.fromhex("0f01c6"), 3, "wrmsrns"),
    (bytes.fromhex("0f01fe"), 3, "invlpgb"),
    (bytes.fromhex("0f01ff"), 3, "tlbsync"),
    (bytes.fromhex("d6"), 1, "udb"),
)


def _known_length(code):
    for pattern, length, _name in KNOWN_UNDECODED:
        if code.startswith(pattern):
            return length
    return 0


def _decode_range(path, starts, sizes, first_index):
    """Worker: decode functions [first_index, ...) of one image."""
    from .shared import elf_image
    image = elf_image(path)                 # opened once per process
    from .decode_core import library
    lib = library()
    if lib is not None and len(starts):
        got = _decode_range_native(lib, image, starts, sizes, first_index)
        if got is not None:
            return got
    dec = _Decoder()
    addr_parts, size_parts, func_parts, raw_parts, bad = [], [], [], [], []
    for k, (start, size) in enumerate(zip(starts, sizes)):
        fidx = first_index + k
        code = bytes(image.read(start, size))
        pos = 0
        while pos < size:
            ins = dec.decode(code[pos:], start + pos)
            n = len(ins)
            if n:
                addr_parts.append(ins["address"])
                size_parts.append(ins["size"].astype(np.uint8))
                raw_parts.append(ins["bytes"])
                func_parts.append(np.full(n, fidx, dtype=np.int32))
                pos += int(ins["size"].sum(dtype=np.int64))
            if pos < size:
                known = _known_length(code[pos:pos + 8])
                if known:
                    one = np.zeros(1, dtype=_ROW)
                    one["address"], one["size"] = start + pos, known
                    one["bytes"][0, :known] = np.frombuffer(code[pos:pos + known], np.uint8)
                    addr_parts.append(one["address"])
                    size_parts.append(one["size"].astype(np.uint8))
                    raw_parts.append(one["bytes"])
                    func_parts.append(np.full(1, fidx, dtype=np.int32))
                    pos += known
                else:
                    bad.append((start + pos, fidx))
                    pos += 1
    dec.close()
    if not addr_parts:
        return (np.zeros(0, np.uint64), np.zeros(0, np.uint8), np.zeros(0, np.int32),
                np.zeros((0, RAW), np.uint8), bad)
    return (np.concatenate(addr_parts), np.concatenate(size_parts),
            np.concatenate(func_parts), np.concatenate(raw_parts), bad)


def _decode_range_native(lib, image, starts, sizes, first_index):
    """_decode_range through the C loop (decode.c): the same rows, the same
    handling of bytes Capstone rejects."""
    from .decode_core import decode_ranges
    bad = []

    def stuck(k, pos, rest):
        known = _known_length(rest[:8])
        if not known:
            bad.append((starts[k] + pos, first_index + k))
        return known
    parts = [bytes(image.read(a, n)) for a, n in zip(starts, sizes)]
    if any(len(p) != n for p, n in zip(parts, sizes)):
        return None             # a range runs past the readable bytes: the Python loop
    code = b"".join(parts)
    dec = _Decoder()
    try:
        addr, size, func, raw = decode_ranges(lib, dec.handle.value, code, starts, sizes,
                                              first_index, stuck)
    finally:
        dec.close()
    return addr, size, func, raw, bad


def disassemble(image, functions, jobs=None):
    """Decode every function of a FunctionTable; returns a Disassembly."""
    starts = functions.start.tolist()
    sizes = functions.size.tolist()
    n = len(starts)
    jobs = jobs or min(os.cpu_count() or 1, 8)
    from .decode_core import library
    lib = library()             # built (or found) once, before any worker starts
    if n >= 2000 and jobs > 1:
        # Balance by bytes, not by count: a few functions are huge.
        cum = np.cumsum(sizes)
        bounds = [0] + [int(np.searchsorted(cum, cum[-1] * k / (jobs * 4)))
                        for k in range(1, jobs * 4)] + [n]
        chunks = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    if n < 2000 or jobs == 1:
        parts = [_decode_range(image.path, starts, sizes, 0)]
    elif lib is not None:
        # The C loop runs without the GIL (ctypes releases it): threads share the
        # image and hand back arrays, where worker processes had to fork and pickle
        # every row back (slower than decoding them, once decoding is in C).
        from concurrent.futures import ThreadPoolExecutor

        def work(chunk):
            a, b = chunk
            got = _decode_range_native(lib, image, starts[a:b], sizes[a:b], a)
            return got if got is not None else _decode_range(image.path, starts[a:b],
                                                             sizes[a:b], a)
        with ThreadPoolExecutor(jobs) as ex:
            parts = list(ex.map(work, chunks))
    else:
        import multiprocessing as mp
        ctx = mp.get_context("fork")
        with ctx.Pool(jobs) as pool:
            parts = pool.starmap(_decode_range, [(image.path, starts[a:b], sizes[a:b], a)
                                                 for a, b in chunks])
    if len(parts) == 1:         # one range (fewer than 2000 functions): no copy
        addr, size, func, raw = parts[0][:4]
    else:
        addr = np.concatenate([p[0] for p in parts])
        size = np.concatenate([p[1] for p in parts])
        func = np.concatenate([p[2] for p in parts])
        raw = np.concatenate([p[3] for p in parts])
    bad = [b for p in parts for b in p[4]]
    del parts                   # the rows are in the arrays now: not held twice
    if len(addr) > 1 and (addr[1:] < addr[:-1]).any():
        # (functions in address order decode in address order: no second copy then)
        order = np.argsort(addr, kind="stable")
        addr, size, func, raw = addr[order], size[order], func[order], raw[order]
    addr, size, func, raw, bad = _redecode_ud1(image, starts, sizes, addr, size, func, raw, bad)
    return Disassembly(addr, size, func, raw, bad)


_PREFIXES = frozenset((0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67, 0xF0, 0xF2, 0xF3))


def ud1_length(code):
    """Length of a UD1 (``0f b9 /r``) at the start of ``code``, 0 if it is none.

    Capstone 5 decodes UD1 without its ModRM byte; the CPU and the kernel
    (7.3's ``__WARN_trap``: ``ud1 (%edx), %rdi``) read it with one, so the
    instruction is longer and what follows starts elsewhere."""
    i = 0
    while i < len(code) and code[i] in _PREFIXES:
        i += 1
    if i < len(code) and 0x40 <= code[i] <= 0x4F:          # REX
        i += 1
    if code[i:i + 2] != b"\x0f\xb9" or len(code) < i + 3:
        return 0
    modrm = code[i + 2]
    mod, rm = modrm >> 6, modrm & 7
    n = i + 3
    if mod != 3 and rm == 4:                                 # SIB
        if len(code) <= n:
            return 0
        base = code[n] & 7
        n += 1
        if mod == 0 and base == 5:
            n += 4
    if mod == 0 and rm == 5:
        n += 4                                               # RIP-relative disp32
    elif mod == 1:
        n += 1
    elif mod == 2:
        n += 4
    return n if n <= len(code) else 0


def _rows_with_0f_b9(raw):
    """Rows of ``raw`` (n, 16) holding the bytes 0F B9 side by side: found by a
    search over the rows' bytes end to end (no per-row temporaries), less the
    matches that run from one row into the next."""
    raw = np.ascontiguousarray(raw, np.uint8)
    if not raw.size:
        return np.zeros(0, np.int64)
    at = np.array([m.start() for m in re.finditer(b"\x0f\xb9", memoryview(raw).cast("B"))],
                  np.int64)
    width = raw.shape[1]
    return np.unique(at[at % width != width - 1] // width)


def _redecode_ud1(image, starts, sizes, addr, size, func, raw, bad):
    """Decode again, one instruction at a time, the functions where Capstone
    cut a UD1 short (rare: a handful of functions). Their undecodable bytes are
    this decode's too: the first one's came from reading a UD1's ModRM byte and
    what followed as instructions (7.3's ``__WARN_trap+0x9``, the jmp after it)."""
    cand = _rows_with_0f_b9(raw)
    funcs = sorted({int(func[i]) for i in cand.tolist()
                    if ud1_length(bytes(raw[i])) > int(size[i])})
    if not funcs:
        return addr, size, func, raw, bad
    dec = _Decoder()
    rows, redone_bad = [], []
    try:
        for f in funcs:
            start, n = int(starts[f]), int(sizes[f])
            code = bytes(image.read(start, n))
            pos = 0
            while pos < n:
                length = ud1_length(code[pos:pos + 16])
                if not length:
                    ins = dec.decode(code[pos:pos + 16], start + pos)
                    length = int(ins["size"][0]) if len(ins) else _known_length(code[pos:pos + 8])
                if not length:          # as the first decode: named, no row, one byte on
                    redone_bad.append((start + pos, f))
                    pos += 1
                    continue
                row = np.zeros(RAW, np.uint8)
                row[:min(length, RAW)] = np.frombuffer(code[pos:pos + min(length, RAW)], np.uint8)
                rows.append((start + pos, length, f, row))
                pos += length
    finally:
        dec.close()
    keep = ~np.isin(func, funcs)
    addr = np.concatenate([addr[keep], np.array([r[0] for r in rows], np.uint64)])
    size = np.concatenate([size[keep], np.array([r[1] for r in rows], size.dtype)])
    func = np.concatenate([func[keep], np.array([r[2] for r in rows], func.dtype)])
    raw = np.concatenate([raw[keep], np.stack([r[3] for r in rows])])
    order = np.argsort(addr, kind="stable")
    redone = set(funcs)
    bad = sorted([b for b in bad if b[1] not in redone] + redone_bad)
    return addr[order], size[order], func[order], raw[order], bad


class _Spans:
    """Address ranges in the shape disassemble() reads (start/size)."""

    def __init__(self, start, size):
        self.start = np.asarray(start, dtype=np.uint64)
        self.size = np.asarray(size, dtype=np.uint64)


def sweep_sections(image, sections, jobs=1):
    """Linear-sweep Disassembly of whole sections (code no function table
    covers; ImageContext.swept caches it per image)."""
    return disassemble(image, _Spans([s.addr for s in sections], [s.size for s in sections]),
                       jobs=jobs)
