"""The x86 boot image (bzImage, a distribution's ``vmlinuz``), as linepack reads and rewrites it.

One reader of the kernel's setup header for the whole project (QEMU's kernel check,
KASLR's link address, ``bzimage --vmlinuz``, the reference recovery).

Layout (Documentation/arch/x86/boot.rst; arch/x86/boot/header.S, compressed/mkpiggy.c)::

    [0, (setup_sects+1)*512)        real-mode setup code; the setup header at 0x1f1
    protected-mode part             the decompressor (its own code and data), with the
                                    compressed payload at payload_offset (relative to the
                                    protected-mode start), payload_length bytes
    [syssize*16 ..)                 optionally an Authenticode signature (signed images)

The payload is the compressor's stream followed by the 4-byte little-endian size of
the decompressed data (the kernel build's ``size_append``, for every compressor).
Decompressed, it is the stripped ELF vmlinux (``objcopy -R .comment -S``) followed
by the KASLR relocation table (``arch/x86/tools/relocs --abs-relocs``-style output
of ``relocs``), read by ``handle_relocations()`` in arch/x86/boot/compressed/misc.c
backwards from the end of the decompressed data: u32 entries, each the low 32 bits
of the virtual address of an absolute field (the kernel sign-extends them), groups
ended by a 0 entry.

Which groups exist is decided by the kernel version (``RELOC_LAYOUTS``): x86-64
kernels whose per-CPU area is zero-based (before 6.15) have an "inverse 32-bit"
group of fields holding ``per_cpu_offset - address`` style values that are
*subtracted* the KASLR delta; later kernels do not.
"""

import bz2
import lzma
import os
import re
import struct
import zlib
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from ..errors import BadInput
from .relocs import sext32

# --- setup header -----------------------------------------------------------------

SETUP_HEADER_START = 0x1f1
# name -> (offset, struct format); boot protocol 2.12+ fields (all x86-64 kernels
# linepack handles have 2.13 or later).
SETUP_FIELDS = {
    "setup_sects": (0x1f1, "B"),
    "root_flags": (0x1f2, "H"),
    "syssize": (0x1f4, "I"),
    "vid_mode": (0x1fa, "H"),
    "boot_flag": (0x1fe, "H"),
    "jump": (0x200, "H"),
    "header": (0x202, "I"),
    "version": (0x206, "H"),
    "kernel_version_ptr": (0x20e, "H"),
    "loadflags": (0x211, "B"),
    "code32_start": (0x214, "I"),
    "initrd_addr_max": (0x22c, "I"),
    "kernel_alignment": (0x230, "I"),
    "relocatable_kernel": (0x234, "B"),
    "min_alignment": (0x235, "B"),
    "xloadflags": (0x236, "H"),
    "cmdline_size": (0x238, "I"),
    "payload_offset": (0x248, "I"),
    "payload_length": (0x24c, "I"),
    "pref_address": (0x258, "Q"),
    "init_size": (0x260, "I"),
    "handover_offset": (0x264, "I"),
    "kernel_info_offset": (0x268, "I"),
}
SETUP_HEADER_END = 0x26c
HDRS_MAGIC = struct.unpack("<I", b"HdrS")[0]
MIN_PROTOCOL = 0x20a          # payload_offset/length (2.08), pref_address/init_size (2.10)
START_KERNEL_MAP = 0xffffffff80000000


@dataclass(frozen=True)
class SetupHeader:
    """The boot protocol's setup header fields (``SETUP_FIELDS``) and the kernel
    version string the header points at."""

    setup_sects: int
    root_flags: int
    syssize: int
    vid_mode: int
    boot_flag: int
    jump: int
    header: int
    version: int
    kernel_version_ptr: int
    loadflags: int
    code32_start: int
    initrd_addr_max: int
    kernel_alignment: int
    relocatable_kernel: int
    min_alignment: int
    xloadflags: int
    cmdline_size: int
    payload_offset: int
    payload_length: int
    pref_address: int
    init_size: int
    handover_offset: int
    kernel_info_offset: int
    kernel_version: str = ""

    @property
    def protected_mode_offset(self):
        """File offset of the protected-mode part (the decompressor)."""
        return ((self.setup_sects or 4) + 1) * 512

    @property
    def payload_file_offset(self):
        return self.protected_mode_offset + self.payload_offset

    @property
    def link_text(self):
        """Virtual address ``_text`` was linked at: pref_address is LOAD_PHYSICAL_ADDR,
        mapped at ``__START_KERNEL_map + LOAD_PHYSICAL_ADDR`` on x86-64."""
        return START_KERNEL_MAP + self.pref_address

    @property
    def protocol(self):
        return f"{self.version >> 8}.{self.version & 0xff}"

    def pack_into(self, buf):
        """Write every field back into ``buf`` (a bytearray of the image)."""
        for name, (off, fmt) in SETUP_FIELDS.items():
            struct.pack_into("<" + fmt, buf, off, getattr(self, name))


