"""Write a modified copy of an ELF image: atomic (temp file + rename) and
byte-reproducible (the output depends only on the inputs).

The file keeps the input's layout for everything the loader sees: the ELF and
program headers and every allocated section stay at their offsets (the
relayout never changes an allocated section's size). Non-allocated sections
(symtab, strtab, relocation sections, comments, debug info) are packed after
the allocated content in their original order, then the section header table.
Sections listed in ``drop`` keep their header but lose their contents (size 0):
section indices, and so symbol and relocation links, stay valid.
"""

import os

import numpy as np

from ..io import atomic_output
from .elf import EHDR, SHDR, SHF_ALLOC, SHF_EXECINSTR, SHT_NOBITS


def write_image(image, out_path, patched=None, drop=(), entry=None, extra_sections=(),
                header_updates=None, section_moves=None, alloc_sections=(), phdr_updates=None,
                segment=None):
    """Write image with ``patched`` {section index: bytes-like of the same size}
    (non-allocated sections may change size: they are packed after the rest).

    ``drop``: section indices whose contents are dropped. ``entry``: new e_entry.
    ``extra_sections``: (name, bytes) non-allocated PROGBITS sections appended
    after the existing ones (their names go into .shstrtab). ``header_updates``:
    {section index: {field: value}} for the section headers (e.g. symtab info).
    ``section_moves``: {section index: (new address, new size)} for allocated
    sections that trade bytes among themselves (``.eh_frame_hdr`` growing into
    ``.eh_frame``): the moved sections must stay inside the bytes they held
    together, and a program header that covered exactly one of them follows it.
    ``alloc_sections``: (name, address, file offset, bytes, alignment) read-only
    PROGBITS sections written in file space that no section uses (a gap inside
    the loaded part, e.g. after the read-only segment); their headers come first
    after the existing ones (index len(image.sections) + k). ``phdr_updates``:
    {program header index: {field: value}} (a segment grown to cover them).
    ``segment``: a new loadable segment after the allocated content (userspace
    room, relayout/user/segment.py), a dict: ``offset`` (file), ``data`` (its
    bytes), ``phdrs`` (the whole new program header table, at file offset
    ``phoff``, inside ``data``), ``sections`` {section index: (new address, file
    offset, size)} for sections that now live there (their bytes are in
    ``data``; ``patched`` must not hold them), ``old_places`` [(name, address,
    file offset, bytes)]: executable sections for what stays at their old
    place (headers added like ``alloc_sections``').
    Returns the output size.
    """
    patched = patched or {}
    out_path = os.fspath(out_path)
    drop = set(drop)
    secs = image.sections
    patched = dict(patched)
    moves = dict(section_moves or {})
    if moves:
        lo = min(secs[i].addr for i in moves)
        hi = max(secs[i].addr + secs[i].size for i in moves)
        for i, (a, n) in moves.items():
            if not lo <= a <= a + n <= hi or not secs[i].flags & SHF_ALLOC:
                raise ValueError(f"moved section {secs[i].name} leaves the bytes it shared")
        spans = sorted(moves.values())
        if any(a1 + n1 > a2 for (a1, n1), (a2, _) in zip(spans, spans[1:])):
            raise ValueError("moved sections overlap")
    seg = segment or {}
    seg_secs = seg.get("sections", {})
    if any(i in patched for i in seg_secs):
        raise ValueError("a section moved to the new segment is also patched in place")
    for idx, buf in patched.items():
        # Allocated sections keep their size (the loader's view is fixed);
        # non-allocated ones (debug info) may be re-encoded to another size.
        want = moves[idx][1] if idx in moves else secs[idx].size
        if len(buf) != want and secs[idx].flags & SHF_ALLOC:
            raise ValueError(f"patched section {secs[idx].name} changed size")
    shstrndx = int(image.ehdr["shstrndx"])
    extra_names, alloc_names = [], []
    old_places = [(n, a, o, d, 16) for n, a, o, d in seg.get("old_places", ())]
    if extra_sections or alloc_sections or old_places:
        strtab = bytearray(patched.get(shstrndx, image.section_bytes(secs[shstrndx])))
        for name, *_ in list(alloc_sections) + old_places:
            alloc_names.append(len(strtab))
            strtab += name.encode() + b"\0"
        for name, _ in extra_sections:
            extra_names.append(len(strtab))
            strtab += name.encode() + b"\0"
        patched[shstrndx] = np.frombuffer(bytes(strtab), np.uint8)
    # Everything up to the end of the allocated content is kept in place.
    fixed_end = int(image.ehdr["phoff"]) + len(image.phdrs) * 56
    for ph in image.phdrs:
        fixed_end = max(fixed_end, int(ph["offset"]) + int(ph["filesz"]))
    for s in secs:
        if s.flags & SHF_ALLOC and s.type != SHT_NOBITS:
            fixed_end = max(fixed_end, s.offset + s.size)
    alloc_end = fixed_end
    if seg:
        if seg["offset"] < fixed_end:
            raise ValueError("the new segment overlaps the file's allocated content")
        fixed_end = seg["offset"] + len(seg["data"])
    shdrs = image.shdrs.copy()
    pieces = []        # (offset, bytes-like) written in order after the fixed part
    pos = fixed_end
    movable = [s for s in secs[1:] if not (s.flags & SHF_ALLOC) and s.type != SHT_NOBITS]
    movable.sort(key=lambda s: (s.offset, s.index))
    for s in movable:
        if s.index in drop:
            shdrs[s.index]["offset"] = pos
            shdrs[s.index]["size"] = 0
            continue
        align = max(int(s.addralign), 1)
        pos = (pos + align - 1) // align * align
        data = patched.get(s.index)
        if data is None:
            data = image.section_bytes(s)
        pieces.append((pos, data))
        shdrs[s.index]["offset"] = pos
        shdrs[s.index]["size"] = len(data)
        pos += len(data)
    new_shdrs = []
    for k, ((name, addr, offset, data, align), name_off) in enumerate(
            zip(list(alloc_sections) + old_places, alloc_names)):
        lo, hi = offset, offset + len(data)

        def span(s):
            """A section's file bytes in the output (a moved one's new place)."""
            if s.index not in moves:
                return s.offset, s.offset + s.size
            a, n = moves[s.index]
            return s.offset + a - s.addr, s.offset + a - s.addr + n
        if hi > fixed_end or any(s.type != SHT_NOBITS and s.size and span(s)[0] < hi and
                                 lo < span(s)[1] and s.index not in seg_secs
                                 for s in secs[1:]):
            raise ValueError(f"section {name} at file offset {lo:#x} overlaps another section")
        h = np.zeros(1, SHDR)
        code = k >= len(alloc_sections)
        h["name"], h["type"], h["addr"] = name_off, 1, addr
        h["flags"] = SHF_ALLOC | (SHF_EXECINSTR if code else 0)
        h["offset"], h["size"], h["addralign"] = offset, len(data), align
        new_shdrs.append(h)
    for (name, data), name_off in zip(extra_sections, extra_names):
        pos = (pos + 7) // 8 * 8
        h = np.zeros(1, SHDR)
        h["name"], h["type"], h["offset"], h["size"], h["addralign"] = name_off, 1, pos, len(data), 8
        pieces.append((pos, np.frombuffer(bytes(data), np.uint8)))
        new_shdrs.append(h)
        pos += len(data)
    if new_shdrs:
        shdrs = np.concatenate([shdrs] + new_shdrs)
    phdrs = image.phdrs.copy() if not seg else seg["phdrs"].copy()
    for idx, (a, off, n) in seg_secs.items():
        shdrs[idx]["addr"], shdrs[idx]["offset"], shdrs[idx]["size"] = a, off, n
    for idx, (a, n) in moves.items():
        s = secs[idx]
        shdrs[idx]["addr"] = a
        shdrs[idx]["offset"] = s.offset + a - s.addr
        shdrs[idx]["size"] = n
        for ph in phdrs:
            if int(ph["type"]) != 1 and int(ph["vaddr"]) == s.addr and \
                    int(ph["memsz"]) == s.size:
                ph["vaddr"] = ph["paddr"] = a
                ph["offset"] = s.offset + a - s.addr
                ph["filesz"] = ph["memsz"] = n
    for idx, fields in (header_updates or {}).items():
        for k, v in fields.items():
            shdrs[idx][k] = v
    for s in secs[1:]:
        if s.index in drop and (s.flags & SHF_ALLOC):
            raise ValueError(f"cannot drop allocated section {s.name}")
    shoff = (pos + 7) // 8 * 8
    ehdr = image.data[:EHDR.itemsize].copy().view(EHDR)
    ehdr["shoff"] = shoff
    ehdr["shnum"] = len(shdrs)
    if entry is not None:
        ehdr["entry"] = entry
    if seg:
        ehdr["phoff"], ehdr["phnum"] = seg["phoff"], len(phdrs)
    for idx, fields in (phdr_updates or {}).items():
        for k, v in fields.items():
            phdrs[idx][k] = v
    with atomic_output(out_path, mode=os.stat(image.path).st_mode & 0o777) as f:
        head = image.data[:alloc_end]
        f.write(memoryview(head))
        # (up to a new segment's offset: a hole, not written; sparse where the file
        # system allows, e.g. the size of a large .bss)
        f.seek(0)
        f.write(ehdr.tobytes())
        if seg:
            f.seek(seg["offset"])
            f.write(memoryview(np.asarray(seg["data"], dtype=np.uint8)))
            f.seek(seg["phoff"])
            f.write(phdrs.tobytes())
        elif moves or phdr_updates:
            f.seek(int(image.ehdr["phoff"]))
            f.write(phdrs.tobytes())
        for _, _, offset, data, _ in list(alloc_sections) + old_places:
            f.seek(offset)
            f.write(memoryview(np.asarray(data, dtype=np.uint8)))
        for idx, buf in patched.items():
            s = secs[idx]
            if s.flags & SHF_ALLOC:
                f.seek(s.offset + (moves[idx][0] - s.addr if idx in moves else 0))
                f.write(memoryview(np.asarray(buf, dtype=np.uint8)))
        f.seek(fixed_end)
        cur = fixed_end
        for off, data in pieces:
            if off > cur:
                f.write(b"\0" * (off - cur))
            f.write(memoryview(np.asarray(data, dtype=np.uint8)))
            cur = off + len(data)
        if shoff > cur:
            f.write(b"\0" * (shoff - cur))
        f.write(shdrs.tobytes())
        size = f.tell()
    return size


__all__ = ["write_image", "SHDR"]
