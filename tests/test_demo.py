"""The README's main job, end to end (small loop count): every step passes and
the before/after table shows the pack and blocks layouts beside stock."""

import json
import re

import pytest

from helpers import run_linepack

pytestmark = [pytest.mark.realkernel, pytest.mark.qemu]


def test_demo_runs_every_step(debian_vmlinux, tmp_path):
    p = run_linepack("demo", "--kernel", debian_vmlinux, "--loops", 200, "--workdir", tmp_path,
                     timeout=1800)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "demo: all steps passed" in p.stdout
    for step in ("verify the original", "profile VFS-mix", "relayout with 'pack'",
                 "relayout with 'blocks'",
                 "verify the new image against the original", "boot the new image",
                 "before/after"):
        assert f"== {step}" in p.stdout, step
    ev = json.loads((tmp_path / "evaluate.json").read_text())
    rows = ev["results"]
    assert {r["layout"] for r in rows} == {"stock", "pack", "blocks"}
    assert {r["cache"] for r in rows} == {"intel-32k-8w", "amd-64k-2w"}
    assert ev["problems"] == []
    # the same workload result on all kernels, fewer misses with pack and blocks on both models
    assert len({r["result_line"] for r in rows}) == 1
    for cache in ("intel-32k-8w", "amd-64k-2w"):
        by = {r["layout"]: r["misses"] for r in rows if r["cache"] == cache}
        assert by["pack"] < by["stock"] and by["blocks"] < by["stock"], (cache, by)
    for s in ("pack", "blocks"):
        assert (tmp_path / f"vmlinux.{s}").exists() and (tmp_path / f"vmlinux.{s}.System.map").exists()
    # the table's .text growth is relayout's own figure (bytes it printed for each strategy)
    for s in ("pack", "blocks"):
        section = p.stdout.split(f"== relayout with '{s}'", 1)[1].split("\n== ", 1)[0]
        printed = int(re.search(r"([+-][\d,]+) bytes \([+-][\d.]+% of \.text\)", section)
                      .group(1).replace(",", ""))
        assert {r["text_growth_bytes"] for r in rows if r["layout"] == s} == {printed}, s
