"""Run the symbolizers people use (binutils addr2line, llvm-symbolizer) on many
addresses in one invocation each, and compare OLD at old addresses with NEW at
new addresses."""

import glob
import os
import re
import shutil
import subprocess


def llvm_tool(name):
    """llvm-19's (else any installed LLVM's) binary of ``name``. tools/setup.sh installs
    llvm-19, so a missing one fails the test that needs it: no check drops out."""
    for cand in [f"/usr/lib/llvm-19/bin/{name}", shutil.which(f"{name}-19"), shutil.which(name)] + \
            sorted(glob.glob(f"/usr/lib/llvm-*/bin/{name}"), reverse=True):
        if cand and os.path.exists(cand):
            return cand
    import pytest
    pytest.fail(f"{name} not installed (tools/setup.sh installs llvm-19: {name}-19, "
                f"/usr/lib/llvm-19/bin/{name})")


def addr2line(exe, addrs, timeout=900):
    """One block per address: function names (inline chain, innermost first) and file:line."""
    p = subprocess.run(["addr2line", "-f", "-i", "-a", "-e", str(exe)],
                       input="".join(f"{a:#x}\n" for a in addrs), capture_output=True, text=True,
                       timeout=timeout, check=True)
    blocks = re.split(r"^0x[0-9a-f]+\n", p.stdout, flags=re.M)[1:]
    assert len(blocks) == len(addrs), (len(blocks), len(addrs))
    return [b.strip() for b in blocks]


def llvm_symbolizer(exe, addrs, timeout=900):
    tool = llvm_tool("llvm-symbolizer")
    p = subprocess.run([tool, "--inlining", "--functions=linkage", f"--obj={exe}"],
                       input="".join(f"{a:#x}\n" for a in addrs), capture_output=True, text=True,
                       timeout=timeout, check=True)
    blocks = p.stdout.strip("\n").split("\n\n")
    assert len(blocks) == len(addrs), (len(blocks), len(addrs))
    return [b.strip() for b in blocks]


def differences(old_exe, new_exe, old_addrs, new_addrs, tools=("addr2line", "llvm-symbolizer")):
    """{tool: [(old address, new address, OLD's answer, NEW's answer)]} where they differ."""
    out = {}
    for t in tools:
        fn = addr2line if t == "addr2line" else llvm_symbolizer
        a, b = fn(old_exe, old_addrs), fn(new_exe, new_addrs)
        out[t] = [(o, n, x, y) for o, n, x, y in zip(old_addrs, new_addrs, a, b) if x != y]
        out[t + ".unknown"] = sum(1 for x in a if x.startswith("??"))
    return out


def outermost_cold_as_parent(block):
    """llvm-symbolizer names the outermost frame from the symbol table (C has no
    linkage names in DWARF): in a `name.cold` part it prints `name.cold`. The
    same answer with that frame's name as its parent function's."""
    lines = block.split("\n")
    if len(lines) >= 2 and lines[-2].endswith(".cold"):
        lines[-2] = lines[-2][:-len(".cold")]
    return "\n".join(lines)


def split_function_samples(rows, insn_addr, n, seed=12):
    """(old addresses, new addresses, in a cold part) of ``n`` seeded original
    instructions of split functions (block map ``rows``), hot and cold parts and
    re-encoded branches alike; a removed jmp has no counterpart in NEW and is
    left out. ``insn_addr``: instruction starts of the original (sorted)."""
    import numpy as np
    from linepack.image import blockmap as bm
    r = rows[rows["old_len"] > 0]
    p = np.searchsorted(r["old"], insn_addr, side="right").astype(np.int64) - 1
    pc = np.maximum(p, 0)
    inside = (p >= 0) & (insn_addr < r["old"][pc] + r["old_len"][pc].astype(np.uint64)) & \
        (r["kind"][pc] != bm.KIND_JMP_REMOVED)
    cand = np.nonzero(inside)[0]
    pick = np.sort(np.random.default_rng(seed).choice(cand, min(n, len(cand)), replace=False))
    old = insn_addr[pick].astype(np.uint64)
    new, ok = bm.address_map(rows).map(old)
    assert ok.all()
    return old.tolist(), new.tolist(), (r["part"][pc[pick]] == bm.PART_COLD).tolist()