def is_bzimage(head):
    """True when ``head`` (the first >= 0x206 bytes of a file) has the setup header magic."""
    return len(head) >= 0x206 and head[0x202:0x206] == b"HdrS"


def parse_setup_header(data, path="image"):
    """SetupHeader of a boot image's bytes (at least the setup code); BadInput otherwise."""
    if len(data) < 0x206 or not is_bzimage(data):
        raise BadInput(f"{path}: not a bzImage (no 'HdrS' setup header)")
    if len(data) < SETUP_HEADER_END:
        raise BadInput(f"{path}: truncated boot image ({len(data)} bytes, setup header "
                       f"needs {SETUP_HEADER_END})")
    vals = {name: struct.unpack_from("<" + fmt, data, off)[0]
            for name, (off, fmt) in SETUP_FIELDS.items()}
    if vals["version"] < MIN_PROTOCOL:
        v = vals["version"]
        raise BadInput(f"{path}: boot protocol {v >> 8}.{v & 0xff} has no payload_offset/"
                       "pref_address (needs 2.10 or later)")
    kv = ""
    ptr = vals["kernel_version_ptr"]
    if ptr:
        start = ptr + 0x200
        end = data.find(b"\0", start, start + 512)
        if end > start:
            kv = data[start:end].decode("ascii", "replace")
    return SetupHeader(**vals, kernel_version=kv)


def read_setup_header(path):
    """SetupHeader of the boot image at ``path`` (reads only its setup code)."""
    try:
        with open(path, "rb") as f:
            head = f.read(0x1000)
            if is_bzimage(head) and len(head) > SETUP_HEADER_START:
                need = ((head[SETUP_HEADER_START] or 4) + 1) * 512
                if need > len(head):
                    head += f.read(need - len(head))
    except IsADirectoryError:
        raise BadInput(f"{path}: is a directory, not a boot image") from None
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}") from None
    return parse_setup_header(head, path)


# --- compressors --------------------------------------------------------------------

LEGACY_LZ4_MAGIC = 0x184c2102
LEGACY_LZ4_BLOCK = 8 << 20     # lz4 -l: 8 MiB uncompressed per block

# (name, magic) as the kernel's decompress_method() tells them apart (lib/decompress.c)
_MAGICS = [
    ("gzip", b"\x1f\x8b"),
    ("bzip2", b"BZh"),
    ("lzma", b"\x5d\x00\x00"),
    ("xz", b"\xfd7zXZ\x00"),
    ("lzo", b"\x89LZO"),
    ("lz4", struct.pack("<I", LEGACY_LZ4_MAGIC)),
    ("zstd", b"\x28\xb5\x2f\xfd"),
]
SUPPORTED_COMPRESSORS = ("gzip", "bzip2", "lzma", "xz", "lz4", "zstd")


def detect_compression(payload, path="image"):
    for name, magic in _MAGICS:
        if payload.startswith(magic):
            if name not in SUPPORTED_COMPRESSORS:
                raise BadInput(f"{path}: payload compressed with {name}, which linepack does "
                               f"not read (it reads {', '.join(SUPPORTED_COMPRESSORS)})")
            return name
    raise BadInput(f"{path}: unknown payload compressor (magic {payload[:4].hex()}; "
                   f"linepack reads {', '.join(SUPPORTED_COMPRESSORS)})")


