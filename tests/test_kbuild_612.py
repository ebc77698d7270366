"""The kbuild hook on a real kernel that strips its relocations: Debian's
linux-source-6.12 (the newest apt has; proved on 6.12.117-1~deb12u1) with configs/kbuild/x86_64-small.config.

1. `linepack kbuild` builds the stock layout (the hook only keeps the link's own
   vmlinux as vmlinux.orig); the shipped vmlinux has no relocations left, and
   relayout refuses it naming the hook.
2. That vmlinux is profiled under QEMU (vfs-mix, PVH entry).
3. `linepack kbuild --profile` relinks in the same object tree with the hook:
   the relink is byte-identical to the profiled link (same build-id), relayout
   runs before x86's post-link step, so vmlinux.relocs, the bzImage and the
   modules come from the rewritten vmlinux; verify --against passes.
4. Both bzImages boot with KASLR (decompressor, vmlinux.relocs, RDRAND):
   vfs-mix gives the stock build's result, the build's own modules load, and
   moved functions show in /proc/kallsyms at their new address + the offset.
   The stock boot and one hooked boot run with call-depth tracking selected
   (a Skylake CPU model, spectre_v2=retpoline retbleed=stuff): the kernel
   patches its accounting thunks into the moved functions' 16-byte paddings.

The config has call-depth tracking and IBT on, as Debian's 6.12 and 7.3 configs
do (CALL_THUNKS -> CALL_PADDING: ``__pfx_`` padding before each function,
``.call_sites``, ``.ibt_endbr_seal``).

Runs in the default test command (tools/run-tests.sh): it is the only proof of the
hook on a real kernel. A cold build of the small config is about 7 minutes of a
2-core machine (docs/packagers.md); the object tree is cached, so a warm run is
minutes. Deselect it with `bash tools/run-tests.sh -m "not kbuild"`. It takes the
newest linux-source-6.12 apt knows (Debian's security archive drops old versions).
"""

import json
import os
import re
import shutil

import pytest

from helpers import run_linepack

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "kbuild", "x86_64-small.config")
DEBIAN = "linux-source-6.12"
PROFILE_LOOPS = 20
BOOT_LOOPS = 20
BOOTS = 3
# The kernel selects call-depth tracking on a CPU model with the RETBleed bug
# (Skylake) when asked; RDRAND for the decompressor's KASLR offset.
CDT_ENV = {"spectre_v2": "retpoline", "retbleed": "stuff", "loglevel": "7"}
CDT_QEMU = ("-cpu", "Skylake-Client-v1,+rdrand")
pytestmark = [pytest.mark.kbuild, pytest.mark.slow, pytest.mark.qemu]


@pytest.fixture(scope="module", autouse=True)
def tools_present():
    """tools/setup.sh installs these: missing is a broken set-up, not a reason to skip."""
    missing = [t for t in ("make", "gcc", "qemu-system-x86_64", "apt-get") if not shutil.which(t)]
    assert not missing, f"not installed (tools/setup.sh installs them): {', '.join(missing)}"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("kbuild612")


def _kbuild(out, *extra):
    r = run_linepack("kbuild", "--debian", DEBIAN, "--config", CONFIG, "-j", "2", "-o", out,
                     *extra, timeout=6 * 3600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Linux 6.12." in r.stdout, r.stdout
    return out


@pytest.fixture(scope="module")
def stock(work):
    return _kbuild(work / "stock")


@pytest.fixture(scope="module")
def profile(work, stock):
    out = work / "vfs.prof"
    r = run_linepack("profile", "--kernel", stock / "vmlinux", "--workload", "vfs-mix",
                     "--loops", PROFILE_LOOPS, "-o", out, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def opt(work, profile):
    return _kbuild(work / "opt", "--profile", profile, "--strategy", "pack")


def _build_id(path):
    from linepack.image.elf import ElfImage
    return ElfImage(str(path)).build_id


def _has_relocs(path):
    from linepack.image.elf import ElfImage
    return ElfImage(str(path)).has_link_relocations()


def _config(d):
    return dict(ln.split("=", 1) for ln in (d / "config").read_text().splitlines()
                if ln.startswith("CONFIG_"))


def test_config_keeps_call_depth_tracking(stock):
    """olddefconfig kept what the test is for (a toolchain without
    -fpatchable-function-entry would drop it silently)."""
    cfg = _config(stock)
    for opt in ("MITIGATION_CALL_DEPTH_TRACKING", "CALL_THUNKS", "CALL_PADDING",
                "PREFIX_SYMBOLS", "X86_KERNEL_IBT", "MITIGATION_RETHUNK"):
        assert cfg.get(f"CONFIG_{opt}") == "y", opt
    assert cfg["CONFIG_FUNCTION_PADDING_BYTES"] == "16"
    from linepack.image.elf import ElfImage
    from linepack.kernel.prefixes import prefix_symbols
    img = ElfImage(str(stock / "vmlinux.orig"))
    assert img.section(".call_sites").size // 4 > 10_000
    assert len(prefix_symbols(img)[0]) > 10_000


def test_stock_build_strips_relocations(stock, tmp_path):
    assert not _has_relocs(stock / "vmlinux")           # 6.5+: stripped after vmlinux.relocs
    assert _has_relocs(stock / "vmlinux.orig")          # what the hook kept
    assert _build_id(stock / "vmlinux") == _build_id(stock / "vmlinux.orig")
    (tmp_path / "p.json").write_text('{"functions": {"vfs_read": 1}}')
    r = run_linepack("relayout", stock / "vmlinux", "--profile", tmp_path / "p.json",
                     "-o", tmp_path / "new")
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert "no link relocations" in line and "linepack kbuild" in line, line
    assert not (tmp_path / "new").exists()


def test_hooked_relink_is_the_profiled_link(stock, profile, opt):
    from linepack.profile.model import Profile
    bid = _build_id(stock / "vmlinux")
    assert Profile.load(str(profile)).meta.get("build_id") == bid
    # fixed build strings: the relink is the same link, byte for byte
    assert (opt / "vmlinux.orig").read_bytes() == (stock / "vmlinux.orig").read_bytes()


def test_hooked_build_ships_the_relaid_code(stock, opt):
    from linepack.image.elf import ElfImage

    def text(p):
        img = ElfImage(str(p))
        return bytes(img.section_bytes(img.section(".text")))

    assert not _has_relocs(opt / "vmlinux") and _has_relocs(opt / "vmlinux.linepack")
    assert text(opt / "vmlinux") == text(opt / "vmlinux.linepack")
    assert text(opt / "vmlinux") != text(stock / "vmlinux")
    assert (opt / "vmlinux.relocs").read_bytes() != (stock / "vmlinux.relocs").read_bytes()
    rep = json.loads((opt / "relayout.json").read_text())
    moved = _moved(opt)
    assert len(moved) >= 50, rep
    # the main text region is laid out by pack; regions with no room before the
    # pinned kprobes text keep their layout, and the report names them
    assert "vfs_read" in moved and "do_sys_openat2" in moved
    assert isinstance(rep["kept_regions"], list)
    # System.map (written by link-vmlinux.sh before the hook) has the new addresses
    smap = {}
    for ln in (opt / "System.map").read_text().splitlines():
        a, _, n = ln.split(" ", 2)
        smap.setdefault(n, set()).add(int(a, 16))
    for name, addr in list(moved.items())[:200]:
        assert addr in smap[name], name


def test_verify_against_the_link(opt):
    r = run_linepack("verify", opt / "vmlinux.linepack", "--against", opt / "vmlinux.orig",
                     "--layout-map", opt / "layout.tsv", timeout=1800)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-2000:])


