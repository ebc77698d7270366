"""A whole kernel build with linepack's post-link hook: for kernels that strip
their relocations (6.5+), linepack runs inside the build.

Since Linux 6.5, x86's post-link step writes ``vmlinux.relocs`` and then strips
the link relocations from ``vmlinux``; relayout needs them, so it must run in
between. ``linepack-postlink.mk`` (next to this file) is that step: kbuild runs
``$(MAKE) -f $(ARCH_POSTLINK) vmlinux`` right after link-vmlinux.sh, and
``make ARCH_POSTLINK=<hook>`` puts linepack there, which then hands over to the
architecture's own Makefile.postlink (relocs, strip), so ``vmlinux.relocs``, the
bzImage and the modules come from the optimized vmlinux.

``kbuild()`` builds a source tree with a config in a cached object tree (kbuild
``O=``; the source tree is never written)::

    <cache>/kbuild/<X.Y.Z>-<config hash>/      object tree (make.log: its make output)
    <cache>/kbuild/src/<package>/              a Debian linux-source package, extracted
                                               (one version each: another replaces it)

The same object tree serves the plain build and the hooked ones: a change of
profile, strategy or hook deletes ``vmlinux`` so that kbuild relinks it (kbuild
relinks on a change of the link command, which names ARCH_POSTLINK but not the
profile) and everything made from it. The build strings are fixed
(KBUILD_BUILD_USER/HOST/VERSION/TIMESTAMP), so a relink gives the same bytes and
the same build-id: a profile of the plain build matches the hooked build's link.
"""

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from .. import io, targets
from ..errors import BadInput, ExternalToolError
from . import tree

HOOK = os.path.join(os.path.dirname(os.path.realpath(__file__)), "linepack-postlink.mk")

# Fixed build strings: reproducible bytes, and a relink keeps the build-id.
BUILD_ENV = {"KBUILD_BUILD_USER": "linepack", "KBUILD_BUILD_HOST": "kbuild",
             "KBUILD_BUILD_VERSION": "1",
             "KBUILD_BUILD_TIMESTAMP": "Wed Jan  1 00:00:00 UTC 2020"}
_STAMP = "linepack-kbuild.json"

# Object-tree file -> name in the output directory.
_OUTPUTS = [
    ("arch/x86/boot/bzImage", "bzImage"),
    ("vmlinux", "vmlinux"),                          # as the build ships it (relocations stripped)
    ("vmlinux.linepack-orig", "vmlinux.orig"),      # the link's own, relocations kept
    ("vmlinux.linepack", "vmlinux.linepack"),       # relayout's output, relocations kept
    ("vmlinux.linepack-layout.tsv", "layout.tsv"),
    ("vmlinux.linepack.json", "relayout.json"),
    ("System.map", "System.map"),
    ("arch/x86/boot/compressed/vmlinux.relocs", "vmlinux.relocs"),
    (".config", "config"),
]


def kernel_version(src):
    """"X.Y.Z" of a kernel source tree (BadInput if it is not an x86 kernel tree)."""
    return ".".join(map(str, tree.source_version(src)))