def _lz4_legacy_decompress(stream, size, path):
    import lz4.block
    out = []
    got = 0
    pos = 4
    while pos + 4 <= len(stream) and got < size:
        n = struct.unpack_from("<I", stream, pos)[0]
        pos += 4
        if n == LEGACY_LZ4_MAGIC:       # concatenated streams (unlz4 accepts them)
            continue
        if pos + n > len(stream):
            raise BadInput(f"{path}: lz4 payload truncated (block of {n} bytes at {pos})")
        block = lz4.block.decompress(bytes(stream[pos:pos + n]),
                                     uncompressed_size=LEGACY_LZ4_BLOCK)
        out.append(block)
        got += len(block)
        pos += n
    return b"".join(out), pos


def _lz4_legacy_compress(data, level=9):
    import lz4.block
    parts = [struct.pack("<I", LEGACY_LZ4_MAGIC)]
    for i in range(0, len(data), LEGACY_LZ4_BLOCK):
        block = lz4.block.compress(data[i:i + LEGACY_LZ4_BLOCK], mode="high_compression",
                                   compression=level, store_size=False)
        parts += [struct.pack("<I", len(block)), block]
    return b"".join(parts)


def decompress_payload(payload, compression, path="image"):
    """The decompressed payload. ``payload`` ends with the 4-byte decompressed size
    the kernel build appends; it is checked against what the stream gives."""
    if len(payload) < 8:
        raise BadInput(f"{path}: payload of {len(payload)} bytes is too short")
    size = struct.unpack_from("<I", payload, len(payload) - 4)[0]
    stream = memoryview(payload)[:-4]
    try:
        if compression == "zstd":
            import zstandard
            out = zstandard.ZstdDecompressor().decompress(bytes(stream), max_output_size=size)
        elif compression == "lz4":
            out, _ = _lz4_legacy_decompress(stream, size, path)
        elif compression == "gzip":
            out = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(stream)
        elif compression == "xz":
            out = lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(bytes(stream))
        elif compression == "lzma":
            out = lzma.LZMADecompressor(lzma.FORMAT_ALONE).decompress(bytes(stream))
        elif compression == "bzip2":
            out = bz2.BZ2Decompressor().decompress(bytes(stream))
        else:
            raise BadInput(f"{path}: cannot decompress {compression}")
    except BadInput:
        raise
    except Exception as e:   # each library has its own error types; all mean a bad stream
        raise BadInput(f"{path}: {compression} payload does not decompress "
                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else '?'}); "
                       "truncated or damaged file") from None
    if len(out) != size:
        raise BadInput(f"{path}: {compression} payload gives {len(out):,} bytes, its size "
                       f"trailer says {size:,} (truncated or damaged file)")
    return out


# Settings tried in turn when a payload must fit the room the decompressor has: the
# kernel build's own first (Debian's payloads come out byte for byte), then smaller.
EFFORTS = {"zstd": ("cli", "ldm", "search", "target"), "lz4": (9, 12)}


def compress_payload(data, compression, effort=None):
    """Compressed stream + the 4-byte size trailer, as the kernel build writes it
    (scripts/Makefile.lib: each compressor at the level the kernel uses).
    ``effort``: one of EFFORTS[compression] (default: the build's own)."""
    if compression == "zstd" and effort == "ldm":
        import zstandard
        params = zstandard.ZstdCompressionParameters.from_level(
            22, window_log=27, enable_ldm=True, threads=1, write_checksum=True)
        c = zstandard.ZstdCompressor(compression_params=params).compressobj()
        z = c.compress(data) + c.flush()
    elif compression == "zstd" and effort == "search":
        # level 22 searching deeper (search log 16 instead of 9): the same window, so any
        # decompressor of the build reads it; ~300 bytes smaller on 7.3's 62 MB payload,
        # where a pack rewrite came out 248 bytes over the room
        import zstandard
        params = zstandard.ZstdCompressionParameters.from_level(
            22, window_log=27, search_log=16, threads=1, write_checksum=True)
        c = zstandard.ZstdCompressor(compression_params=params).compressobj()
        z = c.compress(data) + c.flush()
    elif compression == "zstd" and effort == "target":
        # level 22 with the longest match target (131072 instead of 999): a compressor
        # setting only, same window, any decompressor of the build reads it; ~350 bytes
        # smaller than the CLI's on 6.12's 57 MB payload (a pack rewrite there came out
        # 37 bytes over the room)
        import zstandard
        params = zstandard.ZstdCompressionParameters.from_level(
            22, window_log=27, target_length=131072, threads=1, write_checksum=True)
        c = zstandard.ZstdCompressor(compression_params=params).compressobj()
        z = c.compress(data) + c.flush()
    elif compression == "zstd":
        # as the zstd CLI compresses the build's pipe (`zstd -22 --ultra`): size
        # unknown (so window log 27, no content size), one worker, a checksum;
        # Debian's 6.12/7.3 payloads come out byte for byte
        import zstandard
        c = zstandard.ZstdCompressor(level=22, threads=1, write_checksum=True).compressobj()
        z = c.compress(data) + c.flush()
    elif compression == "lz4":
        z = _lz4_legacy_compress(data, effort or 9)
    elif compression == "gzip":
        c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        z = c.compress(data) + c.flush()
    elif compression == "xz":
        z = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32,
                          filters=[{"id": lzma.FILTER_X86},
                                   {"id": lzma.FILTER_LZMA2, "preset": 9,
                                    "dict_size": 32 << 20}])
    elif compression == "lzma":
        z = lzma.compress(data, format=lzma.FORMAT_ALONE, preset=9)
    elif compression == "bzip2":
        z = bz2.compress(data, 9)
    else:
        raise BadInput(f"cannot compress with {compression}")
    return z + struct.pack("<I", len(data))


