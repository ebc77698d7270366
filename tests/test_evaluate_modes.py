"""evaluate's modes (tools/evaluate/modes.py): each declares the options it takes,
and one generic check refuses every other option given, with one line and exit 2,
before anything runs."""

import pytest

from helpers import run_linepack
from linepack.cli import build_parser
from linepack.evaluate import modes


def _evaluate_parser():
    return next(a for a in build_parser()._actions if a.dest == "verb").choices["evaluate"]


def _args(*argv):
    return _evaluate_parser().parse_args([str(a) for a in argv])


def test_every_option_of_the_verb_is_declared():
    """A new option must be declared in OPTIONS (and so be taken or refused by
    every mode): none can be silently ignored."""
    dests = {a.dest for a in _evaluate_parser()._actions if a.dest != "help"}
    assert dests == set(modes.OPTIONS)
    for m in modes.MODES:
        assert m.takes <= set(modes.OPTIONS), m.name
        assert set(m.refusals) <= set(modes.OPTIONS), m.name


@pytest.mark.parametrize("argv,mode", [
    (["--report", "d", "--kernel", "k"], "report"),
    (["--program", "p", "--kernel", "k", "--train", "a"], "programs"),
    (["--kernel", "k", "--test", "a", "--layout", "pack"], "matrix"),
    (["--kernel", "k", "--layout", "pack", "--sweep", "align-all:1"], "layouts"),
    (["--kernel", "k", "--sweep", "align-all:1"], "sweep"),
    (["--kernel", "k"], "kernels"),
    ([], "kernels"),
])
def test_the_options_choose_the_mode(argv, mode):
    assert modes.choose(_args(*argv)).name == mode


@pytest.mark.parametrize("argv,line", [
    # options these modes used to ignore
    (["--report", "{d}", "--loops", "3"], "--loops does not go with --report (it runs nothing)"),
    (["--report", "{d}", "--", "x"], "unexpected arguments 'x'"),
    (["--program", "p", "--workload", "pipe"], "--workload does not go with --program"),
    (["--program", "p", "-j", "2"], "--jobs does not go with --program"),
    (["--kernel", "k", "--train", "a", "--test", "b", "--csv", "{d}/m.csv"],
     "--csv does not go with --train/--test (the matrix is written by --json)"),
    (["--kernel", "k", "--train", "a", "--test", "b", "--repeat", "2"],
     "--repeat does not go with --train/--test"),
    (["--kernel", "k", "--strategy", "blocks"], "--strategy goes with --train/--test"),
    (["--kernel", "k", "--layout", "pack", "--strategy", "blocks"],
     "--strategy goes with --train/--test"),
    # the same messages as before the modes were objects
    (["--program", "p", "--kernel", "k"], "--kernel does not go with --program"),
    (["--report", "{d}", "--json", "{d}/x.json"], "--json does not go with --report (it runs "
                                                  "nothing)"),
    (["--kernel", "k", "--whatif"], "--whatif replays layouts of one image: give --layout or "
                                    "--sweep"),
    (["--kernel", "k", "--sweep", "align-all:1", "--heatmap", "{d}/h.png"],
     "--heatmap needs --layout"),
    (["--kernel", "k", "--layout", "pack", "--booted"], "--booted goes with --sweep"),
    (["--kernel", "k", "--profile", "p"], "--profile is for --layout/--sweep strategies"),
    (["--kernel", "k", "--weights", "1,2"], "--weights goes with --train"),
    (["--kernel", "k", "x"], "unexpected arguments 'x' (program arguments go after --program"),
    (["--kernel", "k", "--train", "a", "--test", "b", "-j", "0"], "--jobs must be at least 1"),
    (["--kernel", "k", "--vmlinuz", "z"], "--vmlinuz goes with --layout/--sweep"),
    (["--program", "p", "--vmlinuz", "z"], "--vmlinuz does not go with --program"),
])
def test_options_a_mode_does_not_take_are_refused(tmp_path, argv, line):
    p = run_linepack("evaluate", *[a.format(d=tmp_path) for a in argv], timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert line in lines[0], lines[0]
    assert not any(tmp_path.iterdir())          # nothing written
