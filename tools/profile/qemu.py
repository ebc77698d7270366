"""Boot a kernel under QEMU (TCG) and capture its serial console.

Used by ``profile`` (with a TCG plugin) and ``evaluate`` (booted measurement)::

    r = run_workload(vmlinux, "vfs-mix", loops=2000)          # raises on failure
    r.result_line   # 'linepack-result vfs-mix loops=2000 checksum=...'
    r.serial, r.wall, r.command, r.returncode

    r = run_kernel(vmlinux, initrd, append="...", plugin="libx.so", plugin_args={"out": "p.bin"})

Defaults (command line, memory, machine arguments) come from ``configs/kernel.toml``.
``icount=True`` makes runs repeatable: ``-icount shift=0,sleep=off`` ties guest time
to executed instructions, and ``-rtc base=...,clock=vm`` fixes the wall clock.
Failures raise ExternalToolError with one line: QEMU missing or refusing the
kernel, timeout, kernel panic (the panic line is quoted), result line absent.
"""

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

from ..errors import BadInput, ExternalToolError
from . import initramfs as _initramfs
from . import workloads as _workloads

QEMU = "qemu-system-x86_64"
# A bzImage boots through the decompressor, which picks the KASLR offset from
# RDRAND when the CPU has it (under -icount the TSC, its fallback, is the same
# on every boot): give QEMU's default CPU model RDRAND (TCG supports it).
KASLR_CPU = ["-cpu", "qemu64,+rdrand"]
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_TS = re.compile(r"^\[\s*\d+\.\d+\]\s*")


@dataclass
class QemuResult:
    returncode: int
    serial: str
    result_line: "str | None"
    wall: float
    command: list = field(default_factory=list)
    stderr: str = ""

    @property
    def panic_line(self):
        return panic_line(self.serial)


def kernel_defaults():
    """The [boot] and [icount] tables of configs/kernel.toml (built-in fallbacks)."""
    path = os.path.join(_workloads.configs_dir(), "kernel.toml")
    d = _workloads.load_toml(path) if os.path.exists(path) else {}
    boot = d.get("boot", {})
    ic = d.get("icount", {})
    return {
        "append": boot.get("append", "console=ttyS0 rdinit=/init panic=-1 quiet"),
        "memory": str(boot.get("memory", "512")),
        "qemu_args": list(boot.get("qemu_args", ["-nodefaults", "-display", "none", "-monitor",
                                                 "none", "-serial", "stdio"])),
        "icount_args": list(ic.get("qemu_args", ["-icount", "shift=0,sleep=off", "-rtc",
                                                 "base=2020-01-01T00:00:00,clock=vm"])),
    }


_OOPS_START = ("BUG: ", "Oops: ", "general protection fault", "kernel BUG at")


def panic_line(serial):
    """The 'Kernel panic - not syncing: ...' line of a serial log (timestamp removed), or
    None; after an oops (oops=panic) with the oops' first line and its RIP, which say
    what went wrong where ("Fatal exception" alone does not)."""
    lines = [_TS.sub("", ln.strip()) for ln in serial.splitlines()]
    for i, line in enumerate(lines):
        if "Kernel panic" in line:
            oops = next((ln for ln in lines[:i] if ln.startswith(_OOPS_START)), None)
            rip = next((ln for ln in lines[:i] if ln.startswith("RIP: ")), None)
            why = "; ".join(x for x in (oops, rip) if x)
            return f"{line} ({why})" if why else line
    return None


def check_kernel(path):
    """BadInput unless ``path`` looks like something QEMU can boot (ELF vmlinux or bzImage)."""
    try:
        with open(path, "rb") as f:
            head = f.read(0x206)
    except OSError as e:
        raise BadInput(f"cannot read kernel {path}: {e.strerror}") from None
    if head[:4] == b"\x7fELF":
        if head[4:5] != b"\x02" or head[18:20] != b"\x3e\x00":
            raise BadInput(f"{path} is an ELF file but not x86-64 ELF64: not a kernel QEMU can boot")
        return "elf"
    from ..image.bootimage import is_bzimage
    if is_bzimage(head):
        return "bzimage"
    raise BadInput(f"{path} is not a kernel (neither an x86-64 ELF vmlinux nor a bzImage)")


