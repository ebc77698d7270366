"""Room without relinking: a userspace executable's moved code in a new segment.

A plainly linked executable has no room to grow: ``.text`` is followed by
``.fini`` and ``.rodata``. When a layout does not fit in place, the laid-out
code goes to a new loadable segment after everything the loader maps (as
BOLT does): the ``.text`` section header moves there (same index, so symbols,
``.rela.text`` and the DWARF keep naming it), and the old place becomes
``.linepack.orig.text``, which keeps the pinned code (functions a PC-relative
data field nobody explains may designate) and int3 where the moved code was.
A block-level layout's grown ``.eh_frame`` and ``.eh_frame_hdr`` go there too
(``PT_GNU_EH_FRAME`` follows), their old bytes stay where they were.

The program header table gets one more ``PT_LOAD``, so it moves into the new
segment too (``PT_PHDR`` follows). The segment keeps the first segment's
offset-to-address difference (its file offset is its address minus the load
base), so that a kernel that computes ``AT_PHDR`` as load base + ``e_phoff``
(before Linux 5.18) finds the table as well as newer ones; only a ``.bss`` of
more than BIG_GAP makes it follow the file's content instead.
"""

import numpy as np

from ...image.elf import PHDR, SYM

PT_LOAD, PT_PHDR, PT_GNU_EH_FRAME = 1, 6, 0x6474E550
PF_X, PF_R = 1, 4
ORIG_TEXT = ".linepack.orig.text"
BIG_GAP = 1 << 20


def _up(x, a):
    return (x + a - 1) // a * a


class NewSegment:
    """Where the new segment goes and what it holds; ``finish`` builds it."""

    def __init__(self, image):
        loads = [p for p in image.phdrs if int(p["type"]) == PT_LOAD]
        if not loads:
            raise ValueError("no loadable segment")
        self.image = image
        self.align = max([int(p["align"]) for p in loads] + [4096])
        base = int(loads[0]["vaddr"]) - int(loads[0]["offset"])
        mem_end = max(int(p["vaddr"]) + int(p["memsz"]) for p in loads)
        file_end = int(image.ehdr["phoff"]) + len(image.phdrs) * PHDR.itemsize
        for p in image.phdrs:
            file_end = max(file_end, int(p["offset"]) + int(p["filesz"]))
        for s in image.sections:
            if s.is_alloc and s.type != 8:
                file_end = max(file_end, s.offset + s.size)
        self.offset = max(_up(file_end, self.align), _up(mem_end, self.align) - base)
        self.vaddr = self.offset + base
        if self.offset - _up(file_end, self.align) > BIG_GAP:
            # a large .bss: right after the file's content instead (not a file that
            # is mostly a hole); AT_PHDR then needs Linux 5.18 or later
            self.offset = _up(file_end, self.align)
            self.vaddr = _up(mem_end, self.align)
        text = image.section(".text")
        self.text = text
        # the code keeps its offsets within a page (alignments up to 4 KiB hold)
        self.text_base = self.vaddr + text.addr % 4096
        self.eh = {}                # section index: new bytes (a grown .eh_frame / _hdr)

    @property
    def relocate(self):
        """{section index: new start} for the planner."""
        return {self.text.index: self.text_base}

    def text_size(self, plan):
        """Bytes the moved code takes from ``text_base`` on."""
        inside = plan.new_start >= np.uint64(self.text_base)
        if not inside.any():
            return 16
        return _up(int(plan.new_end[inside].max()) - self.text_base, 16)

    def place_eh(self, text_size):
        """Where grown unwind sections start: after the moved code."""
        return _up(self.text_base + text_size, 8)

    def finish(self, rw, first_new_index):
        """write_image's ``segment`` argument; moves the symbols left at the old
        place to ``.linepack.orig.text`` (section ``first_new_index``)."""
        image, text = self.image, self.text
        code = rw.patched.pop(text.index)
        orig = rw.orig.pop(text.index)
        chunks, at = [], self.vaddr
        sections = {}

        def put(addr, data):
            nonlocal at
            if addr > at:
                chunks.append(np.zeros(addr - at, np.uint8))
            chunks.append(np.asarray(data, np.uint8))
            at = addr + len(data)
            return self.offset + addr - self.vaddr

        sections[text.index] = (self.text_base, put(self.text_base, code), len(code))
        eh_hdr_at = None
        for idx, (addr, data) in sorted(self.eh.items(), key=lambda kv: kv[1][0]):
            rw.patched.pop(idx, None)     # fields the reference pass fixed at the old place
            sections[idx] = (addr, put(addr, data), len(data))
            if image.sections[idx].name == ".eh_frame_hdr":
                eh_hdr_at = (addr, len(data))
        # the new PT_LOAD right after the last one (loadable segments in address order)
        last_load = max(i for i, p in enumerate(image.phdrs) if int(p["type"]) == PT_LOAD)
        table = np.insert(np.array(image.phdrs), last_load + 1, np.zeros(1, PHDR))
        ph_at = _up(at, 8)
        ph_off = put(ph_at, np.zeros(len(table) * PHDR.itemsize, np.uint8))
        seg = table[last_load + 1:last_load + 2]
        seg["type"], seg["flags"], seg["align"] = PT_LOAD, PF_R | PF_X, self.align
        seg["offset"], seg["vaddr"], seg["paddr"] = self.offset, self.vaddr, self.vaddr
        seg["filesz"] = seg["memsz"] = at - self.vaddr
        for p in table:
            if int(p["type"]) == PT_PHDR:
                p["offset"], p["vaddr"], p["paddr"] = ph_off, ph_at, ph_at
                p["filesz"] = p["memsz"] = len(table) * PHDR.itemsize
            elif int(p["type"]) == PT_GNU_EH_FRAME and eh_hdr_at is not None:
                a, n = eh_hdr_at
                p["offset"], p["vaddr"], p["paddr"] = self.offset + a - self.vaddr, a, a
                p["filesz"] = p["memsz"] = n
        self._symbols_left_behind(rw, first_new_index)
        data = np.concatenate(chunks)
        self.summary = {"address": f"{self.vaddr:#x}", "size": int(len(data)),
                        "text_bytes": int(len(code)),
                        "eh_bytes": int(sum(len(d) for _, d in self.eh.values()))}
        return {"offset": self.offset, "data": data, "phdrs": table, "phoff": ph_off,
                "sections": sections,
                "old_places": [(ORIG_TEXT, text.addr, text.offset, orig)]}

    def _symbols_left_behind(self, rw, orig_index):
        """Symbols of the code that stayed (pinned) name the old place's section."""
        text = self.text
        for sec in self.image.sections:
            if sec.type not in (2, 11):           # SHT_SYMTAB, SHT_DYNSYM
                continue
            if sec.index in rw.patched:
                rows = np.asarray(rw.patched[sec.index]).view(SYM)
            else:
                rows = np.array(self.image.section_bytes(sec)).view(SYM).copy()
            stay = (rows["shndx"] == text.index) & (rows["value"] >= text.addr) & \
                (rows["value"] < text.end) & ((rows["info"] & 0xF) != 3)
            if stay.any():
                rows["shndx"][stay] = orig_index
                rw.patched[sec.index] = rows.view(np.uint8)
