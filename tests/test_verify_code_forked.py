"""verify --against on an executable compares OLD's instructions (verify/code.py,
steps 1 and 2) in a forked child beside the checks after it; a kernel's stay in the
process. The child's answer is the in-process one: the same findings, counts and
extras, on a rewrite with a corrupted branch."""

import json
import os

import pytest

import helpers

from test_verify_other_branches import PROG

_requirements = helpers.requirements("gcc")


@pytest.fixture
def corrupted(tmp_path):
    """(OLD, a relayout of it whose jecxz in f lands one byte short)."""
    exe, new = helpers.relaid_out_c(tmp_path, PROG)
    from linepack.image.context import ImageContext
    from linepack.image.elf import ElfImage
    n = ImageContext(ElfImage(str(new)))
    fn = int(n.functions.start[n.functions.index_of("f")])
    code = bytes(n.image.read(fn, 64))
    k = code.index(bytes.fromhex("67e3"))
    bad = helpers.patched_copy(new, tmp_path / "bad",
                               {n.image.vaddr_to_offset(fn + k + 2): bytes([code[k + 2] - 1])})
    return str(exe), bad


def _verify(old, new, json_path, monkeypatch, pids):
    from linepack.commands.verify import check
    from linepack.verify import code
    inner = code._check_code

    def recorded(ctx, out):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        return inner(ctx, out)
    monkeypatch.setattr(code, "_check_code", recorded)
    status = check(new, old, json_path=str(json_path), quiet=True)
    monkeypatch.undo()
    with open(json_path) as f:
        report = json.load(f)
    with open(pids) as f:
        ran_in = [int(x) for x in f.read().split()]
    return status, report, ran_in


def test_code_check_runs_in_a_child_with_the_in_process_answer(corrupted, tmp_path,
                                                               monkeypatch, capsys):
    old, bad = corrupted
    status, forked, ran_in = _verify(old, bad, tmp_path / "f.json", monkeypatch,
                                     tmp_path / "f.pids")
    assert ran_in and all(pid != os.getpid() for pid in ran_in)
    monkeypatch.setenv("LINEPACK_VERIFY_NOFORK", "1")
    status1, inproc, ran_in1 = _verify(old, bad, tmp_path / "p.json", monkeypatch,
                                       tmp_path / "p.pids")
    assert ran_in1 == [os.getpid()]
    assert status == status1 == 1
    for k in ("seconds", "wall_seconds"):
        forked.pop(k, None)
        inproc.pop(k, None)
    assert forked == inproc
    assert "equiv.branch-target" in json.dumps(forked)
