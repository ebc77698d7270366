"""Userspace ``blocks``: functions ordered whole, and ``relayout --verify``.

Fixture tests/fixtures/c/order_whole.c, built at test time (-O2 -no-pie
-Wl,--emit-relocs, gcc's partitioning and jump/loop/label alignment off, so
that every block of ``mix`` runs: nothing to split), profiled under
qemu-x86_64 with linepack's plugin:

- ``mix`` (its hot path out of line behind a wrong branch hint) gets its blocks
  in ext-TSP order in one part: no ``mix.cold``, its code changed, the output
  prints what the original prints on three inputs, ``verify --against`` clean;
  with ``order_whole = false`` it is moved whole, byte for byte;
- ``relayout --verify`` writes the same bytes as ``relayout`` and reports what
  ``verify OUTPUT --against IMAGE`` reports (the JSON report, equal key for
  key), also on an output mutated between the rewrite and the check, where both
  name the same findings and exit 1.
"""

import json
import os
import subprocess
import sys

import pytest
import helpers

from linepack.image.elf import ElfImage

_requirements = helpers.requirements("gcc", "qemu-x86_64")

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures", "c")
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "relayout", "blocks.toml")
FLAGS = ["-O2", "-no-pie", "-fno-reorder-blocks-and-partition", "-falign-jumps=1",
         "-falign-loops=1", "-falign-labels=1", "-Wl,--emit-relocs"]


def _linepack(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "linepack", *args], capture_output=True,
                       text=True, timeout=300)
    if check:
        assert p.returncode == 0, p.stdout + p.stderr
    return p


def _func_bytes(path, name):
    im = ElfImage(path)
    i = [k for k, n in enumerate(im.symbol_names()) if n == name]
    assert i, name
    addr, size = int(im.symtab["value"][i[0]]), int(im.symtab["size"][i[0]])
    return addr, bytes(im.read(addr, size))


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    from linepack.profile.user import record_user
    d = str(tmp_path_factory.mktemp("ow"))
    exe = os.path.join(d, "order_whole")
    subprocess.run(["gcc", *FLAGS, "-o", exe, os.path.join(FIX, "order_whole.c")], check=True)
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    out = exe + ".blocks"
    _linepack("relayout", exe, "--profile", prof, "--strategy", "blocks", "-q", "-o", out,
              "--json", out + ".json")
    return d, exe, prof, out


def _runs(path):
    return [subprocess.run([path, *a], capture_output=True, text=True, timeout=60).stdout
            for a in ([], ["1"], ["3"])]


def test_hot_function_without_cold_code_is_ordered_whole(case):
    d, exe, prof, out = case
    summary = json.load(open(out + ".json"))
    assert summary["split"]["functions_reordered_whole"] == 1, summary["split"]
    names = ElfImage(out).symbol_names()
    assert "mix.cold" not in names               # one part: nothing went cold
    _, old = _func_bytes(exe, "mix")
    _, new = _func_bytes(out, "mix")
    assert new != old and abs(len(new) - len(old)) <= 16
    assert _runs(out) == _runs(exe)
    v = _linepack("verify", out, "--against", exe, check=False)
    assert v.returncode == 0, v.stdout + v.stderr


def test_order_whole_off_moves_the_function_as_it_is(case, tmp_path):
    d, exe, prof, out = case
    cfg = tmp_path / "nowhole.toml"
    cfg.write_text(open(CONFIG).read().replace("order_whole = true", "order_whole = false"))
    off = str(tmp_path / "off")
    _linepack("relayout", exe, "--profile", prof, "--config", str(cfg), "-q", "-o", off,
              "--json", off + ".json")
    assert "functions_reordered_whole" not in json.load(open(off + ".json"))["split"]
    assert _func_bytes(off, "mix")[1] == _func_bytes(exe, "mix")[1]
    assert _runs(off) == _runs(exe)


def _report(path):
    return json.load(open(path))


def test_relayout_verify_reports_what_verify_reports(case, tmp_path):
    d, exe, prof, out = case
    both = str(tmp_path / "both")
    p = _linepack("relayout", exe, "--profile", prof, "--strategy", "blocks", "-q", "-o", both,
                  "--verify", "--verify-json", both + ".v.json")
    assert "result:   OK" in p.stdout
    # the same bytes as relayout alone writes
    assert open(both, "rb").read() == open(out, "rb").read()
    _linepack("verify", both, "--against", exe, "-q", "--json", both + ".sep.json")
    assert _report(both + ".v.json") == _report(both + ".sep.json")


MUTATE = r'''
import sys
from linepack import cli
from linepack.commands import relayout as R
from linepack.image.elf import ElfImage

orig = R._run_relayout

def mutated(args, *rest):
    # the rewrite as usual, then one byte of mix's first instruction changed in
    # the written output (mov %rdi,%r8 -> mov %rdi,%r9: same length, other register)
    status = orig(args, *rest)
    im = ElfImage(args.output)
    names = im.symbol_names()
    addr = int(im.symtab["value"][names.index("mix")])
    off = im.vaddr_to_offset(addr)
    with open(args.output, "r+b") as f:
        f.seek(off)
        head = f.read(3)
        assert head == bytes.fromhex("4989f8"), head.hex()
        f.seek(off + 2)
        f.write(b"\xf9")
    return status

R._run_relayout = mutated
sys.exit(cli.main(sys.argv[1:]))
'''


def test_relayout_verify_on_a_mutated_output(case, tmp_path):
    d, exe, prof, out = case
    bad = str(tmp_path / "bad")
    script = tmp_path / "mutate.py"
    script.write_text(MUTATE)
    p = subprocess.run([sys.executable, str(script), "relayout", exe, "--profile", prof,
                        "--strategy", "blocks", "-q", "-o", bad, "--verify", "--verify-json",
                        bad + ".v.json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    sep = _linepack("verify", bad, "--against", exe, "-q", "--json", bad + ".sep.json",
                    check=False)
    assert sep.returncode == 1
    inproc, alone = _report(bad + ".v.json"), _report(bad + ".sep.json")
    assert inproc == alone
    assert inproc["findings"], inproc
    assert any("mix" in json.dumps(f) or f.get("check", "").startswith("equiv")
               for f in inproc["findings"])


def test_relayout_verify_bad_input_one_line(case, tmp_path):
    d, exe, prof, out = case
    junk = tmp_path / "junk"
    junk.write_bytes(b"garbage\n")
    for args in (["relayout", str(junk), "--profile", prof],
                 ["relayout", exe, "--profile", str(junk)]):
        p = _linepack(*args, "--strategy", "blocks", "-o", str(tmp_path / "o"), "--verify",
                      check=False)
        assert p.returncode == 2, p.stderr
        assert p.stderr.count("linepack: error:") == 1 and "Traceback" not in p.stderr
        assert not (tmp_path / "o").exists()


def test_native_ext_tsp_writes_the_python_searchs_bytes(case, tmp_path, monkeypatch):
    """The C ext-TSP changes nothing in the output: the same bytes with the Python search."""
    import linepack.relayout.block_order as bo
    from linepack.relayout.driver import load_profile_full, relayout
    d, exe, prof, out = case
    monkeypatch.setattr(bo, "_lib", None)          # no C core: the Python search
    lp = load_profile_full(prof, exe)
    py = str(tmp_path / "python-order")
    relayout(exe, py, "blocks", hotness=lp.hotness, calls=lp.calls, blocks=lp.blocks,
             profile_build_id=lp.build_id)
    assert open(py, "rb").read() == open(out, "rb").read()
