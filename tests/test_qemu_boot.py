"""Boot Debian's 6.1 cloud vmlinux under QEMU (TCG) with each workload as /init."""

import os
import re
import shutil
import subprocess

import pytest

from linepack.errors import BadInput, ExternalToolError
from linepack.profile import initramfs, qemu, workloads

from helpers import run_linepack
import helpers

pytestmark = [pytest.mark.qemu, pytest.mark.realkernel]
_requirements = helpers.requirements(qemu.QEMU, "gcc")

# Small enough for a few seconds per boot under TCG, big enough to be a real loop.
LOOPS = {"vfs-mix": 1000, "pipe": 1000, "vdso": 20000}


def _elapsed(serial):
    m = re.search(r"^linepack-info \S+ .*elapsed_ns=(\d+)", serial, re.M)
    return int(m.group(1)) if m else None


@pytest.fixture(scope="module")
def vfs_mix_run(debian_vmlinux):
    return qemu.run_workload(debian_vmlinux, "vfs-mix", loops=LOOPS["vfs-mix"], icount=True)


def _static_init(tmp_path, body):
    """A static /init from a few lines of C, packed into an initramfs; returns its path."""
    src = tmp_path / "init.c"
    src.write_text("#include <stdio.h>\n#include <unistd.h>\n#include <sys/reboot.h>\n"
                   f"int main(void) {{ {body} }}\n")
    exe = tmp_path / "init"
    subprocess.run(["gcc", "-static", "-O2", "-o", str(exe), str(src)], check=True)
    return initramfs.build_initramfs(str(exe), dest=str(tmp_path / "init.cpio.gz"))


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_workload_boots_and_matches_native_result(name, debian_vmlinux, vfs_mix_run, tmp_path):
    loops = LOOPS[name]
    res = vfs_mix_run if name == "vfs-mix" else qemu.run_workload(debian_vmlinux, name, loops=loops)
    assert res.returncode == 0
    assert res.result_line.startswith(workloads.load(name).expected_prefix(loops) + " ")
    # Result lines come from syscall results only: the same under QEMU and natively.
    assert res.result_line == workloads.run_native(name, loops)
    lines = res.serial.splitlines()
    begin = lines.index(f"linepack-begin {name}")
    end = lines.index(f"linepack-end {name}")
    assert begin < end < lines.index(res.result_line)
    assert "Power down" in res.serial                 # /init powered off; no panic
    assert "-icount" in res.command and "-no-reboot" in res.command
    assert f"loops={loops}" in res.command[res.command.index("-append") + 1]
    assert res.wall > 0


def test_icount_runs_repeat(debian_vmlinux, vfs_mix_run, tmp_path):
    log = tmp_path / "serial.txt"
    again = qemu.run_workload(debian_vmlinux, "vfs-mix", loops=LOOPS["vfs-mix"], icount=True,
                              log=str(log))
    assert again.result_line == vfs_mix_run.result_line
    assert log.read_text() == again.serial
    # Under -icount guest time counts instructions: the loop's virtual duration
    # repeats (plain TCG differs by 10-20% between runs; icount runs matched exactly).
    a, b = _elapsed(vfs_mix_run.serial), _elapsed(again.serial)
    assert a and b and abs(a - b) <= a * 1e-4


def test_init_that_exits_is_a_kernel_panic_error(debian_vmlinux, tmp_path):
    initrd = _static_init(tmp_path, 'puts("bye"); return 0;')
    with pytest.raises(ExternalToolError, match="kernel panic under QEMU: Kernel panic - not "
                       "syncing: Attempted to kill init") as ei:
        qemu.run_kernel(debian_vmlinux, initrd, icount=False, timeout=120)
    assert "\n" not in str(ei.value)
    res = qemu.run_kernel(debian_vmlinux, initrd, icount=False, timeout=120, check=False)
    assert "Attempted to kill init" in res.panic_line and res.result_line is None


