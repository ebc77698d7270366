"""DWARF call-frame information of ``.eh_frame``: evaluate an FDE's program into
rows, and write a program back from rows.

Used where a function is split into parts (hot part at the symbol, cold part
elsewhere): each part needs a program whose rows, at every new address, give
the state the original program gave at the corresponding original address.

A state is (CFA rule, register rules, GNU_args_size), all hashable tuples:
- CFA: ("reg", regno, offset) or ("expr", bytes);
- register rules (sorted tuple of (regno, rule)): ("off", n), ("valoff", n),
  ("reg", r), ("expr", bytes), ("valexpr", bytes), ("undef",), ("same",);
  a register without a rule is absent.
Offsets are in bytes (already multiplied by the CIE's data alignment).
``remember_state``/``restore_state`` are resolved while evaluating; the writer
uses them again where a state comes back (the epilogue pattern), to stay small.

Opcodes outside DWARF 4's CFA set and GNU_args_size (e.g. DW_CFA_set_loc,
GNU_window_save) raise CfiError: the caller then does not split the function.
"""

import functools
from bisect import bisect_left, bisect_right
import struct

from ...leb128 import read_sleb, read_uleb, sleb, uleb  # noqa: F401 (encoders: used by lsda too)


class CfiError(ValueError):
    """A CFI program this module does not evaluate (the function is not split)."""


_uleb = functools.partial(read_uleb, exc=CfiError, what="LEB128 in a CFI program")
_sleb = functools.partial(read_sleb, exc=CfiError, what="LEB128 in a CFI program")


class CieInfo:
    """What evaluating an FDE needs from its CIE."""

    def __init__(self, code_align, data_align, ra_reg, initial):
        self.code_align, self.data_align, self.ra_reg = code_align, data_align, ra_reg
        self.initial = initial            # bytes of the initial instructions
        self.init_state = None


def parse_cie_info(data, start, id_pos):
    """CieInfo of the CIE record at ``start`` (its id field at ``id_pos``)."""
    length = struct.unpack_from("<I", data, start)[0]
    end = start + 4 + length
    pos = id_pos + 5                      # id, version
    z = data.index(b"\0", pos)
    aug = data[pos:z].decode("ascii", "replace")
    pos = z + 1
    code_align, pos = _uleb(data, pos)
    data_align, pos = _sleb(data, pos)
    if data[id_pos + 4] == 1:
        ra, pos = data[pos], pos + 1
    else:
        ra, pos = _uleb(data, pos)
    if aug.startswith("z"):
        alen, pos = _uleb(data, pos)
        pos += alen
    info = CieInfo(code_align, data_align, ra, bytes(data[pos:end]))
    info.init_state = evaluate(info.initial, info, None)[0][1]
    return info


EMPTY = (("reg", 7, 8), (), 0)


def evaluate(program, cie, init):
    """Rows [(location offset, state)] of ``program`` (an FDE's instructions,
    relative to the FDE start); ``init``: the CIE's initial state (None while
    evaluating the CIE itself). The first row is at offset 0."""
    return _run(program, cie, init)[0]


def used_length(program, cie):
    """Length of ``program`` without its trailing DW_CFA_nop padding."""
    return _run(program, cie, cie.init_state)[1]


def evaluate_with_length(program, cie, init):
    """(evaluate's rows, used_length) from one evaluation."""
    return _run(program, cie, init)


