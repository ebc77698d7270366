"""Every executable byte is classified: decoded / padding / data / unexplained,
each with a reason (linepack.image.coverage), and the table checks see the
code outside sized functions."""

import json
import os

import numpy as np
import pytest

from helpers import build_c, run_linepack
from linepack.image.coverage import DATA, DECODED, PADDING, UNEXPLAINED, CodeCoverage
from linepack.image.elf import ElfImage
from linepack.kernel.base import ImageContext
import helpers

VMLINUX = helpers.debian_vmlinux_path()


def test_asm_code_data_and_unexplained_bytes(tmp_path):
    exe = build_c("coverage_asm.c", tmp_path / "cov", "-O1")
    ctx = ImageContext(ElfImage(exe))
    cov = ctx.coverage
    entry = ctx.image.symbol_address("asm_entry")
    data = ctx.image.symbol_address("asm_data")
    fall = ctx.image.symbol_address("asm_fallthrough")
    # the asm label's code is decoded (not a function: func -1) ...
    d = ctx.disasm
    i = int(d.containing([entry])[0])
    assert i >= 0 and d.addr[i] == entry and d.func[i] == -1 and d.size[i] == 5
    assert cov.category_at([entry, entry + 5])[1] == DECODED          # ret
    # ... undecodable bytes after ret are data, after a nop unexplained, and listed
    assert list(cov.category_at([data, data + 1])) == [DATA, DATA]
    assert cov.category_at([fall + 1])[0] == UNEXPLAINED
    assert any(a == fall + 1 and sec == ".text" and "falls through" in why
               for a, sec, n, why in cov.unexplained)
    assert any(a == data and n == 2 for a, sec, n, why in cov.data_runs)
    # ... and undecodable bytes inside a sized data object are data by its symbol,
    # even where code before it falls through
    obj = ctx.image.symbol_address("asm_object")
    assert list(cov.category_at([obj, obj + 3])) == [DATA, DATA]
    assert any(a == obj and n == 4 and "data object" in why for a, sec, n, why in cov.data_runs)
    assert not any(a < obj + 4 and obj - 1 < a + n for a, sec, n, why in cov.unexplained)
    # the sweep goes on after the object: its int3 is padding, not data
    assert cov.category_at([obj + 4])[0] == PADDING
    # per-section rows add up to the section
    for row in cov.table():
        sec = ctx.image.section(row["section"])
        assert row["decoded"] + row["padding"] + row["data"] + row["unexplained"] == sec.size
    # verify lists the unexplained bytes by address and section in its JSON
    out = tmp_path / "r.json"
    run_linepack("verify", "-q", exe, "--json", out)
    rep = json.loads(out.read_text())
    assert any(u["address"] == f"{fall + 1:#x}" and u["section"] == ".text"
               for u in rep["coverage"]["unexplained"])
    assert any(f["check"] == "coverage.unexplained" for f in rep["findings"])


@pytest.mark.realkernel
def test_debian_61_has_no_unexplained_byte():
    assert os.path.exists(VMLINUX), f"no cached vmlinux at {VMLINUX} (tools/setup.sh fetches it)"
    ctx = ImageContext(ElfImage(VMLINUX))
    cov = ctx.coverage
    rows = {r["section"]: r for r in cov.table()}
    assert set(rows) >= {".text", ".init.text", ".altinstr_aux", ".altinstr_replacement", ".exit.text"}
    assert sum(r["unexplained"] for r in rows.values()) == 0, cov.unexplained[:5]
    assert not cov.conflicts
    # far more than the functions: entry code, thunks, replacement snippets
    assert len(cov.extra) > 10_000
    text = rows[".text"]
    assert text["decoded"] + text["padding"] == text["bytes"]
    # the PVH entry is 32-bit code, decoded in 32-bit mode up to its far jump
    pvh = ctx.image.symbol_address("pvh_start_xen")
    assert cov.category_at([pvh])[0] == DECODED
    # a table entry in non-function code is checked like one in a function:
    # .altinstr_replacement snippets are decoded, so a replacement start off by
    # one byte is inside an instruction
    from linepack.kernel import Alternatives
    alt = Alternatives()
    e = alt.parse(ctx)
    k = int(np.nonzero((e["replacementlen"] > 1) & (ctx.functions.find(e["repl"]) < 0))[0][0])
    bad = e[k:k + 1].copy()
    bad["repl"] += np.uint64(1)
    found = alt.check(ctx, bad)
    assert any(f.check == ".altinstructions.repl-boundary" for f in found) or \
        any(f.check == ".altinstructions.repl-not-instruction" for f in found), found


def test_long_nops_are_padding_instructions():
    """rustc/clang pad with NOPs of up to 15 bytes: six 66 and a 2e before 0f 1f 84
    (7.3's Rust code); each encoding, int3 and single NOPs are padding, a real
    instruction with the same prefixes is not."""
    from linepack.image.coverage import _is_padding_insn
    from linepack.image.disasm import RAW
    hexes = ["90", "cc", "6690", "0f1f440000", "662e0f1f840000000000",
             "66666666662e0f1f840000000000", "6666666666662e0f1f840000000000",
             "66660f1fc0", "6689c8", "662e8b0500000000"]
    raw = np.zeros((len(hexes), RAW), np.uint8)
    size = np.zeros(len(hexes), np.int64)
    for k, h in enumerate(hexes):
        b = bytes.fromhex(h)
        raw[k, :len(b)] = np.frombuffer(b, np.uint8)
        size[k] = len(b)
    got = _is_padding_insn(raw, size).tolist()
    assert got == [True] * 8 + [False, False]
