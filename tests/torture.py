"""The torture boot's machinery, shared by the 6.1 test (test_torture_boot.py) and
the 6.12/7.3 one (test_newkernels_boot.py): the /init, the boot, and the reading of
its log against stock's (see test_torture_boot.py for what the torture does)."""

import os
import re
import subprocess

from helpers import FIXTURES

LOOPS = 4000             # long enough to run through the tracepoint flips (1000 ran ~1.3 s, ending
                         # while events-off was still being written on an idle host)
MAX_COLD_PROBES = 24

_TS = re.compile(r"^\[\s*\d+\.\d+\]\s?")
# Kernel log lines that mean something went wrong in patched code or its tables.
_COMPLAINT = re.compile(r"WARNING|BUG|Oops|Call Trace|Tainted|(?i:jump_label|ftrace|kprobe|panic|"
                        r"general protection|invalid opcode|unwind|\borc\b|corrupt|stack)")
# ... except these, which every 6.1 cloud boot prints.
_BENIGN = re.compile(r"^ftrace: allocat|^kprobes: kprobe jump-optimization is (enabled|disabled)|"
                     r"report a bug$|^Kernel command line:|^Command line:|^Unknown kernel command "
                     r"line parameters|^Scheduler tracepoints stat_sleep|^mem auto-init: stack:")


def build_initrd(work, modules):
    """/init = the torture program, /bin/vfs-mix, and ``modules`` (host .ko paths, loaded
    in that order) under /lib/modules/."""
    from linepack.profile import initramfs, workloads
    init = work / "torture_init"
    subprocess.run(["gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror", "-I",
                    workloads.sources_dir(), "-o", str(init),
                    os.path.join(FIXTURES, "c", "torture_init.c")], check=True)
    extra = [("bin/vfs-mix", workloads.build("vfs-mix"))]
    extra += [("lib/modules/" + os.path.basename(m), m) for m in modules]
    extra.append(("lib/modules/linepack.order",
                  "".join(os.path.basename(m) + "\n" for m in modules).encode()))
    return initramfs.build_initramfs(str(init), extra, dest=str(work / "torture.cpio.gz"))


# A function VFS-mix runs whose first instructions have no ORC entry of their own in
# Debian's build (the lookup there finds the entry before the function): after a
# move, the entry that precedes it must still describe it.
NO_OWN_ORC_ENTRY = "__x64_sys_mmap"


# unlink(2)'s function below its syscall wrapper: do_unlinkat up to 6.x, filename_unlinkat in 7.x
UNLINK_FUNCTIONS = ("do_unlinkat", "filename_unlinkat")


def unlink_function(kernel):
    """The first of UNLINK_FUNCTIONS that ``kernel`` (a vmlinux path) has."""
    from linepack.image.elf import ElfImage
    img = ElfImage(str(kernel))
    try:
        return next(n for n in UNLINK_FUNCTIONS if img.symbol_address(n) is not None)
    finally:
        img.close()


def kprobe_specs(kernel):
    """Three probes, all run on every VFS-mix iteration: the unlink function's entry (an
    ftrace-based kprobe on its __fentry__ site), and int3 kprobes on an instruction
    at least 16 bytes into vfs_unlink and 8 bytes into NO_OWN_ORC_ENTRY."""
    import capstone
    from linepack.image.elf import ElfImage
    specs = [unlink_function(kernel)]
    img = ElfImage(str(kernel))
    md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    for name, least in (("vfs_unlink", 16), (NO_OWN_ORC_ENTRY, 8)):
        addr = img.symbol_address(name)
        off = next(i.address - addr for i in md.disasm(bytes(img.read(addr, 64)), addr)
                   if i.address - addr >= least)
        specs.append(f"{name}+{off:#x}")
    img.close()
    return specs


