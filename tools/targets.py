"""The real targets: Debian's kernels, fetched with apt and cached.

Flavour (``flavour=``, default ``"cloud"``): ``cloud`` (``-cloud-amd64``, the
project's reference), ``generic`` (``-amd64``, what most machines run) or ``rt``
(``-rt-amd64``, PREEMPT_RT); the package names below are the cloud ones, the
others differ only in that suffix.

Series (``series=``, default ``"6.1"``); ``abi`` is the ABI number (6.1.0-56) or
the upstream patch level (118 for 6.12.118+deb13):

- ``6.1`` (bookworm): ``linux-image-6.1.0-<ABI>-cloud-amd64-dbg`` carries the
  unstripped vmlinux (linked with --emit-relocs); ``linux-image-6.1.0-<ABI>-cloud-amd64``
  the vmlinuz and the modules of the same build.
- ``6.12`` (Debian 13 trixie, and trixie-security): ``linux-image-6.12.<N>+deb13-cloud-amd64-dbg``;
  ``linux-image-<rel>-unsigned`` holds ``boot/vmlinuz-<rel>`` and the modules (.ko.xz).
- ``7.3`` (trixie-backports): ``linux-image-7.3.<N>+deb13-cloud-amd64-dbg``; the image is
  split: ``linux-binary-unsigned-<rel>`` holds ``usr/lib/modules/<rel>/vmlinuz.unsigned``,
  ``linux-modules-<rel>`` the modules.
- ``6.12-deb12`` (bookworm-backports): ``linux-image-6.12.<N>+deb12-cloud-amd64-dbg``.

6.12 and 7.3 vmlinux files are linked WITHOUT --emit-relocs: their absolute fields
come from the vmlinuz's KASLR relocation table (``image/bootimage.py``). Debian 13's
packages are read through a private apt state (``<cache>/apt-trixie``: its own
sources list, lists and package cache), so the machine's apt sources stay untouched.

The newest ABI in the apt lists is the default, so a new Debian point release
keeps working; an ABI can be pinned (argument, or ``$LINEPACK_KERNEL_ABI`` for
6.1, ``$LINEPACK_KERNEL_ABI_6_12``, ``$LINEPACK_KERNEL_ABI_7_3``,
``$LINEPACK_KERNEL_ABI_6_12_DEB12``).

Cache layout (``$LINEPACK_CACHE`` or ``$XDG_CACHE_HOME/linepack`` or ``~/.cache/linepack``)::

    debs/<package>_<version>_amd64.deb
    apt-trixie/{sources.list,lists/,cache/}       the private apt state
    kernels/<release>/vmlinux                      (-dbg, with DWARF)
    kernels/<release>/vmlinuz                      (the boot image of the same build)
    kernels/<release>/modules/...                  (only what was asked for, .ko)
"""

import os
import re
import subprocess
import tempfile

from .errors import BadInput, ExternalToolError
from .progress import stderr_log

SERIES = "6.1.0"
# flavour name -> the suffix of its release and package names
FLAVOURS = {"cloud": "cloud-amd64", "generic": "amd64", "rt": "rt-amd64"}
DEFAULT_FLAVOUR = "cloud"

# Debian 13 (trixie) and trixie-backports, read through a private apt state under
# the cache (sources list, lists, package cache) so the machine's apt sources stay
# as they are; signed by the archive keyring every Debian has.
TRIXIE_SOURCES = "".join(
    f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {url} {suite} main\n"
    for url, suite in (("http://deb.debian.org/debian", "trixie"),
                       ("http://deb.debian.org/debian", "trixie-backports"),
                       ("http://deb.debian.org/debian-security", "trixie-security")))


class Series:
    """How one Debian kernel series names its packages, releases and files.

    ``dbg``/``vmlinux``: package and member of the vmlinux with DWARF;
    ``image``/``vmlinuz``: package and member of the boot image; ``modules``/
    ``moddir``: package and folder of the modules. Each is formatted with rel=.
    ``apt``: None (the machine's apt) or the name of a private apt state.
    """

    def __init__(self, name, release_fmt, search_re, pkg_re, env, *, vmlinux, image, vmlinuz,
                 modules, moddir, apt=None, dbg="linux-image-{rel}-dbg", what=""):
        self.name, self.release_fmt, self.search_re = name, release_fmt, search_re
        self.pkg_re, self.env = re.compile(pkg_re, re.M), env
        self.dbg, self.vmlinux, self.image, self.vmlinuz = dbg, vmlinux, image, vmlinuz
        self.modules, self.moddir, self.apt, self.what = modules, moddir, apt, what

    def release(self, abi):
        return self.release_fmt.format(abi=int(abi))

    def of_flavour(self, flavour):
        """This series' names for one flavour (FLAVOURS): the tables below hold
        ``{flavour}`` where the suffix goes."""
        suffix = FLAVOURS.get(flavour)
        if suffix is None:
            raise BadInput(f"unknown kernel flavour {flavour!r} (known: {', '.join(FLAVOURS)})")
        out = Series.__new__(Series)
        out.__dict__.update(self.__dict__)
        out.flavour = flavour
        out.release_fmt = self.release_fmt.replace("{flavour}", suffix)
        out.search_re = self.search_re.replace("{flavour}", re.escape(suffix))
        out.pkg_re = re.compile(self.pkg_re.pattern.replace("{flavour}", re.escape(suffix)), re.M)
        return out