def check_kernel_path(path, flag="--kernel"):
    """check_kernel with clear words for a missing file or a directory, and, for an
    ELF vmlinux, its whole header and section table (a truncated file is bad input
    here, not a QEMU failure after the boot started)."""
    p = str(path)
    if os.path.isdir(p):
        raise BadInput(f"{flag} {p}: is a directory, not a kernel image")
    if not os.path.exists(p):
        raise BadInput(f"{flag} {p}: no such file")
    kind = check_kernel(p)
    if kind == "elf":
        from ..image.elf import ElfImage
        ElfImage(p)
    else:
        # the whole setup header, and a payload the file really holds
        from ..image.bootimage import read_setup_header
        hdr = read_setup_header(p)
        if hdr.payload_file_offset + hdr.payload_length > os.path.getsize(p):
            raise BadInput(f"{flag} {p}: truncated bzImage (its payload ends at "
                           f"{hdr.payload_file_offset + hdr.payload_length:,}, the file has "
                           f"{os.path.getsize(p):,} bytes)")
    return kind


def _plugin_arg(plugin, plugin_args):
    from .trace import plugin_option
    if not os.path.exists(plugin):
        raise BadInput(f"TCG plugin {plugin} does not exist")
    items = plugin_args or {}
    if not hasattr(items, "items"):           # a list of "k=v" strings works too
        items = dict(str(a).split("=", 1) for a in items)
    return plugin_option(os.path.abspath(plugin),
                         [f"{k}={'on' if v is True else 'off' if v is False else v}"
                          for k, v in items.items()])


def qemu_command(kernel, initrd, append=None, memory=None, icount=True, plugin=None,
                 plugin_args=None, extra_args=(), qemu=None):
    """The argument list run_kernel runs (without starting anything)."""
    d = kernel_defaults()
    cmd = [qemu or os.environ.get("LINEPACK_QEMU", QEMU), "-m", str(memory or d["memory"]),
           "-no-reboot"] + d["qemu_args"]
    if icount:
        cmd += d["icount_args"]
    if plugin:
        cmd += ["-plugin", _plugin_arg(plugin, plugin_args)]
    cmd += ["-kernel", str(kernel), "-initrd", str(initrd), "-append",
            d["append"] if append is None else append]
    cmd += [str(a) for a in extra_args]
    return cmd


def _write_log(log, text):
    if log is None:
        return
    if hasattr(log, "write"):
        log.write(text)
        return
    # linepack.io's write: a path the command declared (boot --serial) is staged with
    # its other outputs; the directory must exist (it is never created here).
    from ..io import write_atomic
    write_atomic(str(log), text.encode())


def _clean(raw):
    text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return _ANSI.sub("", text)


def run_kernel(kernel, initrd, append=None, memory="512", icount=True, timeout=600,
               plugin=None, plugin_args=None, extra_args=(), log=None, check=True, qemu=None):
    """Boot ``kernel`` with ``initrd`` and wait until QEMU exits; returns a QemuResult.

    ``append`` replaces the default command line of configs/kernel.toml. ``log``: a
    path or file object that receives the serial output. With ``check`` (default)
    a QEMU failure, a timeout or a kernel panic raises ExternalToolError.
    """
    kind = check_kernel_path(kernel, "kernel")
    if not os.path.isfile(str(initrd)):
        raise BadInput(f"initrd {initrd} does not exist")
    given = [str(a) for a in extra_args] + [str(a) for a in kernel_defaults()["qemu_args"]]
    if kind == "bzimage" and "-cpu" not in given:
        extra_args = tuple(extra_args) + tuple(KASLR_CPU)
    cmd = qemu_command(kernel, initrd, append=append, memory=memory, icount=icount, plugin=plugin,
                       plugin_args=plugin_args, extra_args=extra_args, qemu=qemu)
    if not shutil.which(cmd[0]):
        raise ExternalToolError(f"'{cmd[0]}' is not installed (install qemu-system-x86; "
                                "run tools/setup.sh)")
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        raise ExternalToolError(f"cannot start {cmd[0]}: {e.strerror}") from None
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        out, err = proc.communicate()
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    wall = time.monotonic() - t0
    serial = _clean(out)
    _write_log(log, serial)
    res = QemuResult(returncode=proc.returncode, serial=serial,
                     result_line=_workloads.find_result(serial), wall=wall, command=cmd,
                     stderr=err.decode("utf-8", errors="replace"))
    if not check:
        return res
    if timed_out:
        raise ExternalToolError(f"QEMU timed out after {timeout} s{_last_words(serial)}")
    pl = res.panic_line
    if pl:
        raise ExternalToolError(f"kernel panic under QEMU: {pl}")
    if proc.returncode != 0:
        msg = [ln.strip() for ln in res.stderr.splitlines() if ln.strip()]
        raise ExternalToolError(f"QEMU failed (exit status {proc.returncode}): "
                                f"{msg[-1] if msg else 'no message'}{_last_words(serial)}")
    return res