def debian_source(spec, log=None):
    """The extracted tree of Debian's ``linux-source-X.Y[=VERSION]`` (newest when no
    version is given), fetched with apt once and cached."""
    package, _, version = spec.partition("=")
    if not re.fullmatch(r"linux-source-\d+\.\d+", package):
        raise BadInput(f"--debian {spec}: expected linux-source-X.Y[=VERSION], "
                       "e.g. linux-source-6.12")
    versions = tree._apt_versions(package)
    if not versions:
        raise BadInput(f"no {package} in the apt lists (apt-get update, or give --source DIR)")
    if version and version not in versions:
        raise BadInput(f"no {package} {version} in the apt lists (found: {', '.join(versions)})")
    version = version or versions[0]
    root = os.path.join(targets.cache_dir(), "kbuild", "src")
    dest = os.path.join(root, package)
    stamp = os.path.join(dest, ".linepack-debian-version")

    def have():
        with contextlib.suppress(OSError), open(stamp) as f:
            return f.read().strip() == version
        return False

    if have():
        return dest
    os.makedirs(root, exist_ok=True)
    with tree.locked(root), tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        if have():
            return dest
        shutil.rmtree(dest, ignore_errors=True)
        if log:
            log(f"downloading {package}={version} with apt-get")
        p = subprocess.run(["apt-get", "download", "-q", f"{package}={version}"], cwd=tmp,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        debs = [n for n in os.listdir(tmp) if n.endswith(".deb")]
        if p.returncode or not debs:
            last = (p.stderr.strip().splitlines() or ["no .deb"])[-1]
            raise ExternalToolError(f"apt-get download {package}={version} failed: {last}")
        if log:
            log(f"extracting {package}")
        sh = (f"dpkg-deb --fsys-tarfile {shlex.quote(os.path.join(tmp, debs[0]))} | "
              f"tar -xO ./usr/src/{package}.tar.xz | xz -dc | tar -x -C {shlex.quote(tmp)}")
        p = subprocess.run(["bash", "-o", "pipefail", "-c", sh], stderr=subprocess.PIPE, text=True)
        if p.returncode or not os.path.isdir(os.path.join(tmp, package)):
            raise ExternalToolError(f"cannot extract {package}: {p.stderr.strip()[-200:]}")
        with open(os.path.join(tmp, package, ".linepack-debian-version"), "w") as f:
            f.write(version + "\n")
        os.replace(os.path.join(tmp, package), dest)
    return dest


def build_dir(src, config_bytes):
    return os.path.join(targets.cache_dir(), "kbuild", f"{kernel_version(src)}-"
                        f"{hashlib.sha256(config_bytes).hexdigest()[:16]}")


def _file_sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _make(src, build, args, log_path, jobs):
    cmd = ["nice", "-n", "10", "make", "-C", src, f"O={build}", f"-j{jobs}"] + list(args)
    env = dict(os.environ, LC_ALL="C", **BUILD_ENV)
    env.pop("MAKEFLAGS", None)
    with open(log_path, "ab") as logf:
        logf.write(("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n").encode())
        logf.flush()
        try:
            p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                               stderr=subprocess.STDOUT)
        except FileNotFoundError:
            raise ExternalToolError("'make' is not installed (run tools/setup.sh)") from None
    if p.returncode:
        raise ExternalToolError(f"kernel make {' '.join(a for a in args if '=' not in a)} failed: "
                                f"{tree._first_error(log_path)} (log: {log_path})")


def _linepack_code_hash():
    """Hash of linepack's own code: a new linepack relinks with a new relayout."""
    from ..resources import source_hash
    return source_hash()


def _linepack_command():
    """How the hook calls linepack: this interpreter, this linepack (PYTHONPATH is
    passed down through make's environment)."""
    return f"{sys.executable} -m linepack"


def kbuild(src, config, out_dir, profile=None, strategy="pack", relayout_flags="",
           jobs=None, log=None):
    """Build ``src`` with ``config`` (and, with a profile, linepack in the post-link
    step); copy the results to ``out_dir``. Returns a summary dict."""
    log = log or (lambda m: None)
    jobs = jobs or os.cpu_count() or 1
    src = os.path.abspath(src)
    tree.check_config(config)
    with open(config, "rb") as f:
        config_bytes = f.read()
    build = build_dir(src, config_bytes)
    os.makedirs(build, exist_ok=True)
    make_log = os.path.join(build, "make.log")
    with tree.locked(build):
        stamp_path = os.path.join(build, _STAMP)
        stamp = tree._read_json(stamp_path) or {}
        if stamp.get("src") not in (None, src):
            log(f"{build} was built from {stamp.get('src')}: cleaning it for {src}")
            shutil.rmtree(build)
            os.makedirs(build)
            stamp = {}
        config_copy = os.path.join(build, "linepack.config")
        if not os.path.exists(os.path.join(build, ".config")) or \
                not os.path.exists(config_copy) or open(config_copy, "rb").read() != config_bytes:
            with open(os.path.join(build, ".config"), "wb") as f:
                f.write(config_bytes)
            with open(config_copy, "wb") as f:
                f.write(config_bytes)
            _make(src, build, ["olddefconfig"], make_log, 1)
        cfg = tree.check_config(os.path.join(build, ".config"))

        hook_vars = [f"ARCH_POSTLINK={HOOK}", f"LINEPACK={_linepack_command()}"]
        want = {"hook": HOOK, "profile": None, "strategy": None, "flags": None,
                "linepack": _linepack_code_hash() if profile else None}
        if profile:
            staged = os.path.join(build, "linepack.profile")
            with open(profile, "rb") as f:
                io.write_atomic(staged, f.read())
            want.update(profile=_file_sha(staged), strategy=strategy, flags=relayout_flags)
            hook_vars += [f"LINEPACK_PROFILE={staged}", f"LINEPACK_STRATEGY={strategy}"]
            if relayout_flags:
                hook_vars.append(f"LINEPACK_FLAGS={relayout_flags}")
        if stamp.get("hook_state") != want:
            # kbuild would not relink for a new profile on its own.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(build, "vmlinux"))
            for name in ("vmlinux.linepack", "vmlinux.linepack-layout.tsv",
                         "vmlinux.linepack.json"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(build, name))
        stamp.update(src=src, hook_state=None)
        _write_json(stamp_path, stamp)
        goals = ["bzImage"] + (["modules"] if cfg.get("CONFIG_MODULES") == "y" else [])
        how = f"linepack {strategy} with the profile" if profile else "no profile: stock layout"
        log(f"make {' '.join(goals)} in {build} ({how})")
        _make(src, build, hook_vars + goals, make_log, jobs)
        stamp["hook_state"] = want
        _write_json(stamp_path, stamp)
        summary = _collect(build, out_dir, cfg, profiled=bool(profile))
    summary.update(build_dir=build, version=kernel_version(src))
    return summary


