"""Shared pytest fixtures."""

import os
import shutil

import pytest

# tmp_path_factory directories of session-scoped fixtures begin so: they outlive the module
# that first asked for them (every other one is removed when its module is done)
SESSION_TMP = "session-"


def session_tmp(tmp_path_factory, name):
    """A directory for a session-scoped fixture (one module's cleanup leaves it)."""
    return tmp_path_factory.mktemp(SESSION_TMP + name)


def pytest_runtest_makereport(item, call):
    if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
        module = getattr(item, "module", None)
        if module is not None:
            module.__dict__["_linepack_failed"] = True


@pytest.fixture(scope="module", autouse=True)
def _module_tmp_cleanup(request, tmp_path_factory):
    """Remove the tmp_path_factory directories a module made (its module fixtures' kernels
    and images, hundreds of MB each) when the module is done and none of its tests failed.
    setup.cfg's tmp_path_retention_policy = failed does the same for each test's tmp_path;
    without both, one full run left 20 GB under /tmp and a CI machine ran out of disk."""
    base = tmp_path_factory.getbasetemp()
    before = set(os.listdir(base))
    yield
    if request.module.__dict__.get("_linepack_failed"):
        return
    for name in set(os.listdir(base)) - before:
        if not name.startswith(SESSION_TMP):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


@pytest.fixture(scope="session")
def debian_vmlinux():
    """Path of Debian's 6.1 cloud vmlinux that helpers.debian_abi() names (fetched and cached
    once); fails when unavailable: tools/setup.sh fetches it."""
    import helpers
    from linepack import targets
    from linepack.errors import LinepackError
    try:
        return targets.debian_vmlinux(helpers.debian_abi())
    except LinepackError as e:
        pytest.fail(f"Debian vmlinux unavailable (tools/setup.sh fetches it): {e}")


@pytest.fixture
def make_file(tmp_path):
    """``make_file(name, data=b"", mode=None)`` writes a file under tmp_path and returns its path."""
    def make(name, data=b"", mode=None):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        if mode is not None:
            os.chmod(path, mode)
        return str(path)
    return make


@pytest.fixture(scope="session")
def stock_held_traces(debian_vmlinux, tmp_path_factory):
    """drgn stack traces of Debian's stock 6.1 kernel parked after 50 VFS-mix loops
    (tests/drgn_stacks.py); shared by the rewritten kernels' drgn checks."""
    from drgn_stacks import held_traces
    return held_traces(debian_vmlinux, session_tmp(tmp_path_factory, "stock-dump"), name="stock")


@pytest.fixture(scope="session")
def kernel_profile(tmp_path_factory):
    """``kernel_profile(vmlinux, loops, workload="vfs-mix")``: the path of ``linepack
    profile --kernel VMLINUX --workload WORKLOAD --loops LOOPS -o PATH``, run once per
    session for each (kernel, workload, loops) and shared by every test that profiles
    with those arguments (a QEMU profile of a kernel is the same bytes each run: the
    tests that shared these each made their own). Tests read it; none may change it."""
    from helpers import run_linepack
    made = {}

    def get(vmlinux, loops, workload="vfs-mix"):
        key = (os.path.realpath(vmlinux), workload, int(loops))
        if key not in made:
            d = session_tmp(tmp_path_factory, "profile")
            out = d / f"{workload}-{int(loops)}.prof"
            r = run_linepack("profile", "--kernel", vmlinux, "--workload", workload,
                             "--loops", int(loops), "-o", out, timeout=900)
            assert r.returncode == 0, r.stderr[-2000:]
            made[key] = out
        return made[key]
    return get


@pytest.fixture(scope="session")
def plugin_so():
    """linepack's QEMU plugin, built once (a missing build fails the test that needs it)."""
    from linepack.errors import LinepackError
    from linepack.profile import plugin_build
    try:
        return plugin_build.build_plugin(log=lambda m: None)
    except LinepackError as e:
        pytest.fail(f"the QEMU plugin cannot be built (tools/setup.sh builds it): {e}")


@pytest.fixture(scope="session")
def plugin(plugin_so):
    """The same plugin, by the name the evaluate tests use."""
    return plugin_so
