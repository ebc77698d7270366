"""Function heat from a profile reaches the right function when static functions share a
name (relayout/driver.py function_hotness): a local function is keyed by its address."""

import os

import numpy as np

from helpers import FIXTURES, build_c
from linepack.image.elf import ElfImage
from linepack.profile.model import Profile
from linepack.relayout.driver import function_hotness
from linepack.relayout.plan import make_heat
from linepack.relayout.units import units_of


def test_static_functions_of_one_name_keep_their_own_heat(tmp_path):
    exe = build_c("dup_static_a.c", tmp_path / "dup", os.path.join(FIXTURES, "c", "dup_static_b.c"))
    im = ElfImage(exe)
    units, functions, _ = units_of(im, lambda m: None)
    helpers_ = [i for i, n in enumerate(functions.name) if n == "helper"]
    assert len(helpers_) == 2                       # the fixture's point
    first, second = sorted(helpers_, key=lambda i: int(functions.start[i]))
    main = functions.index_of("main")
    # the second helper runs 40 times, main once (entry blocks of 4 bytes)
    addr = [int(functions.start[second]), int(functions.start[main])]
    p = Profile.from_blocks(exe, addr, [4, 4], [1, 1], [40, 1], meta={"loops": 1})
    hot = function_hotness(p)
    assert hot == {f"{addr[0]:#x}": 40, "main": 1}  # the local one by address, main by name
    heat = make_heat(units, functions, hot)
    u_first, u_second = int(units.funcs[first]), int(units.funcs[second])
    assert heat[u_second] == 40 and heat[u_first] == 0
    assert heat[int(units.funcs[main])] == 1
    # by name (as before), the heat landed on the other helper
    by_name = make_heat(units, functions, p.function_counts())
    assert by_name[u_first] == 40 and by_name[u_second] == 0
    assert np.count_nonzero(heat) == 2
