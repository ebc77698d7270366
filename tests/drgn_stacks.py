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


def compare_held_stacks(stock, new):
    """Assert that the rewritten kernel's parked tasks have stock's stack traces
    (function and source file:line per frame); returns (same, compared)."""
    (st, sres), (nt, nres) = stock, new
    assert nres.result_line == sres.result_line
    by_comm_s = {c: (p, f) for (p, c), f in st.items()}
    by_comm_n = {c: (p, f) for (p, c), f in nt.items()}
    named = [c for c in KTHREADS if c in by_comm_s]
    assert len(named) >= 8, sorted(by_comm_s)
    for c in named:
        assert by_comm_n[c][1] == by_comm_s[c][1], (c, by_comm_s[c][1], by_comm_n[c][1])
    # init asleep in wait4, its child in read on the pipe: a workload task in a syscall
    init_s, init_n = st[(1, "init")], nt[(1, "init")]
    assert any(f.startswith("do_wait ") for f in init_s) and init_n == init_s
    cs, cn = child_pid(sres), child_pid(nres)
    assert cs and cn and any(f.startswith("pipe_read ") for f in st[(cs, "init")])
    assert nt[(cn, "init")] == st[(cs, "init")]
    # every frame has a source line (DWARF, not just symbols)
    assert all(" ?" not in f for f in st[(cs, "init")][:-1])
    common = set(st) & set(nt)
    return sum(st[k] == nt[k] for k in common), len(common)
