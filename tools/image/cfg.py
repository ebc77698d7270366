"""Basic blocks of functions, from the bulk Disassembly (numpy, no per-instruction objects).

Leaders (a block starts at each):
- the function's start;
- every direct jmp/jcc target (from anywhere in the disassembly);
- the instruction after every jmp/jcc, ret, ud2, hlt, indirect jmp, static-key
  site and call to a known noreturn function (int3 padding right after such an
  instruction stays with it: it is SLS padding, not a block);
- every address a kernel table names (``TableSites.leaders``).
No leader is kept strictly inside an atomic range (an alternative or paravirt
patch site: the kernel rewrites its bytes as one piece).

Each block records how it ends (``term``): TERM_FALL (falls into the next
block; also a jmp that ends an alternative site, which boot-time patching may
turn into NOPs), TERM_JMP, TERM_JCC, TERM_KEY (a static-key site: jump to its target or
fall through, as the key flips), TERM_STOP (ret, ud2, indirect jmp, a
noreturn call; not hlt: an interrupt resumes after it); ``target`` is the
direct target (0 when none) and ``insn_first``/``insn_last`` index the
Disassembly.

``splittable`` says per function whether its blocks can be placed apart, and
``reason`` why not (an index into REASONS).
"""

import numpy as np

from .disasm import ANY_PREFIX, RAW, skip_prefixes
# callees that never return: the kernel's list (tools/image/noreturn.py has a program's too)
from .noreturn import KERNEL_NORETURN as NORETURN  # noqa: F401

TERM_FALL, TERM_JMP, TERM_JCC, TERM_KEY, TERM_STOP = 0, 1, 2, 3, 4
BUGFLAG_WARNING = 1          # include/asm-generic/bug.h

# Why a function is moved whole instead of split, in one list (index = reason code).
REASONS = (
    "split",                                   # 0: not a reason: the function is split
    "pinned code (head, entry text, static-call/thunk text, SRSO pair, 2 MiB aligned)",
    "noinstr text (instrumentation boundary: kept whole)",
    "unit holds more than one function (rel8 branch or fall-through between functions)",
    "undecodable bytes",
    "indirect jump that is not a retpoline thunk call",
    "branch into the middle of an instruction",
    "direct branch inside the function carries a relocation",
    "rel8 branch leaves the function",
    "rel8 branch inside an alternative/paravirt site targets another block",
    "falls through past its end",
    "2-byte static-key site whose target is outside the function",
    "not hot",
    "no cold block worth moving",
    "userspace: its .eh_frame FDE does not cover exactly the function, or uses CFI linepack "
    "does not evaluate",
    "userspace: has an LSDA linepack does not rewrite per part (exception specifications, "
    "unsupported encodings)",
    "userspace: no room left in .eh_frame/.eh_frame_hdr for its cold part's FDE",
    "no room before pinned code for the split's growth (its region keeps its original layout)",
    "a call lands after its entry (call-depth tracking patches a thunk before every call target)",
    "code without a function symbol follows it in its unit (its blocks would lie outside "
    "the function the block map names)",
    "holds a loop/loope/loopne/jecxz/xbegin or a jmp/jcc/call behind an unusual prefix (a "
    "branch the split does not re-encode)",
)
(R_SPLIT, R_PINNED, R_NOINSTR, R_GLUED, R_UNDECODABLE, R_INDIRECT, R_MID_INSN, R_RELOC_BRANCH,
 R_REL8_OUT, R_ALT_REL8, R_FALLS_OFF, R_KEY_OUT, R_NOT_HOT, R_NO_COLD,
 R_EH_FRAME, R_EH_LSDA, R_EH_ROOM, R_NO_ROOM, R_CALL_INSIDE, R_TRAILING_CODE,
 R_OTHER_BRANCH) = range(len(REASONS))

def _opcodes(dis):
    """(skip, op, op2, modrm-reg) per instruction after the branch-hint/bnd prefixes."""
    raw = dis.raw
    skip, op, op2 = skip_prefixes(raw, (0x2E, 0x3E, 0xF2, 0xF3))
    # REX prefix before ff /4 (jmp *%r8..)
    rex = (op >= 0x40) & (op <= 0x4F)
    op_r = np.where(rex, op2, op)
    modrm = op2.copy()
    r = np.nonzero(rex)[0]
    modrm[r] = raw[r, np.minimum(skip[r] + 2, RAW - 1)]
    return skip, op, op2, op_r, modrm


