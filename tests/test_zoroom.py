"""Growing a boot image's payload room (tools/image/zoroom.py, ``bzimage --vmlinuz``).

1. Where the truth is known: the kbuild hook's 6.12 object tree (tests/test_kbuild_612.py
   builds it with configs/kbuild/x86_64-small.config). Its decompressor
   (arch/x86/boot/compressed/vmlinux) is relinked with ``--emit-relocs``; the
   references the disassembly finds in the bzImage, which has no symbols, are exactly
   the relocations whose field and target lie on different sides of the payload's end
   (0 missing, 0 extra). The grown image boots with stock's result; an image whose
   decompressor holds a reference into the payload's interior is refused in one line.
2. Debian 13's 6.12 and trixie-backports' 7.3 vmlinuz as shipped: the decompressor is
   moved up (the payload room grown), and the image boots through the boot protocol
   (-kernel) and through its EFI stub under OVMF, with KASLR, printing stock's result.
"""

import os
import shutil
import struct
import subprocess

import pytest

from helpers import run_linepack

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "kbuild", "x86_64-small.config")
OVMF_CODE, OVMF_VARS = "/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"
BOOT_LOOPS = 20
PCREL = ("R_X86_64_PC32", "R_X86_64_PLT32")


@pytest.fixture(scope="module")
def kbuild_tree():
    """The kbuild hook's cached 6.12 object tree (built by tests/test_kbuild_612.py)."""
    from linepack.errors import LinepackError
    from linepack.ship import kbuild
    try:
        src = kbuild.debian_source("linux-source-6.12")
    except LinepackError as e:
        pytest.skip(f"linux-source-6.12 unavailable: {e}")
    with open(CONFIG, "rb") as f:
        tree = kbuild.build_dir(src, f.read())
    need = ["arch/x86/boot/bzImage", "arch/x86/boot/compressed/.vmlinux.cmd", "vmlinux"]
    if not all(os.path.exists(os.path.join(tree, p)) for p in need):
        pytest.skip(f"{tree}: not built (run tests/test_kbuild_612.py first)")
    return tree


def _zo_of(image):
    from linepack.image import zoroom
    lay = zoroom.zo_layout(image)
    pm = image.setup.protected_mode_offset
    return image.data[pm:pm + lay.edata], lay


def _relinked_with_relocs(tree, out):
    """The decompressor linked again by its own command, plus --emit-relocs."""
    with open(os.path.join(tree, "arch/x86/boot/compressed/.vmlinux.cmd")) as f:
        cmd = f.readline().split(":=", 1)[1].split()
    k = cmd.index("-o")
    cmd[k + 1] = str(out)
    subprocess.run(cmd[:k] + ["--emit-relocs"] + cmd[k:], cwd=tree, check=True)


def _link_crossings(elf, boundary):
    """Fields (addresses) of the link's relocations whose value changes when
    [boundary, _end) moves: PC-relative ones with field and symbol on different
    sides, absolute ones whose symbol moves."""
    out = subprocess.run(["readelf", "-rW", str(elf)], capture_output=True, text=True,
                         check=True).stdout
    crossing, total = set(), 0
    for line in out.splitlines():
        p = line.split()
        if len(p) < 5 or not p[2].startswith("R_X86_64_"):
            continue
        total += 1
        field, sym = int(p[0], 16), int(p[3], 16)
        if p[2] in PCREL:
            if (field >= boundary) != (sym >= boundary):
                crossing.add(field)
        elif sym >= boundary:
            crossing.add(field)
    return crossing, total


