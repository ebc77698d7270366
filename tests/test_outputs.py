"""Output paths of every verb (tools/io.py OutputSet): each output flag refused, before any
work, when it names an input, another output, a device node, a path under a missing
directory or under a file, or a directory: exit 2, one line, and no file changed.
Also: all outputs or none (failures and signals), and the input checks done before work.

Everything here runs on a small C program (tests/fixtures/c/hotloop.c) linked with
--emit-relocs: the checks come before the expensive part, so no real kernel is needed.
"""

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from helpers import FIXTURES, run_linepack
from linepack.cli import main
from linepack.errors import BadInput
from linepack.io import Interrupted, OutputSet, atomic_output, write_atomic



@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    """hotloop linked with --emit-relocs, a JSON profile, a
    profile model (imported from BOLT fdata) and its fdata export."""
    d = tmp_path_factory.mktemp("outputs")
    exe = d / "hl"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(FIXTURES, "c", "hotloop.c")], check=True)
    (d / "p.json").write_text(json.dumps({"functions": {"crunch.constprop.0": 100, "mix": 10,
                                                        "main": 1}}))
    (d / "p.fdata").write_text("no_lbr cycles\n1 mix 0 10\n2 crunch.constprop.0 4 100\n")
    assert main(["profile", "--fdata", str(d / "p.fdata"), "--image", str(exe),
                 "-o", str(d / "p.lpprof")]) == 0
    return d


def _inputs(d, tmp):
    """Copy the fixture's inputs into a fresh directory (one per case)."""
    for n in ("hl", "p.json", "p.fdata", "p.lpprof"):
        (tmp / n).write_bytes((d / n).read_bytes())
        os.chmod(tmp / n, os.stat(d / n).st_mode & 0o777)
    return tmp


# Each verb: its argument list (with {name} placeholders for files in the case's
# directory) and its output flags with a default name each.
VERBS = {
    "relayout": (["relayout", "{hl}", "--profile", "{p.json}"], "p.json",
                 {"-o": "out", "--json": "out.json", "--system-map": "out.map",
                  "--layout-map": "out.layout"}),
    "verify": (["verify", "-q", "{hl}"], "hl", {"--json": "report.json"}),
    "profile-import": (["profile", "--fdata", "{p.fdata}", "--image", "{hl}"], "p.fdata",
                       {"-o": "new.lpprof"}),
    "profile-export": (["profile", "--export-fdata", "{p.lpprof}"], "p.lpprof",
                       {"-o": "new.fdata"}),
    "evaluate": (["evaluate", "--kernel", "{hl}", "--layout", "stock", "--layout", "pack",
                  "--whatif"], "hl",
                 {"--json": "ev.json", "--csv": "ev.csv", "--plot": "ev.png",
                  "--heatmap": "heat.png"}),
    "evaluate-program": (["evaluate", "--program", "{hl}"], "hl",
                         {"--json": "ev.json", "--csv": "ev.csv"}),
    "boot": (["boot", "--kernel", "{hl}"], "hl", {"--serial": "serial.log"}),
    "bzimage": (["bzimage", "{hl}"], "hl", {"-o": "bz", "--relocs": "vmlinux.relocs"}),
}
CASES = ["input", "other-output", "device", "missing-parent", "parent-is-file", "directory"]


def _params():
    for v, (_, _, flags) in VERBS.items():
        for flag in flags:
            for case in CASES:
                if case == "other-output" and len(flags) < 2:
                    continue        # a verb with one output flag has no other output to clash with
                yield pytest.param(v, flag, case, id=f"{v}{flag}-{case}")


