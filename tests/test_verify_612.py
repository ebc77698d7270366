"""linepack on Debian's 6.12 cloud vmlinux (bookworm-backports / -security:
``linux-image-6.12.<N>+deb12-cloud-amd64-dbg``, fetched with ``linepack fetch
--series 6.12-deb12``): verify is clean with the 6.12 table layouts, injected faults
are named, and relayout refuses the image (linked without --emit-relocs).

The first tests need no kernel: they pin the version-dependent layouts.
"""

import json
import struct

import numpy as np
import pytest

from helpers import expect_fault as _expect_fault, file_offset as _off, patched_copy, rel32 as _rel, run_linepack
from linepack import targets
from linepack.errors import LinepackError
from linepack.image.elf import ElfImage
from linepack.kernel import TABLES, Alternatives, JumpTable, OrcTable
from linepack.kernel.base import ImageContext, for_version
from linepack.kernel.orc import ORC_BITS

# Census of Debian 6.12.117+deb12 (independently recomputed below from the raw bytes).
KNOWN_CENSUS = {
    117: {"total": 8977, "nop2": 4949, "nop5": 3795, "jmp8": 173, "jmp32": 60},
}
# Tables of a 6.12 x86-64 cloud build: .parainstructions is gone (paravirt calls
# are alternatives with ALT_FLAG_DIRECT_CALL since 6.8); call-depth and IBT
# site lists are new.
TABLES_612 = {"__jump_table", ".static_call_sites", ".altinstructions", ".retpoline_sites",
              ".return_sites", ".smp_locks", ".call_sites", ".ibt_endbr_seal", "__ex_table",
              "__bug_table", "orc_unwind", "__mcount_loc", "kallsyms", "__ksymtab", "__ksymtab_gpl"}


# -- layouts by version (no kernel needed) -------------------------------------

def test_for_version_picks_newest_applicable():
    layouts = [((0, 0), "old"), ((6, 3), "mid"), ((6, 8), "new")]
    assert for_version(layouts, (6, 1, 192)) == "old"
    assert for_version(layouts, (6, 3, 0)) == "mid"
    assert for_version(layouts, (6, 12, 117)) == "new"
    assert for_version(layouts, (5, 10, 0)) == "old"
    assert for_version(layouts, None) == "new"


def test_alt_instr_and_orc_layouts_by_version():
    alt = dict(Alternatives.layouts)
    assert for_version(Alternatives.layouts, (6, 1, 0)).itemsize == 12
    assert for_version(Alternatives.layouts, (6, 12, 0)).itemsize == 14
    assert "flags" in for_version(Alternatives.layouts, (6, 12, 0)).names
    assert len(alt) == 2
    # bits = sp_reg 5 (SP), bp_reg 4 (BP), type 4: REGS_PARTIAL in 6.12, invalid in 6.1
    bits = np.array([5 | (4 << 4) | (4 << 8)], np.uint16)
    old, new = for_version(ORC_BITS, (6, 1, 0)), for_version(ORC_BITS, (6, 12, 0))
    assert new.fields(bits)[2][0] == 4 and new.fields(bits)[2][0] < new.types
    assert old.fields(bits)[2][0] == 0                    # 2-bit type: bit 10 is 'end'
    zero = np.zeros(1, np.uint16)
    assert old.undefined(zero)[0] and new.undefined(zero)[0]
    call_612 = np.array([5 | (2 << 8)], np.uint16)        # CALL in 6.12, sp_reg defined
    assert not new.undefined(call_612)[0]


def test_series_naming():
    assert targets.release(41) == "6.1.0-41-cloud-amd64"
    assert targets.release(117, series="6.12-deb12") == "6.12.117+deb12-cloud-amd64"
    with pytest.raises(LinepackError):
        targets.release(1, series="5.10")


# -- the real 6.12 image -------------------------------------------------------

@pytest.fixture(scope="module")
def abi():
    try:
        known = targets.available_abis("6.12-deb12")
    except LinepackError as e:
        pytest.skip(f"apt unavailable: {e}")
    if not known:
        pytest.skip("apt knows no linux-image-6.12.*+deb12-cloud-amd64-dbg (bookworm-backports)")
    return 117 if 117 in known else known[-1]


