"""linepack's kbuild post-link hook (tools/ship/linepack-postlink.mk) and the
`linepack kbuild` verb's bad-input errors, cheaply.

The hook is run the way kbuild runs ARCH_POSTLINK (`make -f $(ARCH_POSTLINK)
vmlinux` in the object tree, srctree/SRCARCH in the environment) on a small C
program linked with --emit-relocs standing in for vmlinux, with a stand-in for
x86's Makefile.postlink that does what 6.5+ does: record what it sees, then strip
the relocations with the same objcopy flags. The real 6.12 kernel build is
tests/test_kbuild_612.py (slow, opt-in).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import FIXTURES, run_linepack
import helpers

from linepack.image.elf import ElfImage
from linepack.ship.kbuild import HOOK

# x86's post-link step since 6.5 (arch/x86/Makefile.postlink), minus the relocs
# tool: it fingerprints the vmlinux it is given, then strips the relocations.
ARCH_POSTLINK = """\
vmlinux: FORCE
\tsha256sum $@ | cut -d' ' -f1 > $@.seen-by-arch
\treadelf -r $@ | grep -c R_X86_64 > $@.relocs-seen || true
\t$(OBJCOPY) --remove-section='.rel.*' --remove-section='.rel__*' \\
\t\t--remove-section='.rela.*' --remove-section='.rela__*' $@
%.ko: FORCE
\ttouch $@.arch-postlink
clean:
\trm -f vmlinux.seen-by-arch
FORCE:
.PHONY: FORCE clean
"""

_requirements = helpers.requirements("make", "objcopy", "gcc")


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _text(path):
    img = ElfImage(str(path))
    return bytes(img.section_bytes(img.section(".text")))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A fake srctree (arch/x86/Makefile.postlink) and the program as 'vmlinux'."""
    d = tmp_path_factory.mktemp("kbhook")
    (d / "src" / "arch" / "x86").mkdir(parents=True)
    (d / "src" / "arch" / "x86" / "Makefile.postlink").write_text(ARCH_POSTLINK)
    exe = d / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(FIXTURES, "c", "hotloop.c")], check=True)
    (d / "p.json").write_text(json.dumps({"functions": {"crunch.constprop.0": 100, "mix": 10,
                                                        "main": 1}}))
    return d


def _objtree(built, tmp_path):
    obj = tmp_path / "obj"
    obj.mkdir()
    shutil.copy2(built / "prog", obj / "vmlinux")
    sysmap = subprocess.run(["nm", "-n", str(obj / "vmlinux")], stdout=subprocess.PIPE,
                            text=True, check=True).stdout
    (obj / "System.map").write_text(sysmap)
    return obj


def _run_hook(obj, built, *make_vars, target="vmlinux"):
    env = dict(os.environ, srctree=str(built / "src"), SRCARCH="x86", OBJCOPY="objcopy")
    env.pop("MAKEFLAGS", None)
    return subprocess.run(["make", "-f", HOOK, target,
                           f"LINEPACK={sys.executable} -m linepack", *make_vars],
                          cwd=obj, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)


def _output(exe):
    return subprocess.run([str(exe), "3"], stdout=subprocess.PIPE, text=True, check=True).stdout


def test_hook_relayouts_before_the_arch_strip(built, tmp_path):
    obj = _objtree(built, tmp_path)
    orig_sha = _sha(obj / "vmlinux")
    old_map = (obj / "System.map").read_text()
    r = _run_hook(obj, built, f"LINEPACK_PROFILE={built / 'p.json'}")
    assert r.returncode == 0, r.stdout
    # the link's own vmlinux is kept, unchanged, with its relocations
    assert _sha(obj / "vmlinux.linepack-orig") == orig_sha
    assert ElfImage(str(obj / "vmlinux.linepack-orig")).has_link_relocations()
    # the architecture's step got relayout's output (relocations still in) ...
    assert (obj / "vmlinux.seen-by-arch").read_text().strip() == _sha(obj / "vmlinux.linepack")
    assert int((obj / "vmlinux.relocs-seen").read_text()) > 0
    assert ElfImage(str(obj / "vmlinux.linepack")).has_link_relocations()
    # ... and stripped it, as 6.5+ does: what the build ships has none
    assert not ElfImage(str(obj / "vmlinux")).has_link_relocations()
    # the code that ships is the relaid code, not the original's
    assert _text(obj / "vmlinux") == _text(obj / "vmlinux.linepack")
    assert _text(obj / "vmlinux") != _text(obj / "vmlinux.linepack-orig")
    rep = json.loads((obj / "vmlinux.linepack.json").read_text())
    assert rep and (obj / "vmlinux.linepack-layout.tsv").stat().st_size > 0
    # System.map (link-vmlinux.sh wrote it before the hook) follows the new layout
    new_map = (obj / "System.map").read_text()
    assert new_map != old_map
    nm_new = subprocess.run(["nm", "-n", str(obj / "vmlinux.linepack")], stdout=subprocess.PIPE,
                            text=True, check=True).stdout
    crunch = [ln.split()[0] for ln in nm_new.splitlines() if ln.endswith(" crunch.constprop.0")]
    assert crunch and any(ln.startswith(crunch[0]) and ln.endswith("crunch.constprop.0")
                          for ln in new_map.splitlines())
    # the relaid program computes the same result (run unstripped: the x86 strip
    # flags also drop a userspace program's .rela.plt/.rela.dyn)
    os.chmod(obj / "vmlinux.linepack", 0o755)
    assert _output(obj / "vmlinux.linepack") == _output(built / "prog")


