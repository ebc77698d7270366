"""First runs in `linepack profile` files: `relayout --profile P --strategy blocks`
orders hot code by where it first ran, as evaluate's own traces do.

A small program (16 functions the loop calls in a data-dependent order) runs once
under qemu-x86_64 with linepack's plugin, which writes both its block counts
(with each block's first run) and the block sequence (tbtrace=). The profile made
from the counts and the executed blocks evaluate derives from the sequence give
the same order of hot functions; the profile without first runs does not.
"""

import os
import subprocess

import numpy as np
import pytest
import helpers

from linepack.image.elf import ElfImage
from linepack.profile import plugin_build, trace
from linepack.profile.model import Profile
from linepack.profile.user import exec_ranges, inside
from linepack.relayout.block_order import ExecutedBlocks
from linepack.relayout.driver import load_profile_full, relayout
from test_plugin import PROG

_requirements = helpers.requirements("gcc", "qemu-x86_64")
N = 20000


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = tmp_path_factory.mktemp("first")
    (d / "prog.c").write_text(PROG)
    exe = str(d / "prog")
    subprocess.run(["gcc", "-O1", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", exe,
                    str(d / "prog.c")], check=True)
    so = plugin_build.build_plugin(log=lambda m: None)
    out, tbt = d / "o.bin", d / "t.bin"
    p = subprocess.run(["qemu-x86_64", "-plugin", trace.plugin_option(
        so, [f"out={out}", "mode=user", "edges=on", f"tbtrace={tbt}"]), exe, str(N)],
        capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    tr, seq = trace.read_plugin_output(out), trace.read_tbtrace(tbt)
    im = ElfImage(exe)
    inb = inside(tr.tb_addr, exec_ranges(im))
    ine = inside(tr.edge_src, exec_ranges(im)) | inside(tr.edge_dst, exec_ranges(im))
    meta = {"workload": "prog", "loops": 1}

    def profile(path, first):
        Profile.from_blocks(im, tr.tb_addr[inb], tr.tb_size[inb], tr.tb_insns[inb],
                            tr.tb_execs[inb], edge_src=tr.edge_src[ine],
                            edge_dst=tr.edge_dst[ine], edge_count=tr.edge_count[ine], meta=meta,
                            block_first=tr.tb_first[inb] if first else None).save(path)
        return str(path)

    # evaluate's path (layouts.blocks_from_trace): the distinct blocks of the sequence
    # with their counts and the index of their first execution
    keys, at, cnt = np.unique(seq["vaddr"], return_index=True, return_counts=True)
    size = np.array([seq["size"][i] for i in at], np.uint64)
    mine = inside(keys, exec_ranges(im))
    traced = ExecutedBlocks((keys[mine].astype(np.uint64), size[mine],
                             cnt[mine].astype(np.float64)), first=at[mine])
    return {"exe": exe, "dir": d, "with": profile(d / "first.lpprof", True),
            "without": profile(d / "plain.lpprof", False), "traced": traced}


def _hot_order(path):
    """f0..f15 in the order of their new addresses."""
    im = ElfImage(path)
    addr = {i: int(im.symbol_address(f"f{i}")) for i in range(16)}
    return sorted(addr, key=addr.get)


def _relayout(case, name, blocks, lp):
    out = os.path.join(case["dir"], name)
    relayout(case["exe"], out, "blocks", hotness=lp.hotness, calls=lp.calls, blocks=blocks,
             profile_build_id=lp.build_id)
    return _hot_order(out)


def test_profile_first_runs_give_evaluates_order(case):
    lp = load_profile_full(case["with"], case["exe"])
    assert lp.blocks.first is not None and len(lp.blocks.first) == len(lp.blocks[0])
    plain = load_profile_full(case["without"], case["exe"])
    assert plain.blocks.first is None                     # an old-style profile: no order
    from_profile = _relayout(case, "p.out", lp.blocks, lp)
    from_trace = _relayout(case, "t.out", case["traced"], lp)
    by_heat = _relayout(case, "h.out", plain.blocks, plain)
    # the order the loop first called them in (the sequence's first executions)
    im = ElfImage(case["exe"])
    start = {int(im.symbol_address(f"f{i}")): i for i in range(16)}
    tr = case["traced"]
    first = {start[a]: f for a, f in zip(tr[0].tolist(), tr.first.tolist()) if a in start}
    assert from_profile == from_trace == sorted(range(16), key=first.get)
    assert by_heat != from_profile
