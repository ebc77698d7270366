"""End to end on Debian's 6.1 cloud vmlinux: a real VFS-mix profile recorded under
QEMU, `linepack relayout --strategy pack`, then the proofs the relayout issue asks
for: `verify --against` passes, the kernel boots and prints the original's result
line, /proc/kallsyms inside the guest agrees with the new symtab, a module of the
same Debian build loads, elfutils finds no new kinds of error, the other
strategies boot, and the CLI outputs are atomic and byte-reproducible.

Budget: about 4 minutes on 2 cores (the profile, two pack runs, one verify and
seven short boots).
"""

import hashlib
import os
import re
import subprocess

import pytest

from helpers import build_c, run_linepack
import helpers

VMLINUX = helpers.debian_vmlinux_path()
PROFILE_LOOPS = 50          # enough to make ~800 functions hot
BOOT_LOOPS = 50
pytestmark = [pytest.mark.realkernel, pytest.mark.qemu, pytest.mark.slow]
_requirements = helpers.requirements("qemu-system-x86_64", vmlinux=True)


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("relayout-boot")


@pytest.fixture(scope="module")
def vfs_profile(kernel_profile):
    """A real VFS-mix profile of the original kernel (QEMU TCG + the project's plugin)."""
    return kernel_profile(VMLINUX, PROFILE_LOOPS)