# --- the payload: stripped ELF + relocation table -------------------------------------

@dataclass(frozen=True)
class RelocLayout:
    """Groups of the relocation table, in the order handle_relocations() reads them
    (backwards from the end)."""

    name: str
    groups: tuple


LAYOUT_3 = RelocLayout("32-bit, inverse 32-bit, 64-bit", ("abs32", "inv32", "abs64"))
LAYOUT_2 = RelocLayout("32-bit, 64-bit", ("abs32", "abs64"))

# (first version, first version after, layout). misc.c: the inverse group is read
# only while x86-64 per-CPU symbols are zero-based; 6.15 made them ordinary
# (relative) addresses and dropped the group from relocs.c and misc.c.
RELOC_LAYOUTS = [
    ((3, 14), (6, 15), LAYOUT_3),
    ((6, 15), (7, 4), LAYOUT_2),
]


def kernel_series(kernel_version):
    """(major, minor) of a kernel version string such as '6.12.57+deb13-cloud-amd64 (...)'."""
    m = re.match(r"(\d+)\.(\d+)", kernel_version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def reloc_layout(kernel_version, path="image"):
    """The RelocLayout of a kernel version; BadInput for a version linepack does not know."""
    series = kernel_series(kernel_version)
    if series is None:
        raise BadInput(f"{path}: no kernel version in the setup header: cannot tell the "
                       "relocation table's layout")
    for first, after, layout in RELOC_LAYOUTS:
        if first <= series < after:
            return layout
    known = ", ".join(f"{a[0]}.{a[1]}..{b[0]}.{b[1] - 1}" if b[1] else f"{a[0]}.{a[1]}.."
                      for a, b, _ in RELOC_LAYOUTS)
    raise BadInput(f"{path}: kernel {series[0]}.{series[1]}: relocation table layout not "
                   f"known to linepack (known: {known})")


@dataclass
class KaslrRelocs:
    """The KASLR relocation table: virtual addresses (uint64, sign-extended from the
    table's 32 bits as misc.c does) of the fields KASLR adjusts, per group, in table
    order. ``inv32`` is empty for layouts without that group."""

    abs32: np.ndarray
    abs64: np.ndarray
    inv32: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    layout: RelocLayout = LAYOUT_3

    def counts(self):
        return {g: len(getattr(self, g)) for g in self.layout.groups}

    def to_bytes(self):
        """The table as relocs.c writes it: stop, 64-bit, [stop, inverse 32-bit,]
        stop, 32-bit (each entry the low 32 bits of the address)."""
        parts = []
        for g in reversed(self.layout.groups):
            parts.append(np.zeros(1, "<u4"))
            parts.append((np.asarray(getattr(self, g), np.uint64) & 0xffffffff).astype("<u4"))
        return np.concatenate(parts).tobytes()


def parse_relocs(table, layout, path="image"):
    """KaslrRelocs of the raw table bytes (the part of the payload after the ELF)."""
    if len(table) % 4:
        raise BadInput(f"{path}: relocation table of {len(table)} bytes is not whole u32 entries")
    words = np.frombuffer(table, "<u4")
    zeros = np.flatnonzero(words == 0)
    ngroups = len(layout.groups)
    if len(zeros) != ngroups or (len(words) and words[0] != 0):
        raise BadInput(f"{path}: relocation table does not have the {ngroups} groups of a "
                       f"{layout.name} layout ({len(zeros)} stop entries, "
                       f"{len(words):,} entries); not relocatable, or another format")
    groups = {}
    # written front to back in the reverse of the reading order
    bounds = list(zeros) + [len(words)]
    for i, g in enumerate(reversed(layout.groups)):
        groups[g] = sext32(words[bounds[i] + 1:bounds[i + 1]])
    return KaslrRelocs(abs32=groups["abs32"], abs64=groups["abs64"],
                       inv32=groups.get("inv32", np.zeros(0, np.uint64)), layout=layout)


ELF_HDR = struct.Struct("<16sHHIQQQIHHHHHH")
NT_GNU_BUILD_ID = 3
SHT_NOTE = 7


def elf_extent(data, path="image"):
    """Size of the ELF file at the start of ``data``: the furthest of its program
    headers, section headers and section contents."""
    if len(data) < ELF_HDR.size or data[:4] != b"\x7fELF" or data[4] != 2:
        raise BadInput(f"{path}: decompressed payload is not an ELF64 vmlinux")
    (_, _, machine, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum,
     _) = ELF_HDR.unpack_from(data, 0)
    if machine != 62:
        raise BadInput(f"{path}: payload ELF is not x86-64 (e_machine {machine})")
    end = max(ELF_HDR.size, phoff + phnum * phentsize, shoff + shnum * shentsize)
    if end > len(data):
        raise BadInput(f"{path}: payload ELF headers run past the payload (truncated)")
    for i in range(shnum):
        _, stype, _, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        if stype != 8:                       # SHT_NOBITS has no file bytes
            end = max(end, off + size)
    for i in range(phnum):
        _, _, off, _, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        end = max(end, off + filesz)
    if end > len(data):
        raise BadInput(f"{path}: payload ELF sections run past the payload (truncated)")
    return end


def elf_build_id(elf):
    """GNU build-id (hex) of ELF bytes, from its SHT_NOTE sections; None without one."""
    (_, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, _) = ELF_HDR.unpack_from(elf, 0)
    for i in range(shnum):
        _, stype, _, _, off, size = struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize)
        if stype != SHT_NOTE:
            continue
        pos, end = off, off + size
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            dpos = pos + 12 + ((namesz + 3) & ~3)
            if ntype == NT_GNU_BUILD_ID and elf[pos + 12:pos + 12 + namesz].rstrip(b"\0") == b"GNU":
                return bytes(elf[dpos:dpos + descsz]).hex()
            pos = dpos + ((descsz + 3) & ~3)
    return None


