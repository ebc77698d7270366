"""Booted torture test of rewritten kernels (Debian's 6.1 cloud vmlinux under QEMU).

A static /init (tests/fixtures/c/torture_init.c) runs VFS-mix in a child and,
meanwhile, places kprobes (one at a function entry, one inside a function) with
`stacktrace` triggers, takes a stack trace from a tracepoint (task_newtask, fired
by its own fork), enables every tracepoint and disables them again (static keys
flip through every __jump_table site; the kernel checks each site's bytes),
turns the function tracer on for all functions and off (ftrace checks every
__mcount_loc site), after loading three modules of the same Debian build (one,
kyber-iosched, brings its own tracepoints and jump labels).

A kernel passes when its log and results match stock's: the same result lines,
the same stack traces (each reaching the syscall entry), every kprobe hit, and no
kernel complaint stock does not print. The negative test corrupts one static-key
site of a tracepoint in the rewritten kernel: the torture must catch it.

Budget: about 2.5 minutes on 2 cores (a 20-loop profile, one pack relayout, two
full torture boots and one that dies early).
"""

import os
import shutil

import pytest

from helpers import run_linepack
from torture import (ERROR_PATH, LOOPS, NO_OWN_ORC_ENTRY, VFS_PATH, build_initrd,
                     cold_piece_specs, kernel_complaints, kprobe_specs, lines, problems,
                     raw_stacks, stacks, torture_boot, tracepoint_site)
import helpers

VMLINUX = helpers.debian_vmlinux_path()
MODULES = ("fs/fat/fat.ko", "fs/fat/vfat.ko", "block/kyber-iosched.ko")
PROFILE_LOOPS = 20
pytestmark = [pytest.mark.realkernel, pytest.mark.qemu, pytest.mark.slow]
_requirements = helpers.requirements("qemu-system-x86_64", "gcc", vmlinux=True)


# -- set-up ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("torture")


@pytest.fixture(scope="module")
def initrd(work):
    """/init = the torture program, /bin/vfs-mix, three modules (fetched with apt once)."""
    return build_initrd(work, [helpers.debian_module(m) for m in MODULES])


# -- the kernels ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stock(initrd):
    return torture_boot(VMLINUX, initrd, kprobe_specs(VMLINUX))


@pytest.fixture(scope="module")
def profile(kernel_profile):
    return kernel_profile(VMLINUX, PROFILE_LOOPS)


