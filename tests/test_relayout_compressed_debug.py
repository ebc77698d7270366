"""Compressed DWARF (gcc -gz, ld --compress-debug-sections), found on bzip2 built
-g -gz: relayout read the zlib streams as DWARF and stopped with numpy's
`index 28018 is out of bounds for axis 0 with size 28015`. It now says what the
input has and what to do (one line, exit 2, nothing written); --strip-debug and a
decompressed copy go through."""

import os
import subprocess

import helpers

_requirements = helpers.requirements("gcc", "qemu-x86_64", "objcopy")

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "c")


def _relayout(exe, prof, out, *extra):
    return subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", "blocks",
                           "-o", out, *extra], capture_output=True, text=True, timeout=300)


def test_compressed_dwarf_is_refused_with_one_line(tmp_path):
    from linepack.profile.user import record_user
    exe = str(tmp_path / "gz")
    subprocess.run(["gcc", "-O2", "-g", "-gz", "-no-pie", "-Wl,--emit-relocs",
                    "-Wl,--compress-debug-sections=zlib", "-o", exe,
                    os.path.join(FIX, "switch_tables.c")], check=True)
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    out = str(tmp_path / "out")
    p = _relayout(exe, prof, out)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert "its DWARF is compressed" in lines[-1] and "--strip-debug" in lines[-1]
    assert "Traceback" not in p.stderr and not os.path.exists(out)
    # what the line suggests works
    assert _relayout(exe, prof, out, "--strip-debug", "--verify").returncode == 0
    plain = str(tmp_path / "plain")
    subprocess.run(["objcopy", "--decompress-debug-sections", exe, plain], check=True)
    p = _relayout(plain, prof, out + "2", "--verify")
    assert p.returncode == 0, p.stdout + p.stderr
    run = [subprocess.run([b], capture_output=True, text=True) for b in (exe, out, out + "2")]
    assert len({(r.returncode, r.stdout, r.stderr) for r in run}) == 1