def _run(program, cie, init):
    cfa, regs, args = init if init is not None else EMPTY
    regs = dict(regs)
    loc = 0
    rows = []
    stack = []
    ca, da = cie.code_align, cie.data_align
    init_regs = dict(init[1]) if init is not None else {}
    d = program
    pos = 0
    n = len(d)

    regs_t = None           # regs as a sorted tuple; None when changed since it was made

    def emit_row(new_loc):
        nonlocal loc, regs_t
        if regs_t is None:
            regs_t = tuple(sorted(regs.items()))
        st = (cfa, regs_t, args)
        if rows and rows[-1][0] == loc:
            rows[-1] = (loc, st)
        else:
            rows.append((loc, st))
        loc = new_loc

    used = 0
    while pos < n:
        op = d[pos]
        pos += 1
        hi, lo = op & 0xC0, op & 0x3F
        if hi == 0x40:
            emit_row(loc + lo * ca)
            used = pos
            continue
        if hi == 0x80:
            v, pos = _uleb(d, pos)
            regs[lo] = ("off", v * da)
            regs_t = None
            used = pos
            continue
        if hi == 0xC0:
            _restore(regs, init_regs, lo)
            regs_t = None
            used = pos
            continue
        if op == 0x00:              # DW_CFA_nop: padding, not counted in ``used``
            continue
        if op == 0x02:
            emit_row(loc + d[pos] * ca)
            pos += 1
        elif op == 0x03:
            emit_row(loc + struct.unpack_from("<H", d, pos)[0] * ca)
            pos += 2
        elif op == 0x04:
            emit_row(loc + struct.unpack_from("<I", d, pos)[0] * ca)
            pos += 4
        elif op in (0x05, 0x11):                         # offset_extended(_sf)
            r, pos = _uleb(d, pos)
            v, pos = (_uleb if op == 0x05 else _sleb)(d, pos)
            regs[r] = ("off", v * da)
        elif op == 0x06:
            r, pos = _uleb(d, pos)
            _restore(regs, init_regs, r)
        elif op == 0x07:
            r, pos = _uleb(d, pos)
            regs[r] = ("undef",)
        elif op == 0x08:
            r, pos = _uleb(d, pos)
            regs[r] = ("same",)
        elif op == 0x09:
            r, pos = _uleb(d, pos)
            r2, pos = _uleb(d, pos)
            regs[r] = ("reg", r2)
        elif op == 0x0A:
            stack.append((cfa, dict(regs), args))
        elif op == 0x0B:
            if not stack:
                raise CfiError("DW_CFA_restore_state with nothing remembered")
            c, rr, _ = stack.pop()
            cfa, regs = c, rr                      # args_size is not part of the remembered state
        elif op in (0x0C, 0x12):                         # def_cfa(_sf)
            r, pos = _uleb(d, pos)
            v, pos = (_uleb if op == 0x0C else _sleb)(d, pos)
            cfa = ("reg", r, v * (1 if op == 0x0C else da))
        elif op == 0x0D:
            r, pos = _uleb(d, pos)
            if cfa[0] != "reg":
                raise CfiError("DW_CFA_def_cfa_register after a CFA expression")
            cfa = ("reg", r, cfa[2])
        elif op in (0x0E, 0x13):
            v, pos = (_uleb if op == 0x0E else _sleb)(d, pos)
            if cfa[0] != "reg":
                raise CfiError("DW_CFA_def_cfa_offset after a CFA expression")
            cfa = ("reg", cfa[1], v * (1 if op == 0x0E else da))
        elif op == 0x0F:
            ln, p2 = _uleb(d, pos)
            cfa = ("expr", bytes(d[p2:p2 + ln]))
            pos = p2 + ln
        elif op in (0x10, 0x16):
            r, pos = _uleb(d, pos)
            ln, p2 = _uleb(d, pos)
            regs[r] = ("expr" if op == 0x10 else "valexpr", bytes(d[p2:p2 + ln]))
            pos = p2 + ln
        elif op in (0x14, 0x15):
            r, pos = _uleb(d, pos)
            v, pos = (_uleb if op == 0x14 else _sleb)(d, pos)
            regs[r] = ("valoff", v * da)
        elif op == 0x2E:
            args, pos = _uleb(d, pos)
        elif op == 0x2F:
            r, pos = _uleb(d, pos)
            v, pos = _uleb(d, pos)
            regs[r] = ("off", -v * da)
        else:
            raise CfiError(f"CFI opcode {op:#04x} is not supported")
        if op not in _KEEP_REGS:
            regs_t = None
        if pos > n:
            raise CfiError("CFI program runs past its record")
        used = pos
    emit_row(loc)
    return rows, used


# opcodes that leave the register rules as they are (advances, CFA rules,
# remember_state, GNU_args_size)
_KEEP_REGS = frozenset((0x02, 0x03, 0x04, 0x0A, 0x0C, 0x0D, 0x0E, 0x0F, 0x12, 0x13, 0x2E))


def _restore(regs, init_regs, r):
    if r in init_regs:
        regs[r] = init_regs[r]
    else:
        regs.pop(r, None)


def state_at(rows, offset):
    """The state in effect at ``offset`` (rows sorted by location)."""
    lo, hi = 0, len(rows)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if rows[mid][0] <= offset:
            lo = mid
        else:
            hi = mid
    return rows[lo][1]


def _advance(delta, ca):
    if delta % ca:
        raise CfiError("advance not a multiple of the code alignment")
    v = delta // ca
    if v < 0x40:
        return bytes([0x40 | v])
    if v < 0x100:
        return bytes([0x02, v])
    if v < 0x10000:
        return b"\x03" + struct.pack("<H", v)
    return b"\x04" + struct.pack("<I", v)


