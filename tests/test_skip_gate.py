"""tests/skip_gate.py, the CI rule that no test skips for a reason not on the allow-list."""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GATE = os.path.join(HERE, "skip_gate.py")


def _junit(tmp_path, body):
    (tmp_path / "test_sample.py").write_text("import pytest\n" + body)
    xml = tmp_path / "j.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={xml}", str(tmp_path / "test_sample.py")],
                   cwd=tmp_path, capture_output=True, check=False)
    return xml


def _gate(xml, allow):
    return subprocess.run([sys.executable, GATE, str(xml), str(allow)], capture_output=True,
                          text=True)


def test_an_unlisted_skip_fails_and_a_listed_one_passes(tmp_path):
    xml = _junit(tmp_path, "def test_ok(): pass\n"
                           "def test_host(): pytest.skip('perf record failed: EPERM')\n"
                           "@pytest.mark.skipif(True, reason='fat.ko not cached')\n"
                           "def test_mod(): pass\n")
    allow = tmp_path / "allow.txt"
    allow.write_text("# why: containers\nperf record failed\n")
    p = _gate(xml, allow)
    assert p.returncode == 1
    assert "NOT ALLOWED: test_sample::test_mod: fat.ko not cached" in p.stderr
    assert "allowed: test_sample::test_host" in p.stderr
    allow.write_text("perf record failed\nfat.ko not cached\n")
    assert _gate(xml, allow).returncode == 0


def test_no_skips_pass(tmp_path):
    xml = _junit(tmp_path, "def test_ok(): pass\n")
    allow = tmp_path / "allow.txt"
    allow.write_text("")
    p = _gate(xml, allow)
    assert p.returncode == 0 and p.stderr == ""


def test_the_project_allow_list_parses():
    sys.path.insert(0, HERE)
    try:
        import skip_gate
    finally:
        sys.path.remove(HERE)
    entries = skip_gate.read_allow_list(os.path.join(HERE, "allowed-skips.txt"))
    assert entries and all(not e.startswith("#") for e in entries)


# -- tools/run-tests.sh itself (LINEPACK_SKIP_SETUP=1: no set-up step) ---------------------

SCRIPT = os.path.join(os.path.dirname(HERE), "tools", "run-tests.sh")