def _last_words(serial):
    lines = [ln.strip() for ln in serial.splitlines() if ln.strip()]
    return f"; last serial line: {_TS.sub('', lines[-1])!r}" if lines else "; no serial output"


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def loops_append(base, loops, extra=None):
    """A kernel command line with ``loops=N`` (and other key=value words) for /init."""
    words = [base] if base else []
    if loops is not None:
        words.append(f"loops={int(loops)}")
    for k, v in (extra or {}).items():
        words.append(f"{k}={v}")
    return " ".join(words)


def workload_initrd(workload, modules=(), log=None, files=()):
    """Path of the (cached) initramfs whose /init is ``workload``'s binary.

    ``modules``: host paths of .ko files, or (archive path, host path[, parameters])
    tuples, packed under /lib/modules/ (by base name when no archive path is given).
    The workload's /init loads those under /lib/modules/ with finit_module, in the
    order given (listed with their parameters in /lib/modules/linepack.order),
    before its loop. ``files``: more (archive path, host path) pairs.
    """
    binary = _workloads.build(workload, log=log)
    extra, order = list(files), []
    for m in modules:
        params = ""
        if isinstance(m, (tuple, list)):
            arc, host = str(m[0]).lstrip("/"), str(m[1])
            params = str(m[2]) if len(m) > 2 else ""
        else:
            arc, host = f"lib/modules/{os.path.basename(str(m))}", str(m)
        extra.append((arc, host))
        if arc.startswith("lib/modules/") and arc.endswith(".ko"):
            order.append((arc[len("lib/modules/"):] + " " + params).strip())
    if order:
        extra.append(("lib/modules/linepack.order", "".join(n + "\n" for n in order).encode()))
    return _initramfs.build_initramfs(binary, extra)


def kernel_build(kernel):
    """(series, abi, flavour) of a Debian kernel image, from an ELF vmlinux's banner or a
    boot image's version string (6.1, 6.12, 7.3: targets.SERIES_TABLE; cloud, generic,
    rt), or (None, None, None)."""
    from .. import targets
    from ..errors import LinepackError
    try:
        if check_kernel(kernel) == "bzimage":
            from ..image.bootimage import read_setup_header
            text = read_setup_header(kernel).kernel_version
        else:
            from ..image.elf import ElfImage
            from ..kernel.base import kernel_version_of
            text = kernel_version_of(ElfImage(kernel))[1]
    except LinepackError:
        return None, None, None
    return targets.build_of_release(text)


def kernel_abi(kernel):
    """The Debian ABI number of a 6.1 cloud kernel image, from its banner (or None)."""
    series, abi, flavour = kernel_build(kernel)
    return abi if (series, flavour) == ("6.1", "cloud") else None


def debian_module_for(kernel, name):
    """Module ``name`` (e.g. 'drivers/block/brd.ko') of the Debian build ``kernel`` is
    (a rewrite keeps its banner), fetched once; a kernel of no known build: the 6.1
    series' newest, as before."""
    from .. import targets
    series, abi, flavour = kernel_build(kernel)
    return targets.debian_module(name, abi=abi, series=series or targets.DEFAULT_SERIES,
                                 flavour=flavour or targets.DEFAULT_FLAVOUR)


# Fixed identity for reproducible file-system images.
_FS_UUID = "6c696e65-7061-636b-2d64-69736b303031"
_FS_HASH_SEED = "6c696e65-7061-636b-2d68-617368303031"


