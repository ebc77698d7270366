"""linepack verify on Debian's real 6.1 cloud vmlinux, and on copies with one
injected fault each (generated from the real image at test time)."""

import json

import numpy as np
import pytest

import helpers
from helpers import expect_fault as _expect_fault, file_offset as _off, patched_copy, rel32 as _rel, run_linepack
from linepack import targets
from linepack.image.elf import ElfImage
from linepack.kernel import ExTable, JumpTable, Kallsyms, OrcTable
from linepack.kernel.base import ImageContext

pytestmark = pytest.mark.realkernel

# Census measured by an independent script (issue 2), per Debian ABI.
KNOWN_CENSUS = {
    56: {"total": 5980, "nop2": 3011, "nop5": 2767, "jmp8": 134, "jmp32": 68},
    53: {"total": 6021, "nop2": 3025, "nop5": 2795, "jmp8": 136, "jmp32": 65},
}
ALL_TABLES = {"__jump_table", ".static_call_sites", ".altinstructions", ".parainstructions",
              ".retpoline_sites", ".return_sites", ".smp_locks", "__ex_table", "__bug_table",
              "orc_unwind", "__mcount_loc", "kallsyms", "__ksymtab", "__ksymtab_gpl"}


@pytest.fixture(scope="module")
def abi():
    return helpers.debian_abi()


@pytest.fixture(scope="module")
def vmlinux(abi):
    return targets.debian_vmlinux(abi)


@pytest.fixture(scope="module")
def ctx(vmlinux):
    return ImageContext(ElfImage(vmlinux))


def _verify(path, tmp_path):
    out = tmp_path / "r.json"
    p = run_linepack("verify", "-q", path, "--json", out)
    return p, json.loads(out.read_text())


def test_real_vmlinux_is_clean(vmlinux, abi, tmp_path):
    p, rep = _verify(vmlinux, tmp_path)
    assert p.returncode == 0, p.stdout
    assert rep["ok"] is True and rep["findings"] == []
    assert rep["kernel_version"].startswith(f"Linux version 6.1.0-{abi}-cloud-amd64")
    keys = rep["static_keys"]
    assert keys["illegal"] == 0 and keys["improvable"] == 0
    assert keys["total"] == keys["nop2"] + keys["nop5"] + keys["jmp8"] + keys["jmp32"]
    if abi in KNOWN_CENSUS:
        assert {k: keys[k] for k in KNOWN_CENSUS[abi]} == KNOWN_CENSUS[abi]
    assert set(rep["tables"]) == ALL_TABLES
    for name, t in rep["tables"].items():
        assert t["ok"] and t["entries"] > 100, name
    assert rep["tables"]["__jump_table"]["entries"] == keys["total"]
    # summary on stdout names the census
    assert f"{keys['total']} sites" in p.stdout and "result:   OK" in p.stdout


def test_fault_static_key_site_nopped(ctx, vmlinux, tmp_path):
    jt = JumpTable().parse(ctx)
    site = int(jt["code"][100])
    bad = patched_copy(vmlinux, tmp_path / "vmlinux", {_off(ctx, site): b"\x90" * 5})
    name = ctx.symbol_at(site).split("+")[0]
    _expect_fault(bad, tmp_path, "static_key.illegal", [name, "90 90 90 90 90"])


def test_fault_jump_displacement_off_by_one(ctx, vmlinux, tmp_path):
    jt = JumpTable().parse(ctx)
    from linepack.kernel.jump_table import classify
    kind, _ = classify(ctx, jt["code"])
    i = int(np.nonzero(kind == 3)[0][0])                       # first jmp32 site
    site = int(jt["code"][i])
    disp = int.from_bytes(bytes(ctx.image.read(site + 1, 4)), "little", signed=True)
    bad = patched_copy(vmlinux, tmp_path / "vmlinux",
                       {_off(ctx, site + 1): (disp + 1).to_bytes(4, "little", signed=True)})
    _expect_fault(bad, tmp_path, "static_key.displacement", [ctx.symbol_at(site).split("+")[0]])


def test_fault_orc_ips_swapped(ctx, vmlinux, tmp_path):
    orc = OrcTable().parse(ctx)
    ip, e = orc["ip"], orc["entry"]
    i = int(np.nonzero(ip[1001:] > ip[1000:-1])[0][0]) + 1000     # two distinct neighbours
    patches = {_off(ctx, e[i]): _rel(e[i], ip[i + 1]), _off(ctx, e[i + 1]): _rel(e[i + 1], ip[i])}
    bad = patched_copy(vmlinux, tmp_path / "vmlinux", patches)
    _expect_fault(bad, tmp_path, "orc_unwind.sorted", [f"{int(ip[i]):#x}"])


def test_fault_kallsyms_offset_changed(ctx, vmlinux, tmp_path):
    ks = Kallsyms()
    ent = ks.parse(ctx)
    # pick a text symbol in the middle that the ELF symtab also knows
    where = ctx.symbol_addresses()
    i = next(k for k in range(len(ent) // 2, len(ent))
             if ks.types[k] in "tT" and ks.names[k] in where and len(where[ks.names[k]]) == 1)
    off_addr = ctx.image.symbol_address("kallsyms_offsets") + 4 * i
    new = int(ent["offset"][i]) - 0x10                        # address moves 16 bytes up
    bad = patched_copy(vmlinux, tmp_path / "vmlinux",
                       {_off(ctx, off_addr): new.to_bytes(4, "little", signed=True)})
    _expect_fault(bad, tmp_path, "kallsyms.address", [ks.names[i]])


def test_fault_ex_table_out_of_order(ctx, vmlinux, tmp_path):
    ex = ExTable().parse(ctx)
    e = ex["entry"]
    i = 200
    # swap entries i and i+1 (each field is relative to its own address)
    patches = {}
    for a, b in ((i, i + 1), (i + 1, i)):
        patches[_off(ctx, e[a])] = _rel(e[a], ex["insn"][b])
        patches[_off(ctx, e[a] + 4)] = _rel(e[a] + 4, ex["fixup"][b])
        patches[_off(ctx, e[a] + 8)] = int(ex["data"][b]).to_bytes(4, "little", signed=True)
    bad = patched_copy(vmlinux, tmp_path / "vmlinux", patches)
    _expect_fault(bad, tmp_path, "__ex_table.sorted")