def classify(dis):
    """Per instruction: kind codes (0 other, 1 jmp, 2 jcc, 3 ret, 4 ud2, 5 int3,
    6 hlt, 7 indirect jmp, 8 call) from the raw bytes (CFG adds 9: a WARN ud2)."""
    skip, op, op2, op_r, modrm = _opcodes(dis)
    kind = np.zeros(len(dis), np.int8)
    kind[(op == 0xEB) | (op == 0xE9)] = 1
    kind[((op >= 0x70) & (op <= 0x7F)) | (op == 0xE3) | ((op == 0x0F) & (op2 >= 0x80) & (op2 <= 0x8F))] = 2
    kind[(op == 0xC3) | (op == 0xC2)] = 3
    kind[(op == 0x0F) & (op2 == 0x0B)] = 4
    kind[(op == 0xCC) & (skip == 0)] = 5
    kind[op == 0xF4] = 6
    reg = (modrm >> 3) & 7
    kind[(op_r == 0xFF) & ((reg == 4) | (reg == 5))] = 7
    kind[op == 0xE8] = 8
    return kind


class TableSites:
    """Addresses kernel tables name, for the CFG: leaders, atomic ranges and
    static-key sites (code, target). Empty for non-kernel images."""

    def __init__(self, leaders=(), atomic_lo=(), atomic_hi=(), key_code=(), key_target=(),
                 warn=()):
        self.leaders = np.unique(np.asarray(leaders, dtype=np.uint64))
        # ud2 of WARN() sites (__bug_table flag BUGFLAG_WARNING): the trap handler
        # resumes after them, so they fall through (a BUG() ud2 does not)
        self.warn = np.unique(np.asarray(warn, dtype=np.uint64))
        lo = np.asarray(atomic_lo, dtype=np.uint64)
        hi = np.asarray(atomic_hi, dtype=np.uint64)
        o = np.argsort(lo, kind="stable")
        self.atomic_lo, self.atomic_hi = lo[o], hi[o]
        kc = np.asarray(key_code, dtype=np.uint64)
        kt = np.asarray(key_target, dtype=np.uint64)
        o = np.argsort(kc, kind="stable")
        self.key_code, self.key_target = kc[o], kt[o]

    @classmethod
    def from_kernel(cls, ctx):
        """Collect every code address the 6.1 tables hold (ImageContext ``ctx``)."""
        from ..kernel import (Alternatives, BugTable, ExTable, JumpTable, ParaInstructions,
                              RetpolineSites, ReturnSites, StaticCallSites)
        leaders, lo, hi = [], [], []
        kc = kt = np.zeros(0, np.uint64)

        def parse(table_cls):
            t = table_cls()
            try:
                e = t.parse(ctx)
            except Exception:                  # noqa: BLE001 - table absent in this image
                return None
            return e if len(e) else None

        e = parse(ExTable)
        if e is not None:
            leaders += [e["insn"], e["fixup"]]
        e = parse(JumpTable)
        if e is not None:
            kc, kt = e["code"], e["target"]
            leaders += [kc, kt]
        e = parse(Alternatives)
        if e is not None:
            a = e["instr"]
            b = a + e["instrlen"].astype(np.uint64)
            leaders += [a, b]
            lo.append(a)
            hi.append(b)
        e = parse(ParaInstructions)
        if e is not None:
            a = e["instr"]
            b = a + e["len"].astype(np.uint64)
            leaders += [a, b]
            lo.append(a)
            hi.append(b)
        for tc in (StaticCallSites,):
            e = parse(tc)
            if e is not None:
                leaders.append(e["addr"])
        for tc in (RetpolineSites, ReturnSites):
            e = parse(tc)
            if e is not None:
                leaders.append(e["addr"])
        warn = np.zeros(0, np.uint64)
        e = parse(BugTable)
        if e is not None:
            leaders.append(e["addr"])
            warn = e["addr"][(e["flags"] & BUGFLAG_WARNING) != 0]
        cat = lambda xs: np.concatenate([np.asarray(x, np.uint64) for x in xs]) if xs else \
            np.zeros(0, np.uint64)
        return cls(cat(leaders), cat(lo), cat(hi), kc, kt, warn)