def test_crossing_references_are_the_link_relocations(kbuild_tree, tmp_path):
    from linepack.image import bootimage, zoroom
    image = bootimage.read_vmlinuz(os.path.join(kbuild_tree, "arch/x86/boot/bzImage"))
    zo, lay = _zo_of(image)
    elf = tmp_path / "zo.elf"
    _relinked_with_relocs(kbuild_tree, elf)
    subprocess.run(["objcopy", "-O", "binary", str(elf), str(tmp_path / "zo.bin")], check=True)
    # the relocations describe the very bytes of the bzImage's decompressor (less the
    # CRC tools/build.c writes over its last 4 bytes)
    assert (tmp_path / "zo.bin").read_bytes()[:-4] == zo[:-4]
    truth, total = _link_crossings(elf, lay.boundary)
    refs = zoroom.crossing_references(zo, lay)
    found = {int(f) for f in refs["field"]}
    missing, extra = truth - found, found - truth
    print(f"kbuild decompressor: {total} relocations, {len(truth)} cross the payload's end; "
          f"found {len(found)}: {len(missing)} missing, {len(extra)} extra")
    assert total > 400 and len(truth) >= 20
    assert not missing and not extra, (sorted(map(hex, missing)), sorted(map(hex, extra)))
    # both directions and both kinds are exercised
    assert {-1, 1} <= set(refs["sign"].tolist())
    assert {zoroom.KIND_PCREL, zoroom.KIND_RVA} <= set(refs["kind"].tolist())


def test_payload_that_fits_keeps_the_decompressor(kbuild_tree, tmp_path):
    from linepack.image import bootimage
    src = os.path.join(kbuild_tree, "arch/x86/boot/bzImage")
    out = tmp_path / "bz"
    r = run_linepack("bzimage", os.path.join(kbuild_tree, "vmlinux"), "--vmlinuz", src, "-o", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "moved up" not in r.stdout
    old, new = bootimage.read_vmlinuz(src), bootimage.read_vmlinuz(out)
    assert new.setup.syssize == old.setup.syssize and len(new.data) == len(old.data)
    pm, end = old.setup.protected_mode_offset, old.setup.payload_file_offset + \
        old.setup.payload_length
    diff = [i for i in range(end, len(old.data)) if old.data[i] != new.data[i]]
    assert len(diff) <= 8      # input_len and output_len only
    assert new.payload == old.payload and pm == new.setup.protected_mode_offset


def _boot(kernel, efi_vars=None):
    from linepack.profile.qemu import run_workload
    extra = ()
    if efi_vars:
        extra = ("-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
                 "-drive", f"if=pflash,format=raw,unit=1,file={efi_vars}")
    return run_workload(kernel, "vfs-mix", loops=BOOT_LOOPS, icount=False, timeout=600,
                        memory="1024", extra_args=extra,
                        env={"lp_kallsyms": "_text", "efi": "debug", "loglevel": "7"}
                        if efi_vars else {"lp_kallsyms": "_text"})


def _check_boot(kernel, stock, efi_vars=None):
    from linepack.ship import kaslr
    res = _boot(kernel, efi_vars)
    assert res.result_line == stock.result_line
    off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(kernel))
    assert off is not None and off % (2 << 20) == 0, res.serial[-1500:]
    for bad in ("Oops", "BUG:", "WARNING:"):
        assert bad not in res.serial
    if efi_vars:
        assert "efi: EFI v" in res.serial and "EFI stub:" in res.serial, res.serial[-1500:]
    return off


