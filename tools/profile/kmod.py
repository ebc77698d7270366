"""Out-of-tree kernel modules of workloads, built against Debian's linux-headers.

A workload may name a module source directory (``[module] source =
"modules/slab_bulk"`` under workloads/, a Kbuild file plus C sources)::

    ko = build_module("/path/workloads/modules/slab_bulk", "6.1.0-56-cloud-amd64")

builds it with the kernel's own kbuild (``make -C /usr/src/linux-headers-<release>
M=<copy> modules``) once per source hash into ``<cache>/modules/<name>-<sha>.ko``.
The headers come from the Debian package ``linux-headers-<release>`` of the very
build being profiled (tools/setup.sh installs it), so vermagic and symbol CRCs
match and the module loads into that kernel and into any layout linepack made of it.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile

from ..errors import BadInput, ExternalToolError

HEADERS_ROOT = "/usr/src"


def headers_dir(release):
    """The kbuild tree of ``linux-headers-<release>``; ExternalToolError when absent."""
    d = os.path.join(os.environ.get("LINEPACK_KERNEL_HEADERS_ROOT", HEADERS_ROOT),
                     f"linux-headers-{release}")
    if not os.path.isfile(os.path.join(d, "Makefile")):
        raise ExternalToolError(f"kernel headers for {release} are not installed (apt-get install "
                                f"linux-headers-{release}; run tools/setup.sh)")
    return d


def _sources(src_dir):
    try:
        names = sorted(n for n in os.listdir(src_dir)
                       if n == "Kbuild" or n == "Makefile" or n.endswith((".c", ".h")))
    except OSError as e:
        raise BadInput(f"module source {src_dir}: {e.strerror}") from None
    if "Kbuild" not in names and "Makefile" not in names:
        raise BadInput(f"module source {src_dir} has no Kbuild file")
    return names


def _module_name(src_dir):
    """The single ``obj-m := name.o`` of the Kbuild file."""
    path = os.path.join(src_dir, "Kbuild")
    if not os.path.exists(path):
        path = os.path.join(src_dir, "Makefile")
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("obj-m"):
                objs = line.split("=", 1)[1].split()
                if len(objs) == 1 and objs[0].endswith(".o"):
                    return objs[0][:-2]
    raise BadInput(f"{path}: expected one 'obj-m := name.o' line")


def build_module(src_dir, release, log=None):
    """Path of the cached .ko built from ``src_dir`` for kernel ``release``."""
    from ..targets import cache_dir
    names = _sources(src_dir)
    mod = _module_name(src_dir)
    kdir = headers_dir(release)
    h = hashlib.sha256(release.encode() + b"\0")
    for n in names:
        with open(os.path.join(src_dir, n), "rb") as f:
            h.update(n.encode() + b"\0" + f.read() + b"\0")
    dest_dir = os.path.join(cache_dir(), "modules", release)
    dest = os.path.join(dest_dir, f"{mod}-{h.hexdigest()[:16]}.ko")
    if os.path.exists(dest):
        return dest
    if not shutil.which("make"):
        raise ExternalToolError("'make' is not installed (run tools/setup.sh)")
    os.makedirs(dest_dir, exist_ok=True)
    if log:
        log(f"building kernel module {mod} against {os.path.basename(kdir)}")
    with tempfile.TemporaryDirectory(prefix=f"linepack-kmod-{mod}-") as work:
        for n in names:
            shutil.copy(os.path.join(src_dir, n), os.path.join(work, n))
        p = subprocess.run(["make", "-s", "-C", kdir, f"M={work}", "modules"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ko = os.path.join(work, mod + ".ko")
        if p.returncode != 0 or not os.path.exists(ko):
            errs = [ln for ln in p.stdout.splitlines() if "error" in ln.lower()] or \
                p.stdout.strip().splitlines()[-1:] or [f"exit status {p.returncode}"]
            raise ExternalToolError(f"cannot build kernel module {mod}: {errs[0].strip()}")
        fd, tmp = tempfile.mkstemp(dir=dest_dir, prefix=".part-")
        os.close(fd)
        shutil.copyfile(ko, tmp)
        os.replace(tmp, dest)
    return dest


__all__ = ["build_module", "headers_dir"]