# --- the boot image -----------------------------------------------------------------

@dataclass
class BootImage:
    """A read x86 boot image. ``data``: the whole file; ``payload``: the decompressed
    payload; ``elf``: its stripped vmlinux part (bytes); ``kaslr``: the table."""

    path: str
    data: bytes
    setup: SetupHeader
    compression: str
    payload: bytes
    elf_size: int
    kaslr: KaslrRelocs
    build_id: str

    @cached_property
    def elf(self):
        """The stripped ELF vmlinux (bytes, made once)."""
        return self.payload[:self.elf_size]

    @property
    def compressed(self):
        """The compressed payload as stored (stream + size trailer)."""
        o = self.setup.payload_file_offset
        return self.data[o:o + self.setup.payload_length]

    @property
    def signature_size(self):
        """Bytes after the protected-mode part the header declares (an appended
        Authenticode signature on signed images)."""
        return max(0, len(self.data) - self.setup.protected_mode_offset - self.setup.syssize * 16)


def read_vmlinuz(path):
    """BootImage of the bzImage/vmlinuz at ``path``; BadInput (one line) when it is
    not one, is truncated, uses a compressor or table layout linepack does not know."""
    path = str(path)
    setup = read_setup_header(path)
    with open(path, "rb") as f:
        data = f.read()
    return parse_vmlinuz(data, path, setup)


