"""Stack traces of a booted kernel's sleeping tasks, read with drgn from a QEMU
memory dump (linepack.profile.qemu.dump_at_hold): the guest runs a workload to
its result line and parks at a fixed point (init asleep in wait4, a child in
read on an empty pipe), QEMU dumps its memory with the kernel's VMCOREINFO,
and drgn opens the dump with the vmlinux given (its DWARF: function names,
inline frames, source file:line; its ORC: the unwinding)."""

import os

# Tasks whose stacks are the same at the hold point whatever the layout: kernel
# threads asleep in their main loops, init in wait4, its child in pipe_read.
KTHREADS = ("kthreadd", "ksoftirqd/0", "rcu_preempt", "migration/0", "cpuhp/0", "khungtaskd",
            "kcompactd0", "oom_reaper", "kswapd0", "kauditd", "kdevtmpfs", "ksmd")


def traces(dump, vmlinux):
    """{(pid, comm): [frame, ...]} of every task in ``dump``; a frame is
    "function file:line" (file as the DWARF names it; "?" without source)."""
    import drgn
    from drgn.helpers.linux.pid import for_each_task
    prog = drgn.Program()
    prog.set_core_dump(str(dump))
    prog.load_debug_info([str(vmlinux)])
    out = {}
    for task in for_each_task(prog):
        frames = []
        for f in prog.stack_trace(task):
            try:
                path, line, _ = f.source()
                src = f"{path}:{line}"
            except LookupError:
                src = "?"
            frames.append(f"{f.name or '?'} {src}")
        out[(int(task.pid), task.comm.string_().decode())] = frames
    return out


def held_traces(kernel, workdir, loops=50, name="dump"):
    """Boot ``kernel`` with vfs-mix to the hold point, dump, read its task stacks
    with drgn (the dump is deleted after). Returns (traces, QemuResult)."""
    from linepack.profile.qemu import dump_at_hold
    dump = os.path.join(str(workdir), f"{name}.core")
    try:
        res = dump_at_hold(str(kernel), "vfs-mix", dump, loops=loops, timeout=600)
        return traces(dump, kernel), res
    finally:
        if os.path.exists(dump):
            os.unlink(dump)


def child_pid(result):
    """The parked child's pid from the hold line."""
    import re
    m = re.search(r"^linepack-hold \S+ child=(\d+)", result.serial, re.M)
    return int(m.group(1)) if m else None
