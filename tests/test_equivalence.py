"""verify NEW --against OLD: identity passes; each kind of untranslated change is named."""

import json

import numpy as np
import pytest

import helpers
from helpers import patched_copy, run_linepack
from linepack import targets
from linepack.image.elf import ElfImage
from linepack.kernel.base import ImageContext

pytestmark = pytest.mark.realkernel


@pytest.fixture(scope="module")
def vmlinux():
    return targets.debian_vmlinux(helpers.debian_abi())


@pytest.fixture(scope="module")
def ctx(vmlinux):
    return ImageContext(ElfImage(vmlinux))


def _against(new, old, tmp_path, *extra):
    out = tmp_path / "eq.json"
    p = run_linepack("verify", "-q", new, "--against", old, "--json", out, *extra)
    return p, json.loads(out.read_text())


def test_identical_images_are_equivalent(vmlinux, tmp_path):
    p, rep = _against(vmlinux, vmlinux, tmp_path)
    assert p.returncode == 0, p.stdout
    assert rep["equivalence_instructions"] > 2_000_000
    assert rep["equivalence_moved_functions"] == 0


def _first_call(ctx, name):
    """(address, displacement) of the first direct call in function `name`."""
    d = ctx.disasm
    i = ctx.functions.index_of(name)
    idx = np.nonzero((d.func == i) & (d.raw[:, 0] == 0xE8) & (d.size == 5))[0][0]
    a = int(d.addr[idx])
    return a, int.from_bytes(bytes(ctx.image.read(a + 1, 4)), "little", signed=True)


def test_untranslated_call_is_named(ctx, vmlinux, tmp_path):
    a, disp = _first_call(ctx, "vfs_read")
    bad = patched_copy(vmlinux, tmp_path / "new", {
        ctx.image.vaddr_to_offset(a + 1): (disp + 16).to_bytes(4, "little", signed=True)})
    p, rep = _against(bad, vmlinux, tmp_path)
    assert p.returncode == 1
    hits = [f for f in rep["findings"] if f["check"] == "equiv.branch-target"]
    assert len(hits) == 1 and "vfs_read" in hits[0]["message"]


def test_stale_data_pointer_is_named(ctx, vmlinux, tmp_path):
    im = ctx.image
    rel = im.relocations[".data"]
    sel = np.nonzero(rel.type == 1)[0]
    # a pointer into .text
    text = im.section(".text")
    for k in sel.tolist():
        off = int(rel.offset[k])
        val = int(im.view(off, 1, "<u8")[0])
        if text.addr <= val < text.end:
            break
    bad = patched_copy(vmlinux, tmp_path / "new", {im.vaddr_to_offset(off): (val + 64).to_bytes(8, "little")})
    p, rep = _against(bad, vmlinux, tmp_path)
    assert p.returncode == 1
    hits = [f for f in rep["findings"] if f["check"] == "equiv.data-pointer"]
    assert len(hits) == 1 and f"{off:#x}" in hits[0]["message"]


