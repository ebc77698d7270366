"""kallsyms entries for the ``name.cold`` parts of a block-level layout.

kallsyms' arrays (offsets, names, markers, seqs_of_names) were sized by the
link step for its symbol count and sit packed in .rodata, so one more symbol
does not fit where they are. They are rebuilt and placed again: into the old
arrays' own storage where they fit, and what does not into a new read-only
section, ``.linepack.kallsyms``, right after the end of the read-only segment
(the first PT_LOAD: .text .. .BTF_ids on x86-64), in the gap the linker leaves
before the 2 MB-aligned ``_sdata``. That gap exists in the file too, so the
segment only grows (p_filesz = p_memsz). ``__end_rodata`` moves past the new
section: x86-64 ``mark_rodata_ro()`` maps up to ``__end_rodata_hpage_align``
read-only but frees the pages from ``PFN_ALIGN(__end_rodata)`` to ``_sdata``.

The gap is the scarce room (Debian 7.3: 623,800 bytes), so the placement
(``_place``) puts there the fewest bytes a whole-array assignment allows. A kernel
with more symbols may need more than the gap holds (Debian 13's generic 6.12:
167,000 symbols, kallsyms_offsets 670 KB, a 462 KB gap). Then the new section goes
to the end of the kernel text instead (``_text_tail``): x86-64 pads ``.text`` with
int3 up to the 2 MB-aligned ``_etext`` (1 MB on that kernel), mapped read-only
like rodata (and executable, which reading data does not mind); ``.text``'s
section header then ends where the new section starts, ``_etext`` and
``__end_rodata`` stay. Where
the old storage lies, by version (scripts/kallsyms.c write_src):

- 6.1: offsets | relative_base num_syms | names markers seqs_of_names |
  token_table token_index. Two free areas; offsets (4 bytes per symbol, the
  array that grows by whole slots) go to the gap (~350 KB on Debian's cloud
  vmlinux), seqs_of_names into the old offsets' slot.
- 6.12: num_syms | names markers | token_table token_index | offsets |
  relative_base | seqs_of_names. The token arrays split the storage of the
  growing arrays; they keep their bytes (names are encoded with the existing
  tokens) but move as one unit when that joins names..offsets into one area.
  relative_base stays (its 8 bytes hold an absolute address, a field of the
  vmlinuz's KASLR table), so seqs_of_names' old slot can only take a small
  array and seqs_of_names itself goes to the gap (~3 bytes per symbol); when the
  names' and offsets' growth is more than the small arrays free (hundreds of .cold
  parts: Debian's, 471), the offsets go instead (4 bytes per symbol).
- 7.3: num_syms | names markers | token_table token_index | offsets
  seqs_of_names, no relative_base (offsets are PC-relative). With the tokens
  moved, names..seqs_of_names is one area and the gap takes the smallest
  arrays that cover the growth.

The code reaches the arrays and ``__end_rodata`` only through relocated fields
(``--emit-relocs``: R_X86_64_32S / PC32 against the symbols, also in
.init.text), so each such field moves by its symbol's move and the symbols get
their new values. References recovered from a vmlinuz name a symbol only where
recovery proved it (``PFN_ALIGN(__end_rodata)``, ``__pa_symbol(__end_rodata) - 1``:
image/references.py); the rest follow by value, and a move that is not provable
is refused (``_recovered_moves``). ``kallsyms_relative_base`` (an absolute relocation KASLR
adjusts) and ``kallsyms_num_syms`` (updated in place) stay where they are. Old
storage that no new array reuses is zeroed: nothing may read it any more.
"""

import numpy as np

from ...image.elf import RELA, SHT_RELA, SHT_SYMTAB, SYM, SHF_ALLOC, SHT_NOBITS
from ...image.context import ImageContext
from ...image.relocs import RECIPES
from ...kernel.kallsyms import Kallsyms
from .kernel_tables import PatchedImage

