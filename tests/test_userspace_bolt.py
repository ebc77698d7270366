"""The userspace anchor, small: profile under qemu-x86_64, linepack pack, BOLT 19
(functions only and full) from linepack's .fdata, all on the same binary and profile.

Asserts correctness only (same program output everywhere, .eh_frame consistent in
linepack's output, a nonempty profile that BOLT accepts), not timings or misses:
tests/bench/bench_userspace_bolt.py measures those.
"""

import os
import subprocess

import pytest
import helpers

from linepack.image.elf import ElfImage
from linepack.relayout.user.eh_frame import check_eh_frame

HERE = os.path.dirname(os.path.abspath(__file__))
_requirements = helpers.requirements("qemu-x86_64", "llvm-bolt-19", "g++")


_bench = helpers.bench_module


def _run(path, *args):
    p = subprocess.run([str(path), *map(str, args)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def _layouts(exe, args, work, prof_path):
    """linepack pack + BOLT (functions only, full) of exe from one profile."""
    from linepack.profile.fdata import export_fdata
    from linepack.profile.model import Profile
    from linepack.relayout.driver import load_profile_full, relayout
    b = _bench()
    fdata = os.path.join(work, "prof.fdata")
    n = export_fdata(Profile.load(prof_path), fdata, image=str(exe))
    assert n > 0
    lp = load_profile_full(prof_path, image=str(exe))
    out = {"pack": os.path.join(work, "pack")}
    summary, _, _ = relayout(str(exe), out["pack"], "pack", hotness=lp.hotness, calls=lp.calls,
                             blocks=lp.blocks, profile_build_id=lp.build_id)
    assert summary["units_moved"] > 0 and not summary["problems"]
    for label, flags in (("bolt-fn", b.BOLT_FUNCS), ("bolt", b.BOLT_FULL)):
        out[label] = os.path.join(work, label)
        p = subprocess.run(["llvm-bolt-19", str(exe), "-o", out[label], f"-data={fdata}", *flags],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "non-empty execution profile" in p.stdout      # BOLT read our fdata
    return out, summary


def test_cxx_fixture_against_bolt(plugin, tmp_path):
    from linepack.profile.user import measure_user, record_user
    exe = tmp_path / "unwind"
    subprocess.run(["g++", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(HERE, "fixtures", "c", "unwind.cc")], check=True)
    expected = _run(exe)
    prof_path = str(tmp_path / "p.lpprof")
    prof = record_user(str(exe), output=prof_path)
    assert prof.meta["instructions"] > 0 and len(prof.func_addr) >= 6
    assert "lp_leaf" in prof.func_name and len(prof.edge_from) > 0
    out, summary = _layouts(exe, [], str(tmp_path), prof_path)
    assert summary["eh_frame.fdes_moved"] > 0
    assert check_eh_frame(ElfImage(out["pack"])) == []
    for label, path in out.items():
        assert _run(path) == expected, label
    m = measure_user(out["pack"], cache="intel-32k-8w")
    assert m["stdout"].decode() == expected and m["misses"] > 0


def test_cli_profile_program(plugin, tmp_path):
    exe = tmp_path / "echoargs"
    src = tmp_path / "e.c"
    src.write_text('#include <stdio.h>\nint main(int c, char **v){for(int i=1;i<c;i++)'
                   'printf("%s\\n", v[i]);return 0;}\n')
    subprocess.run(["gcc", "-O2", "-no-pie", "-fno-pie", "-o", str(exe), str(src)], check=True)
    p = subprocess.run(["linepack", "profile", "--program", str(exe), "-o", str(tmp_path / "p"),
                        "--", "-x", "hello"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "qemu-user profile of echoargs" in p.stdout
    from linepack.profile.model import Profile
    prof = Profile.load(str(tmp_path / "p"))
    assert "main" in prof.func_name and prof.meta["result_line"] == "hello"
    assert prof.meta["cmdline"] == "echoargs -x hello"
    # a PIE runs at a base qemu-x86_64 picks: its profile holds link addresses
    pie = tmp_path / "pie"
    subprocess.run(["gcc", "-O2", "-pie", "-fpie", "-o", str(pie), str(src)], check=True)
    p = subprocess.run(["linepack", "profile", "--program", str(pie), "-o", str(tmp_path / "q"),
                        "--", "hi"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    q = Profile.load(str(tmp_path / "q"))
    assert "main" in q.func_name and q.meta["result_line"] == "hi"
    assert int(q.meta["load_bias"], 16) % 4096 == 0 and int(q.meta["load_bias"], 16) > 0
    assert q.func_addr.max() < 0x100000          # link addresses of a PIE start near 0


def test_lua_against_bolt(plugin, tmp_path):
    """Debian's lua5.4 (apt-get source, cached): the bench's pipeline, one run."""
    b = _bench()
    try:
        exe = b.build_lua(str(tmp_path), log=lambda m: None)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"lua5.4 source not available: {e}")
    script = tmp_path / "bench.lua"
    script.write_text(b.LUA_SCRIPT)
    expected = _run(exe, script)
    from linepack.profile.user import record_user
    prof_path = str(tmp_path / "p.lpprof")
    prof = record_user(exe, [str(script)], output=prof_path)
    assert "luaV_execute" in prof.func_name and len(prof.func_addr) > 100
    out, summary = _layouts(exe, [str(script)], str(tmp_path), prof_path)
    assert check_eh_frame(ElfImage(out["pack"])) == []
    for label, path in out.items():
        assert _run(path, script) == expected, label
    res, same = b.measure({"original": exe, "pack": out["pack"]}, [str(script)], reps=1,
                          models=["intel-32k-8w"], log=lambda m: None)
    assert same == {"original": True, "pack": True}
    assert res["pack"]["intel-32k-8w"]["misses"] > 0
