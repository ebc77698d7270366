"""`linepack bzimage VMLINUX --vmlinuz VMLINUZ -o NEW` on Debian 13's 6.12 cloud kernel,
as shipped: the identity case (VMLINUX = the -dbg vmlinux of the same build).

NEW keeps the distribution's setup code and decompressor and carries the -dbg
vmlinux stripped as the kernel build strips it plus the relocation table; it is
the distribution's image byte for byte (less an unsigned image's nothing), boots
under QEMU through the boot protocol with KASLR (the decompressor applies the
table), and runs vfs-mix with the shipped vmlinuz's result.

Heavy (the -dbg vmlinux, QEMU): run under the shared lock.
"""

import shutil

import pytest

from helpers import run_linepack
from linepack import targets
from linepack.errors import LinepackError

BOOT_LOOPS = 20
SERIES = "6.12"
pytestmark = [pytest.mark.realkernel,
              pytest.mark.skipif(shutil.which("objcopy") is None, reason="objcopy not installed")]


@pytest.fixture(scope="module")
def shipped():
    try:
        return {"vmlinux": targets.debian_vmlinux(series=SERIES),
                "vmlinuz": targets.debian_vmlinuz(series=SERIES)}
    except LinepackError as e:
        pytest.skip(f"Debian {SERIES} kernel unavailable: {e}")


@pytest.fixture(scope="module")
def rebuilt(shipped, tmp_path_factory):
    out = tmp_path_factory.mktemp("vmlinuz") / "vmlinuz-new"
    r = run_linepack("bzimage", shipped["vmlinux"], "--vmlinuz", shipped["vmlinuz"], "-o", out)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "boot image with a new payload" in r.stdout and "identity" in r.stdout, r.stdout
    return str(out)


def test_identity_is_the_shipped_image(shipped, rebuilt):
    with open(shipped["vmlinuz"], "rb") as a, open(rebuilt, "rb") as b:
        assert a.read() == b.read()


def test_vmlinux_of_another_build_refused(shipped, tmp_path):
    from helpers import debian_vmlinux_path
    out = tmp_path / "x"
    r = run_linepack("bzimage", debian_vmlinux_path(), "--vmlinuz", shipped["vmlinuz"], "-o", out)
    assert r.returncode == 2 and "another build" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def _boot(kernel):
    from linepack.profile.qemu import run_workload
    return run_workload(kernel, "vfs-mix", loops=BOOT_LOOPS, icount=False, timeout=600,
                        env={"lp_kallsyms": "_text"})


@pytest.mark.qemu
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="no qemu-system-x86_64")
def test_rebuilt_vmlinuz_boots_with_kaslr(shipped, rebuilt):
    from linepack.ship import kaslr
    stock = _boot(shipped["vmlinuz"])
    offsets = []
    for _ in range(2):
        res = _boot(rebuilt)
        assert res.result_line == stock.result_line
        off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(rebuilt))
        assert off is not None and off % (2 << 20) == 0, res.serial[-1500:]
        for bad in ("Oops", "BUG:", "WARNING:"):
            assert bad not in res.serial
        offsets.append(off)
    print(f"6.12 rebuilt vmlinuz: {stock.result_line!r}, KASLR offsets {[hex(o) for o in offsets]}")


# -- a rewritten vmlinux: Debian 6.1, whose link relocations are the truth -----------------

@pytest.fixture(scope="module")
def relayout_61(tmp_path_factory, kernel_profile):
    """Debian 6.1 relayouted with `pack` from a vfs-mix profile, with its layout map."""
    try:
        vmlinux = targets.debian_vmlinux(series="6.1")
        vmlinuz = targets.debian_vmlinuz(series="6.1")
    except LinepackError as e:
        pytest.skip(f"Debian 6.1 kernel unavailable: {e}")
    d = tmp_path_factory.mktemp("relayout61")
    prof, out, tsv = kernel_profile(vmlinux, 20), d / "vmlinux.pack", d / "layout.tsv"
    r = run_linepack("relayout", vmlinux, "--profile", prof, "--strategy", "pack", "-o", out,
                     "--layout-map", tsv, "--strip-debug", "-q", timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    new = d / "vmlinuz.pack"
    r = run_linepack("bzimage", out, "--vmlinuz", vmlinuz, "--layout-map", tsv, "-o", new)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fields moved" in r.stdout, r.stdout
    return {"vmlinux": str(out), "vmlinuz": str(new), "stock": vmlinuz}


def test_rewritten_table_is_the_link_relocations(relayout_61):
    """The distribution's table mapped through the layout map equals what relocs.c
    makes of the rewritten vmlinux's own link relocations."""
    from linepack.image import bootimage as B
    from linepack.image.elf import ElfImage
    from test_bootimage import check_table_against_link_relocations
    new = B.read_vmlinuz(relayout_61["vmlinuz"])
    img = ElfImage(relayout_61["vmlinux"])
    check_table_against_link_relocations(new.kaslr, img)
    img.close()
    old = B.read_vmlinuz(relayout_61["stock"])
    moved = int((new.kaslr.abs32 != old.kaslr.abs32).sum())
    assert moved > 1000, moved


@pytest.mark.qemu
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="no qemu-system-x86_64")
def test_rewritten_vmlinuz_boots_with_kaslr(relayout_61):
    from linepack.ship import kaslr
    stock = _boot(relayout_61["stock"])
    for _ in range(2):
        res = _boot(relayout_61["vmlinuz"])
        assert res.result_line == stock.result_line
        off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(relayout_61["vmlinuz"]))
        assert off is not None and off % (2 << 20) == 0, res.serial[-1500:]
        for bad in ("Oops", "BUG:", "WARNING:"):
            assert bad not in res.serial
