"""A kernel tree prepared for the x86 boot image only, cached per kernel release.

The boot image needs far less than a kernel build: the configured tree
(``olddefconfig``), ``prepare`` (host tools, generated headers, objtool), and a
few generated inputs the boot Makefiles take from the main build
(``capflags.c`` for mkcpustr, ``inat-tables.c`` for the decompressor's SEV
code, ``utsversion.h`` for kaslr.c, the EFI stub's ``lib.a``). The rest of the
boot image (``arch/x86/tools/relocs``, compressed/ and boot/ objects) is then
made by the kernel's own ``bzImage`` target on the given vmlinux.

make runs in the object directory with ``-f SRC/Makefile`` (no O=, so no
sub-make that would drop ``-o vmlinux``, which GNU make never passes down).
Debian's extracted source is linepack's own copy and is built in place; a
packager's ``--source`` tree is never written: its objects go to a separate
object tree (kbuild's O= layout, which needs a clean source tree). The input
vmlinux is never written either. Layout under ``linepack.targets.cache_dir()``::

    ship/<release>/linux-source-6.1/   Debian's source package, extracted, configured,
                                       prepared, boot objects (make.log: last make output)
    ship/<release>/config-<release>    the image package's /boot/config-<release>
    ship/custom-<hash>/build/          the object tree for --source DIR --config FILE
"""

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile

from .. import targets
from ..errors import BadInput, ExternalToolError

# Generated files the boot Makefiles include but only the main build makes,
# each made by building one small object, or for arch/x86/lib the directory: a
# single-target build of arch/x86/lib/inat.o is first tried in arch/x86's
# context, which lacks the rule that generates inat-tables.c.
_BOOT_INPUTS = [
    ("arch/x86/kernel/cpu/capflags.o", None),          # capflags.c: arch/x86/boot/mkcpustr
    ("arch/x86/lib/", None),                           # inat-tables.c: compressed/sev.c
    ("init/version-timestamp.o", None),                # generated/utsversion.h: compressed/kaslr.c
    ("drivers/firmware/efi/libstub/lib.a", "CONFIG_EFI_STUB"),   # linked into compressed/vmlinux
]
_STAMP = "linepack-prepared.json"
_STAMP_VERSION = 1


