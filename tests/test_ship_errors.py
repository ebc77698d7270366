"""`linepack bzimage` on bad input: one line on stderr, exit 2, no output file; and
the banner parsing that picks the source package and the build strings."""

import os
import subprocess

import pytest

from helpers import run_linepack
import helpers

VMLINUX = helpers.debian_vmlinux_path()
DEBIAN_BANNER = ("Linux version 6.1.0-41-cloud-amd64 (debian-kernel@lists.debian.org) (gcc-12 "
                 "(Debian 12.2.0-14+deb12u1) 12.2.0, GNU ld (GNU Binutils for Debian) 2.40) #1 "
                 "SMP PREEMPT_DYNAMIC Debian 6.1.192-2 (2026-11-16)\n")


def test_parse_debian_banner():
    from linepack.ship.banner import parse_banner
    b = parse_banner(DEBIAN_BANNER)
    assert b.release == "6.1.0-41-cloud-amd64"
    assert b.version == (6, 1, 192) and b.debian_version == "6.1.192-2"
    assert b.kbuild_env() == {"KBUILD_BUILD_USER": "debian-kernel",
                              "KBUILD_BUILD_HOST": "lists.debian.org",
                              "KBUILD_BUILD_VERSION": "1",
                              "KBUILD_BUILD_TIMESTAMP": "Debian 6.1.192-2 (2026-11-16)"}


def test_parse_plain_kbuild_banner():
    from linepack.ship.banner import parse_banner
    b = parse_banner("Linux version 6.12.9-lp (me@box) (gcc (GCC) 14.2.0, GNU ld 2.43) #3 SMP "
                     "PREEMPT Tue Jan  7 10:00:00 UTC 2025")
    assert (b.release, b.version, b.number, b.debian_version) == ("6.12.9-lp", (6, 12, 9), "3", None)
    assert b.timestamp == "Tue Jan 7 10:00:00 UTC 2025"


def test_not_a_banner_is_bad_input():
    from linepack.errors import BadInput
    from linepack.ship.banner import parse_banner
    with pytest.raises(BadInput, match="no Linux version banner"):
        parse_banner("hello")


def _one_line_exit2(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("linepack: error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_config_not_relocatable(tmp_path):
    from linepack.errors import BadInput
    from linepack.ship.tree import check_config
    cfg = tmp_path / "config"
    cfg.write_text("CONFIG_X86_64=y\n# CONFIG_RELOCATABLE is not set\n")
    with pytest.raises(BadInput, match="CONFIG_RELOCATABLE is not set"):
        check_config(str(cfg))
    if os.path.exists(VMLINUX):
        out = tmp_path / "bz"
        _one_line_exit2(run_linepack("bzimage", VMLINUX, "-o", out, "--config", cfg),
                        "CONFIG_RELOCATABLE is not set")
        assert not out.exists()


def test_source_needs_config(tmp_path):
    assert os.path.exists(VMLINUX), f"no cached vmlinux at {VMLINUX} (tools/setup.sh fetches it)"
    _one_line_exit2(run_linepack("bzimage", VMLINUX, "-o", tmp_path / "bz", "--source", tmp_path),
                    "--source needs --config")


def test_not_a_kernel(tmp_path):
    _one_line_exit2(run_linepack("bzimage", "/bin/sh", "-o", tmp_path / "bz"))
    assert not (tmp_path / "bz").exists()


def test_vmlinux_without_relocations(tmp_path):
    assert os.path.exists(VMLINUX), f"no cached vmlinux at {VMLINUX} (tools/setup.sh fetches it)"
    helpers.require_tool("objcopy")
    """What a 6.5+ build leaves: the relocations stripped after vmlinux.relocs."""
    stripped = tmp_path / "vmlinux.norelocs"
    subprocess.run(["objcopy", "--remove-relocations=*", VMLINUX, str(stripped)], check=True)
    out = tmp_path / "bz"
    _one_line_exit2(run_linepack("bzimage", stripped, "-o", out), "no link relocations",
                    "Makefile.postlink")
    assert not out.exists()


def test_output_directory_missing(tmp_path):
    _one_line_exit2(run_linepack("bzimage", "/bin/sh", "-o", tmp_path / "no" / "bz"),
                    "does not exist")
