"""``bzimage VMLINUX --vmlinuz VMLINUZ``: the distribution's own boot image with a new payload.

No kernel source and no build: the vmlinuz's setup code and decompressor are kept
byte for byte (``image/bootimage.replace_payload``), or, when the new payload does
not fit the old one's room, the decompressor is moved up by whole pages with every
reference across the payload's end rewritten (``image/zoroom.py``); the payload is VMLINUX stripped
as the kernel build strips it for ``arch/x86/boot/compressed/vmlinux.bin``
(``objcopy -R .comment -S``) followed by the KASLR relocation table of VMLINUX.

The table: each field address of the distribution's table mapped through the
layout (a field inside moved code moves with it). Without a layout map the
payload must be the distribution's own (the identity case); with one
(``relayout --layout-map``, plus the ``.linepack.blockmap`` a block-level output
carries) every field is mapped.
"""

import bisect
import os
import struct
import subprocess
import tempfile

import numpy as np

from ..errors import BadInput, ExternalToolError
from ..image import bootimage

# Sections the build's objcopy keeps that linepack's outputs add and the boot does not need.
_NOT_IN_PAYLOAD = (".comment", ".linepack.blockmap")


def strip_like_kbuild(vmlinux):
    """The bytes of ``vmlinux`` as arch/x86/boot/compressed/Makefile makes vmlinux.bin
    from it: ``objcopy -R .comment -S`` (no symbols, no debug info)."""
    fd, tmp = tempfile.mkstemp(prefix="linepack-vmlinux-bin-")
    os.close(fd)
    try:
        cmd = ["objcopy"]
        for s in _NOT_IN_PAYLOAD:
            cmd += ["-R", s]
        cmd += ["-S", os.fspath(vmlinux), tmp]
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except FileNotFoundError:
            raise ExternalToolError("objcopy is not installed (binutils)") from None
        if p.returncode:
            last = (p.stderr.strip().splitlines() or ["?"])[-1]
            raise ExternalToolError(f"objcopy -S {vmlinux} failed: {last}")
        with open(tmp, "rb") as f:
            return f.read()
    finally:
        os.unlink(tmp)


def _section_ends(elf):
    """Sorted (start, end) of the allocated sections of ELF bytes."""
    (_, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, _) = bootimage.ELF_HDR.unpack_from(elf, 0)
    out = []
    for i in range(shnum):
        _, _, flags, addr, _, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        if flags & 2 and size:
            out.append((addr, addr + size))
    return sorted(out)


def layout_address_map(layout_map, original_elf, new_vmlinux=None):
    """AddressMap of a function-level layout from relayout's ``--layout-map`` TSV
    (function, old, new, size). Code between two functions (assembly without a sized
    symbol, prefix padding) moves with the function before it, as relayout moves it:
    each piece runs to the next listed function or its section's end. A block map in
    ``new_vmlinux`` (``.linepack.blockmap``) replaces the pieces of split functions."""
    from ..image.addrmap import AddressMap
    rows = set()
    try:
        with open(layout_map) as f:
            for n, line in enumerate(f, 1):
                if line.startswith("#") or not line.strip():
                    continue
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 4:
                    raise BadInput(f"{layout_map}:{n}: not a layout map line (function, old, "
                                   "new, size separated by tabs)")
                rows.add((int(parts[1], 16), int(parts[2], 16), int(parts[3], 0)))
    except OSError as e:
        raise BadInput(f"{layout_map}: cannot read: {e.strerror}") from None
    except ValueError:
        raise BadInput(f"{layout_map}: not a layout map (bad number)") from None
    rows = sorted(rows)
    secs = _section_ends(original_elf)
    sec_lo = [a for a, _ in secs]
    starts = [r[0] for r in rows]
    old, end, new = [], [], []
    for k, (o, n, size) in enumerate(rows):
        if not size or (old and o < end[-1]):
            continue            # aliases of one function
        # the next listed function: the first row (after this one, rows are sorted) at or
        # past this one's end
        j = bisect.bisect_left(starts, o + size)
        nxt = starts[j] if j < len(starts) else o + size
        i = bisect.bisect_right(sec_lo, o) - 1
        sec_end = secs[i][1] if i >= 0 and o < secs[i][1] else o + size
        old.append(o), end.append(max(o + size, min(nxt, sec_end))), new.append(n)
    amap = AddressMap(old, end, new)
    if new_vmlinux is not None:
        from ..image import blockmap
        from ..image.elf import ElfImage
        img = ElfImage(new_vmlinux)
        try:
            brows = blockmap.read_blockmap(img)
        finally:
            img.close()
        if brows is not None and len(brows):
            amap = blockmap.address_map(brows, base=amap)
    return amap