SECTION_NAME = ".linepack.kallsyms"
PAGE = 4096
ALIGN = 8
TOKEN_INDEX_BYTES = 256 * 2           # kallsyms_token_index: u16 per token byte
MAX_INSN = 15                         # an x86 instruction's longest length
COLD_TYPE = "t"                      # gcc's own .cold parts are local text


class NoRoom(Exception):
    """The read-only segment has no room for the grown arrays."""


def _align(v, a):
    return (v + a - 1) // a * a


class _SectionOut:
    """``write(addr, data)`` into the new section's buffer, else into the rewriter's."""

    def __init__(self, rw, addr, size):
        self.addr, self.buf = addr, np.zeros(size, np.uint8)
        self.rest = PatchedImage(rw)

    def write(self, addr, data):
        data = np.asarray(data, dtype=np.uint8)
        if self.addr <= addr < self.addr + len(self.buf):
            off = addr - self.addr
            if off + len(data) > len(self.buf):
                raise ValueError(f"write at {addr:#x}+{len(data)} runs past {SECTION_NAME}")
            self.buf[off:off + len(data)] = data
        else:
            self.rest.write(addr, data)


def _room(image, first):
    """(program header index, start address, file offset, limit address) of the
    space after the read-only segment holding address ``first``."""
    ph = image.phdrs
    load = [k for k in range(len(ph)) if int(ph["type"][k]) == 1]
    seg = next((k for k in load if int(ph["vaddr"][k]) <= first <
                int(ph["vaddr"][k]) + int(ph["memsz"][k])), None)
    if seg is None:
        raise NoRoom("kallsyms is in no PT_LOAD segment")
    vaddr, memsz = int(ph["vaddr"][seg]), int(ph["memsz"][seg])
    if int(ph["filesz"][seg]) != memsz or ph["flags"][seg] & 2:
        raise NoRoom("the segment holding kallsyms is writable or ends in bss")
    end = vaddr + memsz
    limit = image.symbol_address("__end_rodata_hpage_align")
    nxt = [int(ph["vaddr"][k]) for k in load if int(ph["vaddr"][k]) >= end]
    if nxt:
        limit = min(limit, min(nxt)) if limit is not None else min(nxt)
    if limit is None or limit <= end:
        raise NoRoom("nothing follows the read-only segment to bound the new section")
    start = _align(end, ALIGN)
    offset = int(ph["offset"][seg]) + (start - vaddr)
    # the file bytes there must belong to no section (the gap before .data)
    file_limit = min([s.offset for s in image.sections[1:] if s.type != SHT_NOBITS and
                      s.size and s.offset >= offset] + [image.size])
    return seg, start, offset, min(limit, start + (file_limit - offset))


def _text_tail(rw, image):
    """(section, start address, file offset, limit address, section end) of the
    int3 filler at the end of the kernel text after the layout's last code byte
    (page-aligned: data does not share a page with code), or None. Data goes below
    the limit (_etext); the added section runs to the section's old end."""
    end = image.symbol_address("_etext")
    sec = next((s for s in image.sections if s.is_code and s.is_alloc and s.size and
                s.addr < end <= s.addr + s.size), None) if end is not None else None
    if sec is None or sec.type == SHT_NOBITS:
        return None
    buf = rw.buf(sec)
    used = np.nonzero(buf != 0xCC)[0]
    # the instruction holding the last byte that is not int3 may go on in 0xCC bytes
    # (`jmp .-0x32` is eb cc, an imm8 may be 0xcc): it ends within an instruction's
    # longest length after it (the units' ends are no help: they reach the next unit,
    # padding included)
    last = sec.addr + (int(used[-1]) + MAX_INSN if len(used) else 0)
    _, syms = image.symbol_table()
    # a function that ends in int3 (after its ret) still owns those bytes
    inside = (syms["shndx"] == sec.index) & (syms["size"] > 0)
    if rw.sym_new is not None and inside.any():
        ends = np.asarray(rw.sym_new, np.uint64)[inside] + syms["size"][inside].astype(np.uint64)
        ends = ends[ends <= np.uint64(sec.addr + sec.size)]
        if len(ends):
            last = max(last, int(ends.max()))
    start = _align(last, PAGE)
    # not past _etext: the kernel frees the pages between the end of its text and
    # its read-only data after boot (mark_rodata_ro: the text/rodata gap)
    limit = min(sec.addr + sec.size, end)
    if start >= limit:
        return None
    return sec, start, sec.offset + (start - sec.addr), limit, sec.addr + sec.size


