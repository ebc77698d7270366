"""The x86 boot image reader/writer (tools/image/bootimage.py) on Debian's real
vmlinuz files of 6.1 (LZ4, three table groups), 6.12 (Debian 13, zstd, three
groups) and 7.3 (trixie-backports, zstd, two groups), fetched with
`linepack fetch --series S --vmlinuz`; the -dbg vmlinux of the same build where a
test needs it (`linepack fetch --series S`).

Truth: the payload ELF is the -dbg vmlinux stripped as the kernel build strips it
(same bytes), the table lies in allocated sections of the vmlinux, and on 6.1
(which keeps its link relocations) the table is what arch/x86/tools/relocs makes
of them. Round trip: a written image gives back its payload.
"""

import os
import struct

import numpy as np
import pytest

from helpers import run_linepack
from linepack import targets
from linepack.errors import LinepackError
from linepack.image import bootimage as B

SERIES = ["6.1", "6.12", "7.3"]
GROUPS = {"6.1": ("abs32", "inv32", "abs64"), "6.12": ("abs32", "inv32", "abs64"),
          "7.3": ("abs32", "abs64")}


def _fetch(what, series):
    try:
        if what == "vmlinuz":
            return targets.debian_vmlinuz(series=series)
        return targets.debian_vmlinux(series=series)
    except LinepackError as e:
        pytest.skip(f"Debian {series} {what} unavailable: {e}")


@pytest.fixture(scope="module", params=SERIES)
def series(request):
    return request.param


@pytest.fixture(scope="module")
def boot(series):
    return B.read_vmlinuz(_fetch("vmlinuz", series))


# -- compressors (no kernel needed) -------------------------------------------------------

