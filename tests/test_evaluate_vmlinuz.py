"""evaluate's layouts of a kernel without link relocations (Debian 13's 6.12 -dbg
vmlinux, as shipped): ``--vmlinuz`` gives the boot image the references are
recovered from, as for ``relayout --vmlinuz``; without it, one clear line before
any recording or boot."""

import json

import pytest

from helpers import run_linepack
import helpers

pytestmark = [pytest.mark.realkernel]
SERIES = "6.12"


@pytest.fixture(scope="module")
def shipped():
    from linepack import targets
    from linepack.errors import LinepackError
    try:
        return targets.debian_vmlinux(series=SERIES), targets.debian_vmlinuz(series=SERIES)
    except LinepackError as e:
        pytest.fail(f"Debian {SERIES} kernel unavailable (linepack fetch --series {SERIES}): {e}")


@pytest.mark.parametrize("layout", ["pack", "blocks"])
def test_layouts_of_a_relocationless_kernel_need_its_vmlinuz(shipped, tmp_path, layout):
    vmlinux, _ = shipped
    p = run_linepack("evaluate", "--kernel", vmlinux, "--layout", "stock", "--layout", layout,
                     "--whatif", "--json", tmp_path / "e.json", timeout=300)
    line = helpers.refusal_line(p)
    assert "no link relocations" in line and "--vmlinuz VMLINUZ" in line, line
    assert not any(tmp_path.iterdir())


def test_a_missing_vmlinuz_is_one_line(shipped, tmp_path):
    vmlinux, _ = shipped
    p = run_linepack("evaluate", "--kernel", vmlinux, "--vmlinuz", tmp_path / "nope",
                     "--layout", "pack", "--whatif", timeout=300)
    assert "no such boot image (--vmlinuz)" in helpers.refusal_line(p)


def test_an_output_on_the_vmlinuz_is_refused(shipped, tmp_path):
    vmlinux, _ = shipped
    z = tmp_path / "vmlinuz"
    z.write_bytes(b"not touched")
    p = run_linepack("evaluate", "--kernel", vmlinux, "--vmlinuz", z, "--layout", "pack",
                     "--whatif", "--json", z, timeout=300)
    helpers.refusal_line(p)
    assert z.read_bytes() == b"not touched"


@pytest.mark.qemu
def test_whatif_layouts_from_the_vmlinuz(shipped, tmp_path):
    """The trace of one boot of the stock kernel replayed under ``pack`` rewritten
    with the recovered references: a row per layout and cache model, the same
    kernel work, fewer misses for the profile's own workload."""
    helpers.requirements("qemu-system-x86_64")
    vmlinux, vmlinuz = shipped
    out = tmp_path / "e.json"
    p = run_linepack("evaluate", "--kernel", vmlinux, "--vmlinuz", vmlinuz, "--layout", "stock",
                     "--layout", "pack", "--whatif", "--loops", 20, "--cache", "intel-32k-8w",
                     "--cache", "amd-64k-2w", "--json", out, timeout=1800)
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    rows = json.loads(out.read_text())["results"]
    got = {(r["layout"], r["cache"]): r for r in rows}
    assert set(got) == {(l, c) for l in ("stock", "pack") for c in ("intel-32k-8w", "amd-64k-2w")}
    for c in ("intel-32k-8w", "amd-64k-2w"):
        stock, pack = got["stock", c], got["pack", c]
        assert pack["instructions"] == stock["instructions"]
        assert 0 < pack["misses"] < stock["misses"], (c, pack["misses"], stock["misses"])
        assert pack["text_growth_bytes"] is not None
