"""`linepack fetch --flavour`: Debian's generic and PREEMPT_RT kernels beside the cloud one.

Most machines run the generic flavour (`-amd64`); the tests and defaults use the
cloud one. With the flavour, fetch lists and downloads the right packages, and a
workload that loads a module into a generic kernel gets the generic build's module
(before, every kernel the banner did not name as cloud got the 6.1 cloud module,
which a 6.12 generic kernel refuses: another vermagic).
"""

import os

import pytest

import helpers
from linepack import targets
from linepack.image.elf import ElfImage
from linepack.profile import qemu

pytestmark = pytest.mark.realkernel


def test_list_names_the_flavours_releases():
    p = helpers.run_linepack("fetch", "--series", "6.12", "--flavour", "generic", "--list")
    assert p.returncode == 0, p.stderr
    rels = p.stdout.split()
    assert rels and all(r.startswith("6.12.") and r.endswith("+deb13-amd64") for r in rels), rels
    p = helpers.run_linepack("fetch", "--series", "6.12", "--flavour", "rt", "--list")
    assert p.returncode == 0 and p.stdout.split()[-1].endswith("+deb13-rt-amd64"), p.stdout


def test_a_generic_kernel_gets_its_own_modules():
    """The generic 6.12 vmlinuz (a 100 MB download, cached) names its build; the module
    a workload loads into it comes from that build (its vermagic names the release)."""
    z = targets.debian_vmlinuz(series="6.12", flavour="generic")
    rel = os.path.basename(os.path.dirname(z))
    assert rel.endswith("+deb13-amd64") and "cloud" not in rel
    assert qemu.kernel_build(z) == ("6.12", int(rel.split(".")[2].split("+")[0]), "generic")
    ko = qemu.debian_module_for(z, "drivers/block/brd.ko")
    assert os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(ko)))).endswith(rel)
    # the module's .modinfo strings: vermagic=<release> SMP ...
    im = ElfImage(ko)
    sec = next(s for s in im.sections if s.name == ".modinfo")
    strings = bytes(im.section_bytes(sec)).split(b"\0")
    vermagic = next(x for x in strings if x.startswith(b"vermagic="))
    assert vermagic.split()[0] == b"vermagic=" + rel.encode(), vermagic


def test_an_unknown_flavour_is_one_line():
    p = helpers.run_linepack("fetch", "--flavour", "arm64")
    assert p.returncode == 2 and "invalid choice: 'arm64'" in p.stderr


@pytest.mark.qemu
def test_an_ext4_workload_boots_on_the_generic_kernel():
    """Debian's generic kernel has ext4 and what it needs as modules (jbd2, mbcache,
    crc16 by depends=, crc32c by softdep=): the workload loads them from the build,
    in order, and runs (before: 'mount disk: No such device', then 'Cannot load
    crc32c driver')."""
    z = targets.debian_vmlinuz(series="6.12", flavour="generic")
    p = helpers.run_linepack("boot", "--kernel", z, "--workload", "vfs-mix-ext4", "--loops", "3",
                             timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "linepack-result vfs-mix loops=3" in p.stdout
