"""Units: the contiguous byte ranges the relayout moves.

A unit is one function, extended over the code that follows it up to the next
function when that code is not padding (asm fragments without a symbol size,
``__thunk_restore`` style labels, ``.cold`` pieces...). Code before the first
function of a region that is not padding becomes a unit of its own (e.g. the
kernel's ``startup_64``). Padding between units (int3, zero bytes, NOP runs)
is dropped and re-created by the layout.

A function's prefix (``__pfx_<fn>``: the 16 NOP bytes before each function of
a kernel built with CONFIG_FUNCTION_PADDING_BYTES=16 / CONFIG_PREFIX_SYMBOLS,
where call-depth tracking writes its accounting thunk at boot and the kernel
refuses a padding that is not NOPs) is the first member of its function's unit
and the unit is named after the function: the padding moves with it, verbatim,
and the unit's alignment applies to the prefix start (the function keeps its
offset from its padding, so its own alignment too). An assembly function of such
a kernel has the padding (16 single-byte NOPs) without the symbol: its unit starts
at its padding all the same.

Units joined by a rel8 branch (or an assumed fall-through) are glued into one
unit so their relative placement survives; a unit keeps the bytes between its
members verbatim.

Everything is numpy arrays: ``start``, ``size``, ``align`` (minimum alignment
the unit's start must keep: 2**trailing_zeros(start) capped at 16), ``phase``
(start mod the largest member alignment), ``region`` (index into ``regions``),
``pinned``, and ``funcs`` (function index -> unit index map).
"""

import re

import numpy as np

from ..image.functions import regions as image_regions
from ..image.intervals import containing

MAX_INFERRED_ALIGN = 16

# Regions that never move: kernel entry code is mapped and patched by address
# (PTI maps the entry text, static_call trampolines, retpoline/return thunks).
PINNED_REGION_LABELS = (
    "__entry_text_start", "__irqentry_text_start", "__irqentry_text_end",
    "__entry_text_end", "__softirqentry_text_start", "__softirqentry_text_end",
    "__static_call_text_start", "__static_call_text_end",
    "__indirect_thunk_start", "__indirect_thunk_end",
)
# Last symbol of the kernel's head code (.head.text): everything from the start
# of the first region through the unit holding it stays in place.
HEAD_END_SYMBOLS = ("pvh_start_xen", "startup_64_setup_env", "secondary_startup_64")

# Code placed at a fixed address on purpose (SRSO: srso_alias_untrain_ret is
# 2 MiB aligned and the linker script asserts its address bits). Any unit
# whose start is 2 MiB aligned is pinned too.
PINNED_SYMBOLS = ("srso_alias_untrain_ret", "srso_alias_safe_ret", "srso_untrain_ret",
                  "__x86_return_thunk", "zen_untrain_ret", "srso_safe_ret")
PIN_ALIGNMENT = 1 << 21

# The entry text ends on a 2 MiB (PMD) boundary (ALIGN_ENTRY_TEXT_END, with PTI or
# SRSO): PTI clones the whole PMDs of the entry text into the user page tables and
# the SRSO alias pair sits at fixed bits in that PMD. Up to 6.x .text ends there;
# from 7.x (the linker script puts the entry text first) the main text follows the
# boundary: only the stretch before it stays, the rest is laid out.
ENTRY_TEXT_END = "__entry_text_end"

_PAD_BYTES = bytes((0xCC, 0x00))
PREFIX = "__pfx_"
# The padding call-depth tracking patches before each function (its thunk is smaller;
# the kernel refuses a padding that is not single-byte NOPs)
PADDING_BYTES = 16
PADDING_NOPS = b"\x90" * PADDING_BYTES


def inferred_align(addrs, cap=MAX_INFERRED_ALIGN):
    """2**trailing_zeros(addr), capped (numpy vectorised)."""
    a = np.asarray(addrs, dtype=np.uint64).astype(np.int64)
    low = a & -a
    low = np.where(a == 0, cap, low)
    return np.minimum(low, cap).astype(np.int64)


