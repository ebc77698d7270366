"""Debian 13's 6.12 and trixie-backports' 7.3 cloud kernels as shipped
(``linepack fetch --series 6.12|7.3``, fetched by tools/setup.sh): standalone
verify is clean with each version's table formats; every ``__pfx_`` prefix sits
right before its function and is NOP padding; relayout's units keep each
prefix with its function."""

import json

import numpy as np
import pytest

from helpers import run_linepack
from linepack import targets
from linepack.errors import LinepackError
from linepack.image.elf import ElfImage
from linepack.kernel import BugTable
from linepack.kernel.base import ImageContext
from linepack.kernel.prefixes import prefix_symbols

pytestmark = pytest.mark.realkernel

# per series: __bug_table record size, tables that must be present / absent
EXPECT = {
    "6.12": {"bug": 12, "present": {".call_sites", ".ibt_endbr_seal", ".smp_locks", "__ksymtab_gpl"},
             "absent": set()},
    "7.3": {"bug": 16, "present": {".call_sites", ".ibt_endbr_seal", "__ksymtab"},
            "absent": {".smp_locks", "__ksymtab_gpl"}},
}


@pytest.fixture(scope="module", params=sorted(EXPECT))
def series(request):
    return request.param


@pytest.fixture(scope="module")
def vmlinux(series):
    try:
        return targets.debian_vmlinux(series=series)
    except LinepackError as e:
        pytest.skip(f"Debian {series} vmlinux unavailable: {e}")


@pytest.fixture(scope="module")
def report(vmlinux, tmp_path_factory):
    out = tmp_path_factory.mktemp("vnew") / "r.json"
    p = run_linepack("verify", "-q", vmlinux, "--json", out)
    return p, json.loads(out.read_text())


def test_verify_clean(report, series):
    p, r = report
    errors = [f for f in r["findings"] if f["severity"] == "error"]
    assert p.returncode == 0 and not errors, (p.stderr[-2000:], errors[:5])
    tables = r["tables"]
    assert EXPECT[series]["present"] <= set(tables)
    assert not EXPECT[series]["absent"] & set(tables)
    assert all(t["ok"] for t in tables.values())
    # call-depth tracking: >100k direct calls listed; IBT: thousands of sealed ENDBRs
    assert tables[".call_sites"]["entries"] > 100_000
    assert tables[".ibt_endbr_seal"]["entries"] > 1_000
    pf = r["function_prefixes"]
    assert pf["count"] > 40_000 and pf["bytes"] == [16]
    assert pf["detached"] == 0 and pf["not_nop"] == 0


def test_bug_table_format(vmlinux, series):
    ctx = ImageContext(ElfImage(vmlinux))
    t = BugTable()
    a, n = t.locate(ctx)
    assert t.dtype.itemsize == EXPECT[series]["bug"]
    sec = ctx.image.section("__bug_table")
    assert n * t.dtype.itemsize == sec.size and sec.addr == a
    ent = t.parse(ctx)
    assert not t.check(ctx, ent)


def test_units_keep_prefixes(vmlinux):
    from linepack.relayout.units import build_units
    im = ElfImage(vmlinux)
    ctx = ImageContext(im)
    units, _ = build_units(im, ctx.functions)
    names, addr, size = prefix_symbols(im)
    text = im.section(".text")
    inside = (addr >= np.uint64(text.addr)) & (addr < np.uint64(text.end))
    pu = units.find(addr[inside])
    fu = units.find(addr[inside] + size[inside])
    moved = pu >= 0
    assert moved.sum() > 40_000
    # every prefix of a laid-out function is in its function's unit, at its start
    assert (pu[moved] == fu[moved]).all()
    assert (units.start[pu[moved]] <= addr[inside][moved]).all()


# relayout --vmlinuz + bzimage --vmlinuz of both kernels, booted: test_newkernels_boot.py


def test_runtime_const_sites_all_listed(vmlinux, series):
    """Every runtime-const section (``runtime_*``: sites whose immediate the boot
    patches) is a reference table of the recovery: 7.3 adds ``runtime_mask_``,
    whose site left at its old address made a rewritten 7.3 crash in the code
    that moved there (the boot wrote the futex hash mask into it)."""
    from linepack.kernel.prel32_lists import RuntimeConsts
    ctx = ImageContext(ElfImage(vmlinux))
    secs = [s for s in ctx.image.sections if s.is_alloc and s.size and s.name.startswith("runtime_")]
    assert len(secs) >= (10 if series == "7.3" else 3)
    fields, _ = RuntimeConsts().references(ctx)
    for s in secs:
        inside = (fields >= np.uint64(s.addr)) & (fields < np.uint64(s.addr + s.size))
        assert int(inside.sum()) == s.size // 4, s.name
    if series == "7.3":
        assert any(s.name.startswith("runtime_mask_") for s in secs)
