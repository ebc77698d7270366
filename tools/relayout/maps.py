"""relayout's maps: ``--layout-map`` (old -> new address per function) and
``--system-map`` (the new image's System.map, as the kernel's build writes it)."""

import numpy as np

from ..io import write_atomic


def write_layout_map(path, plan, functions, moved=None):
    """TSV: name, old address, new address, size — one line per function.
    ``moved``: {function index: new address} where a function does not keep its
    offset in its unit (after a prefix trimmed by the blocks strategy)."""
    u = plan.units
    moved = moved or {}
    lines = ["# linepack layout map: function\told\tnew\tsize\n"]
    for ui in range(len(u)):
        for fi, off in u.members[ui]:
            old = int(functions.start[fi])
            new = moved.get(fi)
            if new is None:
                new = int(plan.new_start[ui]) + old - int(u.start[ui])
            lines.append(f"{functions.name[fi]}\t{old:#x}\t{new:#x}\t{int(functions.size[fi])}\n")
    write_atomic(path, "".join(lines))


# scripts/mksysmap (Debian 6.1): nm -n output without these lines.
_SYSMAP_DROP_TYPES = set("aNUw")
_SYSMAP_DROP_PREFIXES = ("$a", "$d", "$t", ".L", "__crc_", "__kstrtab_", "__kstrtabns_")
def _nm_section_letter(sec):
    """The letter ``nm`` gives a symbol of ELF section ``sec`` (lower case), from
    the section flags as BFD sees them (a writable .rodata is data: 'd')."""
    flags, typ = int(sec.flags), int(sec.type)
    if flags & 0x4:                                   # SHF_EXECINSTR -> SEC_CODE
        return "t"
    alloc, nobits = bool(flags & 0x2), typ == 8
    if alloc and not nobits:                          # SEC_DATA
        return "d" if flags & 0x1 else "r"
    if nobits:                                        # no contents
        return "b"
    if sec.name.startswith((".debug", ".zdebug", ".gnu.linkonce.wi.", ".line", ".stab")):
        return "N"
    if not flags & 0x1:
        return "n"
    return "?"


def system_map_lines(image, values):
    """System.map text of ``image`` with symbol ``values``: what
    ``nm -n vmlinux | scripts/mksysmap's filter`` prints (address, type, name;
    sorted by address, then by name)."""
    names, syms = image.symbol_table()
    info = syms["info"].tolist()
    shndx = syms["shndx"].tolist()
    vals = np.asarray(values, dtype=np.uint64).tolist()
    secs = image.sections
    letters = {}
    rows = []
    for i, n in enumerate(names):
        if i == 0 or not n:
            continue
        t, bind, sx = info[i] & 0xF, info[i] >> 4, shndx[i]
        if t in (3, 4):                                # SECTION, FILE: nm hides them
            continue
        if sx == 0:
            c = ("v" if t == 1 else "w") if bind == 2 else "U"
        elif bind == 2:
            c = "V" if t == 1 else "W"
        elif bind == 10:                               # STB_GNU_UNIQUE
            c = "u"
        else:
            if sx == 0xFFF1:
                c = "a"
            elif sx == 0xFFF2:
                c = "C"
            elif sx >= 0xFF00:
                c = "?"
            else:
                c = letters.get(sx)
                if c is None:
                    c = letters[sx] = _nm_section_letter(secs[sx])
            if t == 10:                                # STT_GNU_IFUNC
                c = "i"
            elif bind == 1:
                c = c.upper()
        if c in _SYSMAP_DROP_TYPES or n.startswith(_SYSMAP_DROP_PREFIXES) or n == "L0":
            continue
        rows.append((vals[i], n.encode("latin-1", "replace"), c, n))
    rows.sort(key=lambda r: (r[0], r[1]))
    return "".join(f"{v:016x} {c} {n}\n" for v, _, c, n in rows)


def write_system_map(path, image, rw):
    """System.map of the new image, in the format and order of the kernel's own
    (block-level layouts: with the ``name.cold`` parts, type 't')."""
    text = system_map_lines(image, rw.sym_new)
    split = getattr(rw, "block_split", None)
    if split and split.get("cold_syms"):
        names, _ = image.symbol_table()
        rows = [line for line in text.splitlines(True)]
        rows += [f"{int(addr):016x} t {names[sf.sym]}.cold\n" for sf, addr, _ in split["cold_syms"]]
        rows.sort(key=lambda r: (r[:16], r[19:].encode("latin-1", "replace")))
        text = "".join(rows)
    write_atomic(path, text)