def _snapshot(root):
    """Every entry under root: kind, mode, and content hash (regular) or device number."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    what = hashlib.sha256(f.read()).hexdigest()
            else:
                what = st.st_rdev
            snap[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777, what)
    return snap


def _special_node(path):
    """A character device (a copy of /dev/null's numbers) when we may make one, else a FIFO:
    both are special files an output must never replace."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        os.mkfifo(path)


def _bad_path(tmp, case, flag, flags, an_input):
    if case == "input":
        return str(tmp / an_input), "is also an input"
    if case == "other-output":
        other = next(f for f in flags if f != flag)
        return str(tmp / flags[other]), "is also the output of"
    if case == "device":
        _special_node(tmp / "node")
        return str(tmp / "node"), "linepack writes outputs only to regular files"
    if case == "missing-parent":
        return str(tmp / "nonexist" / "x"), "does not exist"
    if case == "parent-is-file":
        (tmp / "afile").write_text("a file\n")
        return str(tmp / "afile" / "x"), "is not a directory"
    if case == "directory":
        (tmp / "adir").mkdir()
        return str(tmp / "adir"), "is a directory"
    raise AssertionError(case)


def _argv(tmp, verb, flag=None, bad=None):
    args, _, flags = VERBS[verb]
    argv = [str(tmp / a[1:-1]) if a.startswith("{") else a for a in args]
    for f, name in flags.items():
        argv += [f, bad if f == flag else str(tmp / name)]
    return argv


@pytest.mark.parametrize("verb,flag,case", list(_params()))
def test_bad_output_path(fixture_dir, tmp_path, capsys, monkeypatch, verb, flag, case):
    # A boot or QEMU run would fail differently (exit 3): proves nothing ran before the check.
    monkeypatch.setenv("LINEPACK_QEMU", str(tmp_path / "no-qemu"))
    tmp = _inputs(fixture_dir, tmp_path)
    _, an_input, flags = VERBS[verb]
    bad, words = _bad_path(tmp, case, flag, flags, an_input)
    argv = _argv(tmp, verb, flag, bad)
    before = _snapshot(tmp)
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("linepack: error: "), err
    assert words in lines[0] and "Traceback" not in err, lines[0]
    if case != "other-output":      # a clash is named on whichever of the two comes second
        assert lines[0].startswith(f"linepack: error: {flag} "), lines[0]
    assert _snapshot(tmp) == before       # nothing written, created or replaced


def test_hard_link_to_input_is_the_input(fixture_dir, tmp_path, capsys):
    """By os.path.samefile, not only by name: a hard link to the image is the image."""
    tmp = _inputs(fixture_dir, tmp_path)
    os.link(tmp / "hl", tmp / "alias")
    before = _snapshot(tmp)
    rc = main(["relayout", str(tmp / "hl"), "--profile", str(tmp / "p.json"),
               "-o", str(tmp / "out"), "--layout-map", str(tmp / "alias")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--layout-map" in err and "is also an input" in err
    assert _snapshot(tmp) == before


def test_symlink_to_output_replaces_its_target_and_keeps_the_link(fixture_dir, tmp_path, capsys):
    tmp = _inputs(fixture_dir, tmp_path)
    (tmp / "real.json").write_text("old\n")
    os.symlink("real.json", tmp / "link.json")
    assert main(["verify", "-q", str(tmp / "hl"), "--json", str(tmp / "link.json")]) == 0
    assert os.path.islink(tmp / "link.json")
    assert json.loads((tmp / "real.json").read_text())["ok"] is True
    # ... and a link to an input is the input
    os.symlink("hl", tmp / "link-to-input")
    assert main(["verify", "-q", str(tmp / "hl"), "--json", str(tmp / "link-to-input")]) == 2
    assert "is also an input" in capsys.readouterr().err


def test_good_run_writes_every_output_and_no_temp(fixture_dir, tmp_path, capsys):
    tmp = _inputs(fixture_dir, tmp_path)
    before = set(os.listdir(tmp))
    assert main(_argv(tmp, "relayout") + ["-q"]) == 0
    new = set(os.listdir(tmp)) - before
    assert new == {"out", "out.json", "out.map", "out.layout"}
    out = subprocess.run([str(tmp / "out"), "1000"], capture_output=True, text=True)
    ref = subprocess.run([str(tmp / "hl"), "1000"], capture_output=True, text=True)
    assert out.stdout == ref.stdout and "hotloop result" in out.stdout
    printed = capsys.readouterr().out
    assert "DWARF:             none in the input" in printed      # the fixture has no -g


# -- all outputs or none (the OutputSet itself) ------------------------------------------

def test_outputs_appear_together_at_the_end(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    with OutputSet(outputs={"--a": a, "--b": b}):
        write_atomic(a, b"A")
        assert not a.exists()                      # staged: not visible before the end
        with atomic_output(b) as f:
            f.write(b"B")
        assert sorted(os.listdir(tmp_path)) != ["a", "b"]
    assert a.read_bytes() == b"A" and b.read_bytes() == b"B"
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_a_failure_leaves_no_output_and_no_temp(tmp_path):
    (tmp_path / "b").write_text("previous b\n")
    with pytest.raises(RuntimeError):
        with OutputSet(outputs={"--a": tmp_path / "a", "--b": tmp_path / "b"}):
            write_atomic(tmp_path / "a", b"A")      # complete
            with atomic_output(tmp_path / "b") as f:
                f.write(b"half")
                raise RuntimeError("disk on fire")
    assert os.listdir(tmp_path) == ["b"] and (tmp_path / "b").read_text() == "previous b\n"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_leaves_no_output_and_no_temp(tmp_path, sig):
    with pytest.raises(Interrupted) as e:
        with OutputSet(outputs={"--a": tmp_path / "a", "--b": tmp_path / "b"}):
            write_atomic(tmp_path / "a", b"A")
            with atomic_output(tmp_path / "b") as f:
                f.write(b"half")
                os.kill(os.getpid(), sig)        # delivered here, as from another process
                f.write(b"never")
    assert e.value.exit_code == 128 + sig
    assert os.listdir(tmp_path) == []
    assert signal.getsignal(sig) is not None     # handlers restored (pytest's own)


def test_undeclared_writes_keep_their_own_rename(tmp_path):
    """Caches written during a command are not outputs: renamed when their block ends."""
    with OutputSet(outputs={"-o": tmp_path / "o"}):
        write_atomic(tmp_path / "cache", b"c")
        assert (tmp_path / "cache").read_bytes() == b"c"


def test_declaring_checks_at_once(tmp_path):
    (tmp_path / "in").write_text("x")
    outs = OutputSet(inputs=[tmp_path / "in", None, "-"], outputs={"-o": None})
    assert outs.add(None) is None
    with pytest.raises(BadInput, match="is also an input"):
        outs.add(tmp_path / "in", "--json")
    outs.add(tmp_path / "o", "-o")
    with pytest.raises(BadInput, match="-o2 .*: is also the output of -o"):
        outs.add(str(tmp_path / "." / "o"), "-o2")


# -- inputs checked before any work ---------------------------------------------------------

def _one_line_exit2(capsys, argv, *words):
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


@pytest.fixture
def truncated(fixture_dir, tmp_path):
    data = (fixture_dir / "hl").read_bytes()
    p = tmp_path / "truncated"
    p.write_bytes(data[:len(data) // 2])
    return p


@pytest.mark.parametrize("argv", [
    ["boot", "--kernel", "{k}"],
    ["profile", "--kernel", "{k}", "-o", "{d}/p"],
    ["evaluate", "--kernel", "{k}"],
    ["evaluate", "--kernel", "{k}", "--layout", "stock", "--layout", "pack", "--whatif"],
    ["verify", "{k}"],
    ["relayout", "{k}", "-o", "{d}/o", "--strategy", "stock"],
    ["verify", "{hl}", "--against", "{k}"],
], ids=["boot", "profile", "evaluate", "evaluate-layouts", "verify", "relayout",
        "verify-against"])
@pytest.mark.parametrize("kind", ["truncated", "directory"])
def test_bad_kernel_paths(fixture_dir, truncated, tmp_path, capsys, monkeypatch, argv, kind):
    monkeypatch.setenv("LINEPACK_QEMU", str(tmp_path / "no-qemu"))    # a boot would be exit 3
    k = truncated if kind == "truncated" else tmp_path
    argv = [a.format(k=k, d=tmp_path, hl=fixture_dir / "hl") for a in argv]
    _one_line_exit2(capsys, argv, "truncated ELF" if kind == "truncated" else "is a directory")


def test_min_count_must_not_be_negative(fixture_dir, tmp_path, capsys):
    _one_line_exit2(capsys, ["relayout", fixture_dir / "hl", "--profile", fixture_dir / "p.json",
                             "-o", tmp_path / "o", "--min-count", "-5"], "--min-count", ">= 0")
    assert os.listdir(tmp_path) == []


def test_profile_of_unknown_functions(fixture_dir, tmp_path, capsys):
    prof = tmp_path / "other.json"
    prof.write_text(json.dumps({"functions": {"ext4_write": 9, "vfs_read": 8, "mix": 7}}))
    argv = ["relayout", fixture_dir / "hl", "--profile", prof, "-o", tmp_path / "o", "-q"]
    _one_line_exit2(capsys, argv, "2 of 3 functions", "ext4_write, vfs_read", "--allow-missing")
    assert not (tmp_path / "o").exists()
    assert main([str(a) for a in argv] + ["--allow-missing"]) == 0
    assert (tmp_path / "o").exists()


def test_evaluate_bad_profile_fails_before_the_boot(fixture_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LINEPACK_QEMU", str(tmp_path / "no-qemu"))    # a boot would be exit 3
    garbage = tmp_path / "garbage"
    garbage.write_text("this is not a profile\n")
    _one_line_exit2(capsys, ["evaluate", "--kernel", fixture_dir / "hl", "--layout", "stock",
                             "--layout", "pack", "--whatif", "--profile", garbage],
                    "not a profile")


def test_verify_against_not_an_elf_fails_before_the_verify(fixture_dir, tmp_path, capsys):
    bad = tmp_path / "not-an-elf"
    bad.write_text("hello\n" * 100)
    # without -q a verification that had started would print progress lines
    _one_line_exit2(capsys, ["verify", fixture_dir / "hl", "--against", bad, "--json",
                             tmp_path / "r.json"], "not an ELF file")
    assert not (tmp_path / "r.json").exists()


def test_fetch_unknown_abi_names_the_valid_ones():
    from linepack import targets
    known = targets.available_abis()
    assert known, "apt knows no linux-image-6.1.0-*-cloud-amd64-dbg (tools/setup.sh runs apt-get update)"
    p = run_linepack("fetch", "--abi", "9999", timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "9999" in p.stderr and str(known[-1]) in p.stderr


def test_a_failed_boot_keeps_its_serial_log(fixture_dir, tmp_path, capsys, monkeypatch):
    """The one output kept on failure: the serial log is what explains a failed boot."""
    fake = tmp_path / "fake-qemu"
    fake.write_text("#!/bin/sh\necho 'Kernel panic - not syncing: fake'\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("LINEPACK_QEMU", str(fake))
    log = tmp_path / "serial.log"
    rc = main(["boot", "--kernel", str(fixture_dir / "hl"), "--workload", "pipe", "--no-icount",
               "--serial", str(log)])
    err = capsys.readouterr().err
    assert rc == 3 and "Kernel panic - not syncing: fake" in err, err
    assert "Kernel panic - not syncing: fake" in log.read_text()
    assert sorted(os.listdir(tmp_path)) == ["fake-qemu", "serial.log"]


def test_fork_pool_workers_end_normally_under_the_trap():
    """multiprocessing's fork pool (bulk disassembly) ends its workers with SIGTERM: they
    must die as usual, not inherit the command's Interrupted handler and hang the pool."""
    code = ("import multiprocessing as mp, os\n"
            "from linepack.io import trap_signals\n"
            "with trap_signals():\n"
            "    with mp.get_context('fork').Pool(2) as pool:\n"
            "        print(sum(pool.map(abs, range(-50, 50))))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "2500", p.stderr
