"""Block-level equivalence: check a ``.linepack.blockmap`` claim independently.

A block-level relayout says, piece by piece, where each original basic block
of a split function went (tools/image/blockmap.py). Nothing here trusts it:

- coverage: the pieces of each split function tile its original bytes exactly,
  at instruction boundaries (``equiv.block-lost``: bytes no piece covers;
  ``equiv.block-twice``: bytes two pieces cover, or two pieces placed on the
  same new bytes; ``equiv.block-map``: a piece boundary inside an instruction);
- placement: every piece lies inside its function's part in NEW, the parent
  symbol's range (hot) or ``name.cold``'s (cold) (``equiv.block-outside``);
- meaning: every original instruction has one counterpart that decodes to the
  same operation, its operands translated through the block map
  (``equiv.block-instruction``); a re-encoded branch keeps its kind and
  condition, its length is what the map says and its target is the
  translated target (``equiv.relaxation``, short and long forms are equal); a
  jcc may be inverted when its successors swap places: the opposite condition
  must branch to the translated fall-through and fall into the translated
  target (``equiv.jcc-inversion`` otherwise), the same edge set;
- control flow: every original edge exists in NEW: branch targets (above),
  every fall-through either still falls through to the translated successor
  or reaches it through an inserted ``jmp``; a removed ``jmp`` must have been
  unconditional and its place must now be its target (``equiv.edge``);
- tables: every table entry inside a split function maps to an entry of the
  same table in NEW (``equiv.table-stale``);
- ORC: the unwinder's lookup at each new instruction gives the original's
  entry, in particular at every piece start (``equiv.orc-block-start``).

The core works on byte readers and arrays so that tests can hand it small
synthetic functions; ``verify --against`` feeds it the two images.
"""

from bisect import bisect_left
from dataclasses import dataclass, field

import numpy as np

import capstone
from capstone import x86 as cx86

from ..image import blockmap as bm
from ..image.operands import rip_relative
from .addrmap import BlockMap

NOP2 = bytes.fromhex("6690")
NOP5 = bytes.fromhex("0f1f440000")
# Instructions after which control never reaches the next byte.
# (not hlt: an interrupt or NMI resumes after it)
_NO_FALLTHROUGH = {"jmp", "ret", "retf", "iret", "iretq", "int3", "sysret", "sysretq", "ljmp"}


def _falls_through(mnemonic):
    """Capstone's mnemonic names its prefixes first (`notrack jmp`, CET's indirect
    jumps with -fcf-protection; `bnd ret`): the instruction is the last word."""
    return mnemonic.rsplit(" ", 1)[-1] not in _NO_FALLTHROUGH


@dataclass
class SplitFunction:
    name: str
    old_start: int
    old_end: int
    parts: list = field(default_factory=list)   # (part, new_start, new_end)


@dataclass
class BlockFinding:
    check: str
    address: "int | None"
    message: str


def _cs():
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True
    return cs


class _Opaque:
    """An instruction Capstone 5 does not know (``disasm.KNOWN_UNDECODED``, e.g.
    SERIALIZE in finish_task_switch): no operands, so it means its bytes."""

    def __init__(self, addr, code, name):
        self.address, self.size, self.bytes = addr, len(code), bytes(code)
        self.mnemonic, self.op_str, self.operands = name, "", []
        self.disp_size = self.imm_size = self.disp_offset = self.imm_offset = 0

    def group(self, _g):
        return False


def _known(code, addr):
    from ..image.disasm import KNOWN_UNDECODED
    for pattern, length, name in KNOWN_UNDECODED:
        if code.startswith(pattern):
            return _Opaque(addr, code[:length], name)
    return None


def _decode_one(cs, read, addr):
    try:
        code = bytes(read(addr, 16))
    except ValueError:          # near its section's end: what the section holds
        code = b""
        for n in range(15, 0, -1):
            try:
                code = bytes(read(addr, n))
                break
            except ValueError:
                continue
    try:
        return next(cs.disasm(code, addr, 1))
    except (StopIteration, ValueError):
        return _known(code, addr)


class _Light:
    """An instruction as Capstone's lite decode gives it (no operand detail):
    address, length, bytes, mnemonic and operand text. ``_full`` decodes the
    detail where a check needs it (branches, RIP-relative operands, changed
    bytes); most copied instructions never need it."""

    __slots__ = ("address", "size", "bytes", "mnemonic", "op_str")

    def __init__(self, address, size, code, mnemonic, op_str):
        self.address, self.size, self.bytes = address, size, code
        self.mnemonic, self.op_str = mnemonic, op_str

    def group(self, g):
        """Capstone's call/jump groups, for the plain branches ``_plain_branch`` reads
        (the only _Light instructions that get a target)."""
        b0 = self.bytes[0]
        if g == capstone.CS_GRP_CALL:
            return b0 == 0xE8
        if g == capstone.CS_GRP_JUMP:
            return b0 in (0xE9, 0xEB) or 0x70 <= b0 <= 0x7F or \
                (b0 == 0x0F and 0x80 <= self.bytes[1] <= 0x8F)
        return False


def _plain_branch(ins):
    """(opcode bytes, target) of a direct call/jmp/jcc without prefixes (E8/E9 rel32,
    EB/7x rel8, 0F 8x rel32), read from its bytes; None for anything else. Most
    branches a split copies are these: their check needs no detailed decode."""
    b, n = ins.bytes, ins.size
    if n == 5 and b[0] in (0xE8, 0xE9):
        op = 1
    elif n == 2 and (b[0] == 0xEB or 0x70 <= b[0] <= 0x7F):
        op = 1
    elif n == 6 and b[0] == 0x0F and 0x80 <= b[1] <= 0x8F:
        op = 2
    else:
        return None
    rel = int.from_bytes(bytes(b[op:n]), "little", signed=True)
    return op, (ins.address + n + rel) & (2**64 - 1)


def _full(cs, ins):
    """The detailed decode of a _Light instruction (anything else as it is)."""
    if not isinstance(ins, _Light):
        return ins
    return next(cs.disasm(ins.bytes, ins.address, 1))


def _maybe_branch(mnemonic):
    """False only where an instruction cannot be a direct jmp/jcc/call/loop (a
    superset test on the mnemonic; _direct_target decides on the detail)."""
    return any(t[0] == "j" or t.startswith("loop") or t in ("call", "lcall", "xbegin")
               for t in mnemonic.split())


def _decode_all(cs, code, addr, lite=None):
    """Every instruction of ``code``, past the ones Capstone stops at; with
    ``lite`` (a Cs without detail) as _Light instructions."""
    out, pos = [], 0
    while pos < len(code):
        if lite is not None:
            got = [_Light(a, n, code[a - addr:a - addr + n], m, o)
                   for a, n, m, o in lite.disasm_lite(code[pos:], addr + pos)]
        else:
            got = list(cs.disasm(code[pos:], addr + pos))
        out += got
        pos = got[-1].address + got[-1].size - addr if got else pos
        if pos >= len(code):
            break
        ins = _known(code[pos:pos + 16], addr + pos)
        if ins is None:
            break                       # undecodable: reported by the caller
        out.append(ins)
        pos += ins.size
    return out


