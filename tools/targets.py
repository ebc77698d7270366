"""The real targets: Debian's cloud kernels, fetched with apt and cached.

Two series (``series=``, default ``"6.1"``):

- ``6.1`` (bookworm): ``linux-image-6.1.0-<ABI>-cloud-amd64-dbg`` carries the
  unstripped vmlinux (linked with --emit-relocs); ``linux-image-6.1.0-<ABI>-cloud-amd64``
  carries the modules of the same build. ``abi`` is the ABI number (56).
- ``6.12`` (bookworm-backports / -security): ``linux-image-6.12.<N>+deb12-cloud-amd64-dbg``,
  modules in ``linux-image-6.12.<N>+deb12-cloud-amd64``. ``abi`` is the upstream
  patch level N (117). This vmlinux is linked WITHOUT --emit-relocs: verify works
  on it, relayout refuses it.

The newest ABI in the apt lists is the default, so a new Debian point release
keeps working; an ABI can be pinned (argument, or ``$LINEPACK_KERNEL_ABI`` for
6.1 and ``$LINEPACK_KERNEL_ABI_6_12`` for 6.12).

Cache layout (``$LINEPACK_CACHE`` or ``$XDG_CACHE_HOME/linepack`` or ``~/.cache/linepack``)::

    debs/<package>_<version>_amd64.deb
    kernels/6.1.0-<ABI>-cloud-amd64/vmlinux
    kernels/6.1.0-<ABI>-cloud-amd64/modules/...   (only what was asked for)
    kernels/6.12.<N>+deb12-cloud-amd64/vmlinux
"""

import os
import re
import subprocess
import tempfile

from .errors import BadInput, ExternalToolError
from .progress import stderr_log

SERIES = "6.1.0"
FLAVOUR = "cloud-amd64"
_PKG_RE = re.compile(r"^linux-image-6\.1\.0-(\d+)-cloud-amd64-dbg\b", re.M)


class Series:
    """How one Debian kernel series names its packages and releases."""

    def __init__(self, name, release_fmt, search_re, pkg_re, env):
        self.name, self.release_fmt, self.search_re = name, release_fmt, search_re
        self.pkg_re, self.env = re.compile(pkg_re, re.M), env

    def release(self, abi):
        return self.release_fmt.format(abi=int(abi))


SERIES_TABLE = {
    "6.1": Series("6.1", SERIES + "-{abi}-" + FLAVOUR,
                  r"^linux-image-6\.1\.0-[0-9]+-cloud-amd64-dbg$", _PKG_RE.pattern,
                  "LINEPACK_KERNEL_ABI"),
    "6.12": Series("6.12", "6.12.{abi}+deb12-" + FLAVOUR,
                   r"^linux-image-6\.12\.[0-9]+\+deb12-cloud-amd64-dbg$",
                   r"^linux-image-6\.12\.(\d+)\+deb12-cloud-amd64-dbg\b",
                   "LINEPACK_KERNEL_ABI_6_12"),
}
DEFAULT_SERIES = "6.1"


def series_info(series=DEFAULT_SERIES):
    s = SERIES_TABLE.get(str(series))
    if s is None:
        raise BadInput(f"unknown kernel series {series!r} (known: {', '.join(SERIES_TABLE)})")
    return s


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


def available_abis(series=DEFAULT_SERIES):
    """ABI numbers of the -dbg cloud packages apt knows, ascending (6.12: patch levels)."""
    s = series_info(series)
    out = _run(["apt-cache", "search", "--names-only", s.search_re], "apt-cache search")
    return sorted({int(m) for m in s.pkg_re.findall(out)})


def release(abi, series=DEFAULT_SERIES):
    return series_info(series).release(abi)


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
            why = (tar.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]
            if "Not found in archive" in why:
                raise BadInput(f"{os.path.basename(deb)} has no {member}")
            raise ExternalToolError(f"cannot extract {member} from {os.path.basename(deb)}: {why}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resolve_abi(abi=None, series=DEFAULT_SERIES):
    s = series_info(series)
    if abi is not None:
        return int(abi)
    env = os.environ.get(s.env)
    if env:
        return int(env)
    abis = available_abis(series)
    if not abis:
        pattern = s.release_fmt.format(abi="*")
        raise ExternalToolError(f"apt knows no linux-image-{pattern}-dbg package "
                                "(run 'apt-get update' on a Debian 12 machine"
                                + (" with bookworm-backports or -security" if s.name != "6.1" else "")
                                + ")")
    return abis[-1]


def check_abi(abi, series=DEFAULT_SERIES):
    """BadInput naming the valid ABIs when apt knows no package of ``abi`` (asked
    only before a download: a cached kernel needs no apt lists)."""
    known = available_abis(series)
    if known and int(abi) not in known:
        raise BadInput(f"ABI {abi}: apt knows no {release(abi, series)} kernel; valid: "
                       f"{', '.join(map(str, known))} (see 'linepack fetch --list')")


def debian_vmlinux(abi=None, log=None, *, series=DEFAULT_SERIES):
    """Path of the cached vmlinux of Debian's cloud kernel (fetching it once).

    ``series`` is "6.1" (default; ``abi`` = ABI number) or "6.12" (``abi`` =
    patch level, e.g. 117 for 6.12.117+deb12).
    """
    abi = resolve_abi(abi, series)
    rel = release(abi, series)
    dest = os.path.join(cache_dir(), "kernels", rel, "vmlinux")
    if os.path.exists(dest):
        return dest
    check_abi(abi, series)
    deb = download_deb(f"linux-image-{rel}-dbg", log=log)
    if log:
        log(f"extracting vmlinux-{rel} from {os.path.basename(deb)}")
    _extract(deb, f"usr/lib/debug/boot/vmlinux-{rel}", dest)
    return dest


def debian_module(name, abi=None, log=None, *, series=DEFAULT_SERIES):
    """Path of one cached module (.ko) of the same build, e.g. 'fs/fat/vfat.ko'."""
    abi = resolve_abi(abi, series)
    rel = release(abi, series)
    dest = os.path.join(cache_dir(), "kernels", rel, "modules", name)
    if os.path.exists(dest):
        return dest
    check_abi(abi, series)
    deb = download_deb(f"linux-image-{rel}", log=log)
    _extract(deb, f"lib/modules/{rel}/kernel/{name}", dest)
    return dest


_log = stderr_log("linepack")


def main_fetch(abi=None, series=DEFAULT_SERIES):
    path = debian_vmlinux(abi, log=_log, series=series)
    print(path)
    return path


__all__ = ["cache_dir", "available_abis", "debian_vmlinux", "debian_module", "resolve_abi",
           "release", "download_deb", "series_info", "SERIES_TABLE", "DEFAULT_SERIES"]
