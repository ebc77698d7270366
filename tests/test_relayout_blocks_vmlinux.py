"""Block-level relayout (``blocks``) of Debian's 6.1 cloud vmlinux with a real
VFS-mix profile: the CFG on the real image, the split kernel's tables and
symbols, standalone verify, and a boot that prints stock's result.

Budget: about 4 minutes on 2 cores (a short profile, one relayout, one verify,
two boots), plus the debug-info consumers of issue 12 (symbolizers on 10,000
instructions, gdb, llvm-dwarfdump on 24 units, drgn on a dump of one more boot).
"""

import re

import numpy as np
import pytest

from helpers import run_linepack
from linepack.image import blockmap as bm
from linepack.image.cfg import R_SPLIT, TableSites
from linepack.image.elf import ElfImage

pytestmark = [pytest.mark.realkernel, pytest.mark.qemu, pytest.mark.slow]

PROFILE_LOOPS = 50
BOOT_LOOPS = 200


@pytest.fixture(scope="module")
def vmlinux(debian_vmlinux):
    return debian_vmlinux


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("blocks-vmlinux")


@pytest.fixture(scope="module")
def split_kernel(work, vmlinux, kernel_profile):
    prof = kernel_profile(vmlinux, PROFILE_LOOPS)
    from linepack.relayout import strategies
    from linepack.relayout.driver import load_profile_full, relayout
    lp = load_profile_full(str(prof), vmlinux)
    out = work / "vmlinux.blocks"
    summary, plan, rw = relayout(vmlinux, str(out), strategies.get("blocks"), hotness=lp.hotness,
                                 calls=lp.calls, profile_build_id=lp.build_id, blocks=lp.blocks,
                                 keep_instructions=True)      # the tests read rw.dis and the CFG
    return out, summary, rw


def test_evaluate_growth_is_relayouts(split_kernel, vmlinux):
    """The demo's before/after table (evaluate, kernels given by path) shows relayout's
    own .text growth for the block-level kernel, not a figure rebuilt wrongly."""
    from linepack.evaluate.booted import code_growth
    out, summary, _ = split_kernel
    assert code_growth(vmlinux, str(out)) == summary["text_growth_bytes"]
    assert abs(summary["text_growth_pct"]) < 1.0


def test_cfg_of_the_real_kernel(split_kernel, vmlinux):
    _, summary, rw = split_kernel
    cfg = rw.block_split["cfg"]
    assert 400_000 < len(cfg) < 1_000_000            # 596,015 on the 6.1 cloud kernel first measured
    # blocks tile each function: sorted, no overlap
    assert (cfg.start[1:] >= cfg.end[:-1]).all()
    from linepack.kernel.base import ImageContext
    ctx = ImageContext(rw.image)
    ctx._disasm = rw.dis
    sites = TableSites.from_kernel(ctx)
    assert len(sites.atomic_lo) > 8000 and len(sites.key_code) > 5000
    # static_cpu_has() sites: a jmp that is a whole alternative site falls through (the
    # kernel may patch it into NOPs); the split functions among them keep that edge
    # (verify --against checks it on the output)
    from linepack.image.cfg import TERM_FALL
    pj = cfg.patched_jmp
    assert pj.sum() > 100 and (cfg.term[pj] == TERM_FALL).all()
    assert cfg.falls_through()[pj].all()
    assert summary["split"]["patch_site_jmps"] == int(pj.sum())
    assert summary["split"]["patch_site_jmps_split"] > 0
    # an alternative/paravirt site is never split: no block starts strictly inside one
    j = np.searchsorted(sites.atomic_lo, cfg.start, side="left").astype(np.int64) - 1
    jc = np.maximum(j, 0)
    inside = (j >= 0) & (cfg.start > sites.atomic_lo[jc]) & (cfg.start < sites.atomic_hi[jc])
    assert not inside.any(), [hex(int(a)) for a in cfg.start[inside][:5]]
    # every table address that is an instruction start inside a function (and not inside
    # an atomic site) starts a block: no block crosses a table site
    lead = sites.leaders
    i = rw.dis.containing(lead)
    at = (i >= 0) & (rw.dis.addr[np.maximum(i, 0)] == lead) & (cfg.insn_func[np.maximum(i, 0)] >= 0)
    k = np.searchsorted(sites.atomic_lo, lead, side="left").astype(np.int64) - 1
    kc = np.maximum(k, 0)
    in_atomic = (k >= 0) & (lead > sites.atomic_lo[kc]) & (lead < sites.atomic_hi[kc])
    want = lead[at & ~in_atomic]
    assert np.isin(want, cfg.start).all()
    # most functions can be split; the reasons are named
    assert (cfg.reason == R_SPLIT).mean() > 0.9