def _trixie_backports(version):
    """A trixie-backports series (7.2, 7.3, ...): the boot image in
    linux-binary-unsigned-*, the DWARF vmlinux under usr/lib/debug/lib/modules."""
    v = re.escape(version)
    return Series(version, version + ".{abi}+deb13-{flavour}",
                  rf"^linux-image-{v}\.[0-9]+\+deb13-{{flavour}}-dbg$",
                  rf"^linux-image-{v}\.(\d+)\+deb13-{{flavour}}-dbg\b",
                  "LINEPACK_KERNEL_ABI_" + version.replace(".", "_"),
                  vmlinux="usr/lib/debug/lib/modules/{rel}/vmlinux",
                  image="linux-binary-unsigned-{rel}",
                  vmlinuz="usr/lib/modules/{rel}/vmlinuz.unsigned",
                  modules="linux-modules-{rel}", moddir="usr/lib/modules/{rel}/kernel",
                  apt="trixie", what="trixie-backports")


SERIES_TABLE = {
    "6.1": Series("6.1", SERIES + "-{abi}-{flavour}",
                  r"^linux-image-6\.1\.0-[0-9]+-{flavour}-dbg$",
                  r"^linux-image-6\.1\.0-(\d+)-{flavour}-dbg\b",
                  "LINEPACK_KERNEL_ABI",
                  vmlinux="usr/lib/debug/boot/vmlinux-{rel}",
                  image="linux-image-{rel}", vmlinuz="boot/vmlinuz-{rel}",
                  modules="linux-image-{rel}", moddir="lib/modules/{rel}/kernel",
                  what="Debian 12 (bookworm)"),
    "6.12": Series("6.12", "6.12.{abi}+deb13-{flavour}",
                   r"^linux-image-6\.12\.[0-9]+\+deb13-{flavour}-dbg$",
                   r"^linux-image-6\.12\.(\d+)\+deb13-{flavour}-dbg\b",
                   "LINEPACK_KERNEL_ABI_6_12",
                   vmlinux="usr/lib/debug/boot/vmlinux-{rel}",
                   image="linux-image-{rel}-unsigned", vmlinuz="boot/vmlinuz-{rel}",
                   modules="linux-image-{rel}-unsigned", moddir="usr/lib/modules/{rel}/kernel",
                   apt="trixie", what="Debian 13 (trixie, trixie-security)"),
    "7.3": _trixie_backports("7.3"),
    "7.2": _trixie_backports("7.2"),
    # The 6.12 of Debian 12's bookworm-backports (linked without --emit-relocs too).
    "6.12-deb12": Series("6.12-deb12", "6.12.{abi}+deb12-{flavour}",
                         r"^linux-image-6\.12\.[0-9]+\+deb12-{flavour}-dbg$",
                         r"^linux-image-6\.12\.(\d+)\+deb12-{flavour}-dbg\b",
                         "LINEPACK_KERNEL_ABI_6_12_DEB12",
                         vmlinux="usr/lib/debug/boot/vmlinux-{rel}",
                         image="linux-image-{rel}", vmlinuz="boot/vmlinuz-{rel}",
                         modules="linux-image-{rel}", moddir="lib/modules/{rel}/kernel",
                         what="bookworm-backports"),
}
DEFAULT_SERIES = "6.1"