def _relayout(work, profile, strategy):
    out = work / f"vmlinux.{strategy}"
    r = run_linepack("relayout", VMLINUX, "--profile", profile, "--strategy", strategy, "-o", out,
                     "-q", timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def packed(work, profile):
    return _relayout(work, profile, "pack")


@pytest.fixture(scope="module")
def pack_run(packed, initrd):
    return torture_boot(packed, initrd, kprobe_specs(packed))


def test_stock_passes_the_torture(stock):
    from linepack.profile import workloads
    s = stock.serial
    # The checks problems() makes against stock must hold on stock in absolute terms.
    assert lines(s, "linepack-result torture") == \
        ["linepack-result torture modules=3 steps=ok kprobes_hit=3/3"], s[-3000:]
    assert lines(s, "linepack-result vfs-mix") == [workloads.run_native("vfs-mix", LOOPS)]
    assert [ln.split()[1] for ln in lines(s, "linepack-module")] == \
        [os.path.basename(m) for m in MODULES]
    assert "io scheduler kyber registered" in s
    assert not kernel_complaints(s), kernel_complaints(s)
    st = stacks(s)
    # a stack taken inside copy_process by the tracepoint, one per kprobe
    assert ("copy_process", "kernel_clone") in [f[:2] for f in st], st
    assert ("do_unlinkat", "__x64_sys_unlink") in [f[:2] for f in st], st
    assert ("vfs_unlink", "do_unlinkat") in [f[:2] for f in st], st
    assert (NO_OWN_ORC_ENTRY, "do_syscall_64") in [f[:2] for f in st], st
    assert problems(stock, stock) == []


def test_pack_passes_the_torture(pack_run, stock):
    found = problems(pack_run, stock)
    assert found == [], pack_run.serial[-3000:]


def test_pack_unwinds_from_a_function_without_its_own_orc_entry(pack_run, stock):
    """relayout once placed functions without an ORC entry of their own (objtool omits one
    equal to its predecessor) after padding's undefined entry, so the unwinder stopped in
    them; it now adds an entry at every moved piece."""
    def mine(serial):
        return [s for s in stacks(serial) if s and s[0] == NO_OWN_ORC_ENTRY]
    assert mine(stock.serial)
    assert mine(pack_run.serial) == mine(stock.serial)


def test_corrupted_static_key_site_fails_the_torture(packed, initrd, stock, work):
    off, code = tracepoint_site(packed)
    bad = work / "vmlinux.pack.bad-site"
    shutil.copyfile(packed, bad)
    with open(bad, "r+b") as f:
        f.seek(off)
        f.write(bytes.fromhex("0f1f440001"))     # still a 5-byte nop, not the one expected
    run = torture_boot(bad, initrd, kprobe_specs(bad))
    found = problems(run, stock)
    assert any("jump_label" in p for p in found), found
    assert any("steps" in p or "linepack-result torture" in p for p in found), found
    bad.unlink()


def test_blocks_passes_the_torture(work, profile, initrd, stock):
    """The block-level layout (issue 9): as pack, plus
    - /proc/kallsyms lists split functions' parents and `.cold` parts at the new
      symtab's addresses;
    - kprobes defined by `.cold` names (kallsyms_lookup_name through the rebuilt
      seqs_of_names) on a hot part and on every piece of a cold part on an error path
      the torture runs; at least one cold probe fires;
    - the stack trace such a probe takes starts in `name.cold` and reaches the
      syscall entry."""
    from linepack.image.elf import ElfImage
    out = _relayout(work, profile, "blocks")
    img = ElfImage(str(out))
    names = set(img.symbol_names())
    split = [n for n in VFS_PATH if n + ".cold" in names][:5]
    assert split, "none of the VFS-path functions was split"
    cold_fn = next((n for n in ERROR_PATH if n + ".cold" in names), None)
    assert cold_fn, "none of the error-path functions was split"
    cold_specs = cold_piece_specs(img, cold_fn)
    want_sym = {n: img.symbol_address(n) for n in split + [n + ".cold" for n in split]}
    img.close()
    specs = kprobe_specs(out)
    specs += [p for p in (split[0],) if p not in specs] + cold_specs
    run = torture_boot(out, initrd, specs, extra=f"lp_kallsyms={','.join(sorted(want_sym))}")
    assert problems(run, stock, may_miss=cold_specs) == [], run.serial[-3000:]
    # /proc/kallsyms: parents and cold parts at their new addresses
    from linepack.ship import kaslr
    shown = kaslr.kallsyms_lines(run.serial)
    for n, addr in sorted(want_sym.items()):
        assert [a for a, _ in shown.get(n, [])] == [addr], (n, shown.get(n))
        if n.endswith(".cold"):
            assert [t for _, t in shown[n]] == ["t"], shown[n]
    # every cold probe was defined (a failed definition is a failed step, checked by
    # problems()), and the error path ran at least one of them
    hits = {ln.split()[1]: int(ln.split("hits=")[1]) for ln in lines(run.serial, "torture-kprobe")}
    assert set(cold_specs) <= set(hits), hits
    assert any(hits[p] for p in cold_specs), hits
    cold_stacks = [st for st in raw_stacks(run.serial) if st and st[0] == cold_fn + ".cold"]
    print("cold probes:", {p: hits[p] for p in cold_specs}, "stacks from the cold part:",
          cold_stacks[:2])
    assert cold_stacks, raw_stacks(run.serial)
    assert all(st[-1] == "entry_SYSCALL_64_after_hwframe" for st in cold_stacks), cold_stacks
