"""linepack installed like any Python tool: the wheel (not an editable install) in a
fresh virtual environment carries its configs, workloads and C sources, and runs the
demo from a directory outside the checkout."""

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a source distribution holds: the package, its data folders, the build files
SOURCE = ("tools", "configs", "workloads", "setup.py", "setup.cfg", "pyproject.toml", "README.md",
          "MANIFEST.in")


def _run(cmd, cwd, env, timeout):
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd}: {p.stdout[-3000:]}{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, clean environment, a working directory outside the checkout)."""
    top = tmp_path_factory.mktemp("install")
    src = top / "src"
    src.mkdir()
    for name in SOURCE:   # a copy: the build leaves build/ and *.egg-info behind
        p = os.path.join(ROOT, name)
        if os.path.isdir(p):
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(p, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    wheels = top / "wheels"
    # numpy, capstone, ... come from the system's site-packages; linepack from the wheel
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", wheels, src], top, env, 600)
    wheel = [w for w in os.listdir(wheels) if w.startswith("linepack-") and w.endswith(".whl")]
    assert len(wheel) == 1, wheel
    venv = top / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", venv], top, env, 300)
    py = venv / "bin" / "python"
    _run([py, "-m", "pip", "install", "--no-deps", "-q", wheels / wheel[0]], top, env, 600)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    work = top / "elsewhere"
    work.mkdir()
    return py, env, work


def test_wheel_carries_its_data(installed):
    py, env, work = installed
    got = _run([py, "-c", "import json, linepack, linepack.resources as r, "
                "linepack.profile.workloads as w, linepack.profile.trace as t; "
                "print(json.dumps([linepack.__file__, r.configs_dir(), r.sources_dir(), "
                "w.names(), w.load('vfs-mix').source, t.list_cache_configs()]))"],
               work, env, 120)
    package, configs, sources, workloads, vfs_mix, caches = json.loads(got.stdout)
    venv = str(py.parent.parent)
    for path in (package, configs, sources, vfs_mix):
        assert path.startswith(venv + os.sep), path          # the installed copy, not the checkout
    assert "vfs-mix" in workloads and "slab-bulk" in workloads
    assert os.path.isfile(vfs_mix)
    assert {"intel-32k-8w", "amd-64k-2w"} <= set(caches)
    pkg = os.path.dirname(package)
    # every C core of the checkout (a missing one would fall back to Python unseen)
    tools = os.path.join(ROOT, "tools")
    cores = [os.path.relpath(os.path.join(d, f), tools) for d, _, fs in os.walk(tools)
             for f in fs if f.endswith((".c", ".h"))]
    assert {"image/decode.c", "verify/blocks.c", "relayout/parts.c",
            "relayout/user/cfi.c"} <= set(cores)
    for c in cores + ["profile/plugin/linepack_plugin.c", "ship/linepack-postlink.mk"]:
        assert os.path.isfile(os.path.join(pkg, c)), c
    # the console script is the wheel's
    assert _run(["linepack", "--help"], work, env, 120).stdout.startswith("usage: linepack")


@pytest.mark.realkernel
@pytest.mark.qemu
@pytest.mark.slow
def test_installed_demo_runs_outside_the_checkout(installed, debian_vmlinux):
    py, env, work = installed
    out = work / "demo"
    p = _run(["linepack", "demo", "--kernel", debian_vmlinux, "--loops", 20, "--workdir", out],
             work, env, 2400)
    assert "demo: all steps passed" in p.stdout, p.stdout[-3000:]
    table = p.stdout[p.stdout.index("== before/after"):]
    print(table)            # in the log with -s / -rP
    ev = json.loads((out / "evaluate.json").read_text())
    rows = ev["results"]
    assert {r["layout"] for r in rows} == {"stock", "pack", "blocks"}
    assert {r["cache"] for r in rows} == {"intel-32k-8w", "amd-64k-2w"}
    assert ev["problems"] == []
    assert len({r["result_line"] for r in rows}) == 1        # the same workload result everywhere
    lines = [ln.split() for ln in table.splitlines()]
    for r in rows:      # each measured row is in the printed table: layout, then its misses
        assert r["cache"] in table and [r["layout"], f"{r['misses']:,}"] in [ln[:2] for ln in lines], r