@pytest.mark.qemu
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="no qemu-system-x86_64")
def test_grown_kbuild_image_boots(kbuild_tree, tmp_path):
    from linepack.image import bootimage
    src = os.path.join(kbuild_tree, "arch/x86/boot/bzImage")
    out = tmp_path / "bz"
    r = run_linepack("bzimage", os.path.join(kbuild_tree, "vmlinux"), "--vmlinuz", src,
                     "--grow-room", 1, "-o", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "decompressor moved up by 4,096" in r.stdout, r.stdout
    old, new = bootimage.read_vmlinuz(src), bootimage.read_vmlinuz(out)
    assert new.setup.syssize * 16 == old.setup.syssize * 16 + 4096
    assert new.payload == old.payload
    off = _check_boot(str(out), _boot(src))
    print(f"kbuild 6.12 image grown by 4 KiB boots, KASLR offset {off:#x}")


def test_unexplained_reference_refused(kbuild_tree, tmp_path):
    """A decompressor whose code points into the payload's interior (not its start)
    cannot be moved safely: one line, exit 2, nothing written."""
    from linepack.image import bootimage, zoroom
    src = os.path.join(kbuild_tree, "arch/x86/boot/bzImage")
    image = bootimage.read_vmlinuz(src)
    zo, lay = _zo_of(image)
    refs = zoroom.crossing_references(zo, lay)
    back = refs[(refs["sign"] == -1) & (refs["kind"] == zoroom.KIND_PCREL)]
    assert len(back)
    data = bytearray(image.data)
    at = image.setup.protected_mode_offset + int(back["field"][0])
    struct.pack_into("<i", data, at, struct.unpack_from("<i", data, at)[0] + 0x10000)
    bad = tmp_path / "bzImage-bad"
    bad.write_bytes(bytes(data))
    out = tmp_path / "out"
    r = run_linepack("bzimage", os.path.join(kbuild_tree, "vmlinux"), "--vmlinuz", bad,
                     "--grow-room", 1, "-q", "-o", out)
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "inside the payload" in r.stderr, r.stderr
    assert not out.exists()


# -- Debian's shipped images ---------------------------------------------------------------

@pytest.fixture(scope="module", params=("6.12", "7.3"))
def shipped(request):
    from linepack import targets
    from linepack.errors import LinepackError
    try:
        return request.param, targets.debian_vmlinuz(series=request.param)
    except LinepackError as e:
        pytest.fail(f"Debian {request.param} vmlinuz unavailable (linepack fetch): {e}")


@pytest.mark.realkernel
def test_shipped_decompressor_references(shipped):
    """What the finder reports on the shipped images, checked against the headers: both
    startups' ``subl $rva(_end)`` (_end from the PE header), references back to
    startup_32 and input_data from the moved code, nothing it cannot explain."""
    from linepack.image import bootimage, zoroom
    image = bootimage.read_vmlinuz(shipped[1])
    zo, lay = _zo_of(image)
    assert lay.end_known and lay.pe is not None
    refs = zoroom.crossing_references(zo, lay)
    vals = [struct.unpack_from("<I", zo, int(f))[0] for f in refs["field"]]
    rva = [v for v, k in zip(vals, refs["kind"]) if k == zoroom.KIND_RVA]
    assert rva.count(lay.end) == 2
    back = refs[refs["sign"] == -1]
    targets = set()
    for f in back["field"]:
        f = int(f)
        disp = struct.unpack_from("<i", zo, f)[0]
        targets.add(f + 4 + disp)        # lea/jmp: the field ends the instruction
    assert 0 in targets and lay.ehead in targets, sorted(map(hex, targets))
    print(f"{shipped[0]}: {len(refs)} crossing references ({sum(refs['sign'] > 0)} forward)")


@pytest.mark.realkernel
@pytest.mark.qemu
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="no qemu-system-x86_64")
def test_shipped_image_grown_boots(shipped, tmp_path):
    from linepack.image import bootimage
    series, vmlinuz = shipped
    image = bootimage.read_vmlinuz(vmlinuz)
    out = tmp_path / "vmlinuz"
    grow = 100_000
    new = bootimage.write_vmlinuz(image, image.payload, out, grow_room=grow)
    moved = new.setup.syssize * 16 - image.setup.syssize * 16
    assert moved >= grow and moved % 4096 == 0
    assert new.setup.init_size >= image.setup.init_size + moved
    stock = _boot(vmlinuz)
    offs = [_check_boot(str(out), stock)]
    if os.path.exists(OVMF_CODE):
        vars_ = tmp_path / "vars.fd"
        shutil.copy(OVMF_VARS, vars_)
        offs.append(_check_boot(str(out), stock, efi_vars=vars_))
    else:
        print("OVMF not installed (Debian package ovmf): EFI boot not tried")
    print(f"{series}: decompressor moved up by {moved:,}; boots (-kernel"
          f"{', OVMF' if len(offs) > 1 else ''}) with KASLR offsets {[hex(o) for o in offs]}")


@pytest.mark.realkernel
def test_unknown_pe_section_refused(shipped):
    """A PE section header.S of 6.x/7.x does not have (here .compat renamed .sbat) is
    a layout the rewrite does not know how to move: refused in one line."""
    from linepack.errors import BadInput
    from linepack.image import bootimage, zoroom
    data = bytearray(open(shipped[1], "rb").read())
    image = bootimage.parse_vmlinuz(bytes(data), shipped[1])
    at = zoroom.zo_layout(image).pe.sections[".compat"]
    data[at:at + 8] = b".sbat\0\0\0"
    image = bootimage.parse_vmlinuz(bytes(data), shipped[1])
    with pytest.raises(BadInput, match="section .sbat linepack does not know how to move"):
        zoroom.zo_layout(image)
