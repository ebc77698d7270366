"""``verify NEW_VMLINUZ --vmlinux NEW_VMLINUX``: the boot image's payload is the vmlinux.

A vmlinuz (bzImage) carries the stripped vmlinux and the KASLR relocation table,
compressed. ``bzimage --vmlinuz`` writes a new one from relayout's output; this
check reads it back the way the boot does, independently of how it was written:

- ``bootimage.payload``: every PT_LOAD of the payload's ELF has the vmlinux's
  address, sizes, flags and bytes (and the same entry point and build-id);
- ``bootimage.reloc-range``: every table entry is a field the decompressor may
  adjust: inside ``[_text, __bss_start)`` (misc.c stops the boot otherwise),
  sorted and unique per group;
- ``bootimage.reloc-value``: every 64-bit and 32-bit entry's field holds a kernel
  address, virtual (``[_text, _end + 2 MiB]``) or physical (head code and page tables):
  an entry left at a field's old place names bytes of whatever moved there;
- ``bootimage.reloc-missing``: with a vmlinux that keeps relocations (a 6.1 link,
  relayout's output of it), every absolute 64-bit field they name whose value is a
  kernel address is listed (the table was built from the same link);
- ``bootimage.init-size``: the header's init_size covers the kernel's span in memory.
"""

import numpy as np

from ..image import bootimage as bi
from .findings import Sink

PT_LOAD = 1
R_X86_64_64 = 1
SHT_NOBITS, SHT_NOTE = 8, 7
PMD_SIZE = 2 << 20


def is_boot_image(path):
    """True when ``path`` starts with a setup header (a bzImage/vmlinuz)."""
    try:
        with open(path, "rb") as f:
            return bi.is_bzimage(f.read(0x206))
    except OSError:
        return False


def _loads(phdrs):
    return [p for p in phdrs if int(p["type"]) == PT_LOAD]


def _payload_phdrs(elf):
    from ..image.elf import EHDR, PHDR
    eh = np.frombuffer(elf, EHDR, 1)[0]
    off, n = int(eh["phoff"]), int(eh["phnum"])
    return int(eh["entry"]), np.frombuffer(elf, PHDR, n, off)