@pytest.fixture(scope="module")
def vmlinux(abi):
    try:
        return targets.debian_vmlinux(abi, series="6.12-deb12")
    except LinepackError as e:
        pytest.skip(f"Debian 6.12 vmlinux unavailable: {e}")


@pytest.fixture(scope="module")
def ctx(vmlinux):
    return ImageContext(ElfImage(vmlinux))


@pytest.fixture(scope="module")
def clean_report(vmlinux, tmp_path_factory):
    out = tmp_path_factory.mktemp("v612") / "r.json"
    p = run_linepack("verify", "-q", vmlinux, "--json", out)
    return p, json.loads(out.read_text())


def _verify(path, tmp_path):
    out = tmp_path / "r.json"
    p = run_linepack("verify", "-q", path, "--json", out)
    return p, json.loads(out.read_text())


def _raw_census(image):
    """Static-key census straight from the bytes (no linepack.kernel code)."""
    a = image.symbol_address("__start___jump_table")
    b = image.symbol_address("__stop___jump_table")
    raw = bytes(image.read(a, b - a))
    counts = {"nop2": 0, "nop5": 0, "jmp8": 0, "jmp32": 0}
    for k in range(0, len(raw), 16):
        code_rel, = struct.unpack_from("<i", raw, k)
        site = bytes(image.read(a + k + code_rel, 5))
        if site[:2] == b"\x66\x90":
            counts["nop2"] += 1
        elif site == b"\x0f\x1f\x44\x00\x00":
            counts["nop5"] += 1
        elif site[0] == 0xEB:
            counts["jmp8"] += 1
        elif site[0] == 0xE9:
            counts["jmp32"] += 1
    counts["total"] = len(raw) // 16
    return counts


@pytest.mark.realkernel
def test_fetch_series_612_cli(vmlinux, abi):
    p = run_linepack("fetch", "--series", "6.12-deb12", "--list")
    assert p.returncode == 0, p.stderr
    assert f"6.12.{abi}+deb12-cloud-amd64" in p.stdout.split()
    p = run_linepack("fetch", "--series", "6.12-deb12", "--abi", abi)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == vmlinux


@pytest.mark.realkernel
def test_real_612_is_clean(clean_report, ctx, abi):
    p, rep = clean_report
    assert p.returncode == 0, p.stdout
    assert rep["ok"] is True and rep["findings"] == [], rep["findings"][:5]
    assert rep["kernel_version"].startswith(f"Linux version 6.12.{abi}+deb12-cloud-amd64")
    keys = rep["static_keys"]
    assert keys["illegal"] == 0 and keys["improvable"] == 0
    assert keys["total"] == keys["nop2"] + keys["nop5"] + keys["jmp8"] + keys["jmp32"]
    assert rep["tables"]["__jump_table"]["entries"] == keys["total"]
    raw = _raw_census(ctx.image)
    assert {k: keys[k] for k in raw} == raw
    if abi in KNOWN_CENSUS:
        assert {k: keys[k] for k in KNOWN_CENSUS[abi]} == KNOWN_CENSUS[abi]
    assert f"{keys['total']} sites" in p.stdout and "result:   OK" in p.stdout


@pytest.mark.realkernel
def test_real_612_every_present_table_parsed_and_ok(clean_report, ctx):
    _, rep = clean_report
    present = {cls.name for cls in TABLES if cls().locate(ctx) is not None}
    assert present == TABLES_612
    assert set(rep["tables"]) == present
    for name, t in rep["tables"].items():
        assert t["ok"] and t["entries"] > 100, (name, t)
    # 14-byte alt_instr: the whole section, no remainder, every length sane
    sec = ctx.image.section(".altinstructions")
    assert rep["tables"][".altinstructions"]["entries"] * 14 == sec.size
    alt = Alternatives().parse(ctx)
    assert (alt["instrlen"] >= alt["replacementlen"]).all() and (alt["instrlen"] > 0).all()
    # ORC: parallel arrays, every entry a valid 6.12 type, some of each kind the unwinder knows
    orc = OrcTable().parse(ctx)
    assert rep["tables"]["orc_unwind"]["entries"] == ctx.image.section(".orc_unwind").size // 6
    typ = (orc["bits"].astype(np.int64) >> 8) & 7
    assert set(np.unique(typ).tolist()) <= {0, 1, 2, 3, 4} and {1, 2, 3} <= set(typ.tolist())
    # mcount: zero padding is skipped, every other slot counted
    n_mcount = (ctx.image.symbol_address("__stop_mcount_loc")
                - ctx.image.symbol_address("__start_mcount_loc")) // 8
    assert 0 < n_mcount - rep["tables"]["__mcount_loc"]["entries"] < 2000