OUTPUT_MARKER = ".linepack-kbuild-output"


def check_output_dir(out_dir, inputs=()):
    """Before any work: ``-o`` is replaced as a whole, so it must be a new directory
    or one an earlier ``linepack kbuild`` wrote (it holds OUTPUT_MARKER), in a
    writable parent, and neither be nor hold nor sit inside an input."""
    from ..io import check_output_path
    out = os.path.realpath(os.path.abspath(out_dir))
    parent = os.path.dirname(out)
    # the parent: exists, is a directory, accepts new files (probed)
    check_output_path(os.path.join(parent, OUTPUT_MARKER), f"-o {out_dir}:")
    for p in inputs:
        if not p:
            continue
        rp = os.path.realpath(os.path.abspath(p))
        if rp == out or rp.startswith(out + os.sep):
            raise BadInput(f"-o {out_dir}: holds the input {p}; kbuild replaces its output "
                           "directory as a whole, so give a new directory")
        if os.path.isdir(rp) and out.startswith(rp + os.sep):
            raise BadInput(f"-o {out_dir}: is inside the input {p}, which is never written")
    if os.path.lexists(out):
        if not os.path.isdir(out):
            raise BadInput(f"-o {out_dir}: exists and is not a directory")
        if not os.path.exists(os.path.join(out, OUTPUT_MARKER)):
            raise BadInput(f"-o {out_dir}: exists and was not written by linepack kbuild; "
                           "it would be replaced as a whole, so give a new directory")
    return out


def _write_json(path, doc):
    io.write_atomic(path, json.dumps(doc, sort_keys=True, indent=1))


def _collect(build, out_dir, cfg, profiled):
    """Copy the build's outputs into out_dir, replacing it as a whole."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise BadInput(f"-o {out_dir}: directory {parent} does not exist")
    tmp = tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(out_dir) + ".")
    try:
        got = []
        for rel, name in _OUTPUTS:
            if rel.startswith("vmlinux.linepack") and not profiled and rel != "vmlinux.linepack-orig":
                continue
            path = os.path.join(build, rel)
            if not os.path.exists(path):
                raise ExternalToolError(f"the kernel build made no {rel} (log: "
                                        f"{os.path.join(build, 'make.log')})")
            shutil.copyfile(path, os.path.join(tmp, name))
            got.append(name)
        with open(os.path.join(tmp, OUTPUT_MARKER), "w") as f:
            f.write("written by linepack kbuild; replaced as a whole by the next run\n")
        modules = []
        order = os.path.join(build, "modules.order")
        if cfg.get("CONFIG_MODULES") == "y" and os.path.exists(order):
            with open(order) as f:
                for line in f:
                    ko = line.strip()
                    ko = ko[:-2] + ".ko" if ko.endswith(".o") else ko
                    if ko:
                        dest = os.path.join(tmp, "modules", ko)
                        os.makedirs(os.path.dirname(dest), exist_ok=True)
                        shutil.copyfile(os.path.join(build, ko), dest)
                        modules.append(ko)
            if modules:
                with open(os.path.join(tmp, "modules", "modules.order"), "w") as f:
                    f.write("".join(m + "\n" for m in modules))
        aside = None
        if os.path.lexists(out_dir):
            if not os.path.isdir(out_dir):
                raise BadInput(f"-o {out_dir}: exists and is not a directory")
            aside = tempfile.mkdtemp(dir=parent, prefix="." + os.path.basename(out_dir) + ".old.")
            os.rename(out_dir, os.path.join(aside, "d"))
        os.rename(tmp, out_dir)
        tmp = None
        if aside:
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"out_dir": out_dir, "files": got, "modules": modules}
