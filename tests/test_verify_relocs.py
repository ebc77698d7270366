"""verify names an image whose relocation sections disagree with its code: copies
of Debian's 6.1 vmlinux with one link relocation dropped (its type set to
R_X86_64_NONE, which every consumer skips: ld, arch/x86/tools/relocs, linepack).

- an absolute R_X86_64_32S under `mov $sym, %reg`: KASLR would leave it stale;
  standalone verify names it (relocs.absolute);
- a cross-section R_X86_64_PLT32 under a call: relayout would not move it;
  standalone verify names it (relocs.cross-section).
`verify --against` on the first: its comparison passes (it checks the relocations
that are there, and nothing moved); only its standalone pass names the field.
"""


import numpy as np
import pytest

from helpers import expect_fault, patched_copy, run_linepack
import helpers

VMLINUX = helpers.debian_vmlinux_path()
pytestmark = pytest.mark.realkernel
_requirements = helpers.requirements(vmlinux=True)
R_X86_64_PLT32, R_X86_64_32S = 4, 11


@pytest.fixture(scope="module")
def image():
    from linepack.image.elf import ElfImage
    return ElfImage(VMLINUX)


def _text_relocs(image):
    return image.relocations[".text"]


def _drop(image, tmp_path, index, name):
    """A copy with .rela.text entry ``index`` turned into R_X86_64_NONE (symbol kept)."""
    rel = _text_relocs(image)
    info_off = rel.section.offset + 24 * int(index) + 8
    info = int(rel.sym[index]) << 32        # type 0 = R_X86_64_NONE
    return patched_copy(VMLINUX, tmp_path / name, {info_off: info.to_bytes(8, "little")})


def _first(image, rtype, prefix_ok):
    rel = _text_relocs(image)
    for i in np.flatnonzero(rel.type == rtype)[:200000].tolist():
        f = int(rel.offset[i])
        if prefix_ok(bytes(image.read(f - 3, 7))):
            return i, f
    pytest.skip("no suitable relocation")


def _movq_imm_address(b):
    """48 c7 c0+r imm32: movq $sym, %reg (sign-extended: an address), past the
    kernel's first page (which verify treats as numbers: __START_KERNEL arithmetic)."""
    return b[0] == 0x48 and b[1] == 0xC7 and (b[2] & 0xF8) == 0xC0 \
        and int.from_bytes(b[3:7], "little") >= 0x81001000


def test_dropped_absolute_relocation_is_named(image, tmp_path):
    i, field = _first(image, R_X86_64_32S, _movq_imm_address)
    bad = _drop(image, tmp_path, i, "vmlinux.drop32s")
    hits = expect_fault(bad, tmp_path, "relocs.absolute")
    assert [h["address"] for h in hits] == [f"{field:#x}"]


def test_dropped_cross_section_call_relocation_is_named(image, tmp_path):
    text = image.section(".text")
    rel = _text_relocs(image)
    for i in np.flatnonzero(rel.type == R_X86_64_PLT32).tolist():
        f = int(rel.offset[i])
        if bytes(image.read(f - 1, 1)) != b"\xe8":
            continue
        target = f + 4 + int.from_bytes(bytes(image.read(f, 4)), "little", signed=True)
        if not (text.addr <= target < text.end):
            break
    else:
        pytest.skip("no cross-section call")
    bad = _drop(image, tmp_path, i, "vmlinux.dropplt")
    hits = expect_fault(bad, tmp_path, "relocs.cross-section")
    assert [h["address"] for h in hits] == [f"{f:#x}"]


def test_verify_against_on_a_dropped_absolute_relocation(image, tmp_path):
    """What --against's relocation-consistency pass says about the same copy: it
    checks the relocations that are there, so a missing one is only caught by the
    standalone pass it runs first (relocs.absolute), not by the comparison."""
    i, field = _first(image, R_X86_64_32S, _movq_imm_address)
    bad = _drop(image, tmp_path, i, "vmlinux.drop32s")
    import json
    out = tmp_path / "r.json"
    r = run_linepack("verify", "-q", bad, "--against", VMLINUX, "--json", out, timeout=1200)
    assert r.returncode == 1, r.stdout[-2000:]
    rep = json.loads(out.read_text())
    # The comparison passes (every relocation that is there still describes its
    # field); the finding comes from the standalone pass, at the dropped field.
    assert [(f["check"], f["address"]) for f in rep["findings"]] == \
        [("relocs.absolute", f"{field:#x}")]
    assert rep["equivalence_relocations_checked"] > 600000