def is_padding(code):
    """True when a byte string is only int3 / zero bytes / NOP instructions."""
    if not code:
        return True
    if not bytes(code).translate(None, _PAD_BYTES):        # only int3 / zero bytes
        return True
    return _nop_run(code)


_NOPS = [bytes.fromhex(h) for h in (
    "90", "6690", "0f1f00", "0f1f4000", "0f1f440000", "660f1f440000", "0f1f8000000000",
    "0f1f840000000000", "660f1f840000000000", "662e0f1f840000000000",
    "66662e0f1f840000000000", "6666662e0f1f840000000000", "666666662e0f1f840000000000",
    "66666666662e0f1f840000000000", "6666666666662e0f1f840000000000", "cc", "00")]
_NOPS.sort(key=len, reverse=True)


# the longest NOP that matches at each position, never reconsidered (an atomic
# group: the regular expression does what a greedy scan does, in C)
_NOP_RUN = re.compile(b"(?>" + b"|".join(re.escape(n) for n in _NOPS) + b")*+")


def _nop_run(code):
    return _NOP_RUN.fullmatch(code) is not None


class Region:
    """A stretch of code inside one section; units never leave it."""

    __slots__ = ("name", "start", "end", "section", "pinned", "label_at_first")

    def __init__(self, name, start, end, section, pinned=False, label_at_first=False):
        self.name, self.start, self.end = name, int(start), int(end)
        self.section, self.pinned = section, bool(pinned)
        # its start label stays at its first unit's start (relayout/kernel/recovered.py
        # keep_first): where the layout pads before that unit, the label moves up to it
        self.label_at_first = bool(label_at_first)

    def __repr__(self):
        p = " pinned" if self.pinned else ""
        return f"<Region {self.name} {self.start:#x}..{self.end:#x}{p}>"


class UnitTable:
    """Units as arrays; can be built synthetically for tests."""

    def __init__(self, start, size, region, regions, name=None, pinned=None, align=None,
                 phase=None, funcs=None, members=None):
        self.start = np.asarray(start, dtype=np.uint64)
        self.size = np.asarray(size, dtype=np.uint64)
        self.end = self.start + self.size
        self.region = np.asarray(region, dtype=np.int64)
        self.regions = list(regions)
        n = len(self.start)
        self.name = list(name) if name is not None else [f"u{i}" for i in range(n)]
        self.pinned = (np.zeros(n, bool) if pinned is None else np.asarray(pinned, bool))
        for i, r in enumerate(self.regions):
            if r.pinned:
                self.pinned |= self.region == i
        self.align = inferred_align(self.start) if align is None else np.asarray(align, np.int64)
        self.phase = np.zeros(n, np.int64) if phase is None else np.asarray(phase, np.int64)
        # members[i]: list of (function index, offset in unit) — for metrics and names.
        self.members = members if members is not None else [[(i, 0)] for i in range(n)]
        self.funcs = funcs  # function index -> unit index (np.int64) or None

    def __len__(self):
        return len(self.start)

    def find(self, addrs):
        """Unit containing each address, -1 where none (end address excluded)."""
        return containing(self.start, self.end, addrs)