def test_changed_rip_relative_operand_is_named(ctx, vmlinux, tmp_path):
    d = ctx.disasm
    # mov r64, [rip + disp32]: REX.W 8B modrm(mod=00, rm=101), 7 bytes
    rows = np.nonzero((d.raw[:, 0] == 0x48) & (d.raw[:, 1] == 0x8B)
                      & ((d.raw[:, 2] & 0xC7) == 0x05) & (d.size == 7))[0]
    a = int(d.addr[rows[len(rows) // 2]])
    name = ctx.symbol_at(a).split("+")[0]
    disp = int.from_bytes(bytes(ctx.image.read(a + 3, 4)), "little", signed=True)
    bad = patched_copy(vmlinux, tmp_path / "new", {
        ctx.image.vaddr_to_offset(a + 3): (disp + 8).to_bytes(4, "little", signed=True)})
    p, rep = _against(bad, vmlinux, tmp_path)
    assert p.returncode == 1
    hits = [f for f in rep["findings"] if f["check"] == "equiv.instruction-bytes"]
    assert len(hits) == 1 and name in hits[0]["message"] and "rip" in hits[0]["message"]


def test_relocation_no_longer_describing_its_field_is_named(ctx, vmlinux, tmp_path):
    """A field that disagrees with its relocation (S + A) is caught even where the
    value still 'translates' by address (the `_text + 0xfff` class of bug)."""
    im = ctx.image
    rel = im.relocations[".data"]
    names, syms = im.symbol_table()
    typ = syms["info"] & 0xF
    k = next(k for k in np.nonzero(rel.type == 1)[0].tolist()
             if typ[rel.sym[k]] == 2 and rel.addend[k] == 0)       # a named function pointer
    off = int(rel.offset[k])
    val = int(im.view(off, 1, "<u8")[0])
    bad = patched_copy(vmlinux, tmp_path / "new", {im.vaddr_to_offset(off): (val + 1).to_bytes(8, "little")})
    p, rep = _against(bad, vmlinux, tmp_path)
    assert p.returncode == 1
    hits = [f for f in rep["findings"] if f["check"] == "equiv.relocation"]
    assert len(hits) == 1 and names[rel.sym[k]] in hits[0]["message"]
    assert rep["equivalence_relocations_checked"] > 600_000


def test_lost_orc_entry_is_named(ctx, vmlinux, tmp_path):
    from linepack.kernel import OrcTable
    orc = OrcTable().parse(ctx)
    ip, e = orc["ip"], orc["entry"]
    i = 5000
    # entry i now repeats entry i+1's IP: the original IP i is lost
    bad = patched_copy(vmlinux, tmp_path / "new", {
        ctx.image.vaddr_to_offset(int(e[i])): (int(ip[i + 1]) - int(e[i])).to_bytes(4, "little", signed=True)})
    p, rep = _against(bad, vmlinux, tmp_path)
    assert p.returncode == 1
    hits = [f for f in rep["findings"] if f["check"] == "equiv.orc"]
    assert any(f"{int(ip[i]):#x}" in f["message"] and "no entry" in f["message"] for f in hits)


def test_different_builds_are_named(vmlinux, tmp_path):
    known = targets.available_abis()
    other = next((a for a in reversed(known) if a != helpers.debian_abi()), None)
    if other is None:
        pytest.skip("only one Debian ABI known to apt")
    p, rep = _against(targets.debian_vmlinux(other), vmlinux, tmp_path)
    assert p.returncode == 1
    assert any(f["check"] == "equiv.build-id" for f in rep["findings"])


def test_layout_map_is_checked_against_the_symbol_tables(ctx, vmlinux, tmp_path):
    ft = ctx.functions
    good = tmp_path / "good.layout"
    good.write_text("# function\told\tnew\tsize\n" + "".join(
        f"{ft.name[i]}\t{int(ft.start[i]):#x}\t{int(ft.start[i]):#x}\t{int(ft.size[i])}\n"
        for i in range(0, len(ft), 97)))
    p, rep = _against(vmlinux, vmlinux, tmp_path, "--layout-map", good)
    assert p.returncode == 0 and rep["equivalence_layout_map_rows"] > 400
    i = ft.index_of("vfs_read")
    bad = tmp_path / "bad.layout"
    bad.write_text(f"vfs_read\t{int(ft.start[i]):#x}\t{int(ft.start[i]) + 64:#x}\t{int(ft.size[i])}\n")
    p, rep = _against(vmlinux, vmlinux, tmp_path, "--layout-map", bad)
    assert p.returncode == 1
    assert [f["check"] for f in rep["findings"]] == ["equiv.layout-map"]
    assert "vfs_read" in rep["findings"][0]["message"]
    junk = tmp_path / "junk.layout"
    junk.write_text("not a map\n")
    q = run_linepack("verify", vmlinux, "--against", vmlinux, "--layout-map", junk)
    assert q.returncode == 2 and len(q.stderr.strip().splitlines()) == 1
