"""relayout releases the per-instruction tables before the DWARF rewrite
(the pass `release instructions`, passes.release_instructions): the passes after it read none of them, so the
output is the same byte for byte, and whatever is asked for again is decoded
again, equal to the first time."""

import os
import subprocess

import numpy as np
import pytest

from linepack.image.cfg import CFG
from linepack.image.context import ImageContext
from linepack.image.elf import ElfImage
from linepack.relayout.driver import relayout
from linepack.relayout.units import units_of

from helpers import FIXTURES, requirements

_requirements = requirements("gcc")

HOT = {"delta": 100, "push": 95, "gamma_": 90, "alpha": 80, "beta": 70}


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("drop")
    exe = d / "prog"
    subprocess.run(["gcc", "-g", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(FIXTURES, "c", "dwarf_a.c"), os.path.join(FIXTURES, "c", "dwarf_b.c")],
                   check=True, capture_output=True)
    return exe


def test_output_same_with_and_without_the_release(prog, tmp_path):
    released, kept = tmp_path / "released", tmp_path / "kept"
    summary, _, rw = relayout(str(prog), str(released), "hot64", hotness=HOT)
    assert summary["dwarf"] == "rewritten"
    assert rw.dis is None                        # released before the DWARF rewrite
    _, _, rw_kept = relayout(str(prog), str(kept), "hot64", hotness=HOT, keep_instructions=True)
    assert rw_kept.dis is not None
    assert released.read_bytes() == kept.read_bytes()
    # no DWARF rewrite, no release: evaluate lays out several layouts of one image on a
    # shared context whose disassembly must stay (tests/test_evaluate_scale.py)
    _, _, rw_strip = relayout(str(prog), str(tmp_path / "stripped"), "hot64", hotness=HOT,
                              debug="strip")
    assert rw_strip.dis is not None


def test_context_decodes_again_after_drop(prog):
    image = ElfImage(str(prog))
    ctx = ImageContext.of(image)
    before = ctx.disasm
    addr, raw = before.addr.copy(), before.raw.copy()
    units, _, dis = units_of(image)
    uaddr = dis.addr.copy()
    ctx.drop_instructions()
    assert ctx._disasm is None and ctx._function_disasm is None
    again = ctx.disasm
    assert again is not before
    assert np.array_equal(again.addr, addr) and np.array_equal(again.raw, raw)
    units2, _, dis2 = units_of(image)
    assert dis2 is not dis and np.array_equal(dis2.addr, uaddr)
    assert np.array_equal(units2.start, units.start)


def test_cfg_keeps_its_blocks(prog):
    image = ElfImage(str(prog))
    units, functions, dis = units_of(image)
    cfg = CFG(dis, units.start, units.end)
    start, end = cfg.start.copy(), cfg.end.copy()
    assert all(getattr(cfg, n) is not None for n in CFG.INSN_ARRAYS)
    cfg.drop_instructions()
    assert cfg.dis is None and all(getattr(cfg, n) is None for n in CFG.INSN_ARRAYS)
    assert np.array_equal(cfg.start, start) and np.array_equal(cfg.end, end)
