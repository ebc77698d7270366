"""Shared pytest fixtures."""

import os

import pytest


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
    return held_traces(debian_vmlinux, tmp_path_factory.mktemp("stock-dump"), name="stock")