def test_split_summary_and_block_map(split_kernel):
    out, summary, rw = split_kernel
    sp = summary["split"]
    assert sp["functions_split"] > 100 and not summary["problems"]
    assert sp["jmp_inserted"] > 0 and sp["branch"] > 0
    rows = bm.read_blockmap(ElfImage(str(out)))
    assert rows is not None and bm.check_rows(rows) == []
    assert len(rows) == sp["rows"]
    # parts do not overlap in the new image
    r = rows[rows["new_len"] > 0]
    o = np.argsort(r["new"])
    ends = r["new"][o] + r["new_len"][o].astype(np.uint64)
    assert (r["new"][o][1:] >= ends[:-1]).all()
    # static-key census: sites were resized in both directions or kept
    assert summary["static_keys.sites_rechecked"] > 5000
    # ORC: at every piece of a split function the unwinder finds the state that was in
    # effect at the piece's original address
    from linepack.kernel.base import ImageContext
    from linepack.kernel.orc import OrcTable

    def states(path, at):
        e = OrcTable().parse(ImageContext(ElfImage(str(path))))
        o = np.argsort(e["ip"], kind="stable")
        e = e[o]
        i = np.searchsorted(e["ip"], at, side="right") - 1
        return e[["sp_offset", "bp_offset", "bits"]][i]
    p = rows[(rows["new_len"] > 0) & (rows["kind"] != bm.KIND_JMP_INSERTED)]
    before = states(rw.image.path, p["old"].astype(np.uint64))
    after = states(out, p["new"].astype(np.uint64))
    assert (before == after).all(), int((before != after).sum())


def test_symtab_has_cold_parts(split_kernel, vmlinux):
    out, summary, rw = split_kernel
    new = ElfImage(str(out))
    names, syms = new.symbol_table()
    cold = [i for i, n in enumerate(names) if n.endswith(".cold")]
    old_names, _ = ElfImage(vmlinux).symbol_table()
    gcc_cold = sum(1 for n in old_names if n.endswith(".cold"))
    assert len(cold) - gcc_cold == summary["split"]["functions_split"]
    first_global, n_new = rw.sym_index_shift
    assert n_new == summary["split"]["functions_split"]
    cold_at = {int(syms["value"][i]): i for i in cold[-n_new:]}   # ours follow the locals
    for sf in rw.block_split["splits"]:
        pi = sf.sym + (n_new if sf.sym >= first_global else 0)    # locals were inserted
        assert names[pi] == old_names[sf.sym]
        assert int(syms["size"][pi]) == sf.sizes[0]
        ci = cold_at[sf.new_start[1]]
        assert names[ci] == old_names[sf.sym] + ".cold"
        assert int(syms["size"][ci]) == sf.sizes[1] and (syms["info"][ci] & 0xF) == 2


def test_verify_standalone(split_kernel):
    out, _, _ = split_kernel
    r = run_linepack("verify", out, "-q")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert re.search(r"^result:\s+OK", r.stdout, re.M)


def _loud_append():
    from linepack.profile.qemu import kernel_defaults
    return " ".join(w for w in kernel_defaults()["append"].split() if w != "quiet")


def _boot(kernel):
    from linepack.profile.qemu import run_workload
    return run_workload(str(kernel), "vfs-mix", loops=BOOT_LOOPS, icount=False, timeout=300,
                        append=_loud_append())


_TROUBLE = re.compile(r"WARNING|BUG|Oops|W\+X|Call Trace|Tainted|panic|unwind|orc|corrupt|"
                      r"invalid opcode|general protection|jump_label", re.I)


def _trouble(serial):
    lines = (re.sub(r"\[\s*[\d.]+\]|0x[0-9a-f]+|\d+", "#", ln) for ln in serial.splitlines()
             if _TROUBLE.search(ln))
    return set(lines)


