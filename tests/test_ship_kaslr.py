"""Shipping on Debian's 6.1 cloud vmlinux: the bzImage the kernel's own build
makes (`linepack bzimage`) from a relayout, booted through the Linux boot
protocol with KASLR (the decompressor applies vmlinux.relocs), and the
relocation table itself compared with the original's through the layout map.

For each strategy (env LINEPACK_SHIP_STRATEGIES, comma-separated, default
"pack,blocks"): the bzImage boots 5 times,
shows at least 4 different KASLR offsets, and every boot runs vfs-mix with
stock's result, loads fat.ko + vfat.ko of the same Debian build, and shows
moved functions in /proc/kallsyms at their new address plus that boot's offset.
The stock bzImage boots too (sanity).

Budget: about 4-5 minutes on 2 cores with a warm boot-image tree (a cold one
adds its one-time preparation, ~1.5-4 min: README "linepack bzimage").
"""

import os
import re

import numpy as np
import pytest

from helpers import run_linepack
import helpers

VMLINUX = helpers.debian_vmlinux_path()
PROFILE_LOOPS = 20
BOOT_LOOPS = 20
BOOTS = 5
STRATEGIES = [s for s in os.environ.get("LINEPACK_SHIP_STRATEGIES", "pack,blocks").split(",") if s]
pytestmark = [pytest.mark.realkernel, pytest.mark.qemu, pytest.mark.slow]
_requirements = helpers.requirements("qemu-system-x86_64", "make", vmlinux=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("ship")


def _bzimage(vmlinux, out, relocs):
    r = run_linepack("bzimage", vmlinux, "-o", out, "--relocs", relocs, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"bzImage of {helpers.debian_release()}" in r.stdout, r.stdout
    return str(out)


@pytest.fixture(scope="module")
def stock(work):
    d = work / "stock"
    d.mkdir()
    return {"vmlinux": VMLINUX, "bzimage": _bzimage(VMLINUX, d / "bzImage", d / "relocs"),
            "relocs": str(d / "relocs")}


@pytest.fixture(scope="module")
def profile(kernel_profile):
    return str(kernel_profile(VMLINUX, PROFILE_LOOPS))


@pytest.fixture(scope="module", params=STRATEGIES)
def layout(request, work, profile):
    strategy = request.param
    d = work / strategy.replace(":", "-").replace(" ", "-")
    d.mkdir()
    files = {"strategy": strategy, "vmlinux": str(d / "vmlinux"),
             "layout_map": str(d / "layout.tsv"), "system_map": str(d / "System.map")}
    r = run_linepack("relayout", VMLINUX, "--profile", profile, "--strategy", strategy,
                     "-o", files["vmlinux"], "--layout-map", files["layout_map"],
                     "--system-map", files["system_map"], "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    files["bzimage"] = _bzimage(files["vmlinux"], d / "bzImage", d / "relocs")
    files["relocs"] = str(d / "relocs")
    return files


def _modules():
    return [helpers.debian_module(m) for m in ("fs/fat/fat.ko", "fs/fat/vfat.ko")]


def _boot(bzimage, names, modules=()):
    from linepack.profile.qemu import run_workload
    return run_workload(bzimage, "vfs-mix", loops=BOOT_LOOPS, icount=False, timeout=600,
                        modules=modules, env={"lp_kallsyms": ",".join(names)})


def _moved_sample(layout, k=12):
    """Moved functions with a unique name in the new System.map: {name: new address}."""
    seen = {}
    for line in open(layout["system_map"]):
        a, t, n = line.split(" ", 2)
        seen.setdefault(n.strip(), []).append((int(a, 16), t))
    moved = []
    for line in open(layout["layout_map"]):
        if line.startswith("#"):
            continue
        name, old, new, _ = line.rstrip("\n").split("\t")
        if old != new and len(seen.get(name, ())) == 1 and seen[name][0][1] in "tT" \
                and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            moved.append((name, int(new, 16)))
    moved.sort()
    sample = dict(moved[::max(1, len(moved) // k)][:k])
    for hot in ("vfs_read", "do_sys_openat2", "_raw_spin_lock"):
        sample.update((n, a) for n, a in moved if n == hot)
    return sample


@pytest.fixture(scope="module")
def stock_boot(stock):
    """The stock bzImage with KASLR: the sanity boot, and the reference result line."""
    from linepack.ship import kaslr
    res = _boot(stock["bzimage"], ["_text", "vfs_read"])
    off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(stock["bzimage"]))
    return res, off


def test_stock_bzimage_boots_with_kaslr(stock_boot):
    from linepack.image.elf import ElfImage
    from linepack.ship import kaslr
    res, off = stock_boot
    assert off is not None and off % (2 << 20) == 0, res.serial[-1500:]
    syms = kaslr.kallsyms_lines(res.serial)
    assert syms["vfs_read"] == [(ElfImage(VMLINUX).symbol_address("vfs_read") + off, "T")]
    assert "nokaslr" not in res.serial.split("Command line:", 1)[-1].splitlines()[0]


def test_layout_bzimage_kaslr_boots(layout, stock_boot):
    """>= 5 boots, >= 4 distinct offsets; each: stock's vfs-mix result, modules load,
    kallsyms = the layout's addresses + that boot's offset."""
    from linepack.ship import kaslr
    link_text = kaslr.bzimage_link_text(layout["bzimage"])
    sample = _moved_sample(layout)
    assert len(sample) >= 10
    mods = _modules()
    offsets = []
    for _ in range(BOOTS):
        res = _boot(layout["bzimage"], ["_text"] + sorted(sample), modules=mods)
        assert res.result_line == stock_boot[0].result_line
        lines = [ln.strip() for ln in res.serial.splitlines()]
        assert "linepack-module fat.ko loaded" in lines and "linepack-module vfat.ko loaded" in lines
        off = kaslr.kaslr_offset(res.serial, link_text)
        assert off is not None, res.serial[-1500:]
        got = kaslr.kallsyms_lines(res.serial)
        for name, addr in sample.items():
            assert got.get(name) == [(addr + off, got[name][0][1])], (name, got.get(name))
        for bad in ("Oops", "BUG:", "WARNING:", "Unknown symbol"):
            assert bad not in res.serial
        offsets.append(off)
    assert len(set(offsets)) >= 4, [hex(o) for o in offsets]


# -- relocations kept true ---------------------------------------------------------------
def read_relocs(path):
    """vmlinux.relocs of x86-64 as three arrays (64-bit, inverse 32-bit, 32-bit field
    addresses, each u32 = the address's low half), each group after a 0 stop, as
    arch/x86/tools/relocs writes them (the decompressor reads them from the end)."""
    raw = np.fromfile(path, dtype="<u4")
    stops = np.flatnonzero(raw == 0)
    assert len(stops) == 3 and stops[0] == 0, "not an x86-64 vmlinux.relocs"
    return {"64": raw[1:stops[1]], "32neg": raw[stops[1] + 1:stops[2]],
            "32": raw[stops[2] + 1:]}


def _layout_address_map(path, original):
    """The layout map as an AddressMap. Code between two functions (assembly with
    no sized symbol) moves with the function before it, as relayout moves it, so
    each function's piece runs to the next listed function (or its section's end)."""
    from linepack.image.addrmap import AddressMap
    from linepack.image.elf import ElfImage
    image = ElfImage(original)
    rows = []
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        _, o, n, size = line.rstrip("\n").split("\t")
        rows.append((int(o, 16), int(n, 16), int(size, 0)))
    rows = sorted(set(rows))
    old, end, new = [], [], []
    for k, (o, n, size) in enumerate(rows):
        if not size or (old and o < end[-1]):
            continue            # aliases of one function
        nxt = next((r[0] for r in rows[k + 1:] if r[0] >= o + size), o + size)
        sec_end = image.section_at(o).end
        old.append(o), end.append(max(o + size, min(nxt, sec_end))), new.append(n)
    return AddressMap(old, end, new)


def test_relocs_equal_original_translated_through_layout_map(layout, stock):
    amap = _layout_address_map(layout["layout_map"], VMLINUX)
    # a block-level layout: inside split functions, fields move with their block
    from linepack.image import blockmap as bm
    from linepack.image.elf import ElfImage
    rows = bm.read_blockmap(ElfImage(layout["vmlinux"]))
    if rows is not None and len(rows):
        amap = bm.address_map(rows, base=amap)
    before, after = read_relocs(stock["relocs"]), read_relocs(layout["relocs"])
    moved_any = False
    for kind in ("64", "32neg", "32"):
        full = before[kind].astype(np.uint64) | np.uint64(0xffffffff00000000)
        mapped, ok = amap.map(full)
        assert ok.all()
        mapped = (mapped & np.uint64(0xffffffff)).astype(np.uint32)
        moved_any |= bool((mapped != before[kind]).any())
        assert len(after[kind]) == len(before[kind]), kind
        assert np.array_equal(np.unique(mapped), np.unique(after[kind])), kind
    assert moved_any            # the layout did move relocated fields