def _same_plain_branch(ins, plain, new_bytes, new_addr, translate):
    """The plain branch ``ins`` (``plain``: _plain_branch's answer) and the bytes at
    ``new_addr`` are the same opcode with the translated target: what _same_meaning
    finds for such a pair, without decoding. False sends the pair to the full check."""
    op, target = plain
    if new_bytes[:op] != bytes(ins.bytes[:op]):
        return False
    rel = int.from_bytes(new_bytes[op:ins.size], "little", signed=True)
    return (new_addr + ins.size + rel) & (2**64 - 1) == translate(target)


def _rip_disp_offsets(insns):
    """{address: offset of the disp32} of the RIP-relative ones among ``insns``
    (_Light instructions), read from one batched detailed decode
    (image/operands.py) rather than one wrapper decode each."""
    if not insns:
        return {}
    raw = np.zeros((len(insns), 16), np.uint8)
    for k, ins in enumerate(insns):
        raw[k, :ins.size] = np.frombuffer(bytes(ins.bytes), np.uint8)
    has, disp_offset = rip_relative(raw, [ins.size for ins in insns])
    return {ins.address: d for ins, h, d in zip(insns, has.tolist(), disp_offset.tolist())
            if h and d > 0}


def _same_rip_relative(ins, disp_offset, new_read, new_addr, translate):
    """The RIP-relative ``ins`` (its disp32 at ``disp_offset``) and the bytes at
    ``new_addr`` are the same but for the displacement, which designates the
    translated target: what _same_meaning finds for such a pair, without
    decoding. False sends the pair to the full check."""
    size, end = ins.size, disp_offset + 4
    if end > size:
        return False
    try:
        new = bytes(new_read(new_addr, size))
    except ValueError:
        return False
    old = bytes(ins.bytes)
    if new[:disp_offset] != old[:disp_offset] or new[end:] != old[end:]:
        return False
    old_disp = int.from_bytes(old[disp_offset:end], "little", signed=True)
    new_disp = int.from_bytes(new[disp_offset:end], "little", signed=True)
    mask = 2**64 - 1
    return (new_addr + size + new_disp) & mask == \
        translate((ins.address + size + old_disp) & mask)


def _plain_form(code):
    """(kind, condition, length, opcode length) of a direct call/jmp/jcc without
    prefixes at the start of ``code``, else None; short and long jmp and jcc are
    one kind."""
    if len(code) >= 5 and code[0] in (0xE8, 0xE9):
        return ("call" if code[0] == 0xE8 else "jmp"), None, 5, 1
    if len(code) >= 2 and code[0] == 0xEB:
        return "jmp", None, 2, 1
    if len(code) >= 2 and 0x70 <= code[0] <= 0x7F:
        return "jcc", code[0] & 0xF, 2, 1
    if len(code) >= 6 and code[0] == 0x0F and 0x80 <= code[1] <= 0x8F:
        return "jcc", code[1] & 0xF, 6, 2
    return None


def _same_plain_relaxed(ins, new_read, new_addr, new_len, want):
    """The plain branch ``ins`` re-encoded at ``new_addr`` as the same kind of plain
    branch (jcc: the same condition) of ``new_len`` bytes to ``want``: what the
    re-encoded branch check (_relaxation_problem) passes, without decoding. False
    sends the pair to the full check."""
    try:
        new = bytes(new_read(new_addr, new_len))
    except ValueError:
        return False
    old_form, new_form = _plain_form(bytes(ins.bytes)), _plain_form(new)
    if old_form is None or new_form is None or old_form[:2] != new_form[:2] or \
            new_form[2] != new_len:
        return False
    rel = int.from_bytes(new[new_form[3]:new_len], "little", signed=True)
    return (new_addr + new_len + rel) & (2**64 - 1) == want


def _plain_inversion(ins, plain, new_read, new_addr, new_len, map1):
    """The plain jcc ``ins`` (``plain``: _plain_branch's answer) re-encoded at
    ``new_addr`` as a plain jcc of ``new_len`` bytes on the opposite condition that
    branches to the translated fall-through and falls into the translated target:
    a correct inversion, what the full check (_inverted_jcc, _inversion_problem)
    passes, without decoding. False sends the pair to the full check."""
    old_form = _plain_form(bytes(ins.bytes))
    if old_form is None or old_form[0] != "jcc":
        return False
    try:
        new = bytes(new_read(new_addr, new_len))
    except ValueError:
        return False
    new_form = _plain_form(new)
    if new_form is None or new_form[0] != "jcc" or new_form[1] != old_form[1] ^ 1 or \
            new_form[2] != new_len:
        return False
    rel = int.from_bytes(new[new_form[3]:new_len], "little", signed=True)
    got = (new_addr + new_len + rel) & (2**64 - 1)
    target = map1(plain[1])
    return got != target and got == map1(ins.address + ins.size) and \
        target == new_addr + new_len


def _plain_jmp_to(new_read, new_addr, new_len, want):
    """NEW holds at ``new_addr`` a plain jmp (EB rel8 / E9 rel32) of ``new_len`` bytes
    to ``want``: what the inserted-jmp check passes, without decoding. False sends
    it to the full check."""
    try:
        new = bytes(new_read(new_addr, new_len))
    except ValueError:
        return False
    form = _plain_form(new)
    if form is None or form[0] != "jmp" or form[2] != new_len:
        return False
    rel = int.from_bytes(new[form[3]:new_len], "little", signed=True)
    return (new_addr + new_len + rel) & (2**64 - 1) == want


def _direct_target(ins):
    """Target of a direct jmp/jcc/call/loop/xbegin, else None (Capstone puts
    loop/loope/loopne in no jump group, only among the relative branches)."""
    if len(ins.operands) == 1 and ins.operands[0].type == cx86.X86_OP_IMM and (
            ins.group(capstone.CS_GRP_JUMP) or ins.group(capstone.CS_GRP_CALL) or
            ins.group(capstone.CS_GRP_BRANCH_RELATIVE)):
        return ins.operands[0].imm & (2**64 - 1)
    return None


_IP_BASES = (cx86.X86_REG_RIP, cx86.X86_REG_EIP)


def _rip_relative(ins):
    """A RIP- or EIP-based memory operand (EIP: a 67 prefix, the target truncated
    to 32 bits): the target moves with the instruction unless its bytes change."""
    return any(op.type == cx86.X86_OP_MEM and op.mem.base in _IP_BASES for op in ins.operands)


def _ip_text(op_str):
    """Capstone's operand text names rip or eip (a RIP/EIP-relative operand)."""
    return "rip" in op_str or "eip" in op_str


def _meaning(ins):
    """What an instruction does: (mnemonic, operands, the bytes that are no
    address field). Operands are ("target", T) for a direct branch, ("rip", T, ...)
    for a RIP-relative operand (T its absolute target), ("imm", v) and ("mem", ...,
    disp, ...) otherwise; the values that may name code are compared through the
    map by ``_same_meaning``."""
    target = _direct_target(ins)
    ops = []
    for op in ins.operands:
        if op.type == cx86.X86_OP_IMM:
            v = op.imm & (2**64 - 1)
            ops.append(("target", v) if target is not None else ("imm", v, op.size))
        elif op.type == cx86.X86_OP_MEM:
            m = op.mem
            if m.base in _IP_BASES:
                mask = 2**64 - 1 if m.base == cx86.X86_REG_RIP else 2**32 - 1
                t = (ins.address + ins.size + m.disp) & mask
                ops.append(("rip", t, m.base, m.segment, m.index, m.scale, op.size))
            else:
                ops.append(("mem", m.disp & (2**64 - 1), m.base, m.index, m.scale, m.segment,
                            op.size))
        else:
            ops.append(("reg", op.reg, op.size))
    raw = bytearray(ins.bytes)
    # address fields differ legitimately (checked by value); no other byte may
    if ins.disp_size:
        dsz = 4 if ins.disp_size == 2 else ins.disp_size
        raw[ins.disp_offset:ins.disp_offset + dsz] = b"\0" * dsz
    if ins.imm_size:
        raw[ins.imm_offset:ins.imm_offset + ins.imm_size] = b"\0" * ins.imm_size
    if target is not None:
        raw = None                      # short and long forms are equal
    return ins.mnemonic, ops, None if raw is None else bytes(raw)


