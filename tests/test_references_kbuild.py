"""References recovered without link relocations on a 6.12 kernel the kbuild
hook built (tests/test_kbuild_612.py; IBT and call-depth tracking on: 16-byte
``__pfx_`` padding before each function, ``.call_sites``): its
``vmlinux.linepack`` keeps the link relocations (the truth) and its bzImage
carries the KASLR table of that same vmlinux. 0 missing; relayout from the
recovered references writes the link's allocated sections. Skipped when no
build of configs/kbuild/x86_64-small.config (as it is now) is cached."""

import glob
import hashlib
import os
import shutil
import subprocess

import pytest

from linepack import targets
from linepack.image.bootimage import read_vmlinuz
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
import helpers
from references_same import relayout_both

pytestmark = pytest.mark.skipif(shutil.which("objcopy") is None, reason="no objcopy")
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "configs", "kbuild", "x86_64-small.config")


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """A private copy (the build directory may be rebuilt meanwhile) of the
    object tree of this config (named by its hash: linepack/ship/kbuild.py)."""
    with open(CONFIG, "rb") as f:
        tag = hashlib.sha256(f.read()).hexdigest()[:16]
    for d in sorted(glob.glob(os.path.join(targets.cache_dir(), "kbuild", f"6.12*-{tag}"))):
        v, z = os.path.join(d, "vmlinux.linepack"), os.path.join(d, "arch/x86/boot/bzImage")
        if not (os.path.exists(v) and os.path.exists(z)):
            continue
        out = tmp_path_factory.mktemp("kbuild")
        shutil.copyfile(v, out / "vmlinux")
        shutil.copyfile(z, out / "bzImage")
        if read_vmlinuz(str(out / "bzImage")).build_id != ElfImage(str(out / "vmlinux")).build_id:
            continue          # rebuilt between the two copies
        stripped = out / "vmlinux.norela"
        subprocess.run(["objcopy", "--remove-relocations=*", "--strip-debug", str(out / "vmlinux"),
                        str(stripped)], check=True)
        return str(out / "vmlinux"), str(out / "bzImage"), str(stripped)
    pytest.skip("no 6.12 kbuild output cached (tests/test_kbuild_612.py builds one)")


def test_nothing_missing(build, tmp_path):
    vmlinux, bz, _ = build
    out = tmp_path / "refs.json"
    r = helpers.run_linepack("references", vmlinux, "--vmlinuz", bz, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    import json
    c = json.loads(out.read_text())["against_link_relocations"]
    assert c["missing"] == 0 and c["wrong_target"] == 0 and c["relevant"] > 100_000, c["examples"]
    # tables 6.12 adds, recovered by their own modules
    for name in (".ibt_endbr_seal", ".return_sites", ".call_sites", "runtime_ptr_USER_PTR_MAX"):
        assert c["by_section"][name]["relevant"] > 0 and c["by_section"][name]["missing"] == 0


def test_relayout_pack_same_as_link(build, tmp_path):
    vmlinux, bz, stripped = build
    ft = FunctionTable(ElfImage(vmlinux))
    prof = tmp_path / "prof.json"
    import json
    # sparse: the input is already a relayout output (its padding budget is spent)
    prof.write_text(json.dumps({"functions": {ft.name[i]: 1000 - i % 900
                                              for i in range(10, len(ft), 400)}}))
    sa, sb, differ = relayout_both(vmlinux, stripped, bz, str(prof), "pack", tmp_path)
    assert sa["units_moved"] == sb["units_moved"] > 1000
    assert differ == []
    # and verify proves it against the stripped input it came from
    r = helpers.run_linepack("verify", tmp_path / "recovered.pack", "--against", stripped, "-q")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


def test_vmlinuz_of_another_build_refused(build, tmp_path):
    """Debian 6.1's vmlinuz with the 6.12 kbuild vmlinux: one line, exit 2, nothing written."""
    vmlinux, _, stripped = build
    other = os.path.join(targets.cache_dir(), "kernels", helpers.debian_release(), "vmlinuz")
    if not os.path.exists(other):
        pytest.skip("no cached Debian 6.1 vmlinuz")
    out = tmp_path / "o"
    r = helpers.run_linepack("relayout", stripped, "--vmlinuz", other, "--strategy", "stock",
                             "-o", out, "-q")
    assert r.returncode == 2 and "another build" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not out.exists()
    r = helpers.run_linepack("references", vmlinux, "--vmlinuz", other, "-q")
    assert r.returncode == 2 and "another build" in r.stderr, r.stderr
