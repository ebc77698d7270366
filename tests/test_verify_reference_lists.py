"""verify --against checks the plain PC-relative lists into code (initcalls,
.pci_fixup hooks, runtime-constant sites: verify/reference_lists.py). On 6.12
and 7.x, which keep no link relocations, nothing else does: a runtime-constant
site left at its old address passed verify and crashed 7.3 at boot."""

import json

import pytest

import helpers
from helpers import patched_copy, run_linepack
from linepack import targets
from linepack.image.elf import ElfImage
from linepack.kernel import Initcalls, RuntimeConsts
from linepack.kernel.base import ImageContext

pytestmark = pytest.mark.realkernel


def _against(new, old, tmp_path):
    out = tmp_path / "eq.json"
    p = run_linepack("verify", "-q", new, "--against", old, "--json", out)
    return p, json.loads(out.read_text())


def _shifted_field(vmlinux, table, tmp_path, delta):
    """A copy of ``vmlinux`` whose first non-zero field of ``table`` points
    ``delta`` bytes further; returns (copy, field address)."""
    ctx = ImageContext(ElfImage(str(vmlinux)))
    fields, _ = table().references(ctx)
    assert len(fields), f"{table.name}: no fields in {vmlinux}"
    a = int(fields[0])
    v = int.from_bytes(bytes(ctx.image.read(a, 4)), "little", signed=True)
    bad = patched_copy(vmlinux, tmp_path / "new", {
        ctx.image.vaddr_to_offset(a): (v + delta).to_bytes(4, "little", signed=True)})
    return bad, a


def _named(rep, table, addr):
    return [f for f in rep["findings"] if f["check"] == "equiv.reference-list" and
            f["message"].startswith(table + ":") and int(f["address"], 16) == addr]


def test_identity_checks_every_list(tmp_path):
    vmlinux = targets.debian_vmlinux(helpers.debian_abi())
    p, rep = _against(vmlinux, vmlinux, tmp_path)
    assert p.returncode == 0, p.stdout[-2000:]
    assert rep["equivalence_reference_list_fields"] > 1000      # 6.1: initcalls, pci_fixup
    assert not [f for f in rep["findings"] if f["check"] == "equiv.reference-list"]


def test_stale_initcall_is_named(tmp_path):
    vmlinux = targets.debian_vmlinux(helpers.debian_abi())
    bad, a = _shifted_field(vmlinux, Initcalls, tmp_path, 16)
    p, rep = _against(bad, vmlinux, tmp_path)
    assert p.returncode == 1
    assert len(_named(rep, "initcalls", a)) == 1, rep["findings"][:5]


def test_stale_runtime_const_site_is_named_without_relocations(tmp_path):
    """6.12 has runtime_ptr_/runtime_shift_ site lists and no link relocations:
    only this check sees a site that no longer designates its immediate."""
    vmlinux = targets.debian_vmlinux(series="6.12")
    bad, a = _shifted_field(vmlinux, RuntimeConsts, tmp_path, 1)
    p, rep = _against(bad, vmlinux, tmp_path)
    assert p.returncode == 1
    hits = _named(rep, "runtime_const", a)
    assert len(hits) == 1 and "designated" in hits[0]["message"], rep["findings"][:5]
    assert rep["equivalence_counts"]["equiv.reference-list"] == 1