def build_regions(image, sections=(".text",), pin_head=True):
    """Regions of the sections to lay out (others are not returned: they stay put).

    The kernel's entry/irqentry/static_call/thunk regions are pinned; the head
    code at the start of the first region is split off as a pinned region.
    """
    out = []
    pinned_starts = {image.symbol_address(n) for n in PINNED_REGION_LABELS}
    pinned_starts.discard(None)
    head_end = None
    if pin_head and image.symbol_address("_stext") is not None:
        for n in HEAD_END_SYMBOLS:
            a = image.symbol_address(n)
            if a is not None:
                head_end = a
                break
    for r in image_regions(image):
        sec = image.sections[r.section]
        if sec.name not in sections:
            continue
        label = r.name.split(":", 1)[1]
        pinned = r.start in pinned_starts or any(label == n for n in PINNED_REGION_LABELS)
        pmd = -(-r.start // PIN_ALIGNMENT) * PIN_ALIGNMENT
        if label == ENTRY_TEXT_END and r.start < pmd < r.end and _code_starts_at(image, pmd):
            out.append(Region(r.name, r.start, pmd, r.section, True))
            out.append(Region(f"{r.name}@{pmd:#x}", pmd, r.end, r.section))
            continue
        out.append(Region(r.name, r.start, r.end, r.section, pinned))
    return out, head_end


def _code_starts_at(image, addr):
    """True when a function symbol starts at ``addr`` (the linker aligned code there)."""
    _, syms = image.symbol_table()
    at = syms["value"] == np.uint64(addr)
    return bool((at & ((syms["info"] & 0xF) == 2)).any())


def build_units(image, functions, disasm_fn=None, sections=(".text",), pin_head=True, log=None,
                program=False):
    """UnitTable of every function of the laid-out sections.

    ``disasm_fn(unit_table)`` returns a Disassembly of the units; it is used to
    glue rel8-joined units. Returns (units, disassembly or None).
    """
    log = log or (lambda m: None)
    regs, head_end = build_regions(image, sections, pin_head)
    # CONFIG_FUNCTION_PADDING_BYTES of a kernel with prefix symbols (0: none)
    pad = PADDING_BYTES if any(n.startswith(PREFIX) for n in functions.name) else 0
    starts, sizes, regidx, names, members = [], [], [], [], []
    fstart_u = np.asarray(functions.start, dtype=np.uint64)
    fstart = fstart_u.tolist()
    fend = np.asarray(functions.end, dtype=np.uint64).tolist()
    for ri, reg in enumerate(regs):
        sec = image.sections[reg.section]
        code = image.section_bytes(sec)
        lo = int(np.searchsorted(fstart_u, np.uint64(reg.start)))
        hi = int(np.searchsorted(fstart_u, np.uint64(reg.end)))
        cur = None                       # [start, end, members, name]
        pos = reg.start
        for fi in range(lo, hi):
            fs, fe = fstart[fi], fend[fi]
            if fe <= pos:                # nested symbol: already covered
                continue
            fs_eff = max(fs, pos)
            gap_is_code = not is_padding(bytes(code[pos - sec.addr:fs_eff - sec.addr]))
            # the function right after a prefix symbol (its own: by name, or an
            # alias's when aliases collapsed to another name): one unit
            own_prefix = (cur is not None and fs == pos and cur[2]
                          and functions.name[cur[2][-1][0]].startswith(PREFIX)
                          and fend[cur[2][-1][0]] == fs)
            if own_prefix:
                if len(cur[2]) == 1 and cur[0] == fstart[cur[2][0][0]]:
                    cur[3] = functions.name[fi]          # the unit is the function
                cur[2].append((fi, fs - cur[0]))
                cur[1] = fe
            elif cur is None and gap_is_code:
                # Code before the first function (e.g. startup_64): its own unit,
                # which may fall into this function: keep them together.
                cur = [pos, fe, [(fi, fs - pos)], _label_at(image, pos) or f"code@{pos:#x}"]
            elif cur is not None and fs < pos:
                cur[2].append((fi, fs - cur[0]))
                cur[1] = fe
            elif cur is not None and gap_is_code:
                # code without a function symbol after a function (an assembly label
                # such as ret_from_fork): it stays with the function before it, and the
                # next function starts a unit of its own, which glue() joins to it only
                # when the code can fall into it
                # (an assembly function of a padded kernel takes its NOP padding from
                # the end of that code: 7.3's verify_cpu after common_startup_64)
                lead = pad if (pad and fs - pad > pos and not functions.name[fi].startswith(PREFIX)
                               and bytes(code[fs - pad - sec.addr:fs - sec.addr]) == PADDING_NOPS) \
                    else 0
                cur[1] = fs_eff - lead
                starts.append(cur[0]); sizes.append(cur[1] - cur[0])
                regidx.append(ri); names.append(cur[3]); members.append(cur[2])
                cur = [fs - lead, fe, [(fi, lead)], functions.name[fi]]
            else:
                if cur is not None:
                    starts.append(cur[0]); sizes.append(cur[1] - cur[0])
                    regidx.append(ri); names.append(cur[3]); members.append(cur[2])
                # an assembly function of a padded kernel has its NOP padding but no
                # prefix symbol: the padding moves with it all the same
                lead = pad if (pad and fs - pad >= pos
                               and bytes(code[fs - pad - sec.addr:fs - sec.addr]) == PADDING_NOPS
                               and not functions.name[fi].startswith(PREFIX)) else 0
                cur = [fs - lead, fe, [(fi, lead)], functions.name[fi]]
            pos = max(pos, fe)
        tail_is_code = not is_padding(bytes(code[pos - sec.addr:reg.end - sec.addr]))
        if tail_is_code:
            if cur is None:
                cur = [pos, reg.end, [], _label_at(image, pos) or f"code@{pos:#x}"]
            else:
                cur[1] = reg.end
        if cur is not None:
            starts.append(cur[0]); sizes.append(cur[1] - cur[0])
            regidx.append(ri); names.append(cur[3]); members.append(cur[2])
    units = UnitTable(starts, sizes, regidx, regs, names, members=members)
    if head_end is not None:
        _pin_head(units, head_end)
    for n in PINNED_SYMBOLS:
        a = image.symbol_address(n)
        if a is not None:
            k = int(units.find([a])[0])
            if k >= 0:
                units.pinned[k] = True
    st = units.start.astype(np.uint64)
    units.pinned |= (st % np.uint64(PIN_ALIGNMENT)) == 0
    dis = None
    if disasm_fn is not None:
        dis = disasm_fn(units)
        from ..image.cfg import NORETURN
        noret = [a for a in (image.symbol_address(n) for n in NORETURN) if a is not None]
        icalls = ()
        if program:
            # a program's unit ending in ``call *abort@GOTPCREL(%rip)`` falls into nothing
            from ..image.noreturn import indirect_noreturn_calls
            icalls = indirect_noreturn_calls(image, dis)
        units = glue(units, dis, log, noret, icalls)
    units.funcs = _func_map(units, len(functions))
    return units, dis


def _label_at(image, addr):
    names, syms = image.symbol_table()
    hits = np.nonzero(syms["value"] == np.uint64(addr))[0]
    for h in hits.tolist():
        if names[h] and (syms["info"][h] & 0xF) in (0, 2):
            return names[h]
    return None


def _pin_head(units, head_end):
    """Pin units of the first region up to and including the one holding head_end."""
    if not len(units):
        return
    r0 = int(units.region[0])
    k = int(units.find([head_end])[0])
    if k < 0:
        k = int(np.searchsorted(units.start, np.uint64(head_end), side="right")) - 1
    if k < 0 or units.region[k] != r0:
        return
    units.pinned[:k + 1] = True


def _func_map(units, nfuncs):
    fmap = np.full(nfuncs, -1, np.int64)
    for u, mem in enumerate(units.members):
        for fi, _ in mem:
            fmap[fi] = u
    return fmap


def padding_instructions(dis, idx):
    """True per instruction index that is a NOP form (padding; int3 is not: it stops)."""
    idx = np.asarray(idx, np.int64)
    out = np.zeros(len(idx), bool)
    for k, i in enumerate(idx.tolist()):
        n = int(dis.size[i])
        out[k] = bytes(dis.raw[i, :n]) in _NOP_SET
    return out


_NOP_SET = frozenset(n for n in _NOPS if n not in (b"\x00", b"\xcc"))   # int3 is a stop


def glue(units, dis, log=None, noreturn=(), noreturn_icalls=()):
    """Merge units joined by rel8 branches (and unit pairs that fall through).
    ``noreturn``: addresses of functions that never return: a unit ending with a
    call to one does not fall into the next; ``noreturn_icalls``: indices (into
    ``dis``) of indirect calls that never return (image/noreturn.py), likewise."""
    idx, target, kind = dis.pc_relative_branches()        # loop/jecxz rel8 too
    src_u = units.find(dis.addr[idx])
    dst_u = units.find(target)
    cross = (kind == 1) & (src_u >= 0) & (dst_u >= 0) & (src_u != dst_u)
    pair_lo = np.minimum(src_u[cross], dst_u[cross])
    pair_hi = np.maximum(src_u[cross], dst_u[cross])
    # Fall-through: a unit whose last instruction can continue into the next unit.
    ends = units.end
    last = dis.containing(ends - np.uint64(1))
    ok = last >= 0
    lc = np.maximum(last, 0)
    tail_ok = ok & (dis.addr[lc] + dis.size[lc] == ends)
    # trailing NOP padding is never run after a stop: judge the instruction before it
    pad = padding_instructions(dis, lc) & ok
    for k in np.nonzero(pad)[0].tolist():
        i, lo = int(lc[k]), int(units.start[k])
        while i > 0 and int(dis.addr[i - 1]) >= lo and padding_instructions(dis, np.array([i]))[0]:
            i -= 1
        if int(dis.addr[i]) >= lo and not padding_instructions(dis, np.array([i]))[0] \
                and (i == int(lc[k]) or int(dis.addr[i]) + int(dis.size[i]) == int(dis.addr[i + 1])):
            lc[k] = i
    first = dis.raw[lc, 0]
    second = dis.raw[lc, 1]
    # ret (c3, c2), jmp (e9, eb), ud2 (0f 0b), udb (d6), ud1 (0f b9), int3 (cc),
    # jmp* (ff /4 /5); not hlt (f4): an interrupt or NMI resumes after it
    stop = ((first == 0xC3) | (first == 0xC2) | (first == 0xE9) | (first == 0xEB) |
            (first == 0xCC) | ((first == 0x0F) & (second == 0x0B)) |
            (first == 0xD6) | ((first == 0x0F) & (second == 0xB9)) |      # udb, ud1: #UD
            ((first == 0xFF) & (((second >> 3) & 7) >= 4) & (((second >> 3) & 7) <= 5)) |
            ((first == 0x2E) & (second == 0xE9)) | ((first == 0x3E) & (second == 0xFF)) |
            ((first == 0xF3) & (second == 0xC3)) | ((first == 0x41) & (second == 0xFF)))
    if len(noreturn):
        # a call that ends the unit (one followed by NOP padding stays glued: gcc ends a
        # function at such a call, and padding comes after code without a symbol)
        call = tail_ok & (lc == last) & (first == 0xE8) & (dis.size[lc] == 5)
        rel = dis.raw[lc, 1:5].astype(np.uint32)
        disp = (rel[:, 0] | (rel[:, 1] << 8) | (rel[:, 2] << 16) | (rel[:, 3] << 24)).astype(
            np.int32).astype(np.int64)
        tgt = ((dis.addr[lc] + np.uint64(5)).astype(np.int64) + disp).astype(np.uint64)
        stop = stop | (call & np.isin(tgt, np.asarray(noreturn, np.uint64)))
    if len(noreturn_icalls):
        stop = stop | (tail_ok & (lc == last) & np.isin(lc, np.asarray(noreturn_icalls, np.int64)))
    n = len(units)
    adjacent = np.zeros(n, bool)
    if n > 1:
        adjacent[:-1] = (units.end[:-1] == units.start[1:]) & (units.region[:-1] == units.region[1:])
    fall = np.nonzero(tail_ok & ~stop & adjacent)[0]
    # distinct (a, b) unit pairs, a < b
    key = np.unique(np.concatenate([pair_lo, fall]).astype(np.int64) * (n + 1) +
                    np.concatenate([pair_hi, fall + 1]).astype(np.int64))
    if not len(key):
        return units
    pa, pb = key // (n + 1), key % (n + 1)
    # Union of index ranges [a, b] (units between them move with them).
    same = units.region[pa] == units.region[pb]
    join = np.zeros(n + 1, np.int64)
    np.add.at(join, pa[same], 1)
    np.add.at(join, pb[same], -1)
    inside = np.cumsum(join)[:n] > 0     # unit i glued to i+1
    if log:
        log(f"glued {int(inside.sum())} unit boundaries (rel8 branches: "
            f"{len(key) - len(fall)}, fall-through: {len(fall)})")
    # groups: runs of units joined by ``inside``
    first = np.nonzero(np.concatenate([[True], ~inside[:n - 1]]))[0]
    last = np.append(first[1:] - 1, n - 1)
    u_start, u_end, u_align = units.start.tolist(), units.end.tolist(), units.align.tolist()
    u_pinned = units.pinned.tolist()
    first_l, last_l = first.tolist(), last.tolist()
    starts = [u_start[a] for a in first_l]
    sizes = [u_end[b] - u_start[a] for a, b in zip(first_l, last_l)]
    regs = units.region[first].tolist()
    names = [units.name[a] for a in first_l]
    align = [u_align[a] for a in first_l]
    members, pinned, phase = [], [], []
    for a, b, s in zip(first_l, last_l, starts):
        if a == b:                       # a unit on its own: unchanged
            pinned.append(u_pinned[a]); members.append(list(units.members[a])); phase.append(0)
            continue
        pinned.append(any(u_pinned[a:b + 1]))
        mem = []
        amax = 1
        for k in range(a, b + 1):
            off = u_start[k] - s
            mem.extend((fi, off + o) for fi, o in units.members[k])
            amax = max(amax, u_align[k])
        members.append(mem)
        phase.append(s % amax if amax > u_align[a] else 0)
    out = UnitTable(starts, sizes, regs, units.regions, names, pinned, align, phase,
                    members=members)
    return out


def pin_units(units, which):
    """A UnitTable like ``units`` whose units ``which`` (indices) stay where they
    are. The planner keeps pinned units only as the prefix of a region, so each
    becomes a pinned region of its own and its region is cut around it: the
    code before and after it is laid out on each side (userspace: a function a
    loose PC-relative data field may designate, relayout/user/pie.py)."""
    which = set(int(u) for u in np.asarray(which, np.int64).tolist() if u >= 0)
    if not which:
        return units
    regs, new_region = [], np.empty(len(units), np.int64)
    for ri, reg in enumerate(units.regions):
        idx = np.nonzero(units.region == ri)[0]
        idx = idx[np.argsort(units.start[idx], kind="stable")]
        cut = [int(u) for u in idx.tolist() if u in which]
        if not cut or reg.pinned:
            new_region[idx] = len(regs)
            regs.append(reg)
            continue
        pos, part = reg.start, None
        for u in idx.tolist():
            if u in which:
                lo, hi = int(units.start[u]), int(units.end[u])
                regs.append(Region(f"{reg.name}@{lo:#x}(pinned: {units.name[u]})", lo, hi,
                                   reg.section, pinned=True))
                new_region[u] = len(regs) - 1
                pos, part = hi, None
                continue
            if part is None:
                regs.append(Region(reg.name if pos == reg.start else f"{reg.name}@{pos:#x}",
                                   pos, reg.end, reg.section))
                part = len(regs) - 1
            new_region[u] = part
        # each movable part ends where the next pinned unit starts
        for k in range(len(regs) - 1):
            a, b = regs[k], regs[k + 1]
            if not a.pinned and a.section == b.section and a.end > b.start >= a.start:
                regs[k] = Region(a.name, a.start, b.start, a.section)
    pinned = units.pinned.copy()
    pinned[list(which)] = True
    out = UnitTable(units.start, units.size, new_region, regs, units.name, pinned, units.align,
                    units.phase, funcs=units.funcs, members=units.members)
    return out


def units_of(image, log=None):
    """(units, functions, disassembly) of an image's code, computed once per image
    (evaluate plans every layout from the one disassembly of its base)."""
    from ..image.context import ImageContext
    from ..image.disasm import disassemble
    ctx = ImageContext.of(image)

    def build():
        functions = ctx.functions
        if log:
            log(f"disassembling {len(functions)} functions")
        units, dis = build_units(image, functions, lambda u: disassemble(image, u), log=log,
                                 program=not ctx.is_kernel)
        return units, functions, dis
    return ctx.derived("units", build)
