"""The real target: Debian's 6.1 cloud kernel, fetched with apt and cached.

``linux-image-6.1.0-<ABI>-cloud-amd64-dbg`` carries the unstripped vmlinux
(linked with --emit-relocs); ``linux-image-6.1.0-<ABI>-cloud-amd64`` carries the
modules of the same build. The newest ABI in the apt lists is the default, so a
new Debian point release keeps working; an ABI can be pinned.

Cache layout (``$LINEPACK_CACHE`` or ``$XDG_CACHE_HOME/linepack`` or ``~/.cache/linepack``)::

    debs/<package>_<version>_amd64.deb
    kernels/6.1.0-<ABI>-cloud-amd64/vmlinux
    kernels/6.1.0-<ABI>-cloud-amd64/modules/...   (only what was asked for)
"""

import os
import re
import subprocess
import sys
import tempfile

from .errors import BadInput, ExternalToolError

SERIES = "6.1.0"
FLAVOUR = "cloud-amd64"
_PKG_RE = re.compile(r"^linux-image-6\.1\.0-(\d+)-cloud-amd64-dbg\b", re.M)


def cache_dir():
    base = os.environ.get("LINEPACK_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        base = os.path.join(xdg, "linepack")
    os.makedirs(base, exist_ok=True)
    return base


def _run(cmd, what, cwd=None):
    try:
        p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except FileNotFoundError:
        raise ExternalToolError(f"{what}: '{cmd[0]}' is not installed (run tools/setup.sh)") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["exit status %d" % p.returncode])[-1]
        raise ExternalToolError(f"{what} failed: {last}")
    return p.stdout


def available_abis():
    """ABI numbers of the -dbg cloud packages apt knows, ascending."""
    out = _run(["apt-cache", "search", "--names-only", r"^linux-image-6\.1\.0-[0-9]+-cloud-amd64-dbg$"],
               "apt-cache search")
    return sorted({int(m) for m in _PKG_RE.findall(out)})


def release(abi):
    return f"{SERIES}-{abi}-{FLAVOUR}"


def _cached_deb(package):
    debs = os.path.join(cache_dir(), "debs")
    os.makedirs(debs, exist_ok=True)
    for name in sorted(os.listdir(debs)):
        if name.startswith(package + "_") and name.endswith(".deb"):
            return os.path.join(debs, name)
    return None


def download_deb(package, log=None):
    """apt-get download into the cache (once); returns the .deb path."""
    found = _cached_deb(package)
    if found:
        return found
    debs = os.path.join(cache_dir(), "debs")
    if log:
        log(f"downloading {package} with apt-get (cached under {debs})")
    with tempfile.TemporaryDirectory(dir=debs) as tmp:
        _run(["apt-get", "download", "-q", package], f"apt-get download {package}", cwd=tmp)
        got = [n for n in os.listdir(tmp) if n.endswith(".deb")]
        if not got:
            raise ExternalToolError(f"apt-get download {package} produced no .deb")
        os.replace(os.path.join(tmp, got[0]), os.path.join(debs, got[0]))
    return _cached_deb(package)


def _extract(deb, member, dest):
    """Extract one file of a .deb's data archive to dest, atomically."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as out:
            deb_proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE)
            tar = subprocess.run(["tar", "-x", "-O", "-f", "-", "./" + member.lstrip("./")],
                                 stdin=deb_proc.stdout, stdout=out, stderr=subprocess.PIPE)
            deb_proc.stdout.close()
            deb_proc.wait()
        if deb_proc.returncode or tar.returncode:
            raise ExternalToolError(f"cannot extract {member} from {os.path.basename(deb)}: "
                                    f"{tar.stderr.decode(errors='replace').strip()}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resolve_abi(abi=None):
    if abi is not None:
        return int(abi)
    env = os.environ.get("LINEPACK_KERNEL_ABI")
    if env:
        return int(env)
    abis = available_abis()
    if not abis:
        raise ExternalToolError("apt knows no linux-image-6.1.0-*-cloud-amd64-dbg package "
                                "(run 'apt-get update' on a Debian 12 machine)")
    return abis[-1]


def debian_vmlinux(abi=None, log=None):
    """Path of the cached vmlinux of Debian's 6.1 cloud kernel (fetching it once)."""
    abi = resolve_abi(abi)
    rel = release(abi)
    dest = os.path.join(cache_dir(), "kernels", rel, "vmlinux")
    if os.path.exists(dest):
        return dest
    deb = download_deb(f"linux-image-{rel}-dbg", log=log)
    if log:
        log(f"extracting vmlinux-{rel} from {os.path.basename(deb)}")
    _extract(deb, f"usr/lib/debug/boot/vmlinux-{rel}", dest)
    return dest


def debian_module(name, abi=None, log=None):
    """Path of one cached module (.ko) of the same build, e.g. 'fs/fat/vfat.ko'."""
    abi = resolve_abi(abi)
    rel = release(abi)
    dest = os.path.join(cache_dir(), "kernels", rel, "modules", name)
    if os.path.exists(dest):
        return dest
    deb = download_deb(f"linux-image-{rel}", log=log)
    _extract(deb, f"lib/modules/{rel}/kernel/{name}", dest)
    return dest


def _log(msg):
    print(f"linepack: {msg}", file=sys.stderr, flush=True)


def main_fetch(abi=None):
    path = debian_vmlinux(abi, log=_log)
    print(path)
    return path


__all__ = ["cache_dir", "available_abis", "debian_vmlinux", "debian_module", "resolve_abi",
           "release", "download_deb"]