def test_hook_without_profile_only_keeps_the_unstripped_copy(built, tmp_path):
    obj = _objtree(built, tmp_path)
    orig_sha = _sha(obj / "vmlinux")
    r = _run_hook(obj, built)
    assert r.returncode == 0, r.stdout
    assert _sha(obj / "vmlinux.linepack-orig") == orig_sha
    assert (obj / "vmlinux.seen-by-arch").read_text().strip() == orig_sha
    assert not (obj / "vmlinux.linepack").exists()
    assert not ElfImage(str(obj / "vmlinux")).has_link_relocations()
    assert _text(obj / "vmlinux") == _text(obj / "vmlinux.linepack-orig")


def test_hook_failure_fails_the_build(built, tmp_path):
    """No silent fallback: a relayout error stops make before the arch step."""
    obj = _objtree(built, tmp_path)
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"functions": {"mix": 1}, "build_id": "00" * 20}))
    r = _run_hook(obj, built, f"LINEPACK_PROFILE={bad}")
    assert r.returncode != 0
    assert "linepack: error:" in r.stdout and "build-id" in r.stdout, r.stdout
    assert not (obj / "vmlinux.seen-by-arch").exists()


def test_hook_passes_modules_to_the_arch_step(built, tmp_path):
    obj = _objtree(built, tmp_path)
    (obj / "m.ko").write_bytes(b"")
    r = _run_hook(obj, built, target="m.ko")
    assert r.returncode == 0, r.stdout
    assert (obj / "m.ko.arch-postlink").exists()


def _one_line_exit2(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("linepack: error:"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_stripped_image_names_the_hook(built, tmp_path):
    """What a 6.5+ build leaves (the hook's own stripped output): relayout refuses it
    in one line that names the kbuild hook."""
    obj = _objtree(built, tmp_path)
    assert _run_hook(obj, built).returncode == 0
    _one_line_exit2(run_linepack("relayout", obj / "vmlinux", "--profile", built / "p.json",
                                 "-o", tmp_path / "new"),
                    "no link relocations", "linepack kbuild", "ARCH_POSTLINK")
    assert not (tmp_path / "new").exists()


def test_print_hook():
    r = run_linepack("kbuild", "--print-hook")
    assert r.returncode == 0 and r.stdout.strip() == HOOK and os.path.isfile(HOOK)


CONFIG = os.path.join(os.path.dirname(os.path.dirname(FIXTURES)), "configs", "kbuild",
                      "x86_64-small.config")


def test_kbuild_no_source_package(tmp_path):
    helpers.require_tool("apt-cache")
    _one_line_exit2(run_linepack("kbuild", "--debian", "linux-source-6.99", "--config", CONFIG,
                                 "-o", tmp_path / "out"), "no linux-source-6.99 in the apt lists")
    _one_line_exit2(run_linepack("kbuild", "--debian", "linux-source-6.12=0.0-0", "--config",
                                 CONFIG, "-o", tmp_path / "out"), "no linux-source-6.12 0.0-0")
    assert not (tmp_path / "out").exists()


def test_kbuild_config_not_relocatable(tmp_path):
    """Checked before any download or build (the package named does not exist)."""
    cfg = tmp_path / "config"
    cfg.write_text("CONFIG_X86_64=y\n# CONFIG_RELOCATABLE is not set\n")
    _one_line_exit2(run_linepack("kbuild", "--debian", "linux-source-6.99", "--config", cfg,
                                 "-o", tmp_path / "out"), "CONFIG_RELOCATABLE is not set")
    cfg.write_text("CONFIG_ARM64=y\nCONFIG_RELOCATABLE=y\n")
    _one_line_exit2(run_linepack("kbuild", "--source", tmp_path, "--config", cfg,
                                 "-o", tmp_path / "out"), "not an x86-64 kernel config")


def test_kbuild_usage_errors(tmp_path):
    _one_line_exit2(run_linepack("kbuild", "--config", CONFIG, "-o", tmp_path / "o"),
                    "--source DIR or --debian")
    _one_line_exit2(run_linepack("kbuild", "--source", tmp_path, "-o", tmp_path / "o"),
                    "--config")
    _one_line_exit2(run_linepack("kbuild", "--source", tmp_path, "--config", CONFIG,
                                 "-o", tmp_path / "o"), "not a kernel source tree")
    _one_line_exit2(run_linepack("kbuild", "--source", tmp_path, "--config", CONFIG,
                                 "--profile", tmp_path / "nope", "-o", tmp_path / "o"),
                    "no such profile")


def test_kbuild_output_dir_checked_before_work(tmp_path):
    """-o is replaced as a whole: a directory kbuild did not write, one holding an input,
    or one inside the source tree is refused before any build, and left as it was."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "Makefile").write_text("VERSION = 6\nPATCHLEVEL = 12\nSUBLEVEL = 0\n")
    (src / "arch" / "x86" / "boot").mkdir(parents=True)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("user data")
    _one_line_exit2(run_linepack("kbuild", "--source", src, "--config", CONFIG, "-o", mine),
                    "was not written by linepack kbuild")
    assert (mine / "keep.txt").read_text() == "user data"
    cfg = mine / "my.config"
    cfg.write_bytes(open(CONFIG, "rb").read())
    _one_line_exit2(run_linepack("kbuild", "--source", src, "--config", cfg, "-o", mine),
                    "holds the input")
    _one_line_exit2(run_linepack("kbuild", "--source", src, "--config", CONFIG,
                                 "-o", src / "out"), "inside the input")
    _one_line_exit2(run_linepack("kbuild", "--source", src, "--config", CONFIG,
                                 "-o", tmp_path / "nodir" / "out"), "does not exist")
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt", "my.config"]
    assert not (src / "out").exists()
