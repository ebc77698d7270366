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


# -- Debian 13's 6.12 as shipped, end to end ------------------------------------------

@pytest.fixture(scope="module")
def shipped_612(tmp_path_factory):
    try:
        vmlinux = targets.debian_vmlinux(series="6.12")
        vmlinuz = targets.debian_vmlinuz(series="6.12")
    except LinepackError as e:
        pytest.skip(f"Debian 6.12 kernel unavailable: {e}")
    d = tmp_path_factory.mktemp("ship612")
    prof, out, tsv = d / "vfs.prof", d / "vmlinux.pack", d / "layout.tsv"
    r = run_linepack("profile", "--kernel", vmlinux, "--workload", "vfs-mix", "--loops", 20,
                     "-o", prof, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_linepack("relayout", vmlinux, "--vmlinuz", vmlinuz, "--profile", prof, "--strategy",
                     "pack", "-o", out, "--layout-map", tsv, "-q", timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    return {"vmlinux": vmlinux, "vmlinuz": vmlinuz, "out": out, "tsv": tsv, "dir": d}


def test_612_relayout_verify_against_clean(shipped_612):
    s = shipped_612
    rep = s["dir"] / "against.json"
    p = run_linepack("verify", "-q", s["out"], "--against", s["vmlinux"], "--layout-map", s["tsv"],
                     "--json", rep, timeout=1800)
    r = json.loads(rep.read_text())
    errors = [f for f in r["findings"] if f["severity"] == "error"]
    assert p.returncode == 0 and not errors, errors[:5]
    assert r["equivalence_moved_functions"] > 10_000
    assert r["ibt_entries_checked"] > 10_000
    pf = r["function_prefixes"]
    assert pf["count"] > 40_000 and pf["detached"] == 0 and pf["not_nop"] == 0


@pytest.fixture(scope="module")
def vmlinuz_612(shipped_612):
    s = shipped_612
    new = s["dir"] / "vmlinuz.pack"
    r = run_linepack("bzimage", s["out"], "--vmlinuz", s["vmlinuz"], "--layout-map", s["tsv"],
                     "-o", new, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return new


def _boot(kernel, **kw):
    import shutil
    if shutil.which("qemu-system-x86_64") is None:
        pytest.skip("no qemu-system-x86_64")
    from linepack.profile.qemu import run_workload
    env = {"lp_kallsyms": "_text", **kw.pop("env", {})}
    return run_workload(str(kernel), "vfs-mix", loops=5, icount=False, timeout=900, env=env, **kw)


@pytest.mark.qemu
def test_612_bzimage_boots_with_stock_result(shipped_612, vmlinuz_612):
    from linepack.ship import kaslr
    stock, res = _boot(shipped_612["vmlinuz"]), _boot(vmlinuz_612)
    assert res.result_line == stock.result_line
    off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(str(vmlinuz_612)))
    assert off is not None and off % (2 << 20) == 0
    for bad in ("Oops", "BUG:", "WARNING:"):
        assert bad not in res.serial


@pytest.mark.qemu
def test_612_call_depth_tracking_boot(shipped_612, vmlinuz_612):
    """A Skylake CPU model with retbleed=stuff: the kernel selects call-depth
    tracking and patches its accounting thunks into the moved functions'
    paddings at boot; the workload prints the stock result."""
    kw = dict(env={"spectre_v2": "retpoline", "retbleed": "stuff", "loglevel": "7"},
              extra_args=("-cpu", "Skylake-Client-v1,+rdrand"))
    stock, res = _boot(shipped_612["vmlinuz"], **kw), _boot(vmlinuz_612, **kw)
    for r in (stock, res):
        assert "RETBleed: Mitigation: Stuffing" in r.serial
        assert "callthunks: Setting up call depth tracking" in r.serial
    assert res.result_line == stock.result_line
    # the one padding the build itself left without NOPs (an asm function): the
    # kernel warns once, for the same function, in both
    warn = lambda r: [l.split("]", 1)[1] for l in r.serial.splitlines() if "Invalid padding" in l]
    assert warn(res) == warn(stock)
    for bad in ("Oops", "BUG:", "WARNING:"):
        assert bad not in res.serial
