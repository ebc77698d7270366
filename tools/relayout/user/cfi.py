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


# --- the C core (cfi.c) -------------------------------------------------------
# It evaluates and writes plain programs (CFA register + offset; register rules
# off/valoff/reg/undef/same on registers 0..31, in 32 bits; GNU_args_size) with the same
# rules as the Python code above, to the same rows and the same bytes; for any
# other program it answers "not mine" and the Python code runs. Without a
# compiler every caller takes the Python code: the outputs do not change.

_NREG = 32
ROW = None                  # numpy dtype of cfi.c's row_t (loc, then the state's fields)
_RULE_KINDS = {"off": 1, "valoff": 2, "reg": 3, "undef": 4, "same": 5}
_KIND_NAMES = {v: k for k, v in _RULE_KINDS.items()}
_lib = False


def native_lib():
    """cfi.c loaded, or None (no compiler: the Python code does everything)."""
    global _lib, ROW, _CIE
    if _lib is False:
        import ctypes
        import os
        import numpy as np
        from ... import native as nat

        def declare(lib):
            P, I64 = ctypes.c_void_p, ctypes.c_int64
            lib.lp_cfi_eval.argtypes = [P, P, P, P, I64, P, P, P, P]
            lib.lp_cfi_eval.restype = I64
            lib.lp_cfi_compact.argtypes = [P, P, P, P, I64, P, P, P, P, P]
            lib.lp_cfi_compact.restype = ctypes.c_int
            lib.lp_cfi_pieces.argtypes = [P, I64, P, I64, P, ctypes.POINTER(ctypes.c_void_p)]
            lib.lp_cfi_pieces.restype = I64
            lib.lp_cfi_free.argtypes = [P]
            lib.lp_cfi_row_size.restype = I64
        here = os.path.dirname(os.path.abspath(__file__))
        lib = nat.optional_core("cfi", [os.path.join(here, "cfi.c")], "relayout",
                                "the CFI core", declare)
        ROW = np.dtype([("loc", "<i8"), ("cfa_off", "<i8"), ("args", "<i8"),
                        ("cfa_reg", "<i4"), ("present", "<u4"), ("kind", "u1", (_NREG,)),
                        ("val", "<i4", (_NREG,))])
        _CIE = np.dtype([("code_align", "<i8"), ("data_align", "<i8"), ("init", ROW)])
        if lib is not None and lib.lp_cfi_row_size() != ROW.itemsize:
            lib = None
        _lib = lib
    return _lib


_I64 = (-(1 << 63), (1 << 63) - 1)


def _fits(v):
    return isinstance(v, int) and _I64[0] <= v <= _I64[1]


def native_cie(info):
    """cfi.c's record of CIE ``info`` (a CieInfo), or None when its initial state
    or alignments are not plain (then its FDEs take the Python code)."""
    got = getattr(info, "native", False)
    if got is not False:
        return got
    import numpy as np
    rec = None
    cfa, regs, args = info.init_state
    plain = (cfa[0] == "reg" and 0 <= cfa[1] < _NREG and _fits(cfa[2]) and _fits(args)
             and info.code_align > 0 and info.data_align != 0
             and _fits(info.code_align) and _fits(info.data_align)
             and all(0 <= r < _NREG and rule[0] in _RULE_KINDS and
                     (len(rule) == 1 or -(1 << 31) <= rule[1] < 1 << 31) for r, rule in regs))
    if plain:
        rec = np.zeros(1, _CIE)
        rec["code_align"], rec["data_align"] = info.code_align, info.data_align
        init = rec["init"]
        init["cfa_reg"], init["cfa_off"], init["args"] = cfa[1], cfa[2], args
        present = 0
        for r, rule in regs:
            present |= 1 << r
            init["kind"][0, r] = _RULE_KINDS[rule[0]]
            if len(rule) > 1:
                init["val"][0, r] = rule[1]
        init["present"] = present
    info.native = rec
    return rec


def _cie_table(infos):
    """(CIE records end to end, each info's index there) or None when one is not plain."""
    import numpy as np
    index, recs, idx = {}, [], []
    for info in infos:
        k = index.get(id(info))
        if k is None:
            rec = native_cie(info) if info is not None else None
            if rec is None:
                return None
            k = index[id(info)] = len(recs)
            recs.append(rec)
        idx.append(k)
    table = np.concatenate(recs) if recs else np.zeros(1, _CIE)
    return table, np.array(idx, np.int32)