def parse_vmlinuz(data, path="image", setup=None):
    setup = setup or parse_setup_header(data, path)
    start = setup.payload_file_offset
    end = start + setup.payload_length
    if setup.payload_length == 0:
        raise BadInput(f"{path}: setup header declares no payload")
    if end > len(data):
        raise BadInput(f"{path}: truncated: payload ends at {end:,}, file has {len(data):,} bytes")
    compressed = data[start:end]
    compression = detect_compression(compressed, path)
    layout = reloc_layout(setup.kernel_version, path)
    payload = decompress_payload(compressed, compression, path)
    elf_size = elf_extent(payload, path)
    kaslr = parse_relocs(payload[elf_size:], layout, path)
    return BootImage(path=path, data=data, setup=setup, compression=compression,
                     payload=payload, elf_size=elf_size, kaslr=kaslr,
                     build_id=elf_build_id(payload) or "")



# --- writing a new payload into the same setup code and decompressor -----------------

def build_payload(elf, kaslr):
    """Decompressed payload bytes: the stripped ELF then the relocation table."""
    return bytes(elf) + kaslr.to_bytes()


def _extract_offset_pages(output_len, input_len):
    """header.S's ZO_z_min_extract_offset up to its constant part (which cancels in
    the differences this is used for): the decompressor's room before its copy."""
    extract = output_len + (output_len >> 8) - input_len if output_len > input_len else \
        (output_len >> 8)
    return extract


def vo_init_size(elf):
    """VO__end - VO__text of an ELF vmlinux: the span of its PT_LOAD segments in memory
    (the last one runs through .bss and .brk to _end)."""
    (_, _, _, _, _, phoff, _, _, _, phentsize, phnum, _, _, _) = ELF_HDR.unpack_from(elf, 0)
    lo, hi = None, 0
    for i in range(phnum):
        ptype, _, _, vaddr, _, _, memsz = struct.unpack_from("<IIQQQQQ", elf, phoff + i * phentsize)
        if ptype == 1 and memsz:
            # the percpu segment (vaddr 0 on zero-based per-CPU kernels) is not part of the span
            if vaddr < START_KERNEL_MAP:
                continue
            lo = vaddr if lo is None else min(lo, vaddr)
            hi = max(hi, vaddr + memsz)
    return 0 if lo is None else hi - lo


def _alloc_sections(elf):
    """{name: (addr, size)} of the allocated sections of ELF bytes."""
    (_, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, shstrndx) = ELF_HDR.unpack_from(elf, 0)
    rows = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab = rows[shstrndx][4] if shstrndx < len(rows) else 0
    out = {}
    for name, _, flags, addr, _, size in rows:
        if flags & 2:
            end = elf.find(b"\0", strtab + name)
            out[bytes(elf[strtab + name:end]).decode("ascii", "replace")] = (addr, size)
    return out


def _ends_in_added(was, now, added):
    """A section that kept its start and gave the end of its bytes to sections the
    rewrite added (relayout/kernel/kallsyms_cold.py: kallsyms at the end of the
    kernel text): its bounds, and the symbols at them, are where they were."""
    if now is None or now[0] != was[0] or now[1] >= was[1]:
        return False
    pos, end = was[0] + now[1], was[0] + was[1]
    # the added sections must fill the given-up tail end to end, no gap
    for start, size in sorted(a for a in added if was[0] <= a[0] and a[0] + a[1] <= end):
        if start != pos:
            return False
        pos = start + size
    return pos == end


def check_same_bounds(old_elf, new_elf, path="output"):
    """BadInput unless every allocated section of ``old_elf`` is in ``new_elf`` at the
    same address with the same size, and the memory span is the same: the
    decompressor has _text, __start_rodata, _sinittext, __bss_start and _end compiled
    in (misc.c: the table's bounds, kernel_total_size, ...)."""
    old, new = _alloc_sections(old_elf), _alloc_sections(new_elf)
    added = [v for n, v in new.items() if n not in old]
    changed = [n for n, v in old.items() if new.get(n) != v and not _ends_in_added(v, new.get(n),
                                                                                   added)]
    if changed:
        n = changed[0]
        raise BadInput(f"{path}: section {n} is {'missing' if n not in new else 'moved or resized'} "
                       f"({len(changed)} sections): the distribution's decompressor has the "
                       "kernel's section bounds compiled in, so the layout must keep them")
    vo_old, vo_new = vo_init_size(old_elf), vo_init_size(new_elf)
    if vo_new != vo_old:
        raise BadInput(f"{path}: the new vmlinux spans {vo_new:,} bytes in memory, the "
                       f"original {vo_old:,}: the decompressor's bounds (_text, _end) are "
                       "compiled in, so the layout must keep them")


