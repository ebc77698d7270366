""".text growth is one number: relayout's summary, evaluate's rows for a rewritten image
given by path (read back from the two images), and the percentage of _stext.._etext."""

import json
import os
import subprocess

import pytest

from helpers import FIXTURES
from linepack.cli import main
from linepack.evaluate.table import format_rows
from linepack.evaluate.booted import code_growth
from linepack.image.elf import ElfImage
from linepack.image.functions import text_size



@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("growth")
    exe = d / "hl"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(FIXTURES, "c", "hotloop.c")], check=True)
    (d / "p.json").write_text(json.dumps({"functions": {"crunch.constprop.0": 100, "mix": 10,
                                                        "main": 1}}))
    return d


@pytest.mark.parametrize("strategy", ["pack", "align-all 64", "stock"])
def test_relayout_and_evaluate_report_the_same_growth(prog, tmp_path, capsys, strategy):
    out, js = tmp_path / "out", tmp_path / "out.json"
    assert main(["relayout", str(prog / "hl"), "--profile", str(prog / "p.json"), "--strategy",
                 strategy, "-o", str(out), "--json", str(js), "-q"]) == 0
    printed = capsys.readouterr().out
    s = json.loads(js.read_text())
    if strategy == "align-all 64":
        assert s["text_growth_bytes"] > 0           # the fixture's functions are not 64-aligned
    assert code_growth(str(prog / "hl"), str(out)) == s["text_growth_bytes"]
    ts = text_size(ElfImage(str(prog / "hl")))
    assert s["text_growth_pct"] == pytest.approx(100.0 * s["text_growth_bytes"] / ts, abs=1e-4)
    assert f"{s['text_growth_bytes']:+,} bytes ({s['text_growth_pct']:+.2f}% of .text)" in printed


def test_growth_of_another_build_is_not_a_number(prog, tmp_path):
    other = tmp_path / "other"
    subprocess.run(["gcc", "-O1", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-Wl,--build-id",
                    "-o", str(other), os.path.join(FIXTURES, "c", "hotloop.c")], check=True)
    assert code_growth(str(prog / "hl"), str(other)) is None
    row = {"layout": "x", "cache": "c", "mode": "booted", "misses": 1, "fetches": 2,
           "miss_rate": 0.5, "instructions": 10, "hot_lines": 1, "text_growth_pct": None,
           "time_s": 1.0}
    assert "n/a" in format_rows([row])


def test_blocks_growth_counts_the_cold_parts(tmp_path):
    """A block-level output: the split function's hot part keeps its symbol, its cold
    part is a `name.cold` local inserted before the globals (shifting their symbol
    indices), and the block map says where each part went. evaluate's figure is
    relayout's own."""
    import test_relayout_blocks as blk
    from linepack.relayout.driver import relayout
    (tmp_path / "f.s").write_text(blk.ASM)
    (tmp_path / "main.c").write_text(blk.MAIN)
    exe = tmp_path / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(tmp_path / "main.c"), str(tmp_path / "f.s")], check=True)
    out = tmp_path / "split"
    summary, _, _ = relayout(str(exe), str(out), "blocks", hotness={"f": 100.0, "main": 100.0},
                             blocks=blk._hot_ranges(ElfImage(str(exe))))
    # (no room in .eh_frame for the cold parts' FDEs: the code goes to a new segment)
    assert summary["split"]["functions_split"] >= 1 and summary["new_segment"]
    assert summary["text_growth_bytes"] != 0
    assert code_growth(str(exe), str(out)) == summary["text_growth_bytes"]