def _relayout_cli(outdir, profile, strategy="pack"):
    outdir.mkdir(exist_ok=True)
    files = {"vmlinux": outdir / "vmlinux", "json": outdir / "summary.json",
             "system_map": outdir / "System.map", "layout_map": outdir / "layout.tsv"}
    r = run_linepack("relayout", VMLINUX, "--profile", profile, "--strategy", strategy,
                     "-o", files["vmlinux"], "--json", files["json"],
                     "--system-map", files["system_map"], "--layout-map", files["layout_map"],
                     "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    return files, r


@pytest.fixture(scope="module")
def packed(work, vfs_profile):
    files, _ = _relayout_cli(work / "pack1", vfs_profile)
    return files


def _loud_append():
    """The default command line without 'quiet': warnings (W+X check, WARN) reach the log."""
    from linepack.profile.qemu import kernel_defaults
    return " ".join(w for w in kernel_defaults()["append"].split() if w != "quiet")


def _boot(kernel, workload="vfs-mix", loops=BOOT_LOOPS, **kw):
    from linepack.profile.qemu import run_workload
    return run_workload(str(kernel), workload, loops=loops, icount=False, timeout=300,
                        append=_loud_append(), **kw)


_TROUBLE = re.compile(r"WARNING|BUG|Oops|W\+X|insecure|Call Trace|Tainted|panic|unwind|"
                      r"orc|corrupt|invalid opcode|general protection", re.I)


def _trouble(serial):
    """Kinds of worrying kernel log lines (timestamps and numbers normalized)."""
    return _kinds("\n".join(ln for ln in serial.splitlines() if _TROUBLE.search(ln)))


@pytest.fixture(scope="module")
def original_boot():
    return _boot(VMLINUX)


# -- (a) equivalence ------------------------------------------------------------
def test_pack_verify_against_original(packed):
    r = run_linepack("verify", packed["vmlinux"], "--against", VMLINUX,
                     "--layout-map", packed["layout_map"], "-q")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert re.search(r"^result:\s+OK", r.stdout, re.M), r.stdout[-2000:]


# -- (b) boots and runs the workload ------------------------------------------------
def test_pack_boots_same_vfs_mix_result(packed, original_boot):
    import json
    summary = json.loads(packed["json"].read_text())
    assert summary["functions_moved"] > 10000 and not summary["problems"]
    got = _boot(packed["vmlinux"])
    assert got.result_line == original_boot.result_line
    # No kernel warning the original does not print (e.g. the W+X check of
    # mark_rodata_ro, which catches a mistranslated _text+0xfff).
    new_trouble = _trouble(got.serial) - _trouble(original_boot.serial)
    assert not new_trouble, sorted(new_trouble)[:10]
    assert "Checked W+X mappings: passed" in got.serial


# -- (c) /proc/kallsyms inside the guest ----------------------------------------------
def _kallsyms_sample(packed, k=20):
    """Moved functions whose name is unique in the new System.map (deterministic sample)."""
    seen = {}
    for line in packed["system_map"].read_text().splitlines():
        a, t, n = line.split(" ", 2)
        seen.setdefault(n, []).append((int(a, 16), t))
    moved = []
    for line in packed["layout_map"].read_text().splitlines():
        if line.startswith("#"):
            continue
        name, old, new, _ = line.split("\t")
        if old != new and len(seen.get(name, ())) == 1 and seen[name][0][1] in "tT" \
                and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            moved.append((name, int(new, 16), seen[name][0][1]))
    moved.sort()
    step = max(1, len(moved) // k)
    sample = moved[::step][:k]
    for hot in ("vfs_read", "vfs_write", "do_sys_openat2", "_raw_spin_lock"):
        hit = [m for m in moved if m[0] == hot]
        sample += hit
    return sample


def test_proc_kallsyms_matches_new_symtab(packed, work):
    from linepack.image.elf import ElfImage
    from linepack.profile.initramfs import build_initramfs
    from linepack.profile.qemu import run_kernel

    sample = _kallsyms_sample(packed)
    assert len(sample) >= 20
    probe = build_c("kallsyms_probe.c", work / "kallsyms_probe", static=True)
    initrd = build_initramfs(probe)
    names = ",".join(n for n, _, _ in sample)
    # sysrq=l: the probe then asks for a backtrace of every CPU (ORC unwinder +
    # kallsyms names), compared with the original's below.
    append = f"{_loud_append()} syms={names} sysrq=l"
    assert len(append) < 2000            # COMMAND_LINE_SIZE on x86 is 2048
    res = run_kernel(str(packed["vmlinux"]), initrd, append=append, icount=False, timeout=120)
    orig = run_kernel(VMLINUX, initrd, append=append, icount=False, timeout=120)
    assert "kallsyms-probe-sysrq-done" in res.serial
    assert _backtrace(res.serial) == _backtrace(orig.serial) != []
    got = {}
    for line in res.serial.splitlines():
        m = re.search(r"kallsyms-probe-sym ([0-9a-f]+) (\w) (\S+)", line)
        if m:
            got.setdefault(m.group(3), []).append((int(m.group(1), 16), m.group(2)))
    assert "kallsyms-probe-done" in res.serial, res.serial[-2000:]
    new = ElfImage(str(packed["vmlinux"]))
    old = ElfImage(VMLINUX)
    for name, addr, typ in sample:
        assert got.get(name) == [(addr, typ)], (name, got.get(name), hex(addr))
        assert new.symbol_address(name) == addr
        assert old.symbol_address(name) != addr            # it did move


def _backtrace(serial):
    """Function names of the reliable frames of the first 'Call Trace:' after SysRq."""
    text = serial[serial.find("sysrq:"):]
    frames = []
    for line in text[text.find("Call Trace:"):].splitlines()[1:]:
        if "</TASK>" in line:
            break
        m = re.search(r"\]\s+(\?\s+)?([\w.]+)\+0x", line)
        if m and not m.group(1):
            frames.append(m.group(2))
    return frames


# -- (d) a module of the same Debian build loads --------------------------------------
def test_debian_modules_load_in_rewritten_kernel(packed):
    mods = [helpers.debian_module(m) for m in ("fs/fat/fat.ko", "fs/fat/vfat.ko")]
    # run_workload raises ExternalToolError ("module vfat.ko: <errno text>") when
    # finit_module fails; the serial log names each module that loaded.
    res = _boot(packed["vmlinux"], "pipe", loops=10, modules=mods)
    lines = [ln.strip() for ln in res.serial.splitlines()]
    assert "linepack-module fat.ko loaded" in lines
    assert "linepack-module vfat.ko loaded" in lines
    assert "Unknown symbol" not in res.serial and "Oops" not in res.serial


# -- (e) elfutils -------------------------------------------------------------------
def _kinds(text):
    """Message kinds: numbers, addresses and quoted names replaced by placeholders."""
    out = set()
    for line in text.splitlines():
        line = re.sub(r"'[^']*'", "'S'", line.strip())
        line = re.sub(r"\([^)]*\)", "(S)", line)
        line = re.sub(r"(0x)?[0-9a-fA-F]{4,}|\d+", "N", line)
        if line:
            out.add(line)
    return out


def _readelf_diagnostics(path):
    """(exit status, kinds) of eu-readelf -a: its stderr, and diagnostic lines of its
    stdout (filtered by grep: the original's output is ~13 M lines of relocations)."""
    import tempfile
    with tempfile.TemporaryFile() as errf:
        rd = subprocess.Popen(["eu-readelf", "-a", str(path)], stdout=subprocess.PIPE,
                              stderr=errf)
        gr = subprocess.run(["grep", "-a", "-E", "-i",
                             r"eu-readelf:|(invalid|cannot|corrupt|bogus).*(section|offset|"
                             r"entry|index|size)"], stdin=rd.stdout, stdout=subprocess.PIPE)
        rd.stdout.close()
        rc = rd.wait()
        errf.seek(0)
        err = errf.read()
    diag = [ln for ln in gr.stdout.decode(errors="replace").splitlines()
            if not re.match(r"\s*(\d+:|\[\s*\d+\]|0x[0-9a-f]+|[0-9a-f]{16})", ln)]
    return rc, _kinds(err.decode(errors="replace") + "\n" + "\n".join(diag))


def test_elfutils_report_no_new_error_kinds(packed):
    helpers.require_tool("eu-elflint")
    def lint(path):
        r = subprocess.run(["eu-elflint", "--gnu-ld", str(path)], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, errors="replace")
        return _kinds(r.stdout)
    before, after = lint(VMLINUX), lint(packed["vmlinux"])
    assert not (after - before), sorted(after - before)[:10]
    rc0, k0 = _readelf_diagnostics(VMLINUX)
    rc1, k1 = _readelf_diagnostics(packed["vmlinux"])
    assert rc1 <= rc0
    assert not (k1 - k0), sorted(k1 - k0)[:10]


# -- (f) other strategies boot --------------------------------------------------------
@pytest.mark.parametrize("strategy", ["stock", "align-all 16", "align-all 64", "hot64"])
def test_strategy_boots(work, strategy, original_boot, vfs_profile):
    from linepack.relayout.driver import load_profile, relayout
    out = work / ("vmlinux." + strategy.replace(" ", "-"))
    hot = load_profile(str(vfs_profile))[0]
    summary, _, _ = relayout(VMLINUX, str(out), strategy, hotness=hot)
    assert not summary["problems"], summary["problems"][:3]
    got = _boot(out)
    assert got.result_line == original_boot.result_line
    assert not (_trouble(got.serial) - _trouble(original_boot.serial))
    out.unlink()


# -- (g) CLI outputs: atomic, reproducible, System.map format -------------------------
def test_cli_outputs_are_reproducible(work, packed, vfs_profile):
    again, _ = _relayout_cli(work / "pack2", vfs_profile)
    for k in ("vmlinux", "json", "system_map", "layout_map"):
        assert _sha(packed[k]) == _sha(again[k]), k
    # Atomic writes leave nothing behind (temp files are renamed into place).
    for d in (work / "pack1", work / "pack2"):
        assert sorted(p.name for p in d.iterdir()) == \
            ["System.map", "layout.tsv", "summary.json", "vmlinux"]
    # System.map: "address type name", 16 hex digits, sorted by address.
    lines = packed["system_map"].read_text().splitlines()
    assert all(re.fullmatch(r"[0-9a-f]{16} [A-Za-z] \S+", ln) for ln in lines)
    addrs = [int(ln[:16], 16) for ln in lines]
    assert addrs == sorted(addrs)


def test_system_map_equals_nm_of_new_image(packed):
    helpers.require_tool("nm")
    """What the kernel build would write for the new image: nm -n + mksysmap's filter."""
    nm = subprocess.run(["nm", "-n", str(packed["vmlinux"])], stdout=subprocess.PIPE,
                        check=True, env={**os.environ, "LC_ALL": "C"}).stdout.decode()
    drop = re.compile(r" [aNUw] | \$[adt]| \.L| __crc_| L0$| __kstrtab_| __kstrtabns_")
    want = "".join(ln + "\n" for ln in nm.splitlines() if not drop.search(ln))
    assert packed["system_map"].read_text() == want