def read_config(path):
    """{CONFIG_NAME: value} of a kernel .config (``# ... is not set`` lines omitted)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise BadInput(f"{path}: cannot read kernel config: {e.strerror}") from None
    out = {}
    for m in re.finditer(r"^(CONFIG_\w+)=(.*)$", text, re.M):
        out[m.group(1)] = m.group(2).strip().strip('"')
    if not out:
        raise BadInput(f"{path}: not a kernel config (no CONFIG_ lines)")
    return out


def check_config(path, cfg=None):
    """BadInput unless the config builds a relocatable x86-64 boot image."""
    cfg = read_config(path) if cfg is None else cfg
    if cfg.get("CONFIG_X86_64") != "y":
        raise BadInput(f"{path}: not an x86-64 kernel config (CONFIG_X86_64 is not set)")
    if cfg.get("CONFIG_RELOCATABLE") != "y":
        raise BadInput(f"{path}: CONFIG_RELOCATABLE is not set: the boot image would have no "
                       "vmlinux.relocs and KASLR could not move the kernel")
    return cfg


def source_version(src):
    """(VERSION, PATCHLEVEL, SUBLEVEL) from a kernel tree's top Makefile."""
    try:
        with open(os.path.join(src, "Makefile"), encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
    except OSError:
        raise BadInput(f"{src}: not a kernel source tree (no Makefile)") from None
    got = {k: re.search(rf"^{k}\s*=\s*(\d+)", head, re.M) for k in ("VERSION", "PATCHLEVEL",
                                                                      "SUBLEVEL")}
    if not all(got.values()) or not os.path.isdir(os.path.join(src, "arch", "x86", "boot")):
        raise BadInput(f"{src}: not an x86 kernel source tree")
    return tuple(int(got[k].group(1)) for k in ("VERSION", "PATCHLEVEL", "SUBLEVEL"))


@contextlib.contextmanager
def locked(directory):
    """Hold an exclusive lock on a cached tree (two linepack runs share one cache)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class BootTree:
    """A source tree plus an object tree prepared for ``make bzImage``."""

    def __init__(self, src, build, release, kbuild_env, jobs=None, log=None):
        self.src, self.build, self.release = os.path.abspath(src), os.path.abspath(build), release
        self.kbuild_env = dict(kbuild_env)
        self.make_vars = {}
        self.jobs = jobs or os.cpu_count() or 1
        self.log = log or (lambda msg: None)
        self.make_log = os.path.join(self.build, "make.log")

    def make(self, *goals, jobs=None, old=("vmlinux",)):
        """Run the kernel's make in the object tree; ExternalToolError with the first
        error line when it fails (the whole output is in make.log)."""
        cmd = ["make", "-f", os.path.join(self.src, "Makefile"), f"-j{jobs or self.jobs}",
               f"KERNELRELEASE={self.release}"] + [f"{k}={v}" for k, v in self.make_vars.items()]
        for name in old:
            cmd += ["-o", name]
        cmd += list(goals)
        env = dict(os.environ, LC_ALL="C", **self.kbuild_env)
        env.pop("MAKEFLAGS", None)
        with open(self.make_log, "ab") as logf:
            logf.write(("$ " + " ".join(cmd) + "\n").encode())
            logf.flush()
            try:
                p = subprocess.run(cmd, cwd=self.build, env=env, stdin=subprocess.DEVNULL,
                                   stdout=logf, stderr=subprocess.STDOUT)
            except FileNotFoundError:
                raise ExternalToolError("'make' is not installed (run tools/setup.sh)") from None
        if p.returncode:
            raise ExternalToolError(f"kernel make {' '.join(goals)} failed: "
                                    f"{_first_error(self.make_log)} (log: {self.make_log})")

    def prepare(self, config):
        """Configure and prepare the object tree once per (config, release, build strings)."""
        with open(config, "rb") as f:
            config_bytes = f.read()
        self.make_vars = compiler_vars(read_config(config))
        key = {"stamp": _STAMP_VERSION, "release": self.release, "src": self.src,
               "config": hashlib.sha256(config_bytes).hexdigest(), "env": self.kbuild_env,
               "vars": self.make_vars}
        stamp = os.path.join(self.build, _STAMP)
        if _read_json(stamp) == key:
            return False
        os.makedirs(self.build, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stamp)
        with open(self.make_log, "wb"):
            pass
        self.log(f"preparing the boot-image tree for {self.release} in {self.build} "
                 "(once per release: olddefconfig, prepare, boot inputs)")
        with open(os.path.join(self.build, ".config"), "wb") as f:
            f.write(config_bytes)
        self.make("olddefconfig")
        cfg = check_config(os.path.join(self.build, ".config"))
        self.make("prepare")
        for goal, needs in _BOOT_INPUTS:
            if needs is None or cfg.get(needs) == "y":
                self.make(goal)
        with open(stamp, "w") as f:
            json.dump(key, f, sort_keys=True)
        return True


def compiler_vars(cfg):
    """CC=<the compiler the config was made with> when that command exists here.

    The boot image embeds the compiler's name (the banner string in kaslr.c):
    Debian builds with CC=gcc-12, and with the same command the bzImage is
    byte-identical to Debian's (before signing)."""
    words = cfg.get("CONFIG_CC_VERSION_TEXT", "").split()
    cc = words[0] if words else ""
    if re.fullmatch(r"(gcc|clang)(-\d+)?", cc) and shutil.which(cc):
        return {"CC": cc}
    return {}


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _first_error(log_path):
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "no output"
    for ln in lines:
        if re.search(r"(fatal )?error:|\*\*\* ", ln) and "Waiting for unfinished" not in ln:
            return ln.strip()
    return lines[-1].strip() if lines else "no output"


# -- Debian's source package ----------------------------------------------------
def _apt_versions(package):
    """Versions of a package in the apt lists (apt-cache madison), newest first."""
    try:
        p = subprocess.run(["apt-cache", "madison", package], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise ExternalToolError("apt-cache is not installed: give --source DIR --config FILE") \
            from None
    return [ln.split("|")[1].strip() for ln in p.stdout.splitlines() if ln.count("|") >= 2]


def debian_source(info, log=None):
    """The extracted ``linux-source-X.Y`` tree of exactly the vmlinux's Debian version."""
    series = f"{info.version[0]}.{info.version[1]}"
    package = f"linux-source-{series}"
    root = os.path.join(targets.cache_dir(), "ship", info.release)
    dest = os.path.join(root, package)
    stamp = os.path.join(dest, ".linepack-debian-version")
    if os.path.isfile(stamp):
        with open(stamp) as f:
            if f.read().strip() == info.debian_version:
                return dest
    # Another upload of the same release (or a half-made tree): fetch again.
    shutil.rmtree(dest, ignore_errors=True)
    versions = _apt_versions(package)
    if info.debian_version not in versions:
        have = ", ".join(versions) if versions else "none"
        raise BadInput(f"no {package} {info.debian_version} in the apt lists (found: {have}): "
                       "the boot image must come from the vmlinux's own source; give --source "
                       "DIR --config FILE")
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        if log:
            log(f"downloading {package}={info.debian_version} with apt-get")
        p = subprocess.run(["apt-get", "download", "-q", f"{package}={info.debian_version}"],
                           cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        debs = [n for n in os.listdir(tmp) if n.endswith(".deb")]
        if p.returncode or not debs:
            last = (p.stderr.strip().splitlines() or ["no .deb"])[-1]
            raise ExternalToolError(f"apt-get download {package}={info.debian_version} failed: "
                                    f"{last}")
        deb = os.path.join(tmp, debs[0])
        if log:
            log(f"extracting {package} (about 1.5 GB)")
        # dpkg-deb | tar -xO the tarball | xz -d | tar -x: no copy of the tarball on disk.
        sh = (f"dpkg-deb --fsys-tarfile {shlex.quote(deb)} | tar -xO ./usr/src/{package}.tar.xz "
              f"| xz -dc -T0 | tar -x -C {shlex.quote(tmp)}")
        p = subprocess.run(["bash", "-o", "pipefail", "-c", sh], stderr=subprocess.PIPE, text=True)
        if p.returncode or not os.path.isdir(os.path.join(tmp, package)):
            raise ExternalToolError(f"cannot extract {package}: {p.stderr.strip()[-200:]}")
        with open(os.path.join(tmp, package, ".linepack-debian-version"), "w") as f:
            f.write(info.debian_version + "\n")
        os.replace(os.path.join(tmp, package), dest)
    return dest


def debian_config(info, log=None):
    """The image package's /boot/config-<release> (the config the vmlinux was built with)."""
    dest = os.path.join(targets.cache_dir(), "ship", info.release, f"config-{info.release}")
    if os.path.exists(dest):
        return dest
    try:
        deb = targets.download_deb(f"linux-image-{info.release}", log=log)
    except ExternalToolError:
        raise BadInput(f"no linux-image-{info.release} package to take the kernel config from: "
                       "give --config FILE") from None
    targets._extract(deb, f"boot/config-{info.release}", dest)
    return dest


def debian_tree(info, jobs=None, log=None):
    """(BootTree, config path) for a Debian vmlinux, fetched and prepared once."""
    if not info.debian_version or not info.version:
        raise BadInput(f"kernel {info.release} is not a Debian build (its banner names no Debian "
                       "version): give --source DIR --config FILE")
    src = debian_source(info, log=log)
    config = debian_config(info, log=log)
    # Built in place: the extracted tree is linepack's own copy (an O= object tree
    # would miss inat-tables.c, which 6.1's arch/x86/lib generates only in-tree).
    return BootTree(src, src, info.release, info.kbuild_env(), jobs=jobs, log=log), config


def custom_tree(src, config, info, jobs=None, log=None):
    """(BootTree, config) for a packager's own source tree; the object tree is cached
    per (source path, config, release) so the source tree is never written."""
    if info.version and source_version(src) != tuple(info.version):
        have = ".".join(map(str, source_version(src)))
        want = ".".join(map(str, info.version))
        raise BadInput(f"{src} is Linux {have} but the vmlinux is {want}: use the source it "
                       "was built from")
    with open(config, "rb") as f:
        h = hashlib.sha256(os.path.realpath(src).encode() + b"\0" + f.read()
                           + info.release.encode()).hexdigest()[:16]
    build = os.path.join(targets.cache_dir(), "ship", f"custom-{h}", "build")
    return BootTree(src, build, info.release, info.kbuild_env(), jobs=jobs, log=log), config
