"""Workloads: small static C programs run as the initramfs /init (or natively).

A workload is data, ``configs/workloads/<name>.toml``::

    name = "vfs-mix"
    source = "vfs-mix.c"            # under workloads/
    headers = ["linepack.h"]        # also part of the build hash
    default_loops = 2000
    result_prefix = "linepack-result vfs-mix"
    native_needs_dir = true         # natively: `vfs-mix LOOPS DIR`

``build(name)`` compiles it with ``gcc -static -O2`` once per source hash into
``<cache>/workloads/<name>-<sha>``. The result line every workload prints is
``<result_prefix> loops=<N> ...`` and is identical on every run and layout.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

from ..errors import BadInput, ExternalToolError
from ..io import load_toml
from ..resources import configs_dir, sources_dir

CFLAGS = ["-static", "-O2", "-Wall", "-Wextra"]
RESULT_TAG = "linepack-result"
BEGIN_TAG = "linepack-begin"
END_TAG = "linepack-end"
ERROR_TAG = "linepack-error"

@dataclass(frozen=True)
class Workload:
    name: str
    source: str                      # absolute path of the .c file
    default_loops: int
    result_prefix: str
    description: str = ""
    headers: tuple = field(default_factory=tuple)   # absolute paths
    native_needs_dir: bool = False
    # A disk for the guest ([disk] fs = "ext4", size_mb = 64): the runner attaches
    # a deterministic ext4 image as NVMe (built in to Debian's cloud kernel).
    disk_fs: str = ""
    disk_size_mb: int = 0
    disk_device: str = "ram"         # "ram" (brd module, deterministic), "nvme" or "virtio"
    env: tuple = ()                  # (key, value) words for /init's environment
    # An out-of-tree kernel module built against the kernel's linux-headers and
    # loaded by /init ([module] source = "modules/x" under workloads/, params = "...").
    module_source: str = ""          # absolute directory, or ""
    module_params: str = ""

    def expected_prefix(self, loops=None):
        """The start of the result line a run with ``loops`` must print."""
        return f"{self.result_prefix} loops={self.default_loops if loops is None else int(loops)}"


def names():
    """Names of the workloads defined in configs/workloads/."""
    d = os.path.join(configs_dir(), "workloads")
    try:
        return sorted(n[:-5] for n in os.listdir(d) if n.endswith(".toml"))
    except OSError:
        return []


def load(name):
    """The Workload called ``name`` (a Workload passes through)."""
    if isinstance(name, Workload):
        return name
    path = os.path.join(configs_dir(), "workloads", f"{name}.toml")
    if not os.path.exists(path):
        known = ", ".join(names()) or "none"
        raise BadInput(f"unknown workload '{name}' (known: {known})")
    d = load_toml(path)
    src = sources_dir()
    try:
        return Workload(
            name=d.get("name", name),
            source=os.path.join(src, d["source"]),
            default_loops=int(d["default_loops"]),
            result_prefix=d.get("result_prefix", f"{RESULT_TAG} {name}"),
            description=d.get("description", ""),
            headers=tuple(os.path.join(src, h) for h in d.get("headers", ())),
            native_needs_dir=bool(d.get("native_needs_dir", False)),
            disk_fs=str(d.get("disk", {}).get("fs", "")),
            disk_size_mb=int(d.get("disk", {}).get("size_mb", 0)),
            disk_device=str(d.get("disk", {}).get("device", "ram")),
            env=tuple(sorted((str(k), str(v)) for k, v in d.get("env", {}).items())),
            module_source=os.path.join(src, d["module"]["source"]) if "module" in d else "",
            module_params=str(d.get("module", {}).get("params", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{path}: missing or bad field {e}") from None


def _compiler():
    cc = os.environ.get("CC", "gcc")
    if not shutil.which(cc):
        raise ExternalToolError(f"'{cc}' is not installed: workloads need gcc and libc6-dev "
                                "(run tools/setup.sh)")
    return cc


def _cc_version(cc):
    try:
        return subprocess.run([cc, "--version"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return cc


def build_hash(wl, cc):
    h = hashlib.sha256()
    h.update(_cc_version(cc).encode() + b"\0" + " ".join(CFLAGS).encode() + b"\0")
    for p in (wl.source,) + tuple(wl.headers):
        try:
            with open(p, "rb") as f:
                h.update(os.path.basename(p).encode() + b"\0" + f.read() + b"\0")
        except OSError as e:
            raise BadInput(f"workload {wl.name}: cannot read {p}: {e.strerror}") from None
    return h.hexdigest()[:16]


def build(name, log=None):
    """Path of the static binary of workload ``name``, compiled once per source hash."""
    from ..targets import cache_dir
    wl = load(name)
    cc = _compiler()
    dest_dir = os.path.join(cache_dir(), "workloads")
    dest = os.path.join(dest_dir, f"{wl.name}-{build_hash(wl, cc)}")
    if os.path.exists(dest):
        return dest
    os.makedirs(dest_dir, exist_ok=True)
    if log:
        log(f"building workload {wl.name} ({cc} {' '.join(CFLAGS)})")
    fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".part-")
    os.close(fd)
    try:
        p = subprocess.run([cc] + CFLAGS + ["-I", os.path.dirname(wl.source), "-o", tmp, wl.source],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            out = p.stdout
            if "cannot find -lc" in out or "crt1.o" in out or ("No such file" in out and ".h:" in out):
                raise ExternalToolError(f"cannot build workload {wl.name}: static C library "
                                        "missing (install libc6-dev)")
            errs = [ln for ln in out.splitlines() if "error" in ln] or out.strip().splitlines() \
                or [f"exit status {p.returncode}"]
            raise ExternalToolError(f"cannot build workload {wl.name}: {errs[0]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


ROI_SYMBOLS = ("linepack_roi_begin", "linepack_roi_end")


def roi_addresses(name):
    """(begin, end) addresses of linepack_roi_begin/end in the workload's static binary.

    Each runs once, right before / right after the measured loop, so they are the
    TCG plugin's ``start=`` / ``stop=`` for restricting a profile to the loop.
    """
    from elftools.elf.elffile import ELFFile
    binary = build(name)
    with open(binary, "rb") as f:
        elf = ELFFile(f)
        if elf["e_type"] != "ET_EXEC":
            raise BadInput(f"workload {name}: {binary} is not a fixed-address (non-PIE) executable")
        symtab = elf.get_section_by_name(".symtab")
        found = {}
        if symtab is not None:
            for sym_name in ROI_SYMBOLS:
                syms = symtab.get_symbol_by_name(sym_name)
                if syms:
                    found[sym_name] = syms[0]["st_value"]
    missing = [n for n in ROI_SYMBOLS if n not in found]
    if missing:
        raise BadInput(f"workload {name}: no {', '.join(missing)} symbol in {binary}")
    return tuple(found[n] for n in ROI_SYMBOLS)


def find_result(text, prefix=RESULT_TAG):
    """The last line of ``text`` that is ``prefix`` or starts with ``prefix + " "``, or None.

    (A whole-word match: prefix '... loops=10' does not match a 'loops=100' line.)
    """
    found = None
    for line in text.splitlines():
        line = line.strip()
        if line == prefix or line.startswith(prefix + " "):
            found = line
    return found


def find_error(text):
    """The first ``linepack-error`` line a workload printed, or None."""
    for line in text.splitlines():
        if line.strip().startswith(ERROR_TAG):
            return line.strip()
    return None


def run_native(name, loops=None, workdir=None, timeout=600):
    """Run a workload on this machine; returns its result line (raises if absent)."""
    wl = load(name)
    binary = build(wl)
    loops = wl.default_loops if loops is None else int(loops)
    argv = [binary, str(loops)]
    tmp = None
    if wl.native_needs_dir:
        if workdir is None:
            tmp = workdir = tempfile.mkdtemp(prefix=f"linepack-{wl.name}-")
        argv.append(str(workdir))
    try:
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ExternalToolError(f"workload {wl.name} timed out after {timeout} s") from None
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    line = find_result(p.stdout, wl.expected_prefix(loops))
    if p.returncode != 0 or line is None:
        why = find_error(p.stdout) or f"exit status {p.returncode}, no result line"
        raise ExternalToolError(f"workload {wl.name} failed natively: {why}")
    return line


__all__ = ["Workload", "names", "load", "build", "run_native", "find_result", "find_error",
           "configs_dir", "sources_dir", "load_toml", "roi_addresses", "RESULT_TAG", "BEGIN_TAG", "END_TAG"]
