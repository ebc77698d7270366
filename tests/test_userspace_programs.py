"""Real programs besides lua, as people build them (issue 22): zstd's CLI (its own
Makefile, ``-O3``, its Huffman assembly) and SQLite's speedtest1 (the amalgamation,
``-O2``), from Debian's source packages (tests/bench/bench_userspace_bolt.py builds
them; cached under ~/.cache/linepack/userspace), gcc's default PIE code with
``-Wl,--emit-relocs``, linked ``-no-pie`` and ``-pie``. Each is profiled on its
benchmark under qemu-x86_64; ``pack`` and ``blocks`` exit 0 with no problem, go to a
new segment, ``verify --against`` is clean, and the outputs print what the original
prints (timings masked) on the training input and on another one.

About 2 minutes (building sqlite3.c dominates)."""

import subprocess

import pytest

import helpers

_requirements = helpers.requirements("qemu-x86_64", "gcc", "make")


_bench = helpers.bench_module


def _masked_run(b, exe, args, masks, cwd):
    from linepack.evaluate.user import compile_masks, masked
    p = subprocess.run([exe, *args], capture_output=True, cwd=cwd, stdin=subprocess.DEVNULL,
                       timeout=300)
    return p.returncode, masked(p.stdout, compile_masks(masks))


@pytest.mark.parametrize("pie", [False, True], ids=["no-pie", "pie"])
@pytest.mark.parametrize("program", ["zstd", "sqlite"])
def test_real_program_relayout_verify_run(program, pie, tmp_path):
    from linepack.image.elf import ElfImage
    from linepack.profile.user import record_user
    b = _bench()
    build, inputs, masks = b.PROGRAMS[program]
    try:
        exe = build(str(tmp_path), log=lambda m: None, pie=pie)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        pytest.fail(f"{program} could not be built from Debian's source: {e}")
    assert ElfImage(exe).type == (3 if pie else 2)
    train, cross = inputs(str(tmp_path), exe, lambda m: None)
    expected = {tuple(a): _masked_run(b, exe, a, masks, str(tmp_path)) for a in (train, cross)}
    assert all(rc == 0 and out for rc, out in expected.values())
    prof = exe + ".lpprof"
    record_user(exe, list(train), output=prof)
    for strategy in ("pack", "blocks"):
        out = f"{exe}.{strategy}"
        p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy",
                            strategy, "-o", out], capture_output=True, text=True)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        assert "problem:" not in p.stdout
        assert "new segment:" in p.stdout           # no room in place: as people link it
        if strategy == "blocks":
            assert "functions split" in p.stdout
        v = subprocess.run(["linepack", "verify", out, "--against", exe], capture_output=True,
                           text=True)
        assert v.returncode == 0 and "result:   OK" in v.stdout, v.stdout[-3000:]
        for args, want in expected.items():
            assert _masked_run(b, out, list(args), masks, str(tmp_path)) == want, \
                (strategy, args)