def disk_image(fs="ext4", size_mb=64, log=None):
    """A cached, byte-reproducible empty file-system image (mkfs with fixed UUID,
    hash seed and time)."""
    from .. import targets
    if fs != "ext4":
        raise BadInput(f"disk file system '{fs}' is not supported (only ext4)")
    mkfs = shutil.which("mkfs.ext4") or "/sbin/mkfs.ext4"
    if not os.path.exists(mkfs):
        raise ExternalToolError("mkfs.ext4 is not installed (apt-get install e2fsprogs)")
    d = os.path.join(targets.cache_dir(), "disks")
    os.makedirs(d, exist_ok=True)
    dest = os.path.join(d, f"{fs}-{int(size_mb)}m-v2.img")
    if os.path.exists(dest):
        return dest
    tmp = dest + f".{os.getpid()}.part"
    with open(tmp, "wb") as f:
        f.truncate(int(size_mb) << 20)
    env = dict(os.environ, E2FSPROGS_FAKE_TIME="1577836800", MKE2FS_DETERMINISTIC="1")
    p = subprocess.run([mkfs, "-q", "-F", "-U", _FS_UUID, "-E",
                        # no lazy init: the kernel's ext4lazyinit thread would
                        # otherwise zero inode tables with host-timed I/O
                        f"hash_seed={_FS_HASH_SEED},lazy_itable_init=0,lazy_journal_init=0",
                        "-L", "linepack", "-m", "0", tmp], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode:
        os.unlink(tmp)
        raise ExternalToolError(f"mkfs.ext4 failed: {p.stderr.strip().splitlines()[-1:]}")
    os.replace(tmp, dest)
    if log:
        log(f"made {dest}")
    return dest


# Load order of the virtio-blk stack (each after the modules it depends on); those
# the build has built in (Debian 13: all but virtio_blk) are left out.
VIRTIO_BLK_MODULES = ("drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko",
                      "drivers/virtio/virtio_pci_modern_dev.ko",
                      "drivers/virtio/virtio_pci_legacy_dev.ko", "drivers/virtio/virtio_pci.ko",
                      "drivers/block/virtio_blk.ko")


def _filesystem_modules(wl, kernel):
    """The workload's file system and what it depends on, when the kernel's build has
    it as a module (Debian's generic and rt flavours: ext4, jbd2, mbcache, crc16;
    the cloud kernel builds them in), in load order; () otherwise."""
    if not wl.disk_fs:
        return ()
    from .. import targets
    series, abi, flavour = kernel_build(kernel)
    if series is None:
        return ()
    shipped = targets.debian_module_names(abi, series=series, flavour=flavour)
    by_name = {os.path.basename(p)[:-3].replace("-", "_"): p for p in shipped}
    order, seen = [], set()

    def add(name):
        # a crypto soft dependency names an alias (crypto-crc32c): the module
        # providing it is the algorithm's generic one (crc32c_generic.ko)
        base = name.removeprefix("crypto-").replace("-", "_")
        path = by_name.get(base, by_name.get(base + "_generic"))
        if path is None or path in seen:
            return
        seen.add(path)
        ko = targets.debian_module(path, abi=abi, series=series, flavour=flavour)
        for dep in _module_depends(ko):
            add(dep)
        order.append(ko)
    add(wl.disk_fs)
    return tuple(order)


def _module_depends(ko):
    """The module names a .ko's .modinfo lists in ``depends=`` and as ``softdep=pre:``
    (ext4 mounts only with crc32c loaded), in that order."""
    from ..image.elf import ElfImage
    im = ElfImage(ko)
    sec = im.section(".modinfo")
    if sec is None:
        return []
    out = []
    for entry in bytes(im.section_bytes(sec)).split(b"\0"):
        text = entry.decode(errors="replace")
        if text.startswith("depends="):
            out += [d for d in text[len("depends="):].split(",") if d]
        elif text.startswith("softdep="):
            # softdep=pre: a b post: c
            words = text[len("softdep="):].split() + ["post:"]
            if "pre:" in words:
                pre = words[words.index("pre:") + 1:]
                out += pre[:pre.index("post:")]
    return out


def _workload_modules(wl, kernel):
    """The workload's own kernel module ([module] in its config), built for ``kernel``."""
    if not wl.module_source:
        return ()
    from .kmod import build_module
    abi = kernel_abi(kernel)
    if abi is None:
        raise BadInput(f"workload {wl.name} loads a kernel module, which is built against "
                       f"Debian's 6.1 cloud headers: {kernel} is not a Debian 6.1 cloud kernel")
    ko = build_module(wl.module_source, f"6.1.0-{abi}-cloud-amd64")
    name = os.path.basename(wl.module_source.rstrip("/"))
    return ((f"lib/modules/linepack_{name}.ko", ko, wl.module_params),)


@dataclass
class WorkloadBoot:
    """What booting ``kernel`` with a workload needs besides the kernel: plain files
    and arguments, so the boot can run anywhere those files are (runner.py)."""
    workload: str
    initrd: str
    append: str
    extra_args: tuple
    want: str                    # the result line's expected prefix


def workload_boot(kernel, workload="vfs-mix", loops=None, modules=(), log=None, append=None,
                  extra_args=(), env=None):
    """Build (or reuse) the initramfs and disk image of ``workload`` for ``kernel``;
    returns a WorkloadBoot. ``loops`` defaults to the workload's default_loops."""
    wl = _workloads.load(workload)
    loops = wl.default_loops if loops is None else int(loops)
    base = kernel_defaults()["append"] if append is None else append
    words = dict(wl.env)
    words.update(env or {})
    files = []
    if wl.disk_fs and wl.disk_device == "ram":
        # A RAM disk (brd, from the same Debian build) filled from an image in the
        # initramfs: ext4, jbd2 and the block layer run with no host-timed I/O.
        image = disk_image(wl.disk_fs, wl.disk_size_mb or 16)
        brd = debian_module_for(kernel, "drivers/block/brd.ko")
        modules = tuple(modules) + (("lib/modules/brd.ko", brd,
                                     f"rd_nr=1 rd_size={(wl.disk_size_mb or 16) * 1024}"),)
        files.append(("disk.img", image))
        words.setdefault("disk", "/dev/ram0")
        words.setdefault("disk_image", "/disk.img")
        words.setdefault("fstype", wl.disk_fs)
    modules = tuple(modules) + _workload_modules(wl, kernel) + _filesystem_modules(wl, kernel)
    if wl.disk_fs and wl.disk_device == "virtio":
        # virtio-blk and its transport are modules in Debian's cloud kernel
        from .. import targets
        series, abi, flavour = kernel_build(kernel)
        shipped = targets.debian_module_names(abi, series=series, flavour=flavour) \
            if series else None
        modules = tuple(modules) + tuple(debian_module_for(kernel, m) for m in VIRTIO_BLK_MODULES
                                         if shipped is None or m in shipped)
    initrd = workload_initrd(wl, modules, files=files)
    if wl.disk_fs and wl.disk_device == "virtio":
        image = disk_image(wl.disk_fs, wl.disk_size_mb or 64, log=log)
        extra_args = tuple(extra_args) + (
            "-drive", f"file={image},if=none,id=lpdisk,format=raw,snapshot=on",
            "-device", "virtio-blk-pci,drive=lpdisk")
        words.setdefault("disk", "/dev/vda")
        words.setdefault("fstype", wl.disk_fs)
    elif wl.disk_fs and wl.disk_device != "ram":
        image = disk_image(wl.disk_fs, wl.disk_size_mb or 64, log=log)
        # snapshot=on: the guest's writes go to a temporary overlay, the image stays pristine
        extra_args = tuple(extra_args) + (
            "-drive", f"file={image},if=none,id=lpdisk,format=raw,snapshot=on",
            "-device", "nvme,serial=linepack0,drive=lpdisk")
        words.setdefault("disk", "/dev/nvme0n1")
        words.setdefault("fstype", wl.disk_fs)
    return WorkloadBoot(wl.name, initrd, loops_append(base, loops, words or None),
                        tuple(extra_args), wl.expected_prefix(loops))


def check_workload_result(boot, res):
    """Set ``res.result_line`` from the serial output; ExternalToolError when the
    workload's result line is missing."""
    line = _workloads.find_result(res.serial, boot.want)
    if line is None:
        why = _workloads.find_error(res.serial)
        if why:
            raise ExternalToolError(f"workload {boot.workload} failed under QEMU: {why}")
        raise ExternalToolError(f"workload {boot.workload}: no result line '{boot.want} ...' in "
                                f"the serial output{_last_words(res.serial)}")
    res.result_line = line
    return res


def run_workload(kernel, workload="vfs-mix", loops=None, icount=True, plugin=None,
                 plugin_args=None, timeout=600, modules=(), log=None, append=None, memory="512",
                 extra_args=(), env=None):
    """Boot ``kernel`` with ``workload`` as /init and check its result line.

    ``loops`` defaults to the workload's default_loops; ``env`` adds key=value words
    to the command line (they reach /init as environment variables). Raises
    ExternalToolError when the kernel panics or the result line is missing.
    """
    boot = workload_boot(kernel, workload, loops, modules=modules, log=log, append=append,
                         extra_args=extra_args, env=env)
    res = run_kernel(kernel, boot.initrd, append=boot.append, memory=memory, icount=icount,
                     timeout=timeout, plugin=plugin, plugin_args=plugin_args,
                     extra_args=boot.extra_args, log=log)
    return check_workload_result(boot, res)


def dump_at_hold(kernel, workload, dump, loops=None, timeout=300, env=None, settle=1.0,
                 extra_args=()):
    """Boot ``kernel`` with ``workload`` as /init and ``hold=1``: after its result
    line the guest parks (a child asleep in read(2) on a pipe, init in wait4(2);
    workloads/linepack.h) and prints ``linepack-hold``; then QEMU writes the
    guest's memory to ``dump`` (QMP ``dump-guest-memory``, an ELF core; the
    ``vmcoreinfo`` device, fed by the guest's qemu_fw_cfg module of the same
    Debian build, puts the kernel's VMCOREINFO note in it, which drgn and crash
    read) and quits. Deterministic with -icount: the same kernel and
    workload stop at the same point. ``extra_args``: more QEMU arguments (a CPU
    model). Returns a QemuResult (``result_line`` set).
    """
    import json
    import select
    import socket
    import tempfile
    wl = _workloads.load(workload)
    if wl.disk_fs or wl.module_source:
        raise BadInput(f"workload {wl.name}: a dump at the hold point runs tmpfs workloads only")
    loops = wl.default_loops if loops is None else int(loops)
    words = dict(wl.env)
    words.update(env or {})
    words["hold"] = 1
    # the fw_cfg driver (a module in Debian's cloud kernel) hands the kernel's
    # VMCOREINFO to the vmcoreinfo device, which puts it into the dump
    fw_cfg = debian_module_for(kernel, "drivers/firmware/qemu_fw_cfg.ko")
    initrd = workload_initrd(wl, modules=(fw_cfg,))
    sockdir = tempfile.mkdtemp(prefix="lp-qmp-")
    sock = os.path.join(sockdir, "qmp")
    cmd = qemu_command(kernel, initrd, append=loops_append(kernel_defaults()["append"], loops,
                                                           words),
                       extra_args=("-device", "vmcoreinfo",
                                   "-qmp", f"unix:{sock},server=on,wait=off") + tuple(extra_args))
    check_kernel_path(kernel, "kernel")
    if not shutil.which(cmd[0]):
        raise ExternalToolError(f"'{cmd[0]}' is not installed (install qemu-system-x86)")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    raw = b""
    try:
        # the whole marker line, then a settle time: the host sees the marker's bytes
        # while init is still in write(2) on the serial port; it sleeps in wait4(2)
        # only after the write returns (found under load: init's stack was the tty's)
        while not re.search(rb"linepack-hold[^\n]*\n", raw):
            left = timeout - (time.monotonic() - t0)
            if left <= 0:
                raise ExternalToolError(f"QEMU: no 'linepack-hold' within {timeout} s"
                                        f"{_last_words(_clean(raw))}")
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    raise ExternalToolError(f"QEMU exited before the hold point"
                                            f"{_last_words(_clean(raw))}")
                raw += chunk
        time.sleep(settle)
        qmp = socket.socket(socket.AF_UNIX)
        qmp.settimeout(timeout)
        qmp.connect(sock)
        stream = qmp.makefile("rw")

        def call(command, **args):
            stream.write(json.dumps({"execute": command, "arguments": args}) + "\n")
            stream.flush()
            while True:
                reply = json.loads(stream.readline() or "{}")
                if "return" in reply or "error" in reply or not reply:
                    break
            if "return" not in reply:
                raise ExternalToolError(f"QMP {command} failed: "
                                        f"{reply.get('error', {}).get('desc', 'no reply')}")
            return reply["return"]
        json.loads(stream.readline())          # the greeting
        call("qmp_capabilities")
        call("dump-guest-memory", paging=False, protocol=f"file:{os.path.abspath(dump)}")
        call("quit")
        qmp.close()
        out, err = proc.communicate(timeout=60)
        raw += out
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
    serial = _clean(raw)
    res = QemuResult(returncode=proc.returncode, serial=serial,
                     result_line=_workloads.find_result(serial, wl.expected_prefix(loops)),
                     wall=time.monotonic() - t0, command=cmd,
                     stderr=err.decode("utf-8", errors="replace"))
    if res.result_line is None:
        raise ExternalToolError(f"workload {wl.name}: no result line before the hold point")
    return res


__all__ = ["QemuResult", "run_kernel", "run_workload", "workload_boot", "check_workload_result",
           "qemu_command", "kernel_defaults", "panic_line", "workload_initrd", "loops_append",
           "dump_at_hold"]