def _same_meaning(old_ins, new_ins, translate):
    """True when new_ins does what old_ins did, code addresses translated."""
    mo, oo, ro = _meaning(old_ins)
    mn, on, rn = _meaning(new_ins)
    if mo != mn or ro != rn or len(oo) != len(on):
        return False
    mask32 = 0xFFFFFFFF
    for a, b in zip(oo, on):
        if a[0] != b[0]:
            return False
        if a[0] in ("target", "rip"):
            if translate(a[1]) != b[1] or a[2:] != b[2:]:
                return False
        elif a[0] in ("imm", "mem"):
            # an absolute address (sign-extended imm32/disp32 in the kernel) may move
            if a[2:] != b[2:]:
                return False
            if a[1] != b[1] and (translate(a[1]) & mask32) != (b[1] & mask32):
                return False
        elif a != b:
            return False
    return True


_lib = False            # the C scan (blocks.c): False not tried yet, None not available
# blocks.c's states of an instruction
ST_LOST, ST_DONE, ST_DONE_EDGE, ST_FALL, ST_SLOW, ST_BRANCH_FALL = range(6)
# the scan's first output size: a row per 3 bytes of code (x86-64 averages about 4), 8
# bytes of text per row (the instructions C does not pass, about 1 in 5, take ~30 each);
# a scan that runs out is repeated with room enough
_BYTES_PER_ROW, _TEXT_PER_ROW = 3, 8


def _native_lib():
    """The block check's C scan (blocks.c, built at first use), or None (no compiler):
    the Python loop then decides every instruction, with the same results."""
    global _lib
    if _lib is False:
        import ctypes
        import os
        from .. import native as nat

        def declare(lib):
            P, I64 = ctypes.c_void_p, ctypes.c_int64
            lib.lp_block_scan.argtypes = [P, P, ctypes.c_size_t] + [I64] * 5 + \
                [P, P, P, P, I64] + [P] * 6 + [I64] + [P] * 4 + [I64] + \
                [P, I64, P, I64] + [I64, P, I64, I64, P, P, P, I64, P, P, P, I64, P, I64, P] + \
                [P] * 4 + [I64, P, I64] + [P] * 3
            lib.lp_block_scan.restype = ctypes.c_int
        here = os.path.dirname(os.path.abspath(__file__))
        _lib = nat.optional_core("blocks", [os.path.join(here, "blocks.c")], "verify",
                                 "the block check core", declare)
    return _lib


def _new_sections(read):
    """(arrays to keep alive, section starts, ends, where each one's bytes are in
    memory, file-backed) of the ElfImage whose ``read`` this is, as ElfImage.read
    finds a section (the first allocated one in header order), or of the mutation
    test's PatchedImage over one (a patched section's bytes from its copy); None
    for any other reader (tests' byte readers): Python decides."""
    from ..image.elf import SHT_NOBITS, ElfImage
    from .patched import PatchedImage
    im = getattr(read, "__self__", None)
    func = getattr(read, "__func__", None)
    copies = {}
    if isinstance(im, PatchedImage) and func is PatchedImage.read:
        copies, im = im.copies(), im.base
        func = getattr(im.read, "__func__", None)
    if not isinstance(im, ElfImage) or func is not ElfImage.read:
        return None
    data = np.asarray(im.data)
    if data.dtype != np.uint8 or not data.flags.c_contiguous:
        return None
    secs = im.alloc_sections()
    keep = [data] + list(copies.values())
    base = []
    for s in secs:
        c = copies.get(s.index)
        if c is not None and (c.dtype != np.uint8 or not c.flags.c_contiguous or
                              len(c) < s.end - s.addr):
            return None
        base.append(c.ctypes.data if c is not None else data.ctypes.data + s.offset)
    return (keep, np.array([s.addr for s in secs], np.uint64),
            np.array([s.end for s in secs], np.uint64),
            np.array(base, np.uint64),
            np.array([s.type != SHT_NOBITS for s in secs], np.uint8))


def check_blocks(rows, functions, old_read, new_read, outside_map, orc_old=None, orc_new=None,
                 tables=(), no_fallthrough=frozenset(), noreturn=frozenset(), data_moves=None,
                 patch_sites=None):
    """Check a block map; returns (findings, stats).

    ``rows``: block map rows; ``functions``: SplitFunction per function that has
    pieces (original range, parts in NEW); ``old_read``/``new_read``: (addr, n)
    -> bytes; ``outside_map``: old -> new for addresses outside split functions;
    ``orc_old``/``orc_new``: (sorted ips, entry keys) or None; ``tables``:
    (name, old addresses, new addresses) columns; ``no_fallthrough``: original
    addresses (e.g. BUG ud2 sites) that never fall through; ``noreturn``: call
    targets (original addresses) that never return. ``data_moves``: (sorted
    original addresses of relocated fields whose data symbol moved, each one's
    move): an instruction holding one may differ by exactly that move.
    ``patch_sites``: {end: start} of the alternative sites in OLD: a jmp that ends
    one becomes NOPs when the kernel patches it, so it also falls through.
    """
    check = _BlockCheck(rows, functions, old_read, new_read, outside_map, orc_old, orc_new,
                        tables, no_fallthrough, noreturn, data_moves, patch_sites)
    out = _Found(len(functions))
    check.map_checks(out)
    check.functions(0, len(check.split), out)
    check.jmps_and_tables(out)
    check.orc(out)
    return out.findings, out.stats


class _Found:
    """What a run of block checks found: findings, stats and (kernels) the ORC pairs."""

    def __init__(self, n_functions):
        self.findings = []
        self.stats = {"split_functions": n_functions, "pieces": 0, "instructions": 0,
                      "branches_reencoded": 0, "jmps_inserted": 0, "jmps_removed": 0,
                      "edges": 0}
        self.orc_pairs = []         # (old addr, new addr, is piece start, piece)

    def add(self, check, addr, msg):
        self.findings.append(BlockFinding(check, None if addr is None else int(addr), msg))


def _orc_key(orc, addrs):
    ips, keys = orc
    i = np.searchsorted(ips, np.asarray(addrs, np.uint64), side="right").astype(np.int64) - 1
    return np.where(i >= 0, keys[np.maximum(i, 0)], -1)


