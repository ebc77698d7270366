"""verify --against's table check maps every instruction of OLD only where a table
asks it (the ORC table of a kernel): an executable has none, so its verify does not
map its ~240,000 instructions for nothing (tools/verify/tables.py)."""

import numpy as np

import helpers
from linepack.verify import tables
from linepack.verify.context import AgainstContext
from linepack.verify.findings import Sink
from linepack.verify.standalone import verify_image

PROG = r"""
#include <stdio.h>
static int f(int x) { return x * 3 + 1; }
int main(void) { int s = 0; for (int i = 0; i < 10; i++) s += f(i); printf("%d\n", s); return 0; }
"""


def test_an_executables_tables_do_not_map_every_instruction(tmp_path):
    exe, new = helpers.relaid_out_c(tmp_path, PROG)
    ctx = AgainstContext(verify_image(str(new)), str(new), str(exe))
    n_insns = len(ctx.octx.disasm.addr)
    assert n_insns > 10
    asked = []
    inner = ctx.amap.map

    def spy(addrs):
        asked.append(len(np.atleast_1d(addrs)))
        return inner(addrs)
    ctx.amap.map = spy
    out = Sink()
    tables.check_tables(ctx, out)
    assert n_insns not in asked
    assert out.findings == []