class CFG:
    """Blocks of a set of functions (``start``/``end`` arrays, sorted, disjoint)."""

    # per-instruction arrays: one entry per decoded instruction (drop_instructions)
    INSN_ARRAYS = ("insn_func", "insn_kind", "insn_target", "insn_rel", "insn_key",
                   "insn_key_target", "insn_atomic", "insn_intra")

    def drop_instructions(self):
        """Keep the blocks, forget the instructions (the disassembly and every
        ``insn_*`` array indexed by it): once the code is rewritten only the
        blocks are read, and the instruction tables are most of the CFG's memory."""
        self.dis = None
        for name in self.INSN_ARRAYS:
            setattr(self, name, None)

    def __init__(self, dis, fstart, fend, sites=None, noreturn_addrs=(), reloc_insn=None,
                 indirect_ok=False, noreturn_icalls=None):
        # indirect_ok: indirect jumps do not stop a split (userspace jump tables whose
        # every entry is relocated and a leader: relayout/user/user_blocks.py)
        self.indirect_ok = indirect_ok
        # noreturn_icalls: indices (into ``dis``) of indirect calls known not to return
        # (a program's ``call *f@GOTPCREL(%rip)`` to a panic: image/noreturn.py); one
        # that ends a function ends it as a trailing direct call does
        self.noreturn_icalls = noreturn_icalls
        self.dis = dis
        fstart = np.asarray(fstart, dtype=np.uint64)
        fend = np.asarray(fend, dtype=np.uint64)
        self.fstart, self.fend = fstart, fend
        sites = sites or TableSites()
        n = len(dis)
        addr = dis.addr
        size = dis.size.astype(np.uint64)
        iend = addr + size
        # owner function of each instruction
        fi = np.searchsorted(fstart, addr, side="right").astype(np.int64) - 1
        fic = np.maximum(fi, 0)
        owned = (fi >= 0) & (iend <= fend[fic]) if len(fstart) else np.zeros(n, bool)
        fi = np.where(owned, fi, -1)
        self.insn_func = fi
        kind = classify(dis)
        bidx, btarget, bk = dis.branch_targets()
        target = np.zeros(n, np.uint64)
        tkind = np.zeros(n, np.int8)
        target[bidx], tkind[bidx] = btarget, bk
        self.insn_kind, self.insn_target, self.insn_rel = kind, target, tkind
        # static-key sites
        is_key = np.zeros(n, bool)
        key_tgt = np.zeros(n, np.uint64)
        if len(sites.key_code):
            ki = dis.containing(sites.key_code)
            ok = (ki >= 0)
            ok &= dis.addr[np.maximum(ki, 0)] == sites.key_code
            is_key[ki[ok]] = True
            key_tgt[ki[ok]] = sites.key_target[ok]
        self.insn_key, self.insn_key_target = is_key, key_tgt
        noret = np.zeros(n, bool)
        calls = np.nonzero(kind == 8)[0]
        noret[calls] = np.isin(target[calls], np.asarray(noreturn_addrs, np.uint64))
        if len(sites.warn):
            kind = kind.copy()
            ud2 = np.nonzero(kind == 4)[0]
            kind[ud2[np.isin(addr[ud2], sites.warn)]] = 9          # WARN ud2: resumes after
            self.insn_kind = kind
        ends_block = (kind == 1) | (kind == 2) | (kind == 3) | (kind == 4) | (kind == 6) | \
            (kind == 7) | (kind == 9) | is_key | noret
        # hlt ends a block that falls through: an interrupt or NMI resumes after it
        stop = (kind == 3) | (kind == 4) | (kind == 7) | noret
        # leader flags per instruction
        lead = np.zeros(n, bool)
        start_i = dis.containing(fstart)
        lead[start_i[start_i >= 0]] = True
        after = np.nonzero(ends_block)[0] + 1
        after = after[after < n]
        # skip int3 SLS padding after a block end
        int3 = kind == 5
        for _ in range(4):
            step = int3[after] & (after + 1 < n)
            if not step.any():
                break
            after = np.where(step, after + 1, after)
        lead[after] = True
        # direct branch targets and table addresses that are instruction starts
        tgt_all = np.concatenate([btarget, key_tgt[is_key], sites.leaders])
        ti = dis.containing(tgt_all)
        at_start = (ti >= 0) & (dis.addr[np.maximum(ti, 0)] == tgt_all)
        lead[ti[at_start]] = True
        mid = (ti >= 0) & ~at_start
        mid_funcs = np.unique(fi[ti[mid]])
        # no leader strictly inside an atomic range
        atomic = np.zeros(n, bool)
        if len(sites.atomic_lo):
            j = np.searchsorted(sites.atomic_lo, addr, side="left").astype(np.int64) - 1
            jc = np.maximum(j, 0)
            inside = (j >= 0) & (addr > sites.atomic_lo[jc]) & (addr < sites.atomic_hi[jc])
            # also ranges that start before an earlier one ends (nested sites)
            lead &= ~inside
            atomic = inside | np.isin(addr, sites.atomic_lo)
        self.insn_atomic = atomic
        lead &= fi >= 0
        # a leader wherever the owner changes
        lead[1:] |= (fi[1:] != fi[:-1]) & (fi[1:] >= 0)
        if n:
            lead[0] |= fi[0] >= 0
        # blocks
        li = np.nonzero(lead)[0]
        # last instruction of each block: before the next leader or the end of the owner's run
        nxt = np.append(li[1:], n)
        # a block stops at the end of its owner's instructions
        own = fi[li]
        last = nxt - 1
        # trim blocks that run into instructions of no function (between functions)
        bad = fi[np.minimum(last, n - 1)] != own
        if bad.any():
            for k in np.nonzero(bad)[0].tolist():
                j = li[k]
                while j + 1 < nxt[k] and fi[j + 1] == own[k]:
                    j += 1
                last[k] = j
        keep = own >= 0
        li, last, own = li[keep], last[keep], own[keep]
        self.insn_first, self.func = li, own
        self.start = addr[li]
        self.end = iend[last]
        # the block's terminator is its last instruction before trailing int3 padding
        for _ in range(4):
            back = (kind[last] == 5) & (last > li)
            if not back.any():
                break
            last = np.where(back, last - 1, last)
        self.insn_last = last          # the terminator (trailing int3s stay in the block)
        lk = kind[last]
        term = np.full(len(li), TERM_FALL, np.int8)
        term[lk == 1] = TERM_JMP
        term[lk == 2] = TERM_JCC
        term[is_key[last]] = TERM_KEY
        term[stop[last]] = TERM_STOP
        if len(sites.atomic_hi):
            # A jmp that ends a patch site (static_cpu_has: "jmp 6f" into .altinstr_aux)
            # becomes NOPs at boot when the feature is present: the code after the site
            # is then its fall-through, so the block must keep (or jmp to) its successor.
            site_end = (lk == 1) & atomic[last] & np.isin(iend[last], sites.atomic_hi)
            term[site_end] = TERM_FALL
            self.patched_jmp = site_end
        else:
            self.patched_jmp = np.zeros(len(li), bool)
        # a jmp/jcc inside an atomic site is copied as is (blocks.py does not re-encode it)
        self.term = term
        self.target = np.where(is_key[last], key_tgt[last],
                               np.where((lk == 1) | (lk == 2), target[last], 0)).astype(np.uint64)
        # block of each direct target (same function only), -1 otherwise
        bi = np.searchsorted(self.start, self.target, side="right").astype(np.int64) - 1
        bic = np.maximum(bi, 0)
        same = (bi >= 0) & (self.start[bic] == self.target) & (self.func[bic] == own)
        self.target_block = np.where(same, bi, -1)
        # per-function block ranges
        nf = len(fstart)
        self.func_first = np.searchsorted(own, np.arange(nf), side="left")
        self.func_nblocks = np.bincount(own, minlength=nf) if len(own) else np.zeros(nf, np.int64)
        self.reason = np.zeros(nf, np.int8)
        self._mark(mid_funcs[mid_funcs >= 0], R_MID_INSN)
        self._classify_functions(reloc_insn)

    def __len__(self):
        return len(self.start)

    def _mark(self, funcs, reason):
        funcs = np.asarray(funcs, np.int64)
        funcs = funcs[funcs >= 0]
        sel = funcs[self.reason[funcs] == 0]
        self.reason[sel] = reason

    def _classify_functions(self, reloc_insn):
        dis, fi = self.dis, self.insn_func
        kind = self.insn_kind
        # undecodable bytes
        if dis.undecodable:
            bad = np.array([a for a, _ in dis.undecodable], np.uint64)
            f = np.searchsorted(self.fstart, bad, side="right").astype(np.int64) - 1
            fc = np.maximum(f, 0)
            self._mark(f[(f >= 0) & (bad < self.fend[fc])], R_UNDECODABLE)
        if not self.indirect_ok:
            self._mark(fi[kind == 7], R_INDIRECT)
        # every direct branch the CFG does not read as a jmp or jcc is no block
        # terminator here, so its target could land in another part, unfixed: loop,
        # loopne, jecxz and xbegin, a jmp or jcc behind ld's or hand-written addr32,
        # and the branches behind prefixes no decoder reads (Disassembly.
        # unchecked_branches); calls need no terminator (their return comes back)
        idx = dis.pc_relative_branches()[0]
        if len(idx):
            _, op, _ = skip_prefixes(dis.raw[idx], ANY_PREFIX, rounds=14)
            idx = idx[(kind[idx] != 1) & (kind[idx] != 2) & (op != 0xE8)]
        self._mark(fi[np.concatenate([idx, dis.unchecked_branches()])], R_OTHER_BRANCH)
        tgt = self.insn_target
        rel = self.insn_rel
        direct = ((kind == 1) | (kind == 2)) & (rel > 0)
        # the function holding each direct branch's target (-1 elsewhere: unused)
        d = np.nonzero(direct)[0]
        tf = np.full(len(kind), -1, np.int64)
        tfd = np.searchsorted(self.fstart, tgt[d], side="right").astype(np.int64) - 1
        tf[d] = np.where((tfd >= 0) & (tgt[d] < self.fend[np.maximum(tfd, 0)]), tfd, -1)
        intra = direct & (tf == fi) & (fi >= 0)
        self.insn_intra = intra
        self._mark(fi[direct & (rel == 1) & (tf != fi)], R_REL8_OUT)
        if reloc_insn is not None:
            self._mark(fi[intra & reloc_insn], R_RELOC_BRANCH)
        # a rel8 in an atomic site must keep its size: only safe when it stays in its block
        # (a block is copied verbatim, so a loop inside a site keeps its distance)
        alt8 = np.nonzero(intra & (rel == 1) & self.insn_atomic)[0]
        if len(alt8):
            own = np.searchsorted(self.insn_first, alt8, side="right").astype(np.int64) - 1
            t = tgt[alt8]
            oc = np.maximum(own, 0)
            a8 = self.dis.addr[alt8]
            inside = (own >= 0) & (a8 >= self.start[oc]) & (a8 < self.end[oc]) & \
                (t >= self.start[oc]) & (t < self.end[oc])
            self._mark(fi[alt8[~inside]], R_ALT_REL8)
        # static-key sites jumping out of their function: a 5-byte site reaches its target
        # from anywhere (copied with its block, a jmp's rel32 is fixed like any branch
        # leaving moved code); a 2-byte one may not once the parts move apart
        keys = np.nonzero(self.insn_key)[0]
        kf = np.searchsorted(self.fstart, self.insn_key_target[keys], side="right").astype(
            np.int64) - 1
        self._mark(fi[keys[(kf != fi[keys]) & (self.dis.size[keys] < 5)]], R_KEY_OUT)
        # last block of a function falling through past the end (a trailing call is taken
        # as noreturn: a compiler ends a function with a call only when it does not
        # return, else it would run into the next function's bytes; in a program an
        # indirect call its link relocation names a noreturn function too: rustc calls
        # panics and handle_error through GOT slots)
        if len(self.start):
            lastb = self.func_first + self.func_nblocks - 1
            has = self.func_nblocks > 0
            lb = lastb[has]
            li = self.insn_last[lb]
            call = kind[li] == 8
            if self.noreturn_icalls is not None and len(self.noreturn_icalls):
                call = call | np.isin(li, self.noreturn_icalls)
            falls = np.isin(self.term[lb], (TERM_FALL, TERM_JCC, TERM_KEY)) & ~call
            self._mark(np.nonzero(has)[0][falls], R_FALLS_OFF)
            tail_call = (self.term[lb] == TERM_FALL) & call
            self.term[lb[tail_call]] = TERM_STOP

    def falls_through(self):
        """True where control can continue into the next block (same function)."""
        return np.isin(self.term, (TERM_FALL, TERM_JCC, TERM_KEY))

    def blocks_of(self, f):
        a = int(self.func_first[f])
        return a, a + int(self.func_nblocks[f])

    def reason_counts(self, funcs=None):
        r = self.reason if funcs is None else self.reason[funcs]
        c = np.bincount(r, minlength=len(REASONS))
        return {REASONS[i]: int(c[i]) for i in range(len(REASONS)) if c[i]}


def block_counts(cfg, blk_addr, blk_size, blk_count):
    """Execution count of every CFG block from a profile's executed ranges
    (QEMU translation blocks, LBR fall-through ranges: address, size, count):
    the summed count of the ranges that cover the block's first byte. A range
    that covers several blocks (a TB runs through a join point) counts for each."""
    a = np.asarray(blk_addr, dtype=np.uint64)
    s = np.asarray(blk_size, dtype=np.uint64)
    c = np.asarray(blk_count, dtype=np.float64)
    if not len(a) or not len(cfg):
        return np.zeros(len(cfg), np.float64)
    pts = np.concatenate([a, a + s])
    w = np.concatenate([c, -c])
    o = np.argsort(pts, kind="stable")
    pts, cum = pts[o], np.cumsum(w[o])
    i = np.searchsorted(pts, cfg.start, side="right").astype(np.int64) - 1
    out = np.where(i >= 0, cum[np.maximum(i, 0)], 0.0)
    return np.maximum(out, 0.0)