@pytest.mark.realkernel
def test_fault_612_static_key_site_nopped(ctx, vmlinux, tmp_path):
    jt = JumpTable().parse(ctx)
    site = int(jt["code"][100])
    bad = patched_copy(vmlinux, tmp_path / "vmlinux", {_off(ctx, site): b"\x90" * 5})
    name = ctx.symbol_at(site).split("+")[0]
    _expect_fault(bad, tmp_path, "static_key.illegal", [name, "90 90 90 90 90"])


@pytest.mark.realkernel
def test_fault_612_orc_ips_swapped(ctx, vmlinux, tmp_path):
    orc = OrcTable().parse(ctx)
    ip, e = orc["ip"], orc["entry"]
    i = int(np.nonzero(ip[1001:] > ip[1000:-1])[0][0]) + 1000     # two distinct neighbours
    patches = {_off(ctx, e[i]): _rel(e[i], ip[i + 1]), _off(ctx, e[i + 1]): _rel(e[i + 1], ip[i])}
    bad = patched_copy(vmlinux, tmp_path / "vmlinux", patches)
    _expect_fault(bad, tmp_path, "orc_unwind.sorted", [f"{int(ip[i]):#x}"])


@pytest.mark.realkernel
def test_fault_612_orc_type_out_of_range(ctx, vmlinux, tmp_path):
    """type 5 does not exist in 6.12's 3-bit field (the 6.1 decoding would read 1 and miss it)."""
    orc = OrcTable().parse(ctx)
    i = 5000
    bits = (int(orc["bits"][i]) & ~(7 << 8)) | (5 << 8)
    at = ctx.image.symbol_address("__start_orc_unwind") + 6 * i + 4
    bad = patched_copy(vmlinux, tmp_path / "vmlinux", {_off(ctx, at): bits.to_bytes(2, "little")})
    _expect_fault(bad, tmp_path, "orc.entry", [ctx.symbol_at(orc["ip"][i]).split("+")[0]])


@pytest.mark.realkernel
def test_fault_612_alt_instr_length(ctx, vmlinux, tmp_path):
    """A 14-byte record's instrlen (offset 12) shortened below its replacement."""
    alt = Alternatives().parse(ctx)
    i = int(np.nonzero(alt["replacementlen"] >= 2)[0][10])
    at = int(alt["entry"][i]) + 12
    bad = patched_copy(vmlinux, tmp_path / "vmlinux",
                       {_off(ctx, at): bytes([int(alt["replacementlen"][i]) - 1])})
    _expect_fault(bad, tmp_path, ".altinstructions.length", [ctx.symbol_at(alt["instr"][i]).split("+")[0]])


@pytest.mark.realkernel
def test_relayout_refuses_612_without_emit_relocs(vmlinux, tmp_path):
    out = tmp_path / "new.vmlinux"
    for strategy in ("stock", "align-all:64"):
        p = run_linepack("relayout", vmlinux, "--strategy", strategy, "-o", out)
        assert p.returncode == 2, (strategy, p.stdout, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "--emit-relocs" in lines[0], p.stderr
        assert "Traceback" not in p.stderr
        assert not out.exists()


@pytest.mark.realkernel
def test_relayout_pack_with_profile_refuses_612(vmlinux, tmp_path):
    """With a profile of this very build the refusal is still the --emit-relocs line."""
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"functions": {"vfs_read": 1000, "vfs_write": 900,
                                              "schedule": 500, "do_sys_openat2": 100}}))
    out = tmp_path / "new.vmlinux"
    p = run_linepack("relayout", vmlinux, "--profile", prof, "--strategy", "pack", "-o", out)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--emit-relocs" in lines[0], p.stderr
    assert not out.exists()