def _clear_pe_certificate(buf):
    """Zero the PE certificate-table directory entry (the signature is dropped: it
    would not match the new payload)."""
    if buf[:2] != b"MZ" or len(buf) < 0x40:
        return
    pe = struct.unpack_from("<I", buf, 0x3c)[0]
    if pe + 24 > len(buf) or buf[pe:pe + 4] != b"PE\0\0":
        return
    opt = pe + 24
    magic = struct.unpack_from("<H", buf, opt)[0]
    dirs, count_at = (opt + 112, opt + 108) if magic == 0x20b else (opt + 96, opt + 92)
    if struct.unpack_from("<I", buf, count_at)[0] > 4:
        struct.pack_into("<II", buf, dirs + 4 * 8, 0, 0)


def _image_crc(buf):
    """tools/build.c's CRC-32 of everything before the last 4 bytes (no final xor)."""
    return zlib.crc32(bytes(buf[:-4])) ^ 0xffffffff


def _workers():
    """How many compressions run at once: the CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _smallest_fitting(payload, compression, room, grow_room=0, likely_fits=False):
    """The compressed payload: the first of EFFORTS[compression] (in order) whose
    stream fits ``room``, else the smallest of them (the first of equal ones); with
    ``grow_room`` the first effort's. The efforts run on as many threads as there are
    CPUs (the compressors release the GIL: zstd -22 takes ~16 s per effort on a 60 MB
    payload, and a rewritten 6.12/7.3 payload fits none of them); the result is the one
    the efforts would give one after another. ``likely_fits`` (the image's own payload,
    which the build's setting gives back): the first effort alone first, the others
    only if it does not fit (no CPU spent on them when it does)."""
    efforts = EFFORTS.get(compression, (None,))
    if grow_room:
        efforts = efforts[:1]
    if likely_fits and len(efforts) > 1:
        z = compress_payload(payload, compression, efforts[0])
        if len(z) <= room:
            return z
        rest = _smallest_fitting_of(payload, compression, room, efforts[1:])
        return rest if len(rest) < len(z) else z
    return _smallest_fitting_of(payload, compression, room, efforts)


def _smallest_fitting_of(payload, compression, room, efforts):
    workers = min(len(efforts), _workers())
    best = None
    if workers <= 1:
        for effort in efforts:
            z = compress_payload(payload, compression, effort)
            if best is None or len(z) < len(best):
                best = z
            if len(z) <= room:
                break
        return best
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="linepack-compress")
    try:
        futures = [pool.submit(compress_payload, payload, compression, e) for e in efforts]
        for f in futures:
            z = f.result()
            if best is None or len(z) < len(best):
                best = z
            if len(z) <= room:
                break
    finally:
        # efforts not started are dropped; running ones are waited for (a thread cannot
        # be stopped): each started before the fitting one was done, so the wait is
        # within what the efforts take one after another
        pool.shutdown(wait=True, cancel_futures=True)
    return best


def replace_payload(image, payload, path="output", grow_room=0, log=None):
    """Bytes of a new boot image: ``image``'s setup code and decompressor with
    ``payload`` (decompressed: ELF + relocation table) compressed in its place.

    The decompressor's code follows the payload. When the compressed payload fits
    the room the old one had (with the compressor settings of EFFORTS), the
    decompressor is kept byte for byte. When it does not (or ``grow_room`` > 0
    asks for at least that many more bytes), everything after the payload moves up
    by a multiple of 4096 and every value crossing the payload's end is rewritten
    (image/zoroom.py; BadInput when one cannot be explained). Either way
    ``input_len`` and ``output_len`` (two u32 in its .rodata, found by their old
    values), the header's ``payload_length`` and ``init_size`` are updated, the
    CRC that tools/build.c appends is recomputed when the old one was valid, and a
    signature is dropped. Only valid for a payload whose kernel keeps its allocated
    sections where they were (``check_same_bounds``; relayout never changes section
    addresses or sizes).
    """
    from . import zoroom
    log = log or (lambda m: None)
    old = image.setup
    elf_new = payload[:elf_extent(payload, path)]
    check_same_bounds(image.elf, elf_new, path)
    room = old.payload_length
    compressed = _smallest_fitting(payload, image.compression, room, grow_room,
                                   likely_fits=payload == image.payload)
    delta = zoroom.room_delta(max(len(compressed), room + grow_room), room)
    pm = old.protected_mode_offset
    if delta:
        log(f"payload: {len(compressed):,} bytes compressed, room {room:,}: moving the "
            f"decompressor up by {delta:,} bytes")
        grown, lay = zoroom.grow(image, delta)
        buf = bytearray(grown)
        rodata_from = pm + lay.boundary + delta
        old_init_exact = old.init_size == max(
            lay.end + zoroom.min_extract_offset(len(image.payload), room),
            vo_init_size(image.elf))
    else:
        buf = bytearray(image.data[:pm + old.syssize * 16])
        rodata_from = pm
    crc_valid = _image_crc(image.data[:pm + old.syssize * 16]) == \
        struct.unpack_from("<I", image.data, pm + old.syssize * 16 - 4)[0]
    start = old.payload_file_offset
    new_room = room + delta
    buf[start:start + new_room] = compressed + bytes(new_room - len(compressed))
    old_out = len(image.payload)
    pair = struct.pack("<II", room, old_out)
    hits = []
    pos = buf.find(pair, rodata_from)
    while pos >= 0:
        if not start <= pos < start + new_room:
            hits.append(pos)
        pos = buf.find(pair, pos + 1)
    if len(hits) != 1:
        raise BadInput(f"{image.path}: cannot find the decompressor's input_len/output_len "
                       f"({room}, {old_out}): {len(hits)} candidates")
    struct.pack_into("<II", buf, hits[0], len(compressed), len(payload))
    vo_new = vo_init_size(elf_new)
    if delta and old_init_exact:
        # header.S's INIT_SIZE from the moved _end
        init_size = max(lay.end + delta + zoroom.min_extract_offset(len(payload), len(compressed)),
                        vo_new)
    else:
        page = lambda n: (n + 4095) & ~4095
        zo_grow = page(_extract_offset_pages(len(payload), len(compressed)) + (1 << 17)) - \
            page(_extract_offset_pages(old_out, room) + (1 << 17))
        init_size = max(old.init_size + delta + max(zo_grow, 0), vo_new)
    new = replace(parse_setup_header(buf, path), payload_length=len(compressed),
                  init_size=init_size)
    new.pack_into(buf)
    _clear_pe_certificate(buf)
    if crc_valid and delta:
        struct.pack_into("<I", buf, len(buf) - 4, _image_crc(buf))
    return bytes(buf)


def write_vmlinuz(image, payload, out, grow_room=0, log=None):
    """Write the boot image of ``replace_payload`` to ``out`` atomically; returns its
    BootImage (re-read from the bytes written, so the caller sees what boots)."""
    from ..io import atomic_output
    data = replace_payload(image, payload, str(out), grow_room=grow_room, log=log)
    reread = parse_vmlinuz(data, str(out))
    if reread.payload != payload:
        raise BadInput(f"{out}: the written image does not give back its payload")
    with atomic_output(out) as f:
        f.write(data)
    return reread


__all__ = ["SetupHeader", "BootImage", "KaslrRelocs", "RelocLayout", "read_vmlinuz",
           "parse_vmlinuz", "read_setup_header", "parse_setup_header", "is_bzimage",
           "decompress_payload", "compress_payload", "detect_compression", "reloc_layout",
           "parse_relocs", "elf_extent", "elf_build_id", "RELOC_LAYOUTS", "LAYOUT_2", "LAYOUT_3",
           "SUPPORTED_COMPRESSORS", "START_KERNEL_MAP", "build_payload", "replace_payload",
           "write_vmlinuz"]
