"""DWARF of Debian 13's 6.12 and trixie-backports' 7.3 cloud kernels, as shipped
(no .rela.debug_*): `relayout --vmlinuz ... pack` keeps it, rewritten from
address fields found by parsing; addr2line and llvm-symbolizer name the same
function, inline chain and line at moved code's new address as stock at the old
one; verify --against's debug-info checks."""

import json

import numpy as np
import pytest

from linepack import targets
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable

from helpers import run_linepack
from symbolizers import differences
import helpers

pytestmark = pytest.mark.realkernel
_requirements = helpers.requirements("addr2line")
SAMPLES = 2000


def _cached(series):
    try:
        vm, vz = targets.debian_vmlinux(series=series), targets.debian_vmlinuz(series=series)
    except Exception as e:          # not cached and no network: say so, do not pass
        pytest.fail(f"Debian {series} packages not available: {e}")
    return vm, vz


@pytest.fixture(scope="module", params=["6.12", "7.3"])
def packed(request, tmp_path_factory):
    vm, vz = _cached(request.param)
    ft = FunctionTable(ElfImage(vm))
    names = [n for n in ("vfs_write", "vfs_read", "do_sys_openat2", "path_openat",
                         "kmem_cache_free", "link_path_walk", "schedule")
             if ft.index_of(n) is not None]
    names += [ft.name[i] for i in range(100, 40000, 50)]
    d = tmp_path_factory.mktemp("shipped")
    prof = d / "hot.json"
    prof.write_text(json.dumps({"functions": {n: float(1000 - k % 900)
                                              for k, n in enumerate(names)}}))
    out = d / "vmlinux.pack"
    p = run_linepack("relayout", vm, "--vmlinuz", vz, "--profile", prof, "--strategy", "pack",
                     "-o", out, "--json", d / "s.json", "--layout-map", d / "layout.map",
                     "--allow-missing", timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    # old -> new per function (a row per symbol: static names repeat)
    rows = [ln.split("\t") for ln in (d / "layout.map").read_text().splitlines()
            if not ln.startswith("#")]
    moved = [(int(o, 16), int(n, 16), int(z)) for _, o, n, z in rows if o != n and int(z) > 16]
    return request.param, vm, out, json.loads((d / "s.json").read_text()), moved


def test_dwarf_kept_and_rewritten_from_parsed_fields(packed):
    series, vm, out, s, moved = packed
    assert s["dwarf"] == "rewritten" and s["dwarf_fields_from"] == "parsed"
    assert s["dwarf_parsed_info_address_fields"] > 500_000
    assert s["dwarf_address_fields_moved"] > 100_000
    new = ElfImage(str(out))
    assert new.section(".debug_info").size == ElfImage(vm).section(".debug_info").size


def test_symbolizers_agree_on_moved_code(packed):
    series, vm, out, s, moved = packed
    pairs = [(a + off, b + off) for a, b, size in moved for off in range(0, size, 13)]
    assert len(pairs) > SAMPLES
    pick = np.random.default_rng(7).choice(len(pairs), SAMPLES, replace=False)
    old_a, new_a = [pairs[k][0] for k in pick], [pairs[k][1] for k in pick]
    diff = differences(vm, out, old_a, new_a, ("addr2line", "llvm-symbolizer"))
    for t in ("addr2line", "llvm-symbolizer"):
        assert diff[t] == [], (len(diff[t]), diff[t][:3])


def test_verify_against_debug_info(packed, tmp_path):
    series, vm, out, s, moved = packed
    rep = tmp_path / "r.json"
    run_linepack("verify", "-q", out, "--against", vm, "--json", rep, timeout=900)
    d = json.loads(rep.read_text())
    counts = d["equivalence_counts"]
    assert d["debuginfo_line_rows_checked"] >= 10_000
    for k in ("debuginfo.line-row", "debuginfo.subprogram-range", "debuginfo.scope-range"):
        assert counts[k] == 0, (k, [f for f in d["findings"] if f.get("check") == k][:3])
    assert counts["debuginfo.unit-range"] == 0