def test_split_kernel_boots_with_stock_result(split_kernel, vmlinux):
    out, _, _ = split_kernel
    stock = _boot(vmlinux)
    got = _boot(out)
    assert got.result_line and got.result_line == stock.result_line
    new_trouble = _trouble(got.serial) - _trouble(stock.serial)
    assert not new_trouble, sorted(new_trouble)[:10]


# -- debug info of the split kernel (issue 12) -------------------------------------

DWARF_SAMPLES = 10_000


def test_symbolizers_agree_on_split_functions(split_kernel, vmlinux):
    """addr2line -f -i and llvm-symbolizer on NEW at the new address print the same
    function, inline chain and file:line(:column) as on OLD at the old address, for
    10,000 seeded instructions of split functions (hot and cold parts, re-encoded
    branches). llvm-symbolizer's outermost name comes from the symbol table: in a
    cold part it is `name.cold`, accepted exactly there."""
    from symbolizers import (addr2line, llvm_symbolizer, llvm_tool, outermost_cold_as_parent,
                             split_function_samples)
    out, summary, rw = split_kernel
    rows = bm.read_blockmap(ElfImage(str(out)))
    old_a, new_a, cold = split_function_samples(rows, rw.dis.addr, DWARF_SAMPLES)
    assert len(old_a) == DWARF_SAMPLES and sum(cold) > 1000 and len(old_a) - sum(cold) > 1000
    a, b = addr2line(vmlinux, old_a), addr2line(out, new_a)
    bad = [(hex(o), hex(n), x, y) for o, n, x, y in zip(old_a, new_a, a, b) if x != y]
    assert not bad, (len(bad), bad[:3])
    assert sum(x.startswith("??") for x in a) < DWARF_SAMPLES // 100
    assert sum("\n" in x.strip().split("\n", 2)[-1] for x in a) > 1000   # inline chains seen
    if llvm_tool("llvm-symbolizer") is None:
        pytest.fail("llvm-symbolizer not installed (tools/setup.sh installs llvm-19)")
    a, b = llvm_symbolizer(vmlinux, old_a), llvm_symbolizer(out, new_a)
    bad = [(hex(o), hex(n), x, y) for o, n, c, x, y in zip(old_a, new_a, cold, a, b)
           if x != (outermost_cold_as_parent(y) if c else y)]
    assert not bad, (len(bad), bad[:3])
    assert any(c and x != y for c, x, y in zip(cold, a, b))     # the .cold naming is real


def test_gdb_on_a_split_function(split_kernel, vmlinux):
    """gdb: `info line *ADDR` at every instruction of two split functions names the
    same source line on NEW (new address) as on OLD (old address); `disassemble /s`
    lists the function's hot part and its cold part, every instruction of them."""
    import shutil
    import subprocess
    if shutil.which("gdb") is None:
        pytest.fail("gdb not installed (tools/setup.sh installs it)")
    out, summary, rw = split_kernel
    new_img = ElfImage(str(out))
    rows = bm.read_blockmap(new_img)
    names, _ = ElfImage(vmlinux).symbol_table()
    by_name = {names[int(f)]: int(f) for f in np.unique(rows["func"])}
    want = [n for n in ("ksys_lseek", "do_unlinkat", "vfs_write", "path_openat",
                        "do_sys_openat2") if n in by_name][:2]
    assert want, sorted(by_name)[:20]
    amap = bm.address_map(rows)
    cmds_old, cmds_new, counts = [], [], {}
    for name in want:
        mine = rows[rows["func"] == by_name[name]]
        lo = int(mine["old"].min())
        hi = int((mine["old"] + mine["old_len"].astype(np.uint64)).max())
        insn = rw.dis.addr[(rw.dis.addr >= np.uint64(lo)) & (rw.dis.addr < np.uint64(hi))]
        taken = mine[mine["old_len"] > 0]
        k = np.searchsorted(taken["old"], insn, side="right") - 1
        live = insn[taken["kind"][k] != bm.KIND_JMP_REMOVED]
        new, ok = amap.map(live)
        assert ok.all()
        cmds_old += [x for a in live.tolist() for x in ("-ex", f"info line *{a:#x}")]
        cmds_new += [x for a in new.tolist() for x in ("-ex", f"info line *{a:#x}")]
        counts[name] = len(live) + int((mine["kind"] == bm.KIND_JMP_INSERTED).sum())
    for name in want:
        cmds_new += ["-ex", f"disassemble /s {name}"]

    def gdb(path, cmds):
        return subprocess.run(["gdb", "-batch", "-nx", *cmds, str(path)], capture_output=True,
                              text=True, timeout=900).stdout

    def lines(text):
        return [re.sub(r" (starts at|and ends at|is at) address .*", "", ln)
                for ln in text.splitlines() if ln.startswith(("Line ", "No line"))]
    a, b = gdb(vmlinux, cmds_old), gdb(out, cmds_new)
    la, lb = lines(a), lines(b)
    assert len(la) == len(cmds_old) // 2
    assert sum(ln.startswith("Line ") for ln in la) > 0.9 * len(la)
    assert lb[:len(la)] == la
    for name in want:
        part = b.split(f"Dump of assembler code for function {name}:")[1].split("End of")[0]
        ranges = [int(x, 16) for x in re.findall(r"^Address range (0x[0-9a-f]+) to", part, re.M)]
        assert len(ranges) >= 2, part[:500]
        assert new_img.symbol_address(name + ".cold") in ranges
        assert new_img.symbol_address(name) in ranges
        assert len(re.findall(r"^   0x[0-9a-f]+ <", part, re.M)) == counts[name]