def add_cold_kallsyms(rw, image, log=None):
    """After ``cold_symbols``: rebuild kallsyms with one entry per cold part in a
    new section. Returns (extra allocated section, program header updates) for
    write_image, or None when the image has no kallsyms (the in-place update of
    update_kernel_tables is then all there is)."""
    log = log or (lambda m: None)
    ctx = ImageContext(image, log=log)
    table = Kallsyms()
    if table.locate(ctx) is None:
        return None
    names, syms = image.symbol_table()
    cold = [(names[sf.sym] + ".cold", int(sf.new_start[1]))
            for sf in rw.block_split["splits"] if sf.sizes[1]]
    entries = table.parse(ctx)
    n_old = len(entries)
    old_at = {nm: image.symbol_address(nm) for nm in Kallsyms.GROWING
              if image.symbol_address(nm) is not None}
    sizes_now = table.array_sizes(ctx)
    old_size = {nm: sizes_now[nm] for nm in old_at}
    seg, start, offset, limit = _room(image, old_at["kallsyms_offsets"])
    table.add_symbols(ctx, [c[0] for c in cold], [COLD_TYPE] * len(cold))
    # sizes first (they do not depend on addresses), then __end_rodata's new value
    n_new = n_old + len(cold)
    sizes = {"kallsyms_offsets": 4 * n_new, "kallsyms_names": int(table._record_bounds[-1]),
             "kallsyms_markers": 4 * ((n_new + 255) // 256), "kallsyms_seqs_of_names": 3 * n_new}
    tt = image.symbol_address("kallsyms_token_table")
    ti = image.symbol_address("kallsyms_token_index")
    tokens = (tt, ti - tt + TOKEN_INDEX_BYTES) if tt is not None and ti is not None else None
    at, gap_end = _place(old_at, old_size, sizes, start, tokens)
    tail = None
    if gap_end > limit:
        need, free = gap_end - start, limit - start
        tail = _text_tail(rw, image)
        if tail is not None:
            at, gap_end = _place(old_at, old_size, sizes, tail[1], tokens)
        if tail is None or gap_end > tail[3]:
            raise NoRoom(f"kallsyms with {len(cold)} .cold entries needs {need} bytes "
                         f"after the read-only segment, {free} are free"
                         + (f", or {gap_end - tail[1]} at the end of the text, "
                            f"{tail[3] - tail[1]} are free" if tail is not None else ""))
        _, start, offset, limit, section_end = tail
        log(f"kallsyms: {need} bytes needed after the read-only segment, {free} free: the "
            f"grown arrays go to the end of the text at {start:#x} ({limit - start} free)")
    moved = {nm: a for nm, a in at.items() if a != old_at.get(nm, image.symbol_address(nm))}
    end_rodata = image.symbol_address("__end_rodata")
    if tail is None and gap_end > start and end_rodata is not None and \
            end_rodata < _align(gap_end, PAGE):
        moved["__end_rodata"] = _align(gap_end, PAGE)
    refs = ImageContext.of(image).recovered
    # references recovered from a vmlinuz: which fields follow, decided (or
    # refused) before anything is written
    recovered_moves = _recovered_moves(image, refs, moved) if refs is not None else None
    new = table.update(ctx, entries, rw.amap, extra_addr=[c[1] for c in cold],
                       retarget=moved)      # 6.12/7.3 list the arrays' own symbols too
    # at the end of the text the section runs to the old end of .text, its rest the
    # int3 filler that was there (no bytes of the segment outside a section: objcopy,
    # which makes the boot image's payload, writes such gaps as zeros)
    out = _SectionOut(rw, start, (section_end if tail is not None else gap_end) - start)
    out.buf[gap_end - start:] = 0xCC
    for nm, a in old_at.items():          # the old arrays are dead (parts are reused below)
        out.write(a, np.zeros(old_size[nm], np.uint8))
    if "kallsyms_token_table" in at:      # the token arrays moved: their bytes, unchanged
        token_bytes = np.array(image.read(tokens[0], tokens[1]), np.uint8)
        out.write(tokens[0], np.zeros(tokens[1], np.uint8))
        out.write(at["kallsyms_token_table"], token_bytes[:ti - tt])
        out.write(at["kallsyms_token_index"], token_bytes[ti - tt:])
    table.write(ctx, new, out, at=at)
    in_gap = {nm for nm, a in at.items() if a >= start}
    fields = _move_symbols(rw, image, moved, {nm: len(image.sections) for nm in in_gap},
                           recovered_moves)
    ph = image.phdrs
    size = gap_end - int(ph["vaddr"][seg])
    rw.stats["table.kallsyms"] = n_new
    rw.stats["kallsyms.cold_entries"] = len(cold)
    rw.stats["kallsyms.symbols"] = n_new
    rw.stats["kallsyms.fields_moved"] = fields
    rw.stats["kallsyms.section_bytes"] = gap_end - start
    log(f"kallsyms: {len(cold)} .cold entries added ({n_new} symbols); "
        + ", ".join(f"{nm} at {a:#x}" for nm, a in sorted(at.items(), key=lambda x: x[1]))
        + (f" ({SECTION_NAME}: {gap_end - start} bytes)" if in_gap else "")
        + f"; {fields} code fields follow")
    if not in_gap:
        return None, None
    if tail is not None:
        # .text ends where the new section starts (its bytes up to there are the code)
        sec = tail[0]
        rw.patched[sec.index] = rw.buf(sec)[:start - sec.addr].copy()
        rw.section_moves = {**(rw.section_moves or {}), sec.index: (sec.addr, start - sec.addr)}
        rw.stats["kallsyms.text_tail"] = start
        return (SECTION_NAME, start, offset, out.buf, ALIGN), None
    return ((SECTION_NAME, start, offset, out.buf, ALIGN),
            {seg: {"filesz": size, "memsz": size}})


def _areas(old_at, old_size):
    """Free areas of the old storage: arrays lying back to back (up to ALIGN
    padding) form one area. [[start, end]] in address order."""
    areas = []
    for nm in sorted(old_at, key=old_at.get):
        lo, hi = old_at[nm], old_at[nm] + old_size[nm]
        if areas and lo <= _align(areas[-1][1], ALIGN):
            areas[-1][1] = max(areas[-1][1], hi)
        else:
            areas.append([lo, hi])
    return areas


def _lay(unit, pos, sizes, start=None):
    """{array: address} and the end of ``unit`` laid from ``pos``; an array at
    ``start`` (an area's start: an old array's, aligned as the link aligned it
    for at most a u32 array) stays there, the others are 8-aligned."""
    out = {}
    for nm in unit:
        pos = pos if pos == start else _align(pos, ALIGN)
        out[nm] = pos
        pos += sizes[nm]
    return out, pos


def _search(areas, units, sizes, gap):
    """Assign each unit to an area or to the gap, fewest gap bytes. Units are
    tried largest first, each in the first area it fits, then the next ones,
    then the gap (depth first), so the first complete assignment is first-fit
    decreasing, and another one replaces it only when it leaves strictly less
    for the gap. Returns ({array: address}, end of the gap used)."""
    units = sorted(units, key=lambda u: (-sum(sizes[nm] for nm in u), u[0]))
    best = [None, None]
    pos = [a[0] for a in areas]

    def walk(k, gap_pos, at):
        if best[1] is not None and gap_pos >= best[1]:
            return
        if k == len(units):
            best[0], best[1] = dict(at), gap_pos
            return
        unit = units[k]
        for i, area in enumerate(areas):
            placed, end = _lay(unit, pos[i], sizes, area[0])
            if end <= area[1]:
                was, pos[i] = pos[i], end
                walk(k + 1, gap_pos, {**at, **placed})
                pos[i] = was
        placed, end = _lay(unit, gap_pos, sizes)
        walk(k + 1, end, {**at, **placed})

    walk(0, gap, {})
    return best[0], best[1]


def _place(old_at, old_size, sizes, gap, tokens=None):
    """Addresses for the grown arrays: the old arrays' storage first, the rest
    into the gap from address ``gap`` on. The first assignment keeps
    kallsyms_markers right after kallsyms_names and the token arrays where they
    are (first-fit decreasing: Debian 6.1's layout). Where that leaves bytes in
    the gap, which is the scarce room (the space before ``_sdata``), a finer
    one replaces it when it leaves strictly fewer: markers alone, and the token
    table and index (``tokens``: (address, size); back to back, as the parse
    bounds the table by the index; same bytes: names are encoded with the
    existing tokens) as one unit whose old storage joins the areas around it
    (6.12 and 7.3 emit them between kallsyms_markers and kallsyms_offsets).
    Returns ({array: address}, end of the gap used)."""
    units = [["kallsyms_names", "kallsyms_markers"] if nm == "kallsyms_names" else [nm]
             for nm in old_at if nm != "kallsyms_markers"]
    at, end = _search(_areas(old_at, old_size), units, sizes, gap)
    if end == gap:
        return at, end
    fine = [[nm] for nm in old_at]
    old_at2, old_size2, sizes2 = old_at, old_size, sizes
    if tokens is not None:
        tt, size = tokens
        old_at2 = {**old_at, "kallsyms_token_table": tt}
        old_size2 = {**old_size, "kallsyms_token_table": size}
        sizes2 = {**sizes, "kallsyms_token_table": size - TOKEN_INDEX_BYTES,
                  "kallsyms_token_index": TOKEN_INDEX_BYTES}
        fine.append(["kallsyms_token_table", "kallsyms_token_index"])
    at2, end2 = _search(_areas(old_at2, old_size2), fine, sizes2, gap)
    if end2 < end:
        return at2, end2
    return at, end


def _move_symbols(rw, image, moved, new_shndx, recovered_moves=None):
    """Give each symbol in ``moved`` ({name: new value}) its new value (and the
    section index ``new_shndx`` names for it, if any), and add its move to every
    relocated field in an allocated section that refers to it (and to the
    recovered fields ``recovered_moves``: (reference indices, moves)). Returns
    the number of fields changed."""
    names, syms = image.symbol_table()
    symsec = next(s for s in image.sections if s.type == SHT_SYMTAB)
    first_global, shift = getattr(rw, "sym_index_shift", (len(syms), 0))
    rows = rw.buf(symsec).view(SYM)
    delta_of = {}
    for nm, value in moved.items():
        idx = [i for i, x in enumerate(names) if x == nm and syms["shndx"][i] != 0]
        if len(idx) != 1:
            raise ValueError(f"kallsyms: {len(idx)} symbols named {nm}")
        i = idx[0]
        j = i + shift if i >= first_global else i
        delta = value - int(syms["value"][i])
        if rw.sym_new is not None:
            rw.sym_new[i] = value
        rows["value"][j] = value
        if nm in new_shndx:
            rows["shndx"][j] = new_shndx[nm]
        if delta:
            delta_of[j] = delta
    count = 0
    for s in image.sections:
        if s.type != SHT_RELA or s.link != symsec.index or not s.size:
            continue
        target = image.sections[s.info]
        if not target.flags & SHF_ALLOC:
            continue
        r = rw.buf(s).view(RELA)
        sym = (r["info"] >> np.uint64(32)).astype(np.int64)
        sel = np.nonzero(np.isin(sym, list(delta_of)))[0]
        for k in sel.tolist():
            typ = int(r["info"][k] & np.uint64(0xFFFFFFFF))
            recipe = RECIPES.get(typ)
            if recipe is None or recipe.via_got:
                raise ValueError(f"kallsyms: relocation type {typ} against a moved symbol")
            _add_to_field(rw, image, int(r["offset"][k]), recipe, delta_of[int(sym[k])])
            count += 1
    if recovered_moves is not None:
        refs = ImageContext.of(image).recovered
        sel, delta = recovered_moves
        new_field, _ = rw.amap.map(refs.field[sel])
        for k, addr, d in zip(sel.tolist(), new_field.tolist(), delta.tolist()):
            _add_to_field(rw, image, int(addr), RECIPES[int(refs.rtype[k])], int(d))
        count += len(sel)
    return count


def _recovered_moves(image, refs, moved):
    """References recovered from a vmlinuz (image/references.py) name a symbol
    only where recovery proved one (``refs.drag``: ``PFN_ALIGN(__end_rodata)``,
    ``__pa_symbol(__end_rodata) - 1``); the others name their target. A field
    whose symbol is a moved one, or whose target is a moved symbol's old value,
    gets that symbol's move. Returns (reference indices, moves). NoRoom where
    that is not provable: a symbol that stays shares a moved one's old address
    and some field targets it, or a target in the padding that a moved symbol
    bounds (past .BTF_ids for ``__end_rodata``) was attributed to no symbol."""
    from ...image.references import padding_around, virtual_target
    names, syms = image.symbol_table()
    base = virtual_target(refs)
    named = np.full(len(refs), -1, np.int64)
    if refs.drag:
        idx = np.array(list(refs.drag), np.int64)
        named[idx] = np.array(list(refs.drag.values()), np.int64)
        base[idx] = syms["value"][named[idx]].astype(np.uint64)
    typ = syms["info"] & 0xF
    nameable = (typ != 3) & (typ != 4) & (syms["shndx"] > 0) & (syms["shndx"] < 0xFF00)
    sel, delta = [], []
    for nm, value in moved.items():
        i = next(k for k, x in enumerate(names) if x == nm and syms["shndx"][k] != 0)
        old = int(syms["value"][i])
        if value == old:
            continue
        hit = np.nonzero(base == np.uint64(old))[0]
        at_old = np.nonzero(nameable & (syms["value"] == old))[0]
        staying = [names[k] for k in at_old.tolist() if names[k] not in moved]
        if staying and len(hit) and not (named[hit] == i).all():
            raise NoRoom(f"{nm} would move but {staying[0]} shares its address {old:#x} and "
                         "the references recovered from the vmlinuz do not tell which of "
                         "them a field means")
        gap = padding_around(image, old)
        if gap is not None:
            u = refs.padding_unattributed
            loose = u[(u >= np.uint64(gap[0])) & (u <= np.uint64(gap[1]))]
            if len(loose):
                raise NoRoom(f"{nm} would move, but {len(loose)} field(s) recovered from the "
                             f"vmlinuz point into the padding around it (e.g. "
                             f"{int(loose[0]):#x}) and no symbol is proven for them")
        sel.append(hit)
        delta.append(np.full(len(hit), value - old, np.int64))
    if not sel:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(sel), np.concatenate(delta)


def _add_to_field(rw, image, addr, recipe, delta):
    """Add ``delta`` to the field at ``addr`` (width and sign from its relocation recipe)."""
    size, signed = recipe.width, recipe.signed
    sec = image.section_at(addr)
    buf = rw.buf(sec)
    off = addr - sec.addr
    v = int.from_bytes(bytes(buf[off:off + size]), "little", signed=bool(signed)) + delta
    if size == 8:
        v &= (1 << 64) - 1
    elif not (-(1 << 31) <= v < (1 << 31) if signed else 0 <= v < (1 << 32)):
        raise ValueError(f"kallsyms: field at {addr:#x} overflows after the move")
    buf[off:off + size] = np.frombuffer(
        v.to_bytes(size, "little", signed=bool(signed) and size == 4), np.uint8)