def test_missing_result_line_is_an_error(debian_vmlinux, tmp_path, monkeypatch):
    # A workload defined only by data: a config dir and a source that prints nothing.
    cfg, src = tmp_path / "configs", tmp_path / "src"
    (cfg / "workloads").mkdir(parents=True)
    src.mkdir()
    shutil.copy(os.path.join(workloads.configs_dir(), "kernel.toml"), cfg / "kernel.toml")
    (cfg / "workloads" / "silent.toml").write_text(
        'name = "silent"\nsource = "silent.c"\ndefault_loops = 1\n'
        'result_prefix = "linepack-result silent"\n')
    (src / "silent.c").write_text("#include <unistd.h>\n#include <sys/reboot.h>\n"
                                  "int main(void) { sync(); reboot(RB_POWER_OFF); return 0; }\n")
    monkeypatch.setenv("LINEPACK_CONFIGS", str(cfg))
    monkeypatch.setenv("LINEPACK_WORKLOADS", str(src))
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ExternalToolError, match="workload silent: no result line "
                       "'linepack-result silent loops=3 ...'"):
        qemu.run_workload(debian_vmlinux, "silent", loops=3, icount=False, timeout=120)


def test_modules_are_loaded_in_order(debian_vmlinux):
    # the modules of the same build (tools/setup.sh caches them; fetched here otherwise)
    from linepack import targets
    abi = qemu.kernel_abi(debian_vmlinux)
    mods = [targets.debian_module(m, abi=abi) for m in ("fs/fat/fat.ko", "fs/fat/vfat.ko")]
    res = qemu.run_workload(debian_vmlinux, "pipe", loops=10, icount=False, modules=mods,
                            timeout=300)
    lines = res.serial.splitlines()
    assert lines.index("linepack-module fat.ko loaded") < lines.index("linepack-module vfat.ko "
                                                                      "loaded") < \
        lines.index("linepack-begin pipe")


def test_bad_module_is_a_clear_error(debian_vmlinux, make_file):
    bogus = make_file("bogus.ko", b"\x7fELF not really a module" * 10)
    with pytest.raises(ExternalToolError, match="workload pipe failed under QEMU: linepack-error "
                       "pipe module bogus.ko: "):
        qemu.run_workload(debian_vmlinux, "pipe", loops=10, icount=False, modules=[bogus],
                          timeout=300)


def test_not_a_kernel(tmp_path, make_file):
    initrd = make_file("i.cpio.gz", b"x")
    with pytest.raises(BadInput, match="is not a kernel"):
        qemu.run_kernel(make_file("notakernel", b"hello world" * 100), initrd)
    with pytest.raises(BadInput, match="no such file"):
        qemu.run_kernel(str(tmp_path / "missing"), initrd)
    with pytest.raises(BadInput, match="is a directory"):
        qemu.run_kernel(str(tmp_path), initrd)


def test_timeout_kills_qemu(debian_vmlinux, tmp_path):
    initrd = _static_init(tmp_path, "for (;;) pause(); return 0;")
    with pytest.raises(ExternalToolError, match="QEMU timed out after 1 s"):
        qemu.run_kernel(debian_vmlinux, initrd, icount=False, timeout=1)


def test_plugin_and_icount_arguments(make_file, debian_vmlinux):
    so = make_file("p.so", b"")
    cmd = qemu.qemu_command(debian_vmlinux, "i.gz", plugin=so,
                            plugin_args={"out": "/tmp/x.bin", "cache": True, "start": "0x401000"})
    assert cmd[cmd.index("-plugin") + 1] == f"{so},out=/tmp/x.bin,cache=on,start=0x401000"
    assert cmd[cmd.index("-icount") + 1] == "shift=0,sleep=off"
    assert cmd[cmd.index("-rtc") + 1] == "base=2020-01-01T00:00:00,clock=vm"
    as_list = qemu.qemu_command(debian_vmlinux, "i.gz", plugin=so, plugin_args=["out=/x", "mode=all"])
    assert as_list[as_list.index("-plugin") + 1] == f"{so},out=/x,mode=all"
    plain = qemu.qemu_command(debian_vmlinux, "i.gz", icount=False)
    assert "-icount" not in plain and "-rtc" not in plain
    with pytest.raises(BadInput, match="commas"):
        qemu.qemu_command(debian_vmlinux, "i.gz", plugin=so, plugin_args={"out": "a,b"})


def test_boot_cli(debian_vmlinux):
    p = run_linepack("boot", "--kernel", debian_vmlinux, "--workload", "vdso", "--loops", "2000",
                     "--no-icount", timeout=300)
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert out[0] == workloads.run_native("vdso", 2000)
    assert out[1].startswith("wall ") and "no icount" in out[1]
    bad = run_linepack("boot", "--kernel", "/etc/hostname")
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "is not a kernel" in bad.stderr