def check_boot_image(vmlinuz, vmlinux, log=lambda m: None):
    """Sink of findings of ``vmlinuz`` against ``vmlinux``; its ``extra`` holds the
    report's ``boot_image`` facts. BadInput for a file that is no readable boot image."""
    from ..image.elf import ElfImage
    sink = Sink()
    log(f"reading boot image {vmlinuz}")
    img = bi.read_vmlinuz(vmlinuz)
    new = ElfImage(vmlinux)
    elf = img.elf
    entry, pphdrs = _payload_phdrs(elf)
    ploads, nloads = _loads(pphdrs), _loads(new.phdrs)

    # -- the payload is the vmlinux ---------------------------------------------------
    bad = []
    keys = ("vaddr", "paddr", "filesz", "memsz", "flags")
    if len(ploads) != len(nloads):
        bad.append((None, f"payload has {len(ploads)} PT_LOAD segments, the vmlinux "
                          f"{len(nloads)}"))
    for a, b in zip(ploads, nloads):
        va = int(b["vaddr"])
        if any(int(a[k]) != int(b[k]) for k in keys):
            bad.append((va, "segment at {:#x}: payload {} vs vmlinux {}".format(
                va, {k: hex(int(a[k])) for k in keys}, {k: hex(int(b[k])) for k in keys})))
            continue
        pa = np.frombuffer(elf, np.uint8, int(a["filesz"]), int(a["offset"]))
        na = np.frombuffer(new.data, np.uint8, int(b["filesz"]), int(b["offset"]))
        diff = np.flatnonzero(pa != na)
        if len(diff):
            bad.append((va + int(diff[0]), f"segment at {va:#x}: {len(diff):,} bytes differ, "
                                           f"the first at {va + int(diff[0]):#x}"))
    if entry != new.entry:
        bad.append((entry, f"payload entry {entry:#x}, the vmlinux's {new.entry:#x}"))
    if new.build_id and img.build_id != new.build_id:
        bad.append((None, f"payload build-id {img.build_id or '(none)'}, the vmlinux's "
                          f"{new.build_id}"))
    sink.add("bootimage.payload", bad, lambda b: b)

    # -- the relocation table ---------------------------------------------------------
    text, bss, end = (new.symbol_address(n) for n in ("_text", "__bss_start", "_end"))
    if text is None or bss is None or end is None:
        sink.add("bootimage.reloc-range", [None], lambda _: (
            None, "the vmlinux has no _text/__bss_start/_end symbols: the table's bounds "
                  "cannot be checked"))
        text = bss = end = 0
    from ..image.words import read_words             # 0 outside file-backed bytes
    from ..image.relocs import sext32
    kaslr = img.kaslr
    widths = {"abs64": 8, "abs32": 4, "inv32": 4}
    out_of_range, wrong, counts = [], [], {}
    for g in kaslr.layout.groups:
        addrs = np.asarray(getattr(kaslr, g), np.uint64)
        counts[g] = len(addrs)
        if not len(addrs):
            continue
        if text:
            outside = (addrs < np.uint64(text)) | (addrs + np.uint64(widths[g]) > np.uint64(bss))
            out_of_range += [(int(a), f"{g} entry {int(a):#x} is outside _text..__bss_start "
                                      "(the decompressor stops the boot)") for a in addrs[outside]]
        if len(addrs) > 1 and not (np.diff(addrs.astype(np.int64)) > 0).all():
            out_of_range.append((None, f"{g} entries are not sorted and unique"))
        if g == "inv32" or not text:
            continue
        vals, _ = read_words(new, addrs, widths[g])
        if g == "abs32":
            vals = sext32(vals)
        # a kernel address: virtual, or physical (page-table entries and head code
        # hold _text - __START_KERNEL_map forms, with page flags in the low bits);
        # up to a 2 MiB page past _end (head code rounds _end up to one)
        hi = end + PMD_SIZE
        phys_end = np.uint64(hi - bi.START_KERNEL_MAP)
        off = ((vals < np.uint64(text)) | (vals > np.uint64(hi))) & (vals >= phys_end)
        wrong += [(int(a), f"{g} field at {int(a):#x} holds {int(v):#x}, not a kernel address "
                           f"({text:#x}..{end:#x} or its physical form)")
                  for a, v in zip(addrs[off], vals[off])]
    sink.add("bootimage.reloc-range", out_of_range, lambda b: b)
    sink.add("bootimage.reloc-value", wrong, lambda b: b)

    missing = []
    if text and new.has_link_relocations():
        listed = np.asarray(kaslr.abs64, np.uint64)
        for name, rel in new.relocations.items():
            tgt = rel.target
            if not tgt.is_alloc or tgt.name.startswith(".data..percpu"):
                continue
            if tgt.type in (SHT_NOBITS, SHT_NOTE):   # no field bytes; notes are not run
                continue
            sel = rel.type == R_X86_64_64
            if not sel.any():
                continue
            fields = np.asarray(rel.offset[sel], np.uint64)
            vals, _ = read_words(new, fields, 8)
            want = (vals >= np.uint64(text)) & (vals <= np.uint64(end)) & \
                (fields >= np.uint64(text)) & (fields + np.uint64(8) <= np.uint64(bss))
            f = fields[want]
            gone = f[~np.isin(f, listed)]
            missing += [(int(a), f"64-bit field at {int(a):#x} ({name}) holds a kernel "
                                 "address but is not in the table: KASLR would not adjust it")
                        for a in gone]
    sink.add("bootimage.reloc-missing", missing, lambda b: b)

    span = bi.vo_init_size(elf)
    if img.setup.init_size < span:
        sink.add("bootimage.init-size", [None], lambda _: (
            None, f"init_size {img.setup.init_size:,} is less than the kernel's span "
                  f"{span:,} bytes"))
    sink.extra["boot_image"] = {
        "path": str(vmlinuz), "kernel_version": img.setup.kernel_version,
        "compression": img.compression, "payload_bytes": len(img.payload),
        "relocations": counts, "table_layout": kaslr.layout.name,
        "segments_compared": len(nloads)}
    log(f"boot image: {img.compression} payload, {len(nloads)} segments compared, "
        f"relocations {counts}")
    return sink
