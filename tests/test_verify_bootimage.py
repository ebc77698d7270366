"""``verify VMLINUZ --vmlinux VMLINUX`` (tools/verify/bootimage.py): a boot image's
payload checked against the vmlinux it was made from, on Debian's 6.1 cloud
vmlinuz and -dbg vmlinux of the same build, and on copies of that vmlinuz whose
payload was changed (a code byte, table entries moved onto code, one dropped)."""

import json

import numpy as np
import pytest

from helpers import run_linepack
import helpers

pytestmark = [pytest.mark.realkernel]


@pytest.fixture(scope="module")
def debian():
    from linepack import targets
    from linepack.errors import LinepackError
    try:
        return targets.debian_vmlinux(), targets.debian_vmlinuz()
    except LinepackError as e:
        pytest.fail(f"Debian 6.1 kernel unavailable (linepack fetch): {e}")


def test_the_shipped_vmlinuz_carries_its_vmlinux(debian, tmp_path):
    vmlinux, vmlinuz = debian
    rep = tmp_path / "v.json"
    p = run_linepack("verify", vmlinuz, "--vmlinux", vmlinux, "--json", rep, "-q", timeout=1800)
    r = json.loads(rep.read_text())
    assert p.returncode == 0, [f for f in r["findings"] if f["severity"] == "error"][:5]
    bi = r["boot_image"]
    assert bi["compression"] == "lz4" and bi["segments_compared"] == 4
    assert bi["relocations"]["abs64"] > 100_000 and bi["relocations"]["inv32"] > 1000
    assert set(r["boot_image_counts"]) == {"bootimage.payload", "bootimage.reloc-range",
                                           "bootimage.reloc-value", "bootimage.reloc-missing"}
    assert not any(r["boot_image_counts"].values())
    assert "boot image: " in p.stdout and "segments compared" in p.stdout
    assert r["image"].endswith("vmlinux") and r["functions"] > 40_000   # then verified


def test_a_boot_image_needs_its_vmlinux(debian, tmp_path):
    vmlinux, vmlinuz = debian
    line = helpers.refusal_line(run_linepack("verify", vmlinuz, "--json", tmp_path / "v.json"))
    assert "a boot image" in line and "--vmlinux VMLINUX" in line, line
    line = helpers.refusal_line(run_linepack("verify", vmlinux, "--vmlinux", vmlinux))
    assert "not a boot image" in line, line
    assert not any(tmp_path.iterdir())


def test_a_changed_payload_is_named(debian, tmp_path):
    """One code byte changed, five 64-bit entries moved onto function entries (what
    a table left at the old layout does) and one entry dropped: each its finding."""
    from linepack.image import bootimage as bi
    from linepack.image.elf import ElfImage
    from linepack.verify.bootimage import check_boot_image
    vmlinux, vmlinuz = debian
    img = bi.read_vmlinuz(vmlinuz)
    new = ElfImage(vmlinux)
    elf = bytearray(img.elf)
    text = new.by_name[".text"]
    code_at = text.addr + 0x12345
    elf[text.offset + 0x12345] ^= 0xFF        # payload and vmlinux share file offsets here
    assert bytes(elf[text.offset:text.offset + 64]) == bytes(new.data[text.offset:text.offset + 64])
    names, syms = new.symbol_table()
    funcs = np.sort(syms["value"][(syms["info"] & 0xF) == 2])
    funcs = funcs[(funcs > text.addr + 0x100000) & (funcs < text.end)][:5].astype(np.uint64)
    k = img.kaslr
    keep = np.asarray(k.abs64, np.uint64)
    dropped = int(keep[len(keep) // 2])
    abs64 = np.sort(np.concatenate([np.delete(keep, [len(keep) // 2] + list(range(5))), funcs]))
    kaslr = bi.KaslrRelocs(abs32=k.abs32, abs64=abs64, inv32=k.inv32, layout=k.layout)
    out = tmp_path / "vmlinuz.bad"
    bi.write_vmlinuz(img, bi.build_payload(bytes(elf), kaslr), str(out))
    s = check_boot_image(str(out), vmlinux)
    got = {}
    for f in s.findings:
        got.setdefault(f.check, []).append(f)
    assert [f.address for f in got["bootimage.payload"]] == [code_at]
    assert sorted(f.address for f in got["bootimage.reloc-value"]) == funcs.tolist()
    assert dropped in [f.address for f in got["bootimage.reloc-missing"]]
    # and on the command line: findings, exit 1
    p = run_linepack("verify", out, "--vmlinux", vmlinux, "-q", "--json", tmp_path / "r.json",
                     timeout=1800)
    assert p.returncode == 1 and "[bootimage.payload]" in p.stdout, p.stdout[-2000:]