def _moved(d):
    """{name: new address} of moved functions with a plain, unique name."""
    rows = {}
    for line in (d / "layout.tsv").read_text().splitlines():
        if line.startswith("#"):
            continue
        name, old, new, _ = line.split("\t")
        if old != new and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            rows.setdefault(name, []).append(int(new, 16))
    return {n: a[0] for n, a in sorted(rows.items()) if len(a) == 1}


def _modules(d):
    """The build's modules in its modules.order (dependencies first)."""
    order = (d / "modules" / "modules.order").read_text().split()
    return [str(d / "modules" / ko) for ko in order]


def _boot(bzimage, names, modules=(), cdt=False):
    from linepack.profile.qemu import run_workload
    env = {"lp_kallsyms": ",".join(names), **(CDT_ENV if cdt else {})}
    return run_workload(str(bzimage), "vfs-mix", loops=BOOT_LOOPS, icount=False, timeout=900,
                        modules=modules, env=env, extra_args=CDT_QEMU if cdt else ())


def _call_depth_tracking(serial):
    """The boot selected call-depth tracking and patched its thunks; returns the
    functions whose padding it refused (asm functions the build left without NOPs)."""
    assert "RETBleed: Mitigation: Stuffing" in serial, serial[-3000:]
    assert "callthunks: Setting up call depth tracking" in serial, serial[-3000:]
    return [ln.split("]", 1)[-1] for ln in serial.splitlines() if "Invalid padding" in ln]


@pytest.fixture(scope="module")
def stock_boot(stock):
    """One boot of the stock build, with call-depth tracking."""
    from linepack.ship import kaslr
    res = _boot(stock / "bzImage", ["_text"], cdt=True)
    off = kaslr.kaslr_offset(res.serial, kaslr.bzimage_link_text(str(stock / "bzImage")))
    assert off is not None and off % (2 << 20) == 0, res.serial[-2000:]
    _call_depth_tracking(res.serial)
    return res


def test_hooked_bzimage_boots_with_kaslr(opt, stock_boot):
    from linepack.ship import kaslr
    link_text = kaslr.bzimage_link_text(str(opt / "bzImage"))
    moved = _moved(opt)
    sample = dict(list(moved.items())[::max(1, len(moved) // 10)][:10])
    mods = _modules(opt)
    assert mods, "the build made no modules"
    offsets = []
    for k in range(BOOTS):
        res = _boot(opt / "bzImage", ["_text"] + sorted(sample), modules=mods, cdt=k == 0)
        assert res.result_line == stock_boot.result_line
        if k == 0:
            # every padding the stock boot patched, the hooked one patches too
            assert _call_depth_tracking(res.serial) == _call_depth_tracking(stock_boot.serial)
        lines = [ln.strip() for ln in res.serial.splitlines()]
        for m in mods:
            assert f"linepack-module {os.path.basename(m)} loaded" in lines, res.serial[-2000:]
        off = kaslr.kaslr_offset(res.serial, link_text)
        assert off is not None and off % (2 << 20) == 0, res.serial[-2000:]
        got = kaslr.kallsyms_lines(res.serial)
        for name, addr in sample.items():
            assert got.get(name) and got[name][0][0] == addr + off, (name, got.get(name))
        for bad in ("Oops", "BUG:", "WARNING:", "Unknown symbol"):
            assert bad not in res.serial, res.serial[-3000:]
        offsets.append(off)
    assert len(set(offsets)) >= 2, [hex(o) for o in offsets]