def _set_rule(r, rule, cie):
    da = cie.data_align
    init = dict(cie.init_state[1])
    if rule == init.get(r):
        return bytes([0xC0 | r]) if r < 64 else b"\x06" + uleb(r)
    if rule is None:           # absent where the CIE has a rule: only restore gives that
        raise CfiError("a register rule cannot be dropped")
    kind = rule[0]
    if kind in ("off", "valoff"):
        if rule[1] % da:
            raise CfiError("register offset not a multiple of the data alignment")
        f = rule[1] // da
        if kind == "off":
            if f >= 0:
                return (bytes([0x80 | r]) if r < 64 else b"\x05" + uleb(r)) + uleb(f)
            return b"\x11" + uleb(r) + sleb(f)
        return b"\x15" + uleb(r) + sleb(f)
    if kind == "undef":
        return b"\x07" + uleb(r)
    if kind == "same":
        return b"\x08" + uleb(r)
    if kind == "reg":
        return b"\x09" + uleb(r) + uleb(rule[1])
    if kind in ("expr", "valexpr"):
        return (b"\x10" if kind == "expr" else b"\x16") + uleb(r) + uleb(len(rule[1])) + rule[1]
    raise CfiError(f"register rule {kind}")


def diff(a, b, cie):
    """Instructions that turn state ``a`` into state ``b``."""
    out = bytearray()
    ca_, cb = a[0], b[0]
    if ca_ != cb:
        if cb[0] == "expr":
            out += b"\x0f" + uleb(len(cb[1])) + cb[1]
        elif ca_[0] == "reg" and ca_[1] == cb[1]:
            out += (b"\x0e" + uleb(cb[2])) if cb[2] >= 0 else \
                (b"\x13" + sleb(cb[2] // cie.data_align))
        elif ca_[0] == "reg" and ca_[2] == cb[2]:
            out += b"\x0d" + uleb(cb[1])
        else:
            out += (b"\x0c" + uleb(cb[1]) + uleb(cb[2])) if cb[2] >= 0 else \
                (b"\x12" + uleb(cb[1]) + sleb(cb[2] // cie.data_align))
    if a[1] != b[1]:                  # (most steps change the CFA only)
        ra, rb = dict(a[1]), dict(b[1])
        for r in sorted(set(ra) | set(rb)):
            if ra.get(r) != rb.get(r):
                out += _set_rule(r, rb.get(r), cie)
    if a[2] != b[2]:
        out += b"\x2e" + uleb(b[2])
    return bytes(out)


def write_program(rows, cie, length=None):
    """Instructions producing ``rows`` [(offset, state)] from the CIE's initial
    state; ``rows[0]`` is at offset 0. Consecutive equal states are merged;
    a state that comes back after others is remembered and restored (1 byte)
    when that is shorter than writing it again."""
    seq = []
    for off, st in rows:
        if seq and seq[-1][1] == st:
            continue
        if seq and seq[-1][0] == off:
            seq[-1] = (off, st)
            continue
        seq.append((off, st))
    out = bytearray()
    cur = cie.init_state
    loc = 0
    remembered = None
    last = {st: i for i, (_, st) in enumerate(seq)}     # where each state comes last
    diffs = {}                                          # (a, b) -> diff(a, b): states recur

    def step_of(a, b):
        got = diffs.get((a, b))
        if got is None:
            got = diffs[(a, b)] = diff(a, b, cie)
        return got
    for i, (off, st) in enumerate(seq):
        if off != loc:
            out += _advance(off - loc, cie.code_align)
            loc = off
        if remembered is not None and st == remembered and cur[2] == st[2]:
            out += b"\x0b"
            remembered = None
            cur = st
            continue
        step = step_of(cur, st)
        # cur comes back after i (last) and writing it again takes more than a restore
        if remembered is None and len(step) > 1 and i > 0 and \
                last.get(cur, -1) > i and len(step_of(st, cur)) > 1:
            out += b"\x0a"
            remembered = cur
        out += step
        cur = st
    return bytes(out)


def rows_for_pieces(rows, pieces):
    """Rows of a part made of ``pieces`` [(new offset, old offset, old length,
    copied?, state offset)]: each piece starts with the state in effect at its
    ``state offset``; a copied piece follows the original rows inside it."""
    locs = [loc for loc, _ in rows]
    out = []
    for new, old, old_len, copied, at in pieces:
        out.append((new, rows[max(bisect_right(locs, at) - 1, 0)][1]))     # state_at
        if copied:
            for k in range(bisect_right(locs, old), bisect_left(locs, old + old_len)):
                out.append((new + locs[k] - old, rows[k][1]))
    return out
