"""Shared test helpers: build C fixtures at test time, patch copies of images."""

import functools
import os
import re
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")


@functools.lru_cache(maxsize=None)
def debian_abi():
    """The ABI of Debian's 6.1 cloud kernel the tests use: the one tools/setup.sh fetched
    ($LINEPACK_KERNEL_ABI, else the newest apt knows), or the newest cached one when apt
    answers nothing. Never a fixed number: Debian bumps the ABI and drops the old package."""
    from linepack import targets
    from linepack.errors import LinepackError
    try:
        return targets.resolve_abi()
    except LinepackError:
        kernels = os.path.join(targets.cache_dir(), "kernels")
        cached = sorted(int(m.group(1)) for n in (os.listdir(kernels) if os.path.isdir(kernels)
                                                    else ())
                        for m in [re.fullmatch(r"6\.1\.0-(\d+)-cloud-amd64", n)] if m)
        return cached[-1] if cached else 0


def debian_release():
    """uname -r of the kernel the tests use, e.g. 6.1.0-NN-cloud-amd64."""
    from linepack import targets
    return targets.release(debian_abi())


def debian_vmlinux_path():
    """Its cached vmlinux path (exists once tools/setup.sh or `linepack fetch` ran)."""
    from linepack import targets
    return os.path.join(targets.cache_dir(), "kernels", debian_release(), "vmlinux")


def debian_module(name):
    """Cached path of one module (e.g. 'fs/fat/vfat.ko') of the same build as
    debian_vmlinux_path(). tools/setup.sh fetches the ones the tests use, so one that
    cannot be had fails the test instead of skipping it."""
    from linepack import targets
    from linepack.errors import LinepackError
    try:
        return targets.debian_module(name, abi=debian_abi())
    except LinepackError as e:
        pytest.fail(f"module {name} of {debian_release()} unavailable "
                    f"(tools/setup.sh fetches it): {e}")


def require_tool(*names):
    """Path of the first of ``names`` on PATH (or an absolute path that exists); fails the
    test naming them all when none is there: tools/setup.sh installs every tool the tests
    use, so a missing one is a broken set-up, never a reason to drop a check."""
    for n in names:
        path = n if os.path.isabs(n) and os.access(n, os.X_OK) else shutil.which(n)
        if path:
            return path
    pytest.fail(f"{' / '.join(names)} not installed (tools/setup.sh installs it)")


def requirements(*tools, vmlinux=False, autouse=True):
    """A module fixture (assign it to a module-level name) that fails every test of the
    module (with ``autouse=False``: every test that asks for it by that name) when a tool
    or the cached Debian vmlinux is missing."""
    @pytest.fixture(scope="module", autouse=autouse)
    def _requirements():
        for t in tools:
            require_tool(t)
        if vmlinux and not os.path.exists(debian_vmlinux_path()):
            pytest.fail(f"no cached vmlinux at {debian_vmlinux_path()} (tools/setup.sh fetches it)")
    return _requirements


def build_c(src_name, out, *flags, static=False):
    """Compile tests/fixtures/c/<src_name> to out with gcc (a missing gcc fails)."""
    require_tool("gcc")
    cmd = ["gcc", "-O2", *(["-static"] if static else []), *flags,
           os.path.join(FIXTURES, "c", src_name), "-o", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return str(out)


def profiled_cxx(directory, src_name, link):
    """tests/fixtures/c/<src_name> built in ``directory`` with g++ -O2 ``link``
    (-no-pie or -pie) -Wl,--emit-relocs and profiled under qemu-user with no
    arguments: (executable, profile path)."""
    from linepack.profile.user import record_user
    require_tool("g++")
    exe = os.path.join(str(directory), os.path.splitext(src_name)[0])
    subprocess.run(["g++", "-O2", link, "-Wl,--emit-relocs", "-o", exe,
                    os.path.join(FIXTURES, "c", src_name)], check=True)
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    return exe, prof


def run_linepack(*args, timeout=900):
    """Run the CLI as a user would: returns CompletedProcess with text output."""
    return subprocess.run([sys.executable, "-m", "linepack", *map(str, args)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


def run_program(path, *args, timeout=60):
    """Run a built program: (exit status, stdout, stderr), to compare with its original's."""
    p = subprocess.run([str(path), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def relayout_program(exe, prof, strategy, out):
    """`linepack relayout EXE --profile PROF --strategy STRATEGY -o OUT`: CompletedProcess."""
    return run_linepack("relayout", exe, "--profile", prof, "--strategy", strategy, "-o", out,
                        timeout=300)


def verify_against(new, old):
    """`linepack verify NEW --against OLD`: (exit status, stdout + stderr)."""
    p = run_linepack("verify", new, "--against", old, timeout=300)
    return p.returncode, p.stdout + p.stderr


def relaid_out_c(tmp_path, prog):
    """C source ``prog`` built as tmp_path/p (gcc -O2 -no-pie, --emit-relocs) and relaid out
    with ``align-all 64`` as tmp_path/p.lp; asserts that relayout succeeded and that the
    output prints what the original prints. Returns (exe, new)."""
    (tmp_path / "p.c").write_text(prog)
    exe, new = tmp_path / "p", tmp_path / "p.lp"
    subprocess.run(["gcc", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    str(tmp_path / "p.c")], check=True)
    r = run_linepack("relayout", exe, "--strategy", "align-all 64", "-q", "-o", new)
    assert r.returncode == 0, r.stderr
    want = subprocess.run([str(exe)], stdout=subprocess.PIPE, text=True).stdout
    assert subprocess.run([str(new)], stdout=subprocess.PIPE, text=True).stdout == want
    return exe, new


def refusal_line(p):
    """The one stderr line of a refused run (exit 2, no traceback)."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def patched_copy(src, dest, patches):
    """Copy src to dest and apply {file offset: bytes} patches to the copy."""
    shutil.copyfile(src, dest)
    with open(dest, "r+b") as f:
        for off, data in patches.items():
            f.seek(off)
            f.write(data)
    return str(dest)


def verify_json(path, tmp_path, *extra):
    """Run `linepack verify --json` on path: (CompletedProcess, report dict)."""
    import json
    out = tmp_path / "r.json"
    p = run_linepack("verify", "-q", path, "--json", out, *extra)
    return p, json.loads(out.read_text())


def expect_fault(path, tmp_path, check, words=()):
    """verify exits 1 and names ``check`` (and each word) in its findings."""
    p, rep = verify_json(path, tmp_path)
    assert p.returncode == 1, p.stdout
    hits = [f for f in rep["findings"] if f["check"] == check]
    assert hits, [f["check"] for f in rep["findings"]]
    for w in words:
        assert any(w in f["message"] for f in hits), (w, hits[:3])
    assert check in p.stdout
    return hits


def file_offset(ctx, addr):
    return ctx.image.vaddr_to_offset(int(addr))


def rel32(field_addr, target):
    """The s32 a field at field_addr holds to point at target."""
    return (int(target) - int(field_addr)).to_bytes(4, "little", signed=True)


@functools.lru_cache(maxsize=None)
def bench_module(name="bench_userspace_bolt"):
    """A script of tests/bench/ (not a package: benches are run as scripts) as a module."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