@pytest.mark.parametrize("compression", B.SUPPORTED_COMPRESSORS)
def test_compressors_round_trip(compression):
    data = bytes(range(256)) * 3000 + os.urandom(5000) + b"\0" * (9 << 20)   # > one lz4 block
    z = B.compress_payload(data, compression)
    assert B.detect_compression(z) == compression
    assert struct.unpack("<I", z[-4:])[0] == len(data)
    assert B.decompress_payload(z, compression) == data
    with pytest.raises(LinepackError, match="truncated|does not decompress"):
        B.decompress_payload(z[:len(z) // 2] + z[-4:], compression)


@pytest.mark.parametrize("effort", B.EFFORTS["zstd"])
def test_zstd_efforts_keep_the_builds_window(effort):
    """Every setting tried to fit the room writes a stream the build's decompressor
    reads: window at most 2**27 (the kernel's zstd default limit), same trailer."""
    import zstandard
    data = bytes(range(256)) * 3000 + os.urandom(5000) + b"\0" * (1 << 20)
    z = B.compress_payload(data, "zstd", effort)
    assert B.decompress_payload(z, "zstd") == data
    assert zstandard.get_frame_parameters(z[:-4]).window_size <= 1 << 27
    assert zstandard.ZstdDecompressor(max_window_size=1 << 27).decompressobj().decompress(z[:-4]) == data


@pytest.mark.parametrize("likely_fits", [False, True])
@pytest.mark.parametrize("workers", [1, 2, 4])
def test_efforts_chosen_as_one_after_another(monkeypatch, workers, likely_fits):
    """replace_payload's compressor settings run on several threads: the stream chosen
    is the one trying them in EFFORTS' order gives (the first that fits the room, else
    the smallest, the first of equal ones; with grow_room the first), whichever
    finishes first. Here the later efforts finish first."""
    import time
    sizes = {"cli": 10, "ldm": 8, "search": 8, "target": 9}
    delay = {"cli": 0.3, "ldm": 0.2, "search": 0.1, "target": 0.0}
    calls = []

    def fake(data, compression, effort=None):
        assert compression == "zstd" and data == b"payload"
        calls.append(effort)
        time.sleep(delay[effort])
        return effort.encode().ljust(sizes[effort], b".")
    monkeypatch.setattr(B, "compress_payload", fake)
    monkeypatch.setattr(B, "_workers", lambda: workers)
    for room, grow, want in ((5, 0, "ldm"), (8, 0, "ldm"), (9, 0, "ldm"), (10, 0, "cli"),
                             (100, 0, "cli"), (5, 1, "cli")):
        calls.clear()
        got = B._smallest_fitting(b"payload", "zstd", room, grow, likely_fits)
        assert got == want.encode().ljust(sizes[want], b"."), (room, grow, got)
        if grow or (likely_fits and want == "cli"):
            assert calls == ["cli"]        # nothing else compressed when the first fits
    monkeypatch.setattr(B, "EFFORTS", {"zstd": ("target", "search", "ldm", "cli")})
    assert B._smallest_fitting(b"payload", "zstd", 5, 0, likely_fits).startswith(b"search")
    assert B._smallest_fitting(b"payload", "zstd", 9, 0, likely_fits).startswith(b"target")
    sizes["cli"] = 8                       # a tie with the first effort: the first
    monkeypatch.setattr(B, "EFFORTS", {"zstd": ("ldm", "search", "cli")})
    assert B._smallest_fitting(b"payload", "zstd", 5, 0, likely_fits).startswith(b"ldm")


def test_reloc_layout_by_version():
    assert B.reloc_layout("6.1.0-56-cloud-amd64 (x)") is B.LAYOUT_3
    assert B.reloc_layout("6.12.118+deb13-cloud-amd64") is B.LAYOUT_3
    assert B.reloc_layout("6.16.12+deb13-cloud-amd64") is B.LAYOUT_2
    assert B.reloc_layout("7.3.4+deb13-cloud-amd64") is B.LAYOUT_2
    for unknown in ("9.1.0", "2.6.32", ""):
        with pytest.raises(LinepackError, match="not known|no kernel version"):
            B.reloc_layout(unknown)


# -- the real vmlinuz files ---------------------------------------------------------------

@pytest.mark.realkernel
def test_vmlinuz_reads(boot, series):
    s = boot.setup
    assert s.kernel_version.startswith(series + ".")
    assert boot.compression == ("lz4" if series == "6.1" else "zstd")
    assert s.link_text == B.START_KERNEL_MAP + s.pref_address
    assert s.payload_file_offset + s.payload_length <= len(boot.data)
    assert boot.kaslr.layout.groups == GROUPS[series]
    counts = boot.kaslr.counts()
    assert all(n > 1000 for n in counts.values()), counts
    # each group as relocs.c sorts it; every field a kernel-text-mapping address
    for g in GROUPS[series]:
        a = getattr(boot.kaslr, g)
        assert a.dtype == np.uint64 and (np.diff(a.astype(np.int64)) > 0).all()
        assert (a >= np.uint64(s.link_text)).all()
    assert len(boot.payload) == boot.elf_size + 4 * (sum(counts.values()) + len(counts))
    assert boot.kaslr.to_bytes() == boot.payload[boot.elf_size:]
    print(f"{series}: {boot.compression}, table {counts}, build-id {boot.build_id}")


@pytest.mark.realkernel
def test_round_trip(boot, tmp_path):
    """Write the same payload back, re-read: same ELF, same table. Compressed as the
    kernel build compresses (zstd -22 --ultra from a pipe, lz4 -l -9), the payload
    comes out byte for byte, so the image is the distribution's own, less the
    signature of a signed one (dropped, its PE directory entry cleared)."""
    out = tmp_path / "vmlinuz"
    B.write_vmlinuz(boot, B.build_payload(boot.elf, boot.kaslr), out)
    re_read = B.read_vmlinuz(out)
    assert re_read.elf == boot.elf and re_read.build_id == boot.build_id
    for g in boot.kaslr.layout.groups:
        assert np.array_equal(getattr(re_read.kaslr, g), getattr(boot.kaslr, g))
    new = out.read_bytes()
    assert len(new) == len(boot.data) - boot.signature_size
    diff = np.flatnonzero(np.frombuffer(new, np.uint8) !=
                          np.frombuffer(boot.data[:len(new)], np.uint8))
    if boot.signature_size:
        pe = struct.unpack_from("<I", boot.data, 0x3c)[0]
        cert = pe + 24 + 112 + 4 * 8          # PE32+ data directory 4
        assert set(diff.tolist()) <= set(range(cert, cert + 8)), diff
        assert struct.unpack_from("<II", new, cert) == (0, 0)
    else:
        assert len(diff) == 0, diff[:10]


@pytest.mark.realkernel
@pytest.mark.parametrize("damage", ["truncated", "not-bzimage", "lzo", "unknown", "version"])
def test_bad_vmlinuz_cli(damage, tmp_path):
    """One line, exit 2, nothing written (the vmlinuz is read before the vmlinux)."""
    src = _fetch("vmlinuz", "6.12")
    data = bytearray(open(src, "rb").read())
    hdr = B.parse_setup_header(bytes(data))
    if damage == "truncated":
        data = data[:hdr.payload_file_offset + hdr.payload_length // 2]
    elif damage == "not-bzimage":
        data[0x202:0x206] = b"XXXX"
    elif damage in ("lzo", "unknown"):
        o = hdr.payload_file_offset
        data[o:o + 4] = b"\x89LZO" if damage == "lzo" else b"abcd"
    else:
        o = hdr.kernel_version_ptr + 0x200
        data[o:o + 4] = b"9.99"
    bad = tmp_path / "vmlinuz"
    bad.write_bytes(bytes(data))
    out = tmp_path / "new"
    r = run_linepack("bzimage", "/nonexistent-vmlinux", "--vmlinuz", bad, "-o", out)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    want = {"truncated": "truncated", "not-bzimage": "not a bzImage", "lzo": "lzo",
            "unknown": "unknown payload compressor", "version": "not known"}[damage]
    assert want in lines[0], lines[0]
    assert not out.exists()


# -- against the -dbg vmlinux (heavy: run under the shared lock) ---------------------------

@pytest.fixture(scope="module")
def vmlinux(series):
    return _fetch("vmlinux", series)


@pytest.mark.realkernel
def test_payload_is_the_dbg_vmlinux_stripped(boot, vmlinux):
    """Same build-id as the -dbg vmlinux, and the very bytes `objcopy -R .comment -S`
    makes of it (arch/x86/boot/compressed/Makefile's vmlinux.bin)."""
    from linepack.image.elf import ElfImage
    from linepack.ship.vmlinuz import strip_like_kbuild
    img = ElfImage(vmlinux)
    assert boot.build_id and img.build_id == boot.build_id
    assert img.symbol_address("_text") == boot.setup.link_text
    img.close()
    assert strip_like_kbuild(vmlinux) == boot.elf


@pytest.mark.realkernel
def test_table_fields_in_allocated_sections(boot, vmlinux):
    """Every field lies in an allocated section of the vmlinux; on kernels with a
    zero-based per-CPU area, fields in .data..percpu appear at its load address."""
    from linepack.image.elf import ElfImage
    img = ElfImage(vmlinux)
    spans = [(s.addr, s.addr + s.size) for s in img.sections
             if s.is_alloc and s.size and s.addr >= B.START_KERNEL_MAP]
    percpu = img.section(".data..percpu")
    if percpu is not None and percpu.addr == 0:       # zero-based: where it is loaded
        load = img.symbol_address("__per_cpu_load")
        spans.append((load, load + percpu.size))
    lo = np.array([a for a, _ in spans], np.uint64)
    hi = np.array([b for _, b in spans], np.uint64)
    order = np.argsort(lo)
    lo, hi = lo[order], hi[order]
    for g in boot.kaslr.layout.groups:
        a = getattr(boot.kaslr, g)
        i = np.searchsorted(lo, a, side="right") - 1
        inside = (i >= 0) & (a < hi[np.maximum(i, 0)])
        assert inside.all(), (g, [hex(int(x)) for x in a[~inside][:5]])
    img.close()


def link_relocation_fields(img):
    """{kind: sorted uint64 field addresses} of an ElfImage's link relocations in
    allocated sections, as arch/x86/tools/relocs takes them: "abs64" the R_X86_64_64
    fields, less those against a zero-based per-CPU symbol (an offset, not an
    address), less .notes; a field inside a zero-based
    .data..percpu at its load address __per_cpu_load. "abs32" the R_X86_64_32/32S
    fields, "pcrel" the PC32/PLT32 ones."""
    from linepack.image.relocs import (R_X86_64_32, R_X86_64_32S, R_X86_64_64, R_X86_64_PC32,
                                    R_X86_64_PLT32)
    kinds = {R_X86_64_64: "abs64", R_X86_64_32: "abs32", R_X86_64_32S: "abs32",
             R_X86_64_PC32: "pcrel", R_X86_64_PLT32: "pcrel"}
    percpu = img.section(".data..percpu")
    zero_based = percpu is not None and percpu.addr == 0
    per_cpu_load = img.symbol_address("__per_cpu_load") if zero_based else 0
    # relocs.c's is_percpu_sym(): in the per-CPU section, but not these names
    skip_sym = np.zeros(len(img.symtab), bool)
    if zero_based:
        names, syms = img.symbol_table()
        skip_sym = syms["shndx"] == percpu.index
        for i in np.flatnonzero(skip_sym):
            n = names[i]
            if n == "__init_begin" or n.startswith(("__per_cpu_load", "init_per_cpu__")):
                skip_sym[i] = False
    out = {"abs64": [], "abs32": [], "pcrel": []}
    for name, rel in img.relocations.items():
        if not rel.target.is_alloc:
            continue
        t = rel.type
        for ty, kind in kinds.items():
            sel = t == ty
            if kind == "abs64":
                if name == ".notes":
                    continue
                sel &= ~skip_sym[rel.sym]
            f = rel.offset[sel].astype(np.uint64)
            if zero_based and name == ".data..percpu":
                f = f + np.uint64(per_cpu_load)
            out[kind].append(f)
    return {k: np.unique(np.concatenate(v)) for k, v in out.items()}


def check_table_against_link_relocations(kaslr, img):
    """The table equals what relocs.c makes of the link relocations (64-bit group
    exactly; 32-bit and inverse groups within their relocation kinds); returns counts."""
    truth = link_relocation_fields(img)
    missing = np.setdiff1d(truth["abs64"], kaslr.abs64)
    extra = np.setdiff1d(kaslr.abs64, truth["abs64"])
    assert len(missing) == 0 and len(extra) == 0, \
        (len(missing), len(extra), [hex(int(x)) for x in np.concatenate([missing, extra])[:6]])
    assert np.isin(kaslr.abs32, truth["abs32"]).all()
    assert np.isin(kaslr.inv32, truth["pcrel"]).all()
    return {"abs64": len(truth["abs64"]), "abs32 of": len(truth["abs32"])}


@pytest.mark.realkernel
def test_table_is_the_link_relocations_6_1():
    """6.1 keeps its link relocations: the table is relocs.c's reading of them."""
    from linepack.image.elf import ElfImage
    boot = B.read_vmlinuz(_fetch("vmlinuz", "6.1"))
    img = ElfImage(_fetch("vmlinux", "6.1"))
    got = check_table_against_link_relocations(boot.kaslr, img)
    print(f"6.1: table {boot.kaslr.counts()}; link relocations {got}")
    img.close()


# -- the table of a rewritten image -------------------------------------------------------

def test_relocs_follow_the_layout(tmp_path):
    """Fields inside a moved function move with it (sign-extended back, each group
    sorted as relocs.c sorts it); fields elsewhere stay; a field where the layout
    maps nothing is refused."""
    from linepack.image.addrmap import AddressMap
    from linepack.ship.vmlinuz import relocs_for_layout
    base = 0xffffffff81000000
    k = B.KaslrRelocs(abs32=np.array([base + 0x10, base + 0x2004], np.uint64),
                      abs64=np.array([base + 0x1008, base + 0x3000], np.uint64),
                      inv32=np.array([base + 0x2000], np.uint64), layout=B.LAYOUT_3)
    # function A [0x1000, 0x1100) moves to 0x2800; B [0x2000, 0x2100) to 0x1000
    amap = AddressMap([base + 0x1000, base + 0x2000], [base + 0x1100, base + 0x2100],
                      [base + 0x2800, base + 0x1000])
    got = relocs_for_layout(k, amap)
    assert got.abs32.tolist() == [base + 0x10, base + 0x1004]
    assert got.abs64.tolist() == [base + 0x2808, base + 0x3000]
    assert got.inv32.tolist() == [base + 0x1000]
    raw = np.frombuffer(got.to_bytes(), "<u4")
    assert raw[0] == 0 and raw[-1] == (base + 0x1004) & 0xffffffff
    holes = AddressMap([base + 0x1000], [base + 0x1004], [base + 0x5000],
                       extents=[(base + 0x1000, base + 0x1100)])
    with pytest.raises(LinepackError, match="maps nothing"):
        relocs_for_layout(k, holes)


@pytest.mark.realkernel
def test_fetch_vmlinuz_cli_private_apt_state():
    """`fetch --series 6.12 --vmlinuz` prints the cached boot image; Debian 13's lists
    live in the private state, not in the machine's apt lists."""
    path = _fetch("vmlinuz", "6.12")
    r = run_linepack("fetch", "--series", "6.12", "--vmlinuz")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == path
    assert B.read_setup_header(path).kernel_version.startswith("6.12.")
    private = os.path.join(targets.cache_dir(), "apt-trixie", "lists")
    assert any("trixie" in n for n in os.listdir(private))
    assert not any("trixie" in n for n in os.listdir("/var/lib/apt/lists"))
    r = run_linepack("fetch", "--series", "7.3", "--list")
    assert r.returncode == 0 and all(x.startswith("7.3.") for x in r.stdout.split()), r.stdout


@pytest.mark.realkernel
def test_truncated_bzimage_refused_before_qemu(tmp_path):
    from linepack.profile.qemu import check_kernel_path
    data = open(_fetch("vmlinuz", "6.1"), "rb").read()
    p = tmp_path / "vmlinuz"
    p.write_bytes(data[:len(data) // 2])
    with pytest.raises(LinepackError, match="truncated bzImage"):
        check_kernel_path(p)


def _with_section_field(elf, where, field, value):
    """ELF bytes with the 8-byte field at ``field`` of the section header whose
    (addr, size) is ``where`` set to ``value``."""
    elf = bytearray(elf)
    (_, _, _, _, _, _, shoff, _, _, _, _, shentsize, shnum, _) = B.ELF_HDR.unpack_from(elf, 0)
    for i in range(shnum):
        o = shoff + i * shentsize
        _, _, _, addr, _, size = struct.unpack_from("<IIQQQQ", elf, o)
        if (addr, size) == where:
            struct.pack_into("<Q", elf, o + field, value)
    return elf


@pytest.mark.realkernel
def test_moved_section_refused(boot, tmp_path):
    """A payload whose sections moved cannot go into the same decompressor: one line."""
    secs = B._alloc_sections(bytes(boot.elf))
    elf = _with_section_field(boot.elf, secs[".bss"], 16, secs[".bss"][0] + 4096)   # sh_addr
    with pytest.raises(LinepackError, match="section .bss is moved or resized"):
        B.replace_payload(boot, B.build_payload(bytes(elf), boot.kaslr))


@pytest.mark.realkernel
def test_shrunk_section_refused_unless_an_added_section_takes_its_end(boot):
    """A section may give the end of its bytes only to a section the rewrite added
    (kallsyms at the end of the text); shrunk with nothing there, it is refused."""
    secs = B._alloc_sections(bytes(boot.elf))
    elf = _with_section_field(boot.elf, secs[".text"], 32, secs[".text"][1] - 4096)  # sh_size
    with pytest.raises(LinepackError, match="section .text is moved or resized"):
        B.check_same_bounds(bytes(boot.elf), bytes(elf))
    text = secs[".text"]
    assert B._ends_in_added(text, (text[0], text[1] - 4096),
                            [(text[0] + text[1] - 4096, 4096)])
    assert not B._ends_in_added(text, (text[0], text[1] - 4096),
                                [(text[0] + text[1] - 2048, 2048)])
    assert not B._ends_in_added(text, (text[0] + 16, text[1] - 4096),
                                [(text[0] + text[1] - 4096, 4096)])
    # the added sections must reach the old end, end to end
    tail = text[0] + text[1] - 4096
    assert not B._ends_in_added(text, (text[0], text[1] - 4096), [(tail, 2048)])
    assert not B._ends_in_added(text, (text[0], text[1] - 4096), [(tail, 1024), (tail + 2048, 2048)])
    assert B._ends_in_added(text, (text[0], text[1] - 4096), [(tail, 1024), (tail + 1024, 3072)])


def test_text_tail_starts_after_the_layouts_last_code_byte():
    """kallsyms at the end of the text (kallsyms_cold._text_tail) starts after the
    last byte the layout placed, also when that byte is 0xCC (a cold part ending in
    `jmp .-0x32`, eb cc) right after a page boundary: the instruction holding the last
    byte that is not int3 may go on for up to 14 bytes."""
    import types
    from linepack.relayout.kernel.kallsyms_cold import _text_tail
    base, size, page = 0xffffffff81000000, 4 * 4096, 4096
    buf = np.full(size, 0xCC, np.uint8)
    end = 2 * page + 1
    buf[100:end - 2] = 0x90
    buf[end - 2:end] = [0xEB, 0xCC]
    sec = types.SimpleNamespace(is_code=True, is_alloc=True, size=size, addr=base, index=1,
                                type=1, offset=0x200000)
    syms = np.zeros(1, dtype=[("shndx", "<u2"), ("size", "<u8")])
    syms["shndx"], syms["size"] = 1, 50
    image = types.SimpleNamespace(sections=[sec], symbol_address=lambda n: base + size,
                                  symbol_table=lambda: (["f"], syms))
    rw = types.SimpleNamespace(buf=lambda s: buf, sym_new=np.array([base + 100], np.uint64))
    _, start, offset, limit, section_end = _text_tail(rw, image)
    assert start == base + 3 * page and limit == section_end == base + size
    assert offset == sec.offset + 3 * page
    buf[end - 16:end] = 0xCC                         # code ends 15 bytes before the page
    assert _text_tail(rw, image)[1] == base + 2 * page
    # the section runs on past _etext: the tail stops at _etext (the pages after it
    # are freed after boot)
    image.symbol_address = lambda n: base + 3 * page + 512
    assert _text_tail(rw, image)[3:] == (base + 3 * page + 512, base + size)