def torture_boot(kernel, initrd, kprobes, extra=""):
    """Boot ``kernel`` with the torture /init; never raises on a kernel crash (the
    result then lacks its lines and problems() names what went wrong). ``extra``:
    more command-line words (e.g. lp_kallsyms=...)."""
    from linepack.profile.qemu import kernel_defaults, run_kernel
    # Without 'quiet': warnings reach the log.
    base = " ".join(w for w in kernel_defaults()["append"].split() if w != "quiet")
    # Under TCG on a busy host, patching every __fentry__ site can hold the CPU for
    # longer than the lockup and RCU stall detectors allow: a host-speed artifact
    # that says nothing about the layout, so they are off (for stock as well).
    append = (f"{base} nosoftlockup rcupdate.rcu_cpu_stall_suppress=1 loops={LOOPS} "
              f"kprobes={','.join(kprobes)} {extra}").rstrip()
    return run_kernel(str(kernel), initrd, append=append, icount=False, timeout=400, check=False)


# -- reading a torture log --------------------------------------------------------------
def kernel_complaints(serial):
    """Kernel log lines (timestamp dropped) that report trouble, with numbers and
    addresses normalized so two kernels' messages compare."""
    out = set()
    for line in serial.splitlines():
        if not _TS.match(line):
            continue
        msg = _TS.sub("", line).strip()
        if not _COMPLAINT.search(msg) or _BENIGN.search(msg):
            continue
        msg = re.sub(r"\[[0-9a-f]{8,}\]|(0x)?[0-9a-fA-F]{6,}|\d+", "N", msg)
        out.add(re.sub(r"\+N/N", "", msg))
    return out


# Frames of the tracing machinery itself: which of them a probe goes through depends
# on timing (the kernel optimizes an int3 kprobe into a jump after a delay).
_MACHINERY = re.compile(r"^0x|kprobe|optprobe|optimized_callback|^trace_|ftrace|int3|"
                        r"^aggr_pre_handler$")


def stacks(serial, skip=()):
    """Each stack trace as a tuple of function names, innermost first, from the first
    frame of probed code on (a split function's `.cold` part counts as its parent);
    those starting in a function named in ``skip`` are left out."""
    out = []
    for line in serial.splitlines():
        if line.startswith("torture-stack"):
            frames = [re.sub(r"\.cold(\.\d+)?$", "", f) for f in line.split()[1:]]
            while frames and _MACHINERY.search(frames[0]):
                frames.pop(0)
            if not frames or frames[0] not in skip:
                out.append(tuple(frames))
    return sorted(out)


# A kernel message the console printed into the middle of /init's line (the two
# write to the serial port independently): "...kyber-iosched.ko loaded[    1.36] io ..."
_KERNEL_TAIL = re.compile(r"\[\s*\d+\.\d+\].*$")


def lines(serial, prefix):
    """/init's lines starting with ``prefix``, a kernel message glued to the end cut off."""
    return [_KERNEL_TAIL.sub("", ln).strip() for ln in serial.splitlines()
            if ln.strip().startswith(prefix)]


def problems(run, stock, may_miss=(), skip_stacks=()):
    """What is wrong with a torture boot, judged against stock's; [] when nothing.
    ``may_miss``: kprobe specs that need not be hit (code VFS-mix may not run);
    ``skip_stacks``: functions whose stack traces are judged elsewhere."""
    found = []
    for prefix in ("linepack-result vfs-mix", "linepack-module"):
        got, want = lines(run.serial, prefix), lines(stock.serial, prefix)
        if got != want:
            found.append(f"{prefix}: {got} != stock {want}")
    # the torture's own result: the same, but for the number of kprobes placed
    n_probes = len(lines(run.serial, "torture-kprobe"))
    want = [re.sub(r"kprobes_hit=\d+/\d+$", f"kprobes_hit={n_probes}/{n_probes}", ln)
            for ln in lines(stock.serial, "linepack-result torture")]
    got = [re.sub(r"kprobes_hit=\d+/", f"kprobes_hit={n_probes}/", ln)
           for ln in lines(run.serial, "linepack-result torture")] if may_miss else \
        lines(run.serial, "linepack-result torture")
    if got != want or not got:
        found.append(f"linepack-result torture: {lines(run.serial, 'linepack-result torture')} "
                     f"!= {want}")
    bad_steps = [ln for ln in lines(run.serial, "torture-step") if not ln.endswith(" ok")]
    if bad_steps:
        found.append(f"steps failed: {bad_steps}")
    new = kernel_complaints(run.serial) - kernel_complaints(stock.serial)
    if new:
        found.append(f"kernel complaints stock does not have: {sorted(new)[:5]}")
    got, ref = stacks(run.serial, skip_stacks), stacks(stock.serial, skip_stacks)
    if not got or any(s[-1] != "entry_SYSCALL_64_after_hwframe" for s in got):
        found.append(f"stack traces incomplete (not ending at the syscall entry): {got}")
    elif not set(ref) <= set(got):
        # (a kernel probed at more places has more stacks; stock's must all be there)
        found.append(f"stack traces differ from stock: {got} lacks {sorted(set(ref) - set(got))}")
    misses = [ln for ln in lines(run.serial, "torture-kprobe")
              if ln.endswith(" hits=0") and ln.split()[1] not in may_miss]
    if misses or not lines(run.serial, "torture-kprobe"):
        found.append(f"kprobes not hit: {misses or 'none reported'}")
    if "torture-overlap events" not in run.serial:
        found.append("the workload was not running while the tracepoints flipped")
    if run.panic_line or "reboot: Power down" not in run.serial:
        found.append(f"no clean power-off: {run.panic_line or 'no power-down line'}")
    return found