def _run_tests(tmp_path, *args):
    """The script on sample test files; a script that added tests/ to them would run the
    whole suite and hit the timeout."""
    env = dict(os.environ, LINEPACK_SKIP_SETUP="1")
    return subprocess.run(["bash", SCRIPT, "-p", "no:cacheprovider", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def _sample(tmp_path, name, body):
    path = tmp_path / name
    path.write_text("import pytest\n" + body)
    return path


def test_run_tests_passes_arguments_through(tmp_path):
    """A named test file is all that runs (tests/ is not appended), -k reaches pytest."""
    f = _sample(tmp_path, "test_one.py", "def test_a(): pass\ndef test_b(): pass\n")
    p = _run_tests(tmp_path, f)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 passed" in p.stdout and "error" not in p.stdout.lower(), p.stdout
    p = _run_tests(tmp_path, f, "-k", "test_b")
    assert p.returncode == 0 and "1 passed, 1 deselected" in p.stdout, p.stdout


def test_run_tests_gate_fails_an_unlisted_skip_and_allows_a_listed_one(tmp_path):
    bad = _sample(tmp_path, "test_bad.py", "def test_a(): pytest.skip('tool missing')\n")
    p = _run_tests(tmp_path, bad)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "NOT ALLOWED" in p.stderr and "tool missing" in p.stderr
    ok = _sample(tmp_path, "test_ok.py",
                 "def test_a(): pytest.skip('perf record cannot record here: EPERM')\n")
    p = _run_tests(tmp_path, ok)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "skip-gate: allowed" in p.stderr


def test_run_tests_gate_runs_when_nothing_is_collected(tmp_path):
    f = _sample(tmp_path, "test_none.py", "def test_a(): pass\n")
    p = _run_tests(tmp_path, f, "-k", "no_such_test")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "collected no tests" in p.stderr
    # a module skipped at collection: pytest exits 5, the gate still judges the skip
    m = tmp_path / "test_mod.py"
    m.write_text("import pytest\npytest.skip('tool missing', allow_module_level=True)\n")
    p = _run_tests(tmp_path, m)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "NOT ALLOWED" in p.stderr and "tool missing" in p.stderr
    m.write_text("import pytest\n"
                 "pytest.skip('perf record cannot record here: EPERM', allow_module_level=True)\n")
    p = _run_tests(tmp_path, m)
    assert p.returncode == 0 and "skip-gate: allowed" in p.stderr, p.stdout + p.stderr


def test_run_tests_keeps_pytest_failures(tmp_path):
    f = _sample(tmp_path, "test_fail.py", "def test_a(): assert False\n")
    assert _run_tests(tmp_path, f).returncode == 1


def test_a_missing_tool_fails_instead_of_skipping(tmp_path):
    """tests/helpers.py: a tool the set-up installs that is not there fails the tests
    that need it, with one line naming it."""
    f = tmp_path / "test_tool.py"
    f.write_text(f"import sys\nsys.path.insert(0, {HERE!r})\nimport helpers\n"
                 "_requirements = helpers.requirements('no-such-tool-lp')\n"
                 "def test_a(): pass\n"
                 "def test_b(): helpers.require_tool('no-such-tool-lp', 'no-such-tool-lp-19')\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(f)],
                       cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 1, p.stdout
    assert "2 errors" in p.stdout or "2 failed" in p.stdout or "1 failed, 1 error" in p.stdout, p.stdout
    assert "skipped" not in p.stdout
    assert "no-such-tool-lp not installed (tools/setup.sh installs it)" in p.stdout


def _fake_df(tmp_path, free_kib):
    """A `df -P -k` that reports ``free_kib`` free on every disk, first on PATH."""
    bin_dir = tmp_path / f"bin{free_kib}"
    bin_dir.mkdir()
    df = bin_dir / "df"
    df.write_text("#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
                  f"echo 'fake 99999999 1 {free_kib} 1% /'\n")
    df.chmod(0o755)
    return dict(os.environ, LINEPACK_SKIP_SETUP="1", PATH=f"{bin_dir}:{os.environ['PATH']}")


def test_run_tests_warns_when_the_disk_is_short(tmp_path):
    f = _sample(tmp_path, "test_one.py", "def test_a(): pass\n")
    for free_kib, warned in ((5 * 1048576, True), (40 * 1048576, False)):
        p = subprocess.run(["bash", SCRIPT, "-p", "no:cacheprovider", str(f)],
                           env=_fake_df(tmp_path, free_kib), capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        assert ("only 5 GB free" in p.stderr) == warned, p.stderr


def test_module_outputs_are_removed_unless_a_test_failed(tmp_path):
    """tests/conftest.py: a module's tmp_path_factory directories go when the module is
    done, a failed module's stay (and a session fixture's, named session-*, always)."""
    import shutil
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    body = ("@pytest.fixture(scope='module')\n"
            "def out(tmp_path_factory):\n"
            "    d = tmp_path_factory.mktemp('{name}')\n"
            "    (d / 'image').write_bytes(b'x' * 1000)\n"
            "    return d\n"
            "@pytest.fixture(scope='session')\n"
            "def shared(tmp_path_factory):\n"
            "    return tmp_path_factory.mktemp('session-{name}')\n"
            "def test_a(out, shared):\n"
            "    assert {ok}\n")
    _sample(tmp_path, "test_pass.py", body.format(name="passmod", ok=True))
    _sample(tmp_path, "test_fail.py", body.format(name="failmod", ok=False))
    base = tmp_path / "base"
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        f"--basetemp={base}", "test_pass.py", "test_fail.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "1 failed, 1 passed" in p.stdout, p.stdout + p.stderr
    left = sorted(n for n in os.listdir(base)
                  if not n.startswith("test_") and not n.endswith("current"))   # pytest's links
    assert left == ["failmod0", "session-failmod0", "session-passmod0"], left