def series_info(series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    s = SERIES_TABLE.get(str(series))
    if s is None:
        raise BadInput(f"unknown kernel series {series!r} (known: {', '.join(SERIES_TABLE)})")
    return s.of_flavour(flavour)


def build_of_release(text):
    """(series, abi, flavour) of the first Debian release named in ``text`` (a
    banner, a boot image's version string, a uname -r), or (None, None, None)."""
    for name in SERIES_TABLE:
        for flavour in FLAVOURS:
            s = series_info(name, flavour)
            pattern = re.escape(s.release_fmt).replace(re.escape("{abi}"), r"(\d+)")
            m = re.search(r"(?<![\w.])" + pattern + r"(?![\w.+-])", text or "")
            if m:
                return name, int(m.group(1)), flavour
    return None, None, None


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


def _apt_state(name):
    """apt options of the private apt state ``name`` (made, and its lists fetched,
    on first use), or [] for the machine's own apt."""
    if name is None:
        return []
    d = os.path.join(cache_dir(), f"apt-{name}")
    sources = os.path.join(d, "sources.list")
    opts = ["-o", f"Dir::Etc::sourcelist={sources}", "-o", "Dir::Etc::sourceparts=/nonexistent",
            "-o", f"Dir::State::Lists={d}/lists", "-o", f"Dir::Cache={d}/cache",
            "-o", "APT::Sandbox::User=root" if os.geteuid() == 0 else "Debug::NoDropPrivs=0"]
    for sub in ("lists/partial", "cache/archives/partial"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    text = {"trixie": TRIXIE_SOURCES}[name]
    if not os.path.exists(sources) or open(sources).read() != text:
        with open(sources + ".tmp", "w") as f:
            f.write(text)
        os.replace(sources + ".tmp", sources)
    if not any(n.endswith("_InRelease") for n in os.listdir(os.path.join(d, "lists"))):
        update_apt_state(name)
    return opts


def update_apt_state(name):
    """apt-get update of a private apt state (the machine's lists are not touched)."""
    d = os.path.join(cache_dir(), f"apt-{name}")
    opts = ["-o", f"Dir::Etc::sourcelist={d}/sources.list", "-o", "Dir::Etc::sourceparts=/nonexistent",
            "-o", f"Dir::State::Lists={d}/lists", "-o", f"Dir::Cache={d}/cache",
            "-o", "APT::Sandbox::User=root" if os.geteuid() == 0 else "Debug::NoDropPrivs=0"]
    _run(["apt-get", "-q"] + opts + ["update"], f"apt-get update ({name}, private state {d})")


def available_abis(series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    """ABI numbers of the flavour's -dbg packages apt knows, ascending (6.12/7.3: patch levels)."""
    s = series_info(series, flavour)
    out = _run(["apt-cache"] + _apt_state(s.apt) + ["search", "--names-only", s.search_re],
               "apt-cache search")
    return sorted({int(m) for m in s.pkg_re.findall(out)})


def release(abi, series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    return series_info(series, flavour).release(abi)


def _cached_deb(package):
    debs = os.path.join(cache_dir(), "debs")
    os.makedirs(debs, exist_ok=True)
    for name in sorted(os.listdir(debs)):
        if name.startswith(package + "_") and name.endswith(".deb"):
            return os.path.join(debs, name)
    return None


def download_deb(package, log=None, apt=None):
    """apt-get download into the cache (once); returns the .deb path. ``apt``: a
    private apt state's name (None: the machine's apt)."""
    found = _cached_deb(package)
    if found:
        return found
    debs = os.path.join(cache_dir(), "debs")
    if log:
        log(f"downloading {package} with apt-get (cached under {debs})")
    opts = _apt_state(apt)
    with tempfile.TemporaryDirectory(dir=debs) as tmp:
        _run(["apt-get", "download", "-q"] + opts + [package], f"apt-get download {package}",
             cwd=tmp)
        got = [n for n in os.listdir(tmp) if n.endswith(".deb")]
        if not got:
            raise ExternalToolError(f"apt-get download {package} produced no .deb")
        os.replace(os.path.join(tmp, got[0]), os.path.join(debs, got[0]))
    return _cached_deb(package)


def _extract(deb, member, dest, xz=False):
    """Extract one file of a .deb's data archive to dest, atomically (``xz``: the
    member is xz-compressed; write it decompressed)."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as out:
            deb_proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE)
            tar = subprocess.run(["tar", "-x", "-O", "-f", "-", "./" + member.lstrip("./")],
                                 stdin=deb_proc.stdout, stdout=subprocess.PIPE if xz else out,
                                 stderr=subprocess.PIPE)
            deb_proc.stdout.close()
            deb_proc.wait()
            if xz and not tar.returncode:
                import lzma
                out.write(lzma.decompress(tar.stdout))
        if deb_proc.returncode or tar.returncode:
            why = (tar.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]
            if "Not found in archive" in why:
                raise BadInput(f"{os.path.basename(deb)} has no {member}")
            raise ExternalToolError(f"cannot extract {member} from {os.path.basename(deb)}: {why}")
        if os.path.getsize(tmp) == 0:
            raise ExternalToolError(f"{member} in {os.path.basename(deb)} is empty (a symlink?)")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resolve_abi(abi=None, series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    s = series_info(series, flavour)
    if abi is not None:
        return int(abi)
    env = os.environ.get(s.env)
    if env:
        return int(env)
    abis = available_abis(series, flavour)
    if not abis:
        pattern = s.release_fmt.format(abi="*")
        where = f"the private {s.apt} apt state" if s.apt else \
            "apt (run 'apt-get update' on a Debian 12 machine" + \
            (" with bookworm-backports)" if s.name != "6.1" else ")")
        raise ExternalToolError(f"{where} knows no linux-image-{pattern}-dbg package")
    return abis[-1]


def check_abi(abi, series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    """BadInput naming the valid ABIs when apt knows no package of ``abi`` (asked
    only before a download: a cached kernel needs no apt lists)."""
    known = available_abis(series, flavour)
    if known and int(abi) not in known:
        raise BadInput(f"ABI {abi}: apt knows no {release(abi, series, flavour)} kernel; valid: "
                       f"{', '.join(map(str, known))} (see 'linepack fetch --series {series} "
                       f"--flavour {flavour} --list')")


def _cached_file(kind, series, flavour, abi, log, rel_path, package, member, xz=False):
    s = series_info(series, flavour)
    abi = resolve_abi(abi, series, flavour)
    rel = release(abi, series, flavour)
    dest = os.path.join(cache_dir(), "kernels", rel, rel_path)
    if os.path.exists(dest):
        return dest
    check_abi(abi, series, flavour)
    deb = download_deb(package.format(rel=rel), log=log, apt=s.apt)
    if log:
        log(f"extracting {kind} of {rel} from {os.path.basename(deb)}")
    _extract(deb, member.format(rel=rel), dest, xz=xz)
    return dest


def debian_vmlinux(abi=None, log=None, *, series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    """Path of the cached vmlinux (with DWARF) of a Debian kernel (fetching it once).

    ``series`` is "6.1" (default; ``abi`` = ABI number), "6.12" (Debian 13) or "7.3"
    (trixie-backports), ``abi`` the patch level (118 for 6.12.118+deb13), or
    "6.12-deb12" (bookworm-backports); ``flavour`` "cloud" (default), "generic" or "rt".
    """
    s = series_info(series, flavour)
    return _cached_file("vmlinux", series, flavour, abi, log, "vmlinux", s.dbg, s.vmlinux)


def debian_vmlinuz(abi=None, log=None, *, series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    """Path of the cached boot image (vmlinuz) of the same build (fetching it once)."""
    s = series_info(series, flavour)
    return _cached_file("vmlinuz", series, flavour, abi, log, "vmlinuz", s.image, s.vmlinuz)


def debian_module(name, abi=None, log=None, *, series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    """Path of one cached module (.ko) of the same build, e.g. 'fs/fat/vfat.ko'
    (Debian 13's are .ko.xz in the package: cached decompressed)."""
    s = series_info(series, flavour)
    xz = s.apt is not None
    return _cached_file("module", series, flavour, abi, log, os.path.join("modules", name),
                        s.modules,
                        f"{s.moddir}/{name}" + (".xz" if xz else ""), xz=xz)


def debian_module_names(abi=None, log=None, *, series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    """Paths (e.g. 'drivers/block/brd.ko') of every module the build's modules package
    ships, listed once into the cache; what the kernel has built in is not there (Debian
    13 builds in the virtio core and PCI transport that 6.1 has as modules)."""
    s = series_info(series, flavour)
    abi = resolve_abi(abi, series, flavour)
    rel = release(abi, series, flavour)
    dest = os.path.join(cache_dir(), "kernels", rel, "modules.list")
    if not os.path.exists(dest):
        deb = download_deb(s.modules.format(rel=rel), log=log, apt=s.apt)
        deb_proc = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", deb], stdout=subprocess.PIPE)
        tar = subprocess.run(["tar", "-t"], stdin=deb_proc.stdout, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        deb_proc.stdout.close()
        if deb_proc.wait() or tar.returncode:
            raise ExternalToolError(f"cannot list {os.path.basename(deb)}: "
                                    f"{(tar.stderr.strip().splitlines() or ['?'])[0]}")
        prefix = "./" + s.moddir.format(rel=rel) + "/"
        names = sorted(n[len(prefix):].removesuffix(".xz") for n in tar.stdout.splitlines()
                       if n.startswith(prefix) and n.endswith((".ko", ".ko.xz")))
        from .io import write_atomic
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        write_atomic(dest, "".join(n + "\n" for n in names))
    with open(dest) as f:
        return {ln.strip() for ln in f if ln.strip()}


_log = stderr_log("linepack")


def main_fetch(abi=None, series=DEFAULT_SERIES, flavour=DEFAULT_FLAVOUR):
    path = debian_vmlinux(abi, log=_log, series=series, flavour=flavour)
    print(path)
    return path


__all__ = ["build_of_release", "cache_dir", "available_abis", "debian_vmlinux", "debian_vmlinuz",
           "debian_module", "debian_module_names", "resolve_abi", "release", "download_deb",
           "series_info", "update_apt_state", "SERIES_TABLE", "DEFAULT_SERIES", "FLAVOURS",
           "DEFAULT_FLAVOUR"]