class _BlockCheck:
    """check_blocks' parts over one block map: the map's own checks (map_checks),
    each split function's (functions: any range of them, in original order), the
    inserted jmps and tables (jmps_and_tables) and ORC (orc), each adding to a
    _Found; what they share (the map, the pieces' columns) is made once here."""

    def __init__(self, rows, functions, old_read, new_read, outside_map, orc_old, orc_new,
                 tables, no_fallthrough, noreturn, data_moves, patch_sites):
        self.rows, self.old_read, self.new_read = rows, old_read, new_read
        self.orc_old, self.orc_new, self.tables = orc_old, orc_new, tables
        self.no_fallthrough, self.noreturn, self.patch_sites = no_fallthrough, noreturn, \
            patch_sites
        amap = BlockMap(rows, outside_map)
        cs = _cs()
        lite = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
        f_start = np.array([f.old_start for f in functions], np.uint64)
        order = np.argsort(f_start, kind="stable")
        functions = [functions[i] for i in order]
        f_start = f_start[order]
        f_end = np.array([f.old_end for f in functions], np.uint64)

        # which function each row belongs to, by its original address
        old = rows["old"].astype(np.uint64)
        fi = np.searchsorted(f_start, old, side="right").astype(np.int64) - 1
        fic = np.maximum(fi, 0)
        inside = (fi >= 0) & (old < f_end[fic]) if len(functions) else np.zeros(len(rows), bool)
        # an inserted jmp may name its function's end (a fall-through off the last block)
        at_end = (fi >= 0) & (old == f_end[fic]) & (rows["kind"] == bm.KIND_JMP_INSERTED)
        insert_at = {}
        for r in rows[rows["kind"] == bm.KIND_JMP_INSERTED]:
            insert_at[int(r["new"])] = r

        orc_ok = orc_old is not None and orc_new is not None and len(orc_old[0]) and len(orc_new[0])

        # the pieces' columns and the moved data fields as lists: the loop below reads
        # them per instruction, where one-element numpy indexing costs more than the check
        piece_kind, piece_old, piece_old_end = amap.kind.tolist(), amap.old.tolist(), \
            amap.old_end.tolist()
        piece_new, piece_new_len = amap.new.tolist(), amap.new_len.tolist()
        moved_field_addrs, moved_field_deltas = (data_moves.addrs.tolist(),
                                                 data_moves.deltas.tolist()) \
            if data_moves is not None and len(data_moves.addrs) else ([], [])
        # an image without relocations: fields designating a moved data symbol by value
        moved_extents = data_moves if data_moves is not None and data_moves.extents else None
        # The common instruction, a copied one whose bytes NEW holds unchanged at its
        # place in the piece (one comparison per piece: most pieces are equal whole, the
        # others hold a changed call or branch beside unchanged instructions),
        # neither a branch nor RIP-relative nor holding a moved data field, has the same
        # meaning without a read or a decode; with its successor in the same piece (the
        # pieces not overlapping) its fall-through lands on the next byte of the piece
        # without a map lookup. It is counted as the full path counts it (instructions,
        # edges, ORC pairs); the last one of a piece gets the full fall-through check.
        fast = len(amap.old) < 2 or bool(np.all(amap.old[1:] >= amap.old_end[:-1]))
        piece_same = {}
        maybe_branch = {}
        # where each piece's end maps (map1 of it, for all pieces at once)
        end_new = amap.map(amap.old_end).tolist() if fast and len(amap.old) else []

        # each function's rows (ascending row order), grouped once
        in_rows = np.nonzero(inside)[0]
        in_rows = in_rows[np.argsort(fic[in_rows], kind="stable")]
        group_at = np.searchsorted(fic[in_rows], np.arange(len(functions) + 1)).tolist()
        self.amap, self.cs, self.lite, self.split = amap, cs, lite, functions
        self.f_start, self.f_end, self.old, self.inside, self.at_end = f_start, f_end, old, \
            inside, at_end
        self.insert_at, self.orc_ok = insert_at, orc_ok
        self.piece_kind, self.piece_old, self.piece_old_end = piece_kind, piece_old, \
            piece_old_end
        self.piece_new, self.piece_new_len = piece_new, piece_new_len
        self.moved_field_addrs, self.moved_field_deltas = moved_field_addrs, moved_field_deltas
        self.moved_extents, self.fast, self.end_new = moved_extents, fast, end_new
        self.piece_same, self.maybe_branch = piece_same, maybe_branch
        self.in_rows, self.group_at = in_rows, group_at

    def _detail_at(self):
        """blocks.c's struct detail_at: the detailed Capstone handle and where its
        details keep the operands and the displacement's offset (image/operands.py's)."""
        from ..image import operands as ops
        return np.array([self.cs.csh.value, ops._INSN_OFF["detail"], ops._OP_COUNT,
                         ops._OPERANDS, ops._OP, ops._OP_TYPE, ops._OP_MEM_BASE,
                         ops._DISP_OFFSET, cx86.X86_OP_MEM, cx86.X86_REG_RIP], np.int64)

    def scan(self, lo, hi, codes):
        """blocks.c's decode and states of split functions lo..hi-1 (``codes``: their
        original bytes): (addresses, lengths, pieces, states as lists, first row per
        function, stuck per function, (instructions passed, edges counted, re-encoded
        branches passed), the
        mnemonic and operand text, tab between, of each ST_FALL/ST_SLOW instruction in
        order); None
        where the C scan cannot run (no compiler, a reader that is no ElfImage's, the
        pieces overlapping: the Python loop's fast path is off then too)."""
        lib = _native_lib() if self.fast and hi > lo else None
        secs = _new_sections(self.new_read) if lib is not None else None
        if secs is None:
            return None
        import ctypes
        from capstone import _cs
        amap = self.amap
        if not hasattr(self, "_scan_cols"):
            as_u64 = lambda v: np.ascontiguousarray(v, np.uint64)     # noqa: E731
            # the function-level map of everything else (BlockMap.map1's outside1)
            fmap = amap.function_map
            fcols = (fmap.old_start, fmap.old_end, fmap.new_start, fmap.label_old,
                     fmap.label_new, fmap.label_end, np.sort(fmap.fixed)) \
                if fmap is not None else ((),) * 7
            self._scan_cols = (as_u64(amap.old), as_u64(amap.old_end), as_u64(amap.new),
                               as_u64(amap.new_len), np.ascontiguousarray(amap.kind, np.int64),
                               as_u64(self.end_new), as_u64(self.moved_field_addrs),
                               as_u64(sorted(self.no_fallthrough)),
                               as_u64(sorted(self.noreturn)), fmap is not None,
                               [as_u64(c) for c in fcols])
        p_old, p_end, p_new, p_newlen, p_kind, p_endnew, moved, nofall, noreturn, outside, \
            (o_start, o_end, n_start, l_old, l_new, l_end, fixed) = self._scan_cols
        # plain branches and RIP-relative copies in C where the translation is
        # BlockMap.map1's alone (no moved extents) and a jmp never falls through (no
        # patch sites: kernels')
        branches = self.moved_extents is None and not self.patch_sites
        _keep, sec_lo, sec_hi, sec_base, sec_file = secs
        flen = np.array([len(c) for c in codes], np.int64)
        code_off = np.concatenate([[0], np.cumsum(flen)[:-1]]).astype(np.int64)
        fstart = np.array([f.old_start for f in self.split[lo:hi]], np.uint64)
        buf = np.frombuffer(b"".join(codes), np.uint8)
        nfunc = hi - lo
        ffirst = np.zeros(nfunc + 1, np.int64)
        fstuck = np.zeros(nfunc, np.uint8)
        counts = np.zeros(4, np.int64)
        fields = dict(capstone._cs_insn._fields_)
        off = {n: getattr(capstone._cs_insn, n).offset for n in fields}
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)      # noqa: E731
        cap = int(flen.sum()) // _BYTES_PER_ROW + 1024
        tcap = cap * _TEXT_PER_ROW
        while True:
            oaddr, osize = np.zeros(cap, np.uint64), np.zeros(cap, np.uint8)
            opiece, ostate = np.zeros(cap, np.int64), np.zeros(cap, np.int8)
            otext = np.zeros(tcap, np.uint8)
            rc = lib.lp_block_scan(
                ctypes.cast(_cs.cs_disasm, ctypes.c_void_p).value,
                ctypes.cast(_cs.cs_free, ctypes.c_void_p).value, self.lite.csh.value,
                ctypes.sizeof(capstone._cs_insn), off["address"], off["size"],
                off["mnemonic"], off["op_str"],
                ptr(buf), ptr(code_off), ptr(fstart), ptr(flen), nfunc,
                ptr(p_old), ptr(p_end), ptr(p_new), ptr(p_newlen), ptr(p_kind), ptr(p_endnew),
                len(p_old), ptr(sec_lo), ptr(sec_hi), ptr(sec_base), ptr(sec_file),
                len(sec_lo), ptr(moved), len(moved), ptr(nofall), len(nofall),
                int(branches), ptr(noreturn), len(noreturn), int(outside), ptr(o_start),
                ptr(o_end), ptr(n_start), len(o_start), ptr(l_old), ptr(l_new), ptr(l_end),
                len(l_old), ptr(fixed), len(fixed), ptr(self._detail_at()),
                ptr(oaddr), ptr(osize), ptr(opiece), ptr(ostate), cap, ptr(otext), tcap,
                ptr(ffirst), ptr(fstuck), ptr(counts))
            if rc == 0:
                break
            if rc == 2:                 # FULL: room for one instruction a byte
                cap = int(flen.sum()) + 1024
            else:                       # TEXT_FULL: most instructions need their text
                tcap = max(4 * tcap, 1 << 16)
        n = int(ffirst[-1])
        text = otext[:int(counts[2])].tobytes().decode("ascii").split("\n")[:-1]
        return (oaddr[:n].tolist(), osize[:n].tolist(), opiece[:n].tolist(),
                ostate[:n].tolist(), ffirst.tolist(), fstuck.tolist(),
                (int(counts[0]), int(counts[1]), int(counts[3])), iter(text))

    def cut(self):
        """Where the split functions divide into two halves of about as many original
        bytes each."""
        done = np.cumsum((self.f_end - self.f_start).astype(np.int64))
        return int(np.searchsorted(done, done[-1] // 2)) + 1 if len(done) else 0

    def map_checks(self, out):
        """The block map's own rows: well-formed, each in a split function, no two
        pieces on the same new bytes."""
        rows, old, add = self.rows, self.old, out.add
        bad = bm.check_rows(rows)
        for b in bad:
            add("equiv.block-map", None, f"block map: {b}")
        for k in np.nonzero(~(self.inside | self.at_end))[0].tolist():
            add("equiv.block-map", int(rows["new"][k]),
                f"piece at original {int(old[k]):#x} is in no split function")

        # new-side overlap: two pieces on the same new bytes
        nz = rows[rows["new_len"] > 0]
        if len(nz) > 1:
            o = np.argsort(nz["new"], kind="stable")
            ns = nz["new"][o].astype(np.uint64)
            ne = ns + nz["new_len"][o].astype(np.uint64)
            for k in np.nonzero(ne[:-1] > ns[1:])[0].tolist():
                add("equiv.block-twice", int(ns[k + 1]),
                    f"two pieces placed on the same bytes at {int(ns[k + 1]):#x} (originals "
                    f"{int(nz['old'][o][k]):#x} and {int(nz['old'][o][k + 1]):#x})")

    def functions(self, lo, hi, out):
        """Split functions lo..hi-1 (in original order), instruction by instruction."""
        rows, functions, amap, cs, lite = self.rows, self.split, self.amap, self.cs, self.lite
        old_read, new_read = self.old_read, self.new_read
        no_fallthrough, noreturn, patch_sites = self.no_fallthrough, self.noreturn, \
            self.patch_sites
        insert_at, orc_ok, fast, end_new = self.insert_at, self.orc_ok, self.fast, self.end_new
        piece_kind, piece_old, piece_old_end = self.piece_kind, self.piece_old, \
            self.piece_old_end
        piece_new, piece_new_len = self.piece_new, self.piece_new_len
        moved_field_addrs, moved_field_deltas = self.moved_field_addrs, self.moved_field_deltas
        moved_extents, piece_same, maybe_branch = self.moved_extents, self.piece_same, \
            self.maybe_branch
        in_rows, group_at = self.in_rows, self.group_at
        add, stats, orc_pairs = out.add, out.stats, out.orc_pairs

        n_insns = n_fast_edges = 0      # stats' instructions and (fast path) edges

        def piece_diff(p):
            """True: NEW holds piece p's bytes unchanged; False: not comparable (another
            length, unreadable); else the running count of changed bytes (a list, [0] first)."""
            lo, n = piece_old[p], piece_old_end[p] - piece_old[p]
            if piece_new_len[p] != n:
                return False
            try:
                nb, ob = bytes(new_read(piece_new[p], n)), bytes(old_read(lo, n))
            except ValueError:
                return False
            if nb == ob:
                return True
            return [0] + np.cumsum(np.frombuffer(nb, np.uint8) !=
                                   np.frombuffer(ob, np.uint8)).tolist()

        def unchanged(p, a, succ):
            """NEW holds the bytes [a, succ) of copied piece p unchanged at their place."""
            got = piece_same.get(p)
            if got is None:
                got = piece_same[p] = piece_diff(p)
            if got is True or got is False:
                return got
            return got[succ - piece_old[p]] == got[a - piece_old[p]]

        def fall_edge(f, ins, a, target, n_end):
            """The fall-through edge after ``ins`` (at ``a``, ending at ``n_end`` in NEW)."""
            succ = a + ins.size
            falls = _falls_through(ins.mnemonic) and a not in no_fallthrough and \
                not (target is not None and ins.group(capstone.CS_GRP_CALL) and
                     target in noreturn)
            if not falls and ins.mnemonic == "jmp" and patch_sites and \
                    patch_sites.get(succ, succ + 1) <= a:
                falls = True        # a jmp ending a patch site: NOPs once patched
            if not falls or succ >= f.old_end:
                return
            stats["edges"] += 1
            want = amap.map1(succ)
            if want == n_end:
                return
            ins_row = insert_at.get(n_end)
            if ins_row is not None and int(ins_row["old"]) == succ:
                return                              # checked with the inserted jmps below
            sp = int(amap.piece([succ])[0])
            removed = sp >= 0 and piece_kind[sp] == bm.KIND_JMP_REMOVED
            add("equiv.edge", n_end, f"{f.name}: fall-through from '{ins.mnemonic} "
                f"{ins.op_str}' at {a:#x} to {succ:#x} is broken: NEW continues at "
                f"{n_end:#x}, the successor "
                + ("is a removed jmp whose target is" if removed else "is") + f" at {want:#x}"
                + _between(lite, new_read, n_end, want))

        def one(f, ins, p, rip_disp_offsets):
            """The checks of the original instruction ``ins`` in piece ``p`` (counted
            by the caller): the Python fast path, else in full."""
            nonlocal n_fast_edges
            a = ins.address
            kind = piece_kind[p]
            if fast and kind == bm.KIND_COPIED and type(ins) is _Light:
                succ = a + ins.size
                mb = maybe_branch.get(ins.mnemonic)
                if mb is None:
                    mb = maybe_branch[ins.mnemonic] = _maybe_branch(ins.mnemonic)
                if succ <= piece_old_end[p] and not mb and not _ip_text(ins.op_str) and \
                        unchanged(p, a, succ):
                    k = bisect_left(moved_field_addrs, a) if moved_field_addrs else 0
                    if not (k < len(moved_field_addrs) and moved_field_addrs[k] < succ):
                        n = piece_new[p] + (a - piece_old[p])
                        if orc_ok:
                            orc_pairs.append((a, n, piece_old[p] == a, p))
                        if succ < piece_old_end[p] and succ < f.old_end or \
                                end_new[p] == n + ins.size:
                            # its successor is the piece's next byte, in NEW too, or
                            # the piece's end maps to where the instruction ends
                            if _falls_through(ins.mnemonic) and \
                                    a not in no_fallthrough and succ < f.old_end:
                                n_fast_edges += 1
                        else:
                            fall_edge(f, ins, a, None, n + ins.size)
                        return
            piece_start = piece_old[p] == a
            plain = _plain_branch(ins) if kind in (bm.KIND_COPIED, bm.KIND_BRANCH) and \
                isinstance(ins, _Light) else None
            if plain is None and (kind != bm.KIND_COPIED or maybe_branch.get(ins.mnemonic, True)
                                  and _maybe_branch(ins.mnemonic)):
                ins = _full(cs, ins)
            # a lite instruction is no direct branch (_maybe_branch said so) or a plain one
            target = plain[1] if plain is not None else \
                None if isinstance(ins, _Light) else _direct_target(ins)
            if kind == bm.KIND_COPIED:
                n = piece_new[p] + (a - piece_old[p])
                translate, data_moved = amap.map1, False
                if moved_field_addrs:
                    k = bisect_left(moved_field_addrs, a)
                    if k < len(moved_field_addrs) and moved_field_addrs[k] < a + ins.size:
                        d = moved_field_deltas[k]
                        translate = lambda v, d=d: (v + d) & (2**64 - 1)   # noqa: E731
                        data_moved = True
                elif moved_extents is not None:
                    def translate(v, base=amap.map1):
                        m = moved_extents.moved_value(v)
                        return base(v) if m is None else m
                # the same bytes mean the same unless an operand is relative to the
                # instruction's address (RIP operand, direct branch) or refers to a
                # moved data symbol: no decode needed
                rip_disp_offset = rip_disp_offsets.get(a) \
                    if isinstance(ins, _Light) and not data_moved else None
                if rip_disp_offset is not None and \
                        _same_rip_relative(ins, rip_disp_offset, new_read, n, translate):
                    new_ins = ins       # same bytes but the displacement, the translated target
                else:
                    if isinstance(ins, _Light) and _ip_text(ins.op_str):
                        ins = _full(cs, ins)            # decoded once, kept for below
                    rip = not isinstance(ins, _Light) and _rip_relative(ins)
                    if not data_moved and target is None and not rip and \
                            bytes(new_read(n, ins.size)) == bytes(ins.bytes):
                        new_ins = ins
                    elif plain is not None and not data_moved and \
                            _same_plain_branch(ins, plain, bytes(new_read(n, ins.size)), n,
                                               translate):
                        new_ins = ins   # same opcode, same length, the translated target
                    else:
                        ins = _full(cs, ins)
                        new_ins = _decode_one(cs, new_read, n)
                if new_ins is None or new_ins.size != ins.size or \
                        (new_ins is not ins and not _same_meaning(ins, new_ins, translate)):
                    add("equiv.block-instruction", n, f"{f.name}: '{ins.mnemonic} "
                        f"{ins.op_str}' at {a:#x} has no counterpart of the same meaning "
                        f"at {n:#x}"
                        + (f" (found '{new_ins.mnemonic} {new_ins.op_str}')"
                           if new_ins else ""))
                    return
                n_end = n + ins.size
            elif kind == bm.KIND_BRANCH:
                stats["branches_reencoded"] += 1
                n = piece_new[p]
                new_len = piece_new_len[p]
                if piece_old[p] != a or piece_old_end[p] != a + ins.size:
                    add("equiv.block-map", a, f"{f.name}: branch piece {piece_old[p]:#x} is "
                        f"not exactly the instruction at {a:#x}")
                    return
                if plain is not None and \
                        _same_plain_relaxed(ins, new_read, n, new_len, amap.map1(plain[1])):
                    n_end = n + new_len     # the full check below finds nothing for it
                elif plain is not None and \
                        _plain_inversion(ins, plain, new_read, n, new_len, amap.map1):
                    # both edges kept (the full check below counts it the same)
                    stats["jcc_inverted"] = stats.get("jcc_inverted", 0) + 1
                    if orc_ok:
                        orc_pairs.append((a, n, piece_start, p))
                    return
                else:
                    ins = _full(cs, ins)
                    new_ins = _decode_one(cs, new_read, n)
                    # an opposite condition to the original target is a flipped jcc
                    # (relaxation); to anywhere else it claims to be an inversion
                    if _inverted_jcc(ins, new_ins) and target is not None and \
                            _direct_target(new_ins) != amap.map1(target):
                        why = _inversion_problem(ins, new_ins, new_len, target, amap)
                        if why:
                            add("equiv.jcc-inversion", n, f"{f.name}: '{ins.mnemonic}' at "
                                f"{a:#x} inverted to '{new_ins.mnemonic}' wrongly: {why}")
                        else:
                            stats["jcc_inverted"] = stats.get("jcc_inverted", 0) + 1
                            if orc_ok:
                                orc_pairs.append((a, n, piece_start, p))
                        return                # both edges checked by the inversion
                    why = _relaxation_problem(ins, new_ins, new_len, target, amap)
                    if why:
                        add("equiv.relaxation", n, f"{f.name}: branch at {a:#x} re-encoded "
                            f"wrongly: {why}")
                        return
                    n_end = n + new_len
            elif kind == bm.KIND_JMP_REMOVED:
                stats["jmps_removed"] += 1
                if ins.mnemonic != "jmp" or target is None:
                    add("equiv.edge", piece_new[p], f"{f.name}: removed '{ins.mnemonic} "
                        f"{ins.op_str}' at {a:#x} is not an unconditional direct jmp")
                elif amap.map1(target) != piece_new[p]:
                    place, now = piece_new[p], amap.map1(target)
                    add("equiv.edge", place, f"{f.name}: removed jmp at {a:#x} went to "
                        f"{target:#x} (now {now:#x}), but its place leads to {place:#x}: the "
                        "target must be the next instruction"
                        + _between(lite, new_read, place, now))
                return
            elif kind == bm.KIND_PAD_DROPPED:
                # the front of a prefix's NOP padding, not kept: single-byte NOPs only,
                # and its place is where the kept padding starts
                stats["padding_dropped"] = stats.get("padding_dropped", 0) + 1
                if bytes(ins.bytes) != b"\x90":
                    add("equiv.padding-dropped", piece_new[p], f"{f.name}: dropped "
                        f"'{ins.mnemonic} {ins.op_str}' at {a:#x} is not padding (a NOP)")
                elif piece_start and amap.map1(piece_old_end[p]) != piece_new[p]:
                    add("equiv.padding-dropped", piece_new[p], f"{f.name}: dropped padding "
                        f"at {a:#x} does not lead to the kept padding at "
                        f"{amap.map1(piece_old_end[p]):#x}")
                return
            else:
                return
            if orc_ok:
                orc_pairs.append((a, n, piece_start, p))
            fall_edge(f, ins, a, target, n_end)

        codes = [bytes(old_read(f.old_start, f.old_end - f.old_start))
                 for f in functions[lo:hi]]
        native = self.scan(lo, hi, codes)
        if native is not None:
            c_addr, c_size, c_piece, c_state, c_first, c_stuck, \
                (c_passed, c_edges, c_relaxed), c_text = native
            n_insns += c_passed
            n_fast_edges += c_edges
            stats["branches_reencoded"] += c_relaxed
        for fidx in range(lo, hi):
            f = functions[fidx]
            sel = in_rows[group_at[fidx]:group_at[fidx + 1]]
            fr = rows[sel]
            pieces = fr[fr["old_len"] > 0]
            stats["pieces"] += int(len(fr))
            code = codes[fidx - lo]
            if native is not None and not c_stuck[fidx - lo]:
                # decoded in C, the common instructions decided there (scan)
                insns = None
                c_lo, c_hi = c_first[fidx - lo], c_first[fidx - lo + 1]
                starts = set(c_addr[c_lo:c_hi])
                decoded_end = c_addr[c_hi - 1] + c_size[c_hi - 1] if c_hi > c_lo else \
                    f.old_start
            else:
                insns = _decode_all(cs, code, f.old_start, lite)
                rip_disp_offsets = _rip_disp_offsets(
                    [i for i in insns if isinstance(i, _Light) and _ip_text(i.op_str)])
                starts = {i.address for i in insns}
                decoded_end = insns[-1].address + insns[-1].size if insns else f.old_start
            if decoded_end != f.old_end:
                add("equiv.block-map", f.old_start,
                    f"{f.name}: original does not decode to its end")
            # coverage: the pieces tile [old_start, old_end)
            p_old = [int(v) for v in pieces["old"].tolist()]
            p_end = [a + int(n) for a, n in zip(p_old, pieces["old_len"].tolist())]
            pos = f.old_start
            for a, e in zip(p_old, p_end):
                if a > pos:
                    add("equiv.block-lost", pos, f"{f.name}: original bytes {pos:#x}..{a:#x} "
                        "are in no piece (a block was lost)")
                elif a < pos:
                    add("equiv.block-twice", a, f"{f.name}: original bytes "
                        f"{a:#x}..{min(pos, e):#x} are in two pieces (a block placed twice)")
                pos = max(pos, e)
            if pos < f.old_end:
                add("equiv.block-lost", pos, f"{f.name}: original bytes "
                    f"{pos:#x}..{f.old_end:#x} are in no piece (a block was lost)")
            for a, e in zip(p_old, p_end):
                for edge in (a, e):
                    if edge < f.old_end and edge not in starts:
                        add("equiv.block-map", edge, f"{f.name}: piece boundary {edge:#x} is "
                            "inside an instruction")
            # placement: inside the part the row names
            part_ranges = {p: (s, e) for p, s, e in f.parts}
            for r_old, ns, r_len, r_part in zip(fr["old"].tolist(), fr["new"].tolist(),
                                                fr["new_len"].tolist(), fr["part"].tolist()):
                if not r_len:
                    continue
                rng = part_ranges.get(r_part)
                ne = ns + r_len
                if rng is None or ns < rng[0] or ne > rng[1]:
                    where = "hot part" if r_part == bm.PART_HOT else "cold part"
                    add("equiv.block-outside", ns, f"{f.name}: piece of original {r_old:#x} "
                        f"at {ns:#x}..{ne:#x} is outside its {where}"
                        + (f" {rng[0]:#x}..{rng[1]:#x}" if rng else " (no such symbol in NEW)"))

            # instructions and edges
            if insns is not None:
                pidx = amap.piece(np.array([i.address for i in insns], np.uint64)) \
                    if insns else []
                for ins, p in zip(insns, pidx.tolist() if len(insns) else []):
                    if p < 0:
                        continue                    # reported as lost above
                    n_insns += 1
                    one(f, ins, p, rip_disp_offsets)
                continue
            # C passed the common instructions (counted above); the others as lite
            # instructions (C's decode: their text) through the Python checks
            todo = [k for k in range(c_lo, c_hi)
                    if c_state[k] >= ST_FALL or orc_ok and c_state[k] != ST_LOST]
            light = {}
            for k in todo:
                if c_state[k] >= ST_FALL:               # C gave its text
                    o, n = c_addr[k] - f.old_start, c_size[k]
                    m, _, ops = next(c_text).partition("\t")
                    light[k] = _Light(c_addr[k], n, code[o:o + n], m, ops)
            rip_disp_offsets = _rip_disp_offsets(
                [light[k] for k in todo if c_state[k] == ST_SLOW and _ip_text(light[k].op_str)])
            for k in todo:
                st, p, a = c_state[k], c_piece[k], c_addr[k]
                if st == ST_SLOW:
                    n_insns += 1
                    one(f, light[k], p, rip_disp_offsets)
                    continue
                n = piece_new[p] + (a - piece_old[p])
                if orc_ok:
                    orc_pairs.append((a, n, piece_old[p] == a, p))
                if st == ST_FALL:
                    fall_edge(f, light[k], a, None, n + c_size[k])
                elif st == ST_BRANCH_FALL:          # a plain branch C passed
                    n_end = n + piece_new_len[p] if piece_kind[p] == bm.KIND_BRANCH else \
                        n + c_size[k]
                    fall_edge(f, light[k], a, _plain_branch(light[k])[1], n_end)

        if native is not None and next(c_text, None) is not None:
            # C's text lines are taken by position: one left over means they were out
            # of step with the rows, and what was checked from them is not proven
            add("equiv.block-map", functions[lo].old_start,
                "block check: the C scan's instruction text is out of step with its rows")
        # the per-instruction counts, kept in locals in the loop above
        stats["instructions"] += n_insns
        stats["edges"] += n_fast_edges
    def jmps_and_tables(self, out):
        """Every inserted jmp goes to the translated fall-through target; every table
        entry inside a split function maps to an entry of NEW's column."""
        rows, amap, cs, new_read, orc_ok = self.rows, self.amap, self.cs, self.new_read, \
            self.orc_ok
        f_start, f_end, tables = self.f_start, self.f_end, self.tables
        add, stats, orc_pairs = out.add, out.stats, out.orc_pairs
        # inserted jmps: each a jmp to the translated fall-through target
        for r in rows[rows["kind"] == bm.KIND_JMP_INSERTED]:
            stats["jmps_inserted"] += 1
            n, want = int(r["new"]), amap.map1(int(r["old"]))
            if _plain_jmp_to(new_read, n, int(r["new_len"]), want):
                if orc_ok:
                    orc_pairs.append((int(r["old"]), n, True, len(amap.old) + n))
                continue
            j = _decode_one(cs, new_read, n)
            got = _direct_target(j) if j is not None and j.mnemonic == "jmp" else None
            if got is None or j.size != int(r["new_len"]) or got != want:
                add("equiv.edge", n, f"inserted jmp at {n:#x} should go to {want:#x} (original "
                    f"{int(r['old']):#x})" + (f", goes to {got:#x}" if got is not None else
                                              ", is not a direct jmp of that length"))
            elif orc_ok:
                orc_pairs.append((int(r["old"]), n, True, len(amap.old) + n))

        # tables: entries inside split functions must map to an entry of NEW's column
        split_lo, split_hi = f_start, f_end
        for name, col_old, col_new in tables:
            col_old = np.asarray(col_old, np.uint64)
            k = np.searchsorted(split_lo, col_old, side="right").astype(np.int64) - 1
            kc = np.maximum(k, 0)
            mine = (k >= 0) & (col_old < split_hi[kc]) if len(split_lo) else \
                np.zeros(len(col_old), bool)
            if not mine.any():
                continue
            want = amap.map(col_old[mine])
            have = np.isin(want, np.asarray(col_new, np.uint64))
            for o, w in zip(col_old[mine][~have].tolist(), want[~have].tolist()):
                add("equiv.table-stale", w, f"{name}: the entry for {o:#x} should now name {w:#x}; "
                    "NEW has no such entry (stale)")

    def orc(self, out):
        """Kernels: the ORC lookup at each new instruction gives the original's entry
        (the pairs the functions and jmps checks collected in ``out``)."""
        orc_ok, orc_old, orc_new, orc_pairs, add, stats = self.orc_ok, self.orc_old, \
            self.orc_new, out.orc_pairs, out.add, out.stats
        # ORC: the lookup at each new instruction gives the original's entry
        if orc_ok and orc_pairs:
            pa = np.array(orc_pairs, dtype=np.uint64)
            ko, kn = _orc_key(orc_old, pa[:, 0]), _orc_key(orc_new, pa[:, 1])
            wrong = pa[ko != kn].tolist()
            # a piece whose start is wrong is reported once, at its start
            bad_start = {p for _, _, start, p in wrong if start}
            for (o, n, start, p) in wrong:
                if start:
                    add("equiv.orc-block-start", n, f"ORC at the piece start {n:#x} differs from "
                        f"the original's at {o:#x} (entry missing or wrong)")
                elif p not in bad_start:
                    add("equiv.orc-block", n,
                        f"ORC at {n:#x} differs from the original's at {o:#x}")
            stats["orc_checked"] = int(len(pa))


def blocks_in_halves(rows, functions, old_read, new_read, outside_map, orc_old=None,
                     orc_new=None, tables=(), no_fallthrough=frozenset(), noreturn=frozenset(),
                     data_moves=None, patch_sites=None):
    """check_blocks on two cores: the second half of the split functions, the inserted
    jmps and the tables in a forked child (verify/forked.py) while this process makes
    the map's own checks and the first half; the same (findings, stats) as one call.
    With ORC tables (kernels) one call: the ORC check needs every function's pairs."""
    from .forked import Forked
    orc = orc_old is not None and orc_new is not None and len(orc_old[0]) and len(orc_new[0])
    if orc or len(functions) < 2:
        return check_blocks(rows, functions, old_read, new_read, outside_map, orc_old, orc_new,
                            tables, no_fallthrough, noreturn, data_moves, patch_sites)
    check = _BlockCheck(rows, functions, old_read, new_read, outside_map, orc_old, orc_new,
                        tables, no_fallthrough, noreturn, data_moves, patch_sites)
    cut = check.cut()

    def second_half():
        out = _Found(len(functions))
        check.functions(cut, len(check.split), out)
        check.jmps_and_tables(out)
        return out.findings, out.stats
    other = Forked(second_half)
    try:
        out = _Found(len(functions))
        check.map_checks(out)
        check.functions(0, cut, out)
    except BaseException:
        other.cancel()
        raise
    found_b, stats_b = other.result()
    for k, v in stats_b.items():
        if k != "split_functions":
            out.stats[k] = out.stats.get(k, 0) + v
    return out.findings + found_b, out.stats


def _between(lite, new_read, lo, hi):
    """For an edge finding: what NEW holds in the few bytes [lo, hi) between where
    execution continues and where it should (padding left where a jmp was
    removed, typically), or "" when hi is not just ahead of lo."""
    n = hi - lo
    if not 0 < n <= 16:
        return ""
    raw = bytes(new_read(lo, n))
    names, end = [], lo
    for a, size, mnemonic, _ in lite.disasm_lite(raw, lo):
        names.append(mnemonic)
        end = a + size
    byte_s = f"{n} byte{'s' if n > 1 else ''}"
    if end == hi and names == ["nop"]:
        what = f"a {n}-byte nop"
    elif end == hi and names and set(names) <= {"int3", "nop"}:
        what = f"{byte_s} of {'int3' if set(names) == {'int3'} else 'int3/nop'} padding"
    else:
        what = f"{byte_s} of code or data"
    return f"; NEW has {what} ({raw.hex(' ')}) in between"


def _jcc_cond(ins):
    """Condition code (0..15) of a jcc from its bytes, else None."""
    raw = bytes(ins.bytes)
    k = 0
    while k < len(raw) and raw[k] in (0x2E, 0x3E, 0xF2):
        k += 1
    if k < len(raw) and 0x70 <= raw[k] <= 0x7F:
        return raw[k] & 0xF
    if k + 1 < len(raw) and raw[k] == 0x0F and 0x80 <= raw[k + 1] <= 0x8F:
        return raw[k + 1] & 0xF
    return None


def _inverted_jcc(ins, new_ins):
    """True when new_ins is a jcc on the opposite condition of ins (a jcc)."""
    if new_ins is None:
        return False
    c0, c1 = _jcc_cond(ins), _jcc_cond(new_ins)
    return c0 is not None and c1 is not None and c1 == c0 ^ 1


def _inversion_problem(ins, new_ins, new_len, target, amap):
    """Why an inverted jcc does not keep both edges, or None: it must branch to
    the original fall-through and fall into the original target, translated."""
    if new_ins.size != new_len:
        return f"form: {new_ins.size} bytes where the map says {new_len}"
    fall = ins.address + ins.size
    got, want = _direct_target(new_ins), amap.map1(fall)
    if got != want:
        return (f"it goes to {'nowhere' if got is None else hex(got)}; the original "
                f"fall-through {fall:#x} is now at {want:#x}")
    n_end = new_ins.address + new_ins.size
    if target is None:
        return f"'{ins.mnemonic} {ins.op_str}' is not a direct branch"
    if amap.map1(target) != n_end:
        return (f"it falls through to {n_end:#x}; the original target {target:#x} is now at "
                f"{amap.map1(target):#x}")
    return None


def _relaxation_problem(ins, new_ins, new_len, target, amap):
    """Why a re-encoded branch is wrong, or None."""
    if target is None:
        # a static-key site that is a nop keeps being a nop (of either size)
        if bytes(ins.bytes) in (NOP2, NOP5):
            if new_ins is None or bytes(new_ins.bytes) not in (NOP2, NOP5) or \
                    new_ins.size != new_len:
                return f"a static-key nop became {new_ins.mnemonic if new_ins else 'undecodable'}"
            return None
        return f"'{ins.mnemonic} {ins.op_str}' is not a direct branch"
    if new_ins is None:
        return "NEW does not decode there"
    if new_ins.size != new_len:
        return f"form: {new_ins.size} bytes where the map says {new_len}"
    if new_ins.mnemonic != ins.mnemonic:
        return f"form: '{ins.mnemonic}' became '{new_ins.mnemonic}'"
    got = _direct_target(new_ins)
    want = amap.map1(target)
    if got != want:
        return (f"displacement: goes to {got:#x}, the original target {target:#x} is now at "
                f"{want:#x}")
    return None


__all__ = ["SplitFunction", "BlockFinding", "BlockMap", "check_blocks"]