# Split functions on VFS-mix's path, in order of preference, for the blocks kprobes.
VFS_PATH = ("do_unlinkat", "vfs_unlink", "do_sys_openat2", "path_openat", "do_filp_open",
             "link_path_walk", "__fput", "dput", "shmem_get_folio_gfp", "filemap_map_pages",
             "do_mmap", "__do_munmap", "generic_perform_write", "vfs_write", "do_dentry_open",
             "lookup_fast", "step_into", "walk_component", "kmem_cache_alloc", "kmem_cache_free")


# Split functions on the error paths the torture's VFS rounds take (open and unlink of
# a missing file): the first one with a cold part gets a probe on every piece of it.
ERROR_PATH = ("do_sys_openat2", "do_unlinkat", "do_filp_open", "path_openat", "filename_parentat",
               "lookup_one_qstr_excl", "link_path_walk", "walk_component")


def cold_piece_specs(img, name):
    """kprobe specs (`name.cold[+off]`) at the start of every piece of name's cold part."""
    from linepack.image import blockmap as bm
    rows = bm.read_blockmap(img)
    names, syms = img.symbol_table()
    k = names.index(name + ".cold")
    lo = int(syms["value"][k])
    hi = lo + int(syms["size"][k])
    new = rows["new"][(rows["old_len"] > 0) & (rows["new"] >= lo) & (rows["new"] < hi)]
    starts = sorted(set(int(a) for a in new.tolist()))[:MAX_COLD_PROBES]
    return [f"{name}.cold" if a == lo else f"{name}.cold+{a - lo:#x}" for a in starts]


def raw_stacks(serial):
    """Stack traces as tuples of frame names as printed (`.cold` kept), innermost
    first, the tracing machinery's frames dropped."""
    out = []
    for line in serial.splitlines():
        if line.startswith("torture-stack"):
            frames = line.split()[1:]
            while frames and _MACHINERY.search(frames[0]):
                frames.pop(0)
            out.append(tuple(frames))
    return out


def tracepoint_site(kernel):
    """File offset and bytes of a 5-byte static-key site of the sched_switch tracepoint
    (events/enable flips it; nothing enables it during boot)."""
    from linepack.image.elf import ElfImage
    from linepack.kernel.base import ImageContext
    from linepack.kernel.jump_table import NOP5, JumpTable
    img = ElfImage(str(kernel))
    ctx = ImageContext(img)
    ent = JumpTable().parse(ctx)
    key = img.symbol_address("__tracepoint_sched_switch") + 8     # struct tracepoint.key
    for code in ent["code"][ent["key"] == key].tolist():
        if bytes(img.read(code, 5)) == NOP5:
            return img.vaddr_to_offset(code), code
    raise AssertionError("no nop5 site of __tracepoint_sched_switch")
