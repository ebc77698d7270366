"""The workloads added for issue 13 boot as /init of Debian's 6.1 cloud kernel and
print the same result line natively, under QEMU on the stock kernel, and under
QEMU on a `pack` layout of it (trained on one of them, fork-exec).

Budget: about 4 minutes on 2 cores alone (one short profile, one pack relayout,
twelve short boots without -icount).
"""

import os

import pytest

from helpers import run_linepack
from linepack.errors import ExternalToolError
from linepack.profile import kmod, workloads
import helpers

VMLINUX = helpers.debian_vmlinux_path()
RELEASE = helpers.debian_release()
# Small loop counts: the result line, not the measurement, is what is checked here.
LOOPS = {"fork-exec": 20, "tcp-loopback": 50, "epoll": 200, "dirwalk": 2, "fsync": 20,
         "slab-bulk": 100}
_boot_requirements = helpers.requirements("qemu-system-x86_64", vmlinux=True, autouse=False)
qemu_marks = [pytest.mark.realkernel, pytest.mark.qemu, pytest.mark.slow,
              pytest.mark.usefixtures("_boot_requirements")]


@pytest.fixture
def headers():
    """tools/setup.sh installs the headers of the tests' kernel: missing fails."""
    assert os.path.isdir(f"/usr/src/linux-headers-{RELEASE}"), \
        f"linux-headers-{RELEASE} not installed (tools/setup.sh installs it)"


def _expected(name, loops):
    """What the workload must print: its native result, or (kernel module) the counts."""
    if name == "slab-bulk":
        # one round per iteration, 4 passes over bulk sizes 1 + 8 + 32 + 128
        return (f"linepack-result slab-bulk loops={loops} rounds={loops} "
                f"objects={loops * 4 * (1 + 8 + 32 + 128)} failures=0")
    return workloads.run_native(name, loops)


def _boot(kernel, name):
    from linepack.profile.qemu import run_workload
    return run_workload(str(kernel), name, loops=LOOPS[name], icount=False, timeout=300).result_line


def test_at_least_eight_workloads():
    assert len(workloads.names()) >= 8
    assert set(LOOPS) <= set(workloads.names())


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A pack layout of the stock kernel from a short fork-exec profile."""
    work = tmp_path_factory.mktemp("wl-boot")
    prof, out = work / "fork-exec.prof", work / "vmlinux"
    r = run_linepack("profile", "--kernel", VMLINUX, "--workload", "fork-exec", "--loops", 10,
                     "-o", prof, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_linepack("relayout", VMLINUX, "--profile", prof, "--strategy", "pack", "-o", out, "-q",
                     timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _qemu(test):
    for m in qemu_marks:
        test = m(test)
    return test


@_qemu
@pytest.mark.parametrize("name", sorted(LOOPS))
def test_result_line_same_natively_on_stock_and_on_pack(name, packed):
    if name == "slab-bulk":
        assert os.path.isdir(f"/usr/src/linux-headers-{RELEASE}"), \
            f"linux-headers-{RELEASE} not installed (tools/setup.sh installs it)"
    want = _expected(name, LOOPS[name])
    assert _boot(VMLINUX, name) == want
    assert _boot(packed, name) == want


def test_slab_module_builds_against_the_debian_headers_and_is_cached(headers):
    wl = workloads.load("slab-bulk")
    ko = kmod.build_module(wl.module_source, RELEASE)
    assert kmod.build_module(wl.module_source, RELEASE) == ko
    data = open(ko, "rb").read()
    assert data[:4] == b"\x7fELF"
    assert f"vermagic={RELEASE} SMP".encode() in data
    assert b"kmem_cache_alloc_bulk" in data and b"kmem_cache_free_bulk" in data


def test_missing_headers_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("LINEPACK_KERNEL_HEADERS_ROOT", str(tmp_path))
    with pytest.raises(ExternalToolError) as e:
        kmod.build_module(workloads.load("slab-bulk").module_source, RELEASE)
    assert f"linux-headers-{RELEASE}" in str(e.value) and "\n" not in str(e.value)
