"""Build linepack's QEMU TCG plugin against the installed QEMU.

Debian's qemu-system-x86 has the TCG plugin API compiled in but does not ship
``qemu-plugin.h``.  We take it from Debian's own source package of exactly the
installed version (``apt-get source --download-only qemu=<version>``; a
``deb-src`` entry is added in ``/etc/apt/sources.list.d/linepack-src.sources``
when apt has none), extract only ``include/qemu/qemu-plugin.h`` from the
upstream tarball, apply the Debian patches that touch it (none do in
bookworm's 7.2), and cache it::

    <cache>/qemu-plugin/<source version>/qemu-plugin.h
    <cache>/plugin/linepack_plugin-<hash>.so  (+ .stamp: hash of source, Makefile, header, cc)

``LINEPACK_QEMU_PLUGIN_H=/path/qemu-plugin.h`` skips the download.  Building is
idempotent: nothing is rebuilt unless the source, Makefile, header or
compiler changed.
"""

import glob
import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile

from .. import targets
from ..errors import ExternalToolError
from ..progress import stderr_log

PLUGIN_API_VERSION = 1          # the API linepack_plugin.c is written against (QEMU 7.2)
QEMU_PACKAGE = "qemu-system-x86"
HEADER_MEMBER = "include/qemu/qemu-plugin.h"
SRC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugin")
SOURCES_FILE = "/etc/apt/sources.list.d/linepack-src.sources"
SO_NAME = "linepack_plugin.so"

