"""Run the symbolizers people use (binutils addr2line, llvm-symbolizer) on many
addresses in one invocation each, and compare OLD at old addresses with NEW at
new addresses."""

import glob
import os
import re
import shutil
import subprocess


def llvm_tool(name):
    """Newest llvm-19 (or any) binary of ``name``, or None."""
    for cand in [f"/usr/lib/llvm-19/bin/{name}", shutil.which(f"{name}-19"), shutil.which(name)] + \
            sorted(glob.glob(f"/usr/lib/llvm-*/bin/{name}"), reverse=True):
        if cand and os.path.exists(cand):
            return cand
    return None


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