def test_drgn_stack_traces_of_the_split_kernel(split_kernel, stock_held_traces, tmp_path):
    """drgn on a memory dump of the booted split kernel gives the same stack traces,
    with source lines, for the same sleeping tasks as on stock's (tests/drgn_stacks.py)."""
    from drgn_stacks import compare_held_stacks, held_traces
    out, summary, rw = split_kernel
    new = held_traces(out, tmp_path, name="blocks")
    same, n = compare_held_stacks(stock_held_traces, new)
    assert same >= 0.9 * n, (same, n)


def test_llvm_dwarfdump_verify_on_split_units(split_kernel, vmlinux, tmp_path):
    """llvm-dwarfdump --verify reports no more errors on the split kernel than on
    stock, on 12 seeded units holding split functions and 12 others, among the
    units llvm 19 can verify (tests/dwarfdump_sample.py)."""
    from dwarfdump_sample import compare_verify, sample_units, units_with_code_in
    from symbolizers import llvm_tool
    tool = llvm_tool("llvm-dwarfdump")
    assert tool, "llvm-dwarfdump not installed (tools/setup.sh installs llvm-19)"
    out, summary, rw = split_kernel
    rows = bm.read_blockmap(ElfImage(str(out)))
    r = rows[rows["old_len"] > 0]
    split = units_with_code_in(vmlinux, r["old"], r["old"] + r["old_len"].astype(np.uint64))
    units = sorted(set(sample_units(vmlinux, 12, among=split)) | set(sample_units(vmlinux, 12)))
    assert len(units) >= 20
    old, new = compare_verify(vmlinux, out, units, tmp_path, tool)
    # no error on NEW that OLD does not have at the same DIE
    assert new[1] <= old[1], sorted(new[1] - old[1])[:5]


def test_debug_frame_fdes_stay_in_their_function(split_kernel, vmlinux):
    """A split function's .debug_frame FDE is cut to the run at its start that moved
    as one block: no FDE covers another one's code (as on stock); before the cut,
    a split function's FDE kept its old length from its new start."""
    from linepack.dwarf import encoding as enc
    out, summary, rw = split_kernel
    assert summary["dwarf_fdes_split"] > 0

    def fdes(path):
        im = ElfImage(str(path))
        b = bytes(im.section_bytes(im.section(".debug_frame")))
        p, out = 0, []
        while p + 4 <= len(b):
            ln = enc.u(b, p, 4)
            if ln in (0, 0xFFFFFFFF):
                break
            if enc.u(b, p + 4, 4) != 0xFFFFFFFF and ln >= 20:
                out.append((enc.u(b, p + 8, 8), enc.u(b, p + 16, 8)))
            p += 4 + ln
        return sorted(out)
    old, new = fdes(vmlinux), fdes(out)
    assert len(old) == len(new) > 40000
    overlaps = [(hex(a), n, hex(c)) for (a, n), (c, m) in zip(new, new[1:]) if a + n > c]
    assert not overlaps, overlaps[:5]
    assert sum(1 for (a, n), (c, _) in zip(old, old[1:]) if a + n > c) == 0