_DEB_SRC = """# Added by linepack (tools/profile/plugin_build.py): Debian source packages,
# used to fetch qemu-plugin.h matching the installed QEMU.
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: {codename} {codename}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian-security
Suites: {codename}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


_log = stderr_log("linepack")


def _run(cmd, what, cwd=None, env=None):
    try:
        p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    except FileNotFoundError:
        raise ExternalToolError(f"{what}: '{cmd[0]}' is not installed (run tools/setup.sh)") from None
    return p


def _check(p, what):
    if p.returncode != 0:
        lines = [ln for ln in (p.stderr or "").strip().splitlines() if not ln.startswith("W:")]
        raise ExternalToolError(f"{what} failed: {(lines or ['exit status %d' % p.returncode])[-1]}")
    return p.stdout


def _as_root(cmd):
    if os.geteuid() == 0:
        return cmd
    if shutil.which("sudo"):
        return ["sudo", "-n"] + cmd
    raise ExternalToolError(f"'{' '.join(cmd)}' needs root (or set LINEPACK_QEMU_PLUGIN_H "
                            "to an existing qemu-plugin.h)")


def installed_qemu_version():
    """Debian source version of the installed qemu-system-x86, e.g. '1:7.2+dfsg-7+deb12u18'."""
    p = _run(["dpkg-query", "-W", "-f=${db:Status-Abbrev}|${source:Version}", QEMU_PACKAGE],
             "dpkg-query")
    out = p.stdout.strip()
    if p.returncode != 0 or not out.startswith("ii") or "|" not in out:
        raise ExternalToolError(f"{QEMU_PACKAGE} is not installed (run tools/setup.sh)")
    return out.split("|", 1)[1]


def _upstream(version):
    """'1:7.2+dfsg-7+deb12u18' -> '7.2'."""
    v = version.split(":", 1)[-1]
    return re.split(r"[+~-]", v, 1)[0]


def _has_deb_src():
    files = glob.glob("/etc/apt/sources.list") + glob.glob("/etc/apt/sources.list.d/*.list") \
        + glob.glob("/etc/apt/sources.list.d/*.sources")
    for f in files:
        try:
            text = open(f, encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        if re.search(r"^\s*deb-src\s", text, re.M) or \
           re.search(r"^\s*Types:.*\bdeb-src\b", text, re.M | re.I):
            if not re.search(r"^\s*Enabled:\s*no", text, re.M | re.I):
                return True
    return False


def _codename():
    try:
        with open("/etc/os-release", encoding="utf-8") as f:
            m = re.search(r"^VERSION_CODENAME=\"?(\w+)", f.read(), re.M)
            if m:
                return m.group(1)
    except OSError:
        pass
    return "bookworm"


def _ensure_deb_src(log):
    if _has_deb_src():
        return False
    log(f"adding a deb-src entry ({SOURCES_FILE}) to fetch qemu's source package")
    text = _DEB_SRC.format(codename=_codename())
    if os.geteuid() == 0:
        with open(SOURCES_FILE + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(SOURCES_FILE + ".tmp", SOURCES_FILE)
    else:
        p = subprocess.run(_as_root(["tee", SOURCES_FILE]), input=text, text=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _check(p, f"writing {SOURCES_FILE}")
    return True


def _apt_update(log):
    log("apt-get update (source lists)")
    _check(_run(_as_root(["apt-get", "update", "-q"]), "apt-get update"), "apt-get update")


def _source_versions():
    p = _run(["apt-cache", "showsrc", "qemu"], "apt-cache showsrc")
    if p.returncode != 0:
        return []
    return re.findall(r"^Version:\s*(\S+)", p.stdout, re.M)


def _patch_sections(diff_text, member):
    """The parts of a unified diff that modify ``member`` (path without the a/ prefix)."""
    out, cur, keep = [], [], False
    lines = diff_text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            if keep:
                out += cur
            new = lines[i + 1][4:].split("\t")[0].strip()
            keep = new.split("/", 1)[-1] == member
            cur = [ln, lines[i + 1]]
            i += 2
            continue
        if ln.startswith(("diff ", "Index: ", "index ")):
            if keep:
                out += cur
            keep, cur = False, []
        else:
            cur.append(ln)
        i += 1
    if keep:
        out += cur
    return "".join(out)


def fetch_header(log=_log):
    """Path of qemu-plugin.h matching the installed QEMU (downloaded and cached once)."""
    override = os.environ.get("LINEPACK_QEMU_PLUGIN_H")
    if override:
        if not os.path.isfile(override):
            raise ExternalToolError(f"LINEPACK_QEMU_PLUGIN_H={override}: no such file")
        return override
    version = installed_qemu_version()
    dest_dir = os.path.join(targets.cache_dir(), "qemu-plugin", version.replace(":", "_"))
    dest = os.path.join(dest_dir, "qemu-plugin.h")
    if os.path.exists(dest):
        return dest

    added = _ensure_deb_src(log)
    versions = _source_versions()
    if added or version not in versions:
        _apt_update(log)
        versions = _source_versions()
    if not versions:
        raise ExternalToolError("apt knows no 'qemu' source package (deb-src entries missing?)")
    want = version
    if version not in versions:
        same = [v for v in versions if _upstream(v) == _upstream(version)]
        if not same:
            raise ExternalToolError(f"no qemu source package for upstream {_upstream(version)} "
                                    f"(installed {version}; apt has {', '.join(versions)})")
        want = same[0]
        log(f"qemu source {version} is not in apt; using {want} (same upstream, same plugin API)")

    os.makedirs(dest_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dest_dir), prefix=".src-") as tmp:
        os.chmod(tmp, 0o755)  # let apt's _apt user write here
        log(f"downloading Debian's qemu {want} source (~24 MB) for qemu-plugin.h")
        _check(_run(["apt-get", "source", "--download-only", "-q", f"qemu={want}"],
                    "apt-get source qemu", cwd=tmp), "apt-get source qemu")
        origs = glob.glob(os.path.join(tmp, "*.orig.tar.*"))
        debs = glob.glob(os.path.join(tmp, "*.debian.tar.*"))
        if not origs:
            raise ExternalToolError("apt-get source qemu: no .orig tarball downloaded")
        header = None
        with tarfile.open(origs[0]) as tf:
            for m in tf:
                if m.isfile() and m.name.split("/", 1)[-1] == HEADER_MEMBER:
                    header = tf.extractfile(m).read()
                    break
        if header is None:
            raise ExternalToolError(f"{os.path.basename(origs[0])} has no {HEADER_MEMBER}")
        work = os.path.join(tmp, "tree")
        os.makedirs(os.path.join(work, os.path.dirname(HEADER_MEMBER)))
        with open(os.path.join(work, HEADER_MEMBER), "wb") as f:
            f.write(header)
        # Debian patches applied in series order; only the hunks on the header matter.
        if debs:
            with tarfile.open(debs[0]) as tf:
                names = {m.name: m for m in tf if m.isfile()}
                series = names.get("debian/patches/series")
                order = []
                if series:
                    for ln in tf.extractfile(series).read().decode(errors="replace").splitlines():
                        ln = ln.split("#", 1)[0].strip()
                        if ln:
                            order.append(ln.split()[0])
                for pname in order:
                    m = names.get("debian/patches/" + pname)
                    if not m:
                        continue
                    part = _patch_sections(tf.extractfile(m).read().decode(errors="replace"),
                                           HEADER_MEMBER)
                    if part:
                        log(f"applying Debian patch {pname} to qemu-plugin.h")
                        p = subprocess.run(["patch", "-p1", "-s", "--no-backup-if-mismatch"],
                                           cwd=work, input=part, text=True,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                        if p.returncode:
                            raise ExternalToolError(f"Debian patch {pname} does not apply to "
                                                    f"qemu-plugin.h: {p.stdout.strip()[-200:]}")
        with open(os.path.join(work, HEADER_MEMBER), "rb") as f:
            header = f.read()
        fd, part = tempfile.mkstemp(dir=dest_dir, prefix=".part-")
        with os.fdopen(fd, "wb") as f:
            f.write(header)
        os.chmod(part, 0o644)
        os.replace(part, dest)
    return dest


def header_api_version(header):
    with open(header, encoding="utf-8", errors="replace") as f:
        m = re.search(r"^#define\s+QEMU_PLUGIN_VERSION\s+(\d+)", f.read(), re.M)
    if not m:
        raise ExternalToolError(f"{header}: no QEMU_PLUGIN_VERSION (not a qemu-plugin.h?)")
    return int(m.group(1))


def _compiler_id():
    p = _run([os.environ.get("CC", "cc"), "--version"], "cc --version")
    return (p.stdout or "").splitlines()[0] if p.returncode == 0 and p.stdout else "?"


def _stamp(header):
    h = hashlib.sha256()
    for path in (os.path.join(SRC_DIR, "linepack_plugin.c"), os.path.join(SRC_DIR, "Makefile"),
                 header):
        with open(path, "rb") as f:
            h.update(f.read())
        h.update(b"\0")
    h.update(_compiler_id().encode())
    h.update(os.environ.get("CFLAGS", "").encode())
    return h.hexdigest()


def plugin_dir():
    return os.path.join(targets.cache_dir(), "plugin")


def build_plugin(force=False, log=_log):
    """Build (if needed) and return the path of linepack_plugin.so."""
    if not os.path.isfile(os.path.join(SRC_DIR, "linepack_plugin.c")):
        raise ExternalToolError(f"plugin source missing under {SRC_DIR}")
    header = fetch_header(log=log)
    api = header_api_version(header)
    if api != PLUGIN_API_VERSION:
        raise ExternalToolError(f"{header}: QEMU plugin API version {api}, linepack's plugin is "
                                f"written for version {PLUGIN_API_VERSION} (QEMU 7.2)")
    out_dir = plugin_dir()
    os.makedirs(out_dir, exist_ok=True)
    stamp = _stamp(header)
    # one file per stamp: checkouts with different plugin sources sharing a cache do not
    # rebuild each other's plugin (nor invalidate each other's cached traces)
    so = os.path.join(out_dir, SO_NAME.replace(".so", f"-{stamp[:12]}.so"))
    stamp_path = so + ".stamp"
    if not force and os.path.exists(so) and os.path.exists(stamp_path):
        with open(stamp_path, encoding="utf-8") as f:
            if f.read().strip() == stamp:
                return so
    if shutil.which("pkg-config") is None:
        raise ExternalToolError("building the plugin needs pkg-config and libglib2.0-dev "
                                "(run tools/setup.sh)")
    if _run(["pkg-config", "--exists", "glib-2.0"], "pkg-config").returncode != 0:
        raise ExternalToolError("building the plugin needs glib headers: apt-get install "
                                "libglib2.0-dev (run tools/setup.sh)")
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        inc = os.path.join(tmp, "include")
        os.makedirs(inc)
        shutil.copyfile(header, os.path.join(inc, "qemu-plugin.h"))
        p = _run(["make", "-s", "-C", SRC_DIR, f"QEMU_PLUGIN_INCLUDE={inc}", f"BUILD={tmp}"],
                 "make (plugin)")
        if p.returncode != 0:
            err = [ln for ln in (p.stderr + p.stdout).splitlines() if "error" in ln.lower()]
            raise ExternalToolError("plugin build failed: " + (err or (p.stderr or p.stdout)
                                                               .strip().splitlines() or ["?"])[0])
        os.replace(os.path.join(tmp, SO_NAME), so)
        with open(stamp_path + ".tmp", "w", encoding="utf-8") as f:
            f.write(stamp + "\n")
        os.replace(stamp_path + ".tmp", stamp_path)
    log(f"built {so}")
    return so


def plugin_path():
    """Path of the plugin, built on first use (quiet when already built)."""
    return build_plugin(log=lambda m: None) if os.environ.get("LINEPACK_QUIET") else build_plugin()


__all__ = ["build_plugin", "fetch_header", "plugin_path", "installed_qemu_version",
           "header_api_version", "PLUGIN_API_VERSION"]