def _programs_packed(progs):
    import numpy as np
    lens = np.fromiter((len(p) for p in progs), np.int64, len(progs))
    offs = np.zeros(len(progs), np.int64)
    if len(progs) > 1:
        np.cumsum(lens[:-1], out=offs[1:])
    data = b"".join(progs) or b"\0"
    return data, offs, lens


def compact_native(progs, infos):
    """eh_frame_split._compact's programs for ``progs`` (CIEs ``infos``, None
    allowed): a list with the compacted bytes, or None where the program (or its
    CIE) is not plain; None without the C core."""
    lib = native_lib()
    if lib is None or not progs:
        return None
    import numpy as np
    plain = [k for k, info in enumerate(infos) if info is not None and native_cie(info) is not None]
    out = [None] * len(progs)
    if not plain:
        return out
    cies, idx = _cie_table([infos[k] for k in plain])
    data, offs, lens = _programs_packed([progs[k] for k in plain])
    n = len(plain)
    buf = np.empty(max(int(lens.sum()), 1), np.uint8)
    out_off, out_len = np.zeros(n, np.int64), np.zeros(n, np.int64)
    status = np.ones(n, np.int8)
    p = lambda a: a.ctypes.data   # noqa: E731
    if lib.lp_cfi_compact(data, p(offs), p(lens), p(idx), n, p(cies), p(buf), p(out_off),
                          p(out_len), p(status)) != 0:
        return out
    raw = buf.tobytes()
    for k, s, o, ln in zip(plain, status.tolist(), out_off.tolist(), out_len.tolist()):
        if not s:
            out[k] = raw[o:o + ln]
    return out


def evaluate_native(progs, infos, partial=False):
    """The rows of every program (``evaluate``'s, as cfi.c rows: a ROW array end to
    end) with each program's (first row, row count); None without the C core or
    when one program or CIE is not plain; ``partial``: the count -1 where a
    program is not plain, None only when a CIE is not."""
    lib = native_lib()
    if lib is None:
        return None
    import numpy as np
    got = _cie_table(infos)
    if got is None:
        return None
    cies, idx = got
    data, offs, lens = _programs_packed(progs)
    n = len(progs)
    rows = np.empty(int(lens.sum()) + n, ROW)
    first, count = np.zeros(n, np.int64), np.zeros(n, np.int64)
    p = lambda a: a.ctypes.data   # noqa: E731
    total = lib.lp_cfi_eval(data, p(offs), p(lens), p(idx), n, p(cies), p(rows), p(first),
                            p(count))
    if not partial and (count < 0).any():
        return None
    return rows[:total], first, count


def pieces_program_native(rows, pieces, info):
    """write_program(rows_for_pieces(rows, pieces), info) from cfi.c rows (one
    program's), or None (not plain: the Python code decides). ``pieces``: as
    rows_for_pieces's, or their fields end to end in one flat list."""
    lib = native_lib()
    cie = native_cie(info) if lib is not None else None
    if cie is None or not len(rows):
        return None
    import ctypes
    from array import array
    import numpy as np
    flat = array("q", [v for p in pieces for v in p] if pieces and isinstance(pieces[0], tuple)
                 else pieces)
    rows = np.ascontiguousarray(rows)
    out = ctypes.c_void_p()
    n = lib.lp_cfi_pieces(rows.ctypes.data, len(rows), flat.buffer_info()[0] if flat else None,
                          len(flat) // 5, cie.ctypes.data, ctypes.byref(out))
    if n < 0:
        return None
    try:
        return ctypes.string_at(out, n)
    finally:
        lib.lp_cfi_free(out)


def rows_from_native(rows):
    """cfi.c rows as ``evaluate`` gives them: [(location, state)]."""
    out = []
    for loc, off, args, reg, present, kinds, vals in rows.tolist():
        regs = []
        for r in range(_NREG):
            if present >> r & 1:
                kind = _KIND_NAMES[kinds[r]]
                regs.append((r, (kind,) if kind in ("undef", "same") else (kind, vals[r])))
        out.append((loc, (("reg", reg, off), tuple(regs), args)))
    return out
