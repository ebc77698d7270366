"""References recovered without link relocations, proven on Debian's 6.1 cloud
kernel, which keeps its ``.rela.*`` (the truth): ``linepack references`` finds
every link relocation whose field or target lies in movable code (0 missing),
and ``relayout --vmlinuz`` of a relocation-stripped copy (objcopy
--remove-relocations='*' --strip-debug: the -dbg vmlinux as 6.5+ ships it, less
the DWARF) writes the same allocated sections as relayout from the link
relocations. Heavy (the 590 MB vmlinux): run under the shared lock."""

import json
import os
import shutil
import subprocess

import pytest

from linepack import targets
from linepack.errors import LinepackError
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
import helpers
from references_same import relayout_both

VMLINUX = helpers.debian_vmlinux_path()
pytestmark = [pytest.mark.realkernel,
              pytest.mark.skipif(not os.path.exists(VMLINUX), reason="no cached vmlinux"),
              pytest.mark.skipif(shutil.which("objcopy") is None, reason="no objcopy")]


@pytest.fixture(scope="module")
def vmlinuz():
    try:
        return targets.debian_vmlinuz()
    except LinepackError as e:
        pytest.skip(f"Debian 6.1 vmlinuz unavailable: {e}")


@pytest.fixture(scope="module")
def stripped(tmp_path_factory):
    out = tmp_path_factory.mktemp("stripped") / "vmlinux.norela"
    subprocess.run(["objcopy", "--remove-relocations=*", "--strip-debug", VMLINUX, str(out)],
                   check=True)
    assert not ElfImage(str(out)).has_link_relocations()
    return str(out)


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A synthetic hotness map over real function names (as test_relayout_vmlinux)."""
    ft = FunctionTable(ElfImage(VMLINUX))
    names = [n for n in ("vfs_write", "vfs_read", "do_sys_openat2", "path_openat", "ksys_lseek",
                         "_raw_spin_lock", "schedule", "memcpy", "kmem_cache_alloc")
             if ft.index_of(n) is not None]
    names += [ft.name[i] for i in range(100, 40000, 50)]
    p = tmp_path_factory.mktemp("prof") / "prof.json"
    p.write_text(json.dumps({"functions": {n: 1000 - k % 900 for k, n in enumerate(names)}}))
    return str(p)


def test_nothing_missing(vmlinuz, tmp_path):
    out = tmp_path / "refs.json"
    r = helpers.run_linepack("references", VMLINUX, "--vmlinuz", vmlinuz, "--json", out)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rep = json.loads(out.read_text())
    c = rep["against_link_relocations"]
    assert c["missing"] == 0 and c["wrong_target"] == 0, c["examples"]
    assert c["relevant"] > 700_000 and c["recovered"] == c["relevant"]
    for name in (".text", ".orc_unwind_ip", ".return_sites", ".rodata", "__ksymtab", ".data"):
        assert c["by_section"][name]["missing"] == 0
    rec = rep["recovered"]
    # the per-CPU PC32 fields the table lists are all found in code
    assert rec["percpu_pc32"] > 0 and rec["percpu_pc32_not_in_code"] == 0
    assert "missing" in r.stdout and ".orc_unwind_ip" in r.stdout


def test_relayout_pack_same_as_link(vmlinuz, stripped, profile, tmp_path):
    sa, sb, differ = relayout_both(VMLINUX, stripped, vmlinuz, profile, "pack", tmp_path)
    assert sa["units_moved"] == sb["units_moved"] > 1000
    assert differ == []
    ref = sb["references"]
    # every pin the recovery adds has its reason counted (on 6.1 the unexplained
    # values are data that merely looks like s32 offsets: the link has no
    # relocation there, test_nothing_missing), and they are a small share
    assert len(ref["pinned_units"]) == (ref["unexplained"]["functions_pinned"] +
                                        ref["label_arithmetic_units_pinned"] +
                                        ref["boundary_units_pinned"])
    assert 0 < len(ref["pinned_units"]) < 0.01 * sb["units"]


def test_stripped_refused_without_vmlinuz(stripped, tmp_path):
    r = helpers.run_linepack("relayout", stripped, "--strategy", "stock", "-o", tmp_path / "o")
    assert r.returncode == 2 and "--vmlinuz" in r.stderr
    assert not (tmp_path / "o").exists()


def test_blocks_from_vmlinuz_refused_when_kallsyms_must_grow(vmlinuz, stripped, tmp_path):
    """blocks from recovered references: kallsyms' arrays would have to grow past
    __end_rodata, whose uses (PFN_ALIGN arithmetic) the KASLR table does not all list,
    so __end_rodata may not move: relayout says so in one line and writes nothing
    (a kernel without .cold kallsyms entries fails verify)."""
    prof = tmp_path / "vfs.prof"
    r = helpers.run_linepack("profile", "--kernel", VMLINUX, "--workload", "vfs-mix",
                             "--loops", 20, "-o", prof, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "o"
    r = helpers.run_linepack("relayout", stripped, "--vmlinuz", vmlinuz, "--profile", prof,
                             "--strategy", "blocks", "--strip-debug", "-q", "-o", out)
    assert r.returncode == 2, r.stdout + r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "__end_rodata" in err[0] and "nothing written" in err[0], err
    assert not out.exists()