def relocs_for_layout(kaslr, amap):
    """The KaslrRelocs of the rewritten image: every field address mapped through
    ``amap`` (anything with AddressMap's ``map(addrs) -> (new, ok)``), each group
    sorted as relocs.c sorts it. BadInput when a field falls where the layout maps
    nothing (dropped padding)."""
    out = {}
    for g in kaslr.layout.groups:
        addrs = np.asarray(getattr(kaslr, g), np.uint64)
        new, ok = amap.map(addrs)
        if not np.all(ok):
            bad = addrs[~np.asarray(ok, bool)]
            raise BadInput(f"{len(bad)} {g} relocation fields of the table fall where the "
                           f"layout maps nothing (first {int(bad[0]):#x})")
        out[g] = np.sort(np.asarray(new, np.uint64) & np.uint64(0xffffffff)).astype(np.int32) \
            .astype(np.int64).view(np.uint64)
    return bootimage.KaslrRelocs(abs32=out["abs32"], abs64=out["abs64"],
                                 inv32=out.get("inv32", np.zeros(0, np.uint64)),
                                 layout=kaslr.layout)


def make_from_vmlinuz(vmlinux, vmlinuz, out, layout_map=None, log=None, relocs_out=None,
                      grow_room=0):
    """Write ``out``: the distribution's boot image ``vmlinuz`` with ``vmlinux`` (a
    rewrite of the vmlinux of the same build) as its payload; returns a summary dict.
    When the new payload does not fit the old one's room (or ``grow_room`` asks for
    more), the decompressor moves up to make room (image/zoroom.py)."""
    log = log or (lambda m: None)
    image = bootimage.read_vmlinuz(vmlinuz)
    from ..image.elf import ElfImage
    if layout_map is not None and not os.path.isfile(layout_map):
        raise BadInput(f"--layout-map {layout_map}: no such file")
    img = ElfImage(vmlinux)
    try:
        build_id = img.build_id
    finally:
        img.close()
    if build_id != image.build_id:
        raise BadInput(f"{vmlinux}: build-id {(build_id or 'none')[:16]}... is not the build-id "
                       f"of {vmlinuz}'s payload ({image.build_id[:16]}...): another build")
    log(f"{vmlinuz}: {image.setup.kernel_version.split()[0]}, {image.compression}, "
        f"table {image.kaslr.counts()}")
    elf = strip_like_kbuild(vmlinux)
    if layout_map is None:
        if elf != image.elf:
            raise BadInput(f"{vmlinux} differs from {vmlinuz}'s payload: give the layout map "
                           "of the relayout (--layout-map) so the relocation table can follow it")
        kaslr = image.kaslr
        how = "identity"
    else:
        amap = layout_address_map(layout_map, image.elf, vmlinux)
        kaslr = relocs_for_layout(image.kaslr, amap)
        moved = sum(int(np.count_nonzero(getattr(kaslr, g) != np.sort(getattr(image.kaslr, g))))
                    for g in kaslr.layout.groups)
        how = f"{moved:,} fields moved"
    log(f"payload: stripped ELF {len(elf):,} bytes + table ({how}); compressing ({image.compression})")
    new = bootimage.write_vmlinuz(image, bootimage.build_payload(elf, kaslr), out,
                                  grow_room=grow_room, log=log)
    if relocs_out:
        from ..io import atomic_output
        with atomic_output(relocs_out) as f:
            f.write(kaslr.to_bytes())
    return {"vmlinuz": os.fspath(out), "release": image.setup.kernel_version.split()[0],
            "compression": image.compression, "size": len(new.data),
            "payload": len(new.payload), "compressed": new.setup.payload_length,
            "room": image.setup.payload_length, "relocs": new.kaslr.counts(), "table": how,
            "moved": new.setup.syssize * 16 - image.setup.syssize * 16}
