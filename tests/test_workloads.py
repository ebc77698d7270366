"""Workloads (build, native runs) and the deterministic initramfs writer."""

import gzip
import os
import shutil
import stat
import subprocess

import pytest
import helpers
from elftools.elf.elffile import ELFFile

from linepack.errors import BadInput, ExternalToolError
from linepack.profile import initramfs, workloads

SMALL = {"vfs-mix": 200, "pipe": 300, "vdso": 1000, "fork-exec": 20, "tcp-loopback": 50,
         "epoll": 100, "dirwalk": 1, "fsync": 10}

_requirements = helpers.requirements("gcc")


def test_configs_define_the_three_workloads():
    assert {"vfs-mix", "pipe", "vdso"} <= set(workloads.names())
    for name in workloads.names():
        wl = workloads.load(name)
        assert wl.name == name
        assert os.path.isfile(wl.source)
        assert all(os.path.isfile(h) for h in wl.headers)
        assert wl.default_loops > 0
        assert wl.expected_prefix(7) == f"{wl.result_prefix} loops=7"


def test_unknown_workload_is_a_clear_error():
    with pytest.raises(BadInput, match="unknown workload 'nope'"):
        workloads.load("nope")


@pytest.mark.parametrize("name", sorted(SMALL))
def test_build_is_static_cached_and_has_roi_markers(name):
    path = workloads.build(name)
    assert workloads.build(name) == path            # second call: the cached binary
    assert os.path.basename(path).startswith(name + "-")
    with open(path, "rb") as f:
        elf = ELFFile(f)
        assert elf["e_type"] == "ET_EXEC"
        assert not any(seg["p_type"] == "PT_INTERP" for seg in elf.iter_segments())
    begin, end = workloads.roi_addresses(name)
    assert 0 < begin < end


@pytest.mark.parametrize("name", sorted(SMALL))
def test_native_run_is_deterministic(name, tmp_path):
    loops = SMALL[name]
    a = workloads.run_native(name, loops, workdir=tmp_path if name == "vfs-mix" else None)
    b = workloads.run_native(name, loops)
    assert a == b
    assert a.startswith(workloads.load(name).expected_prefix(loops) + " ")
    # The loop count is part of the line, and the work changes with it.
    c = workloads.run_native(name, loops + 1)
    assert c != a
    assert os.listdir(tmp_path) == []               # vfs-mix cleaned up after itself


def test_native_output_protocol(tmp_path):
    p = subprocess.run([workloads.build("vfs-mix"), "10", str(tmp_path)], stdout=subprocess.PIPE,
                       text=True, check=True)
    lines = p.stdout.splitlines()
    tags = [ln.split()[0] for ln in lines]
    assert tags == ["linepack-begin", "linepack-end", "linepack-result", "linepack-info"]
    assert "elapsed_ns=" not in lines[2]


def test_vfs_mix_counts_from_env(tmp_path):
    env = dict(os.environ, loops="12", workdir=str(tmp_path))
    p = subprocess.run([workloads.build("vfs-mix")], stdout=subprocess.PIPE, text=True, env=env)
    assert p.returncode == 0
    assert workloads.find_result(p.stdout) == workloads.run_native("vfs-mix", 12)


def test_find_result_matches_whole_words():
    text = "noise\nlinepack-result pipe loops=100 checksum=1\nlinepack-info pipe x\n"
    assert workloads.find_result(text) == "linepack-result pipe loops=100 checksum=1"
    assert workloads.find_result(text, "linepack-result pipe loops=100").endswith("checksum=1")
    assert workloads.find_result(text, "linepack-result pipe loops=10") is None
    assert workloads.find_result("linepack-resultx\n") is None


def test_vfs_mix_without_directory_fails_clearly():
    p = subprocess.run([workloads.build("vfs-mix"), "10"], stdout=subprocess.PIPE, text=True,
                       env={k: v for k, v in os.environ.items() if k != "workdir"})
    assert p.returncode == 2
    assert p.stdout.startswith("linepack-error vfs-mix no directory")


def test_bad_loop_count_fails_clearly():
    p = subprocess.run([workloads.build("pipe"), "12x"], stdout=subprocess.PIPE, text=True)
    assert p.returncode == 2
    assert workloads.find_error(p.stdout) == "linepack-error pipe bad loop count '12x'"


def test_missing_compiler_is_an_external_tool_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    with pytest.raises(ExternalToolError, match="not installed.*libc6-dev"):
        workloads.build("pipe")


def test_missing_static_libc_is_named(tmp_path, monkeypatch, make_file):
    # A compiler that fails the way gcc does without libc6-dev's libc.a.
    fake = make_file("fake-gcc", "#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1; exit 0; }\n"
                     "echo '/usr/bin/ld: cannot find -lc: No such file or directory' >&2\nexit 1\n",
                     mode=0o755)
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", fake)
    with pytest.raises(ExternalToolError, match="static C library missing \\(install libc6-dev\\)"):
        workloads.build("pipe")
    assert not os.path.exists(tmp_path / "cache" / "workloads") or \
        os.listdir(tmp_path / "cache" / "workloads") == []


# ---------------------------------------------------------------- initramfs

def test_initramfs_is_byte_reproducible_and_parses_back(tmp_path, make_file):
    init = workloads.build("vfs-mix")
    mod = make_file("host/x.ko", b"\x7fELF fake module")
    extra = {"lib/modules/6.1/kernel/x.ko": mod, "etc/motd": b"hi\n"}
    a = initramfs.build_initramfs(init, extra, dest=str(tmp_path / "a.cpio.gz"))
    b = initramfs.build_initramfs(init, dict(reversed(list(extra.items()))),
                                  dest=str(tmp_path / "b.cpio.gz"))
    data = open(a, "rb").read()
    assert data == open(b, "rb").read()
    assert data[:2] == b"\x1f\x8b" and data[4:8] == b"\0\0\0\0"       # gzip, mtime 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".part-")]

    entries = initramfs.parse_newc(data)
    by = {e.path: e for e in entries}
    assert [e.path for e in entries] == sorted(by)
    assert by["init"].data == open(init, "rb").read()
    assert stat.S_IMODE(by["init"].mode) == 0o755 and stat.S_ISREG(by["init"].mode)
    assert stat.S_ISCHR(by["dev/console"].mode)
    assert (by["dev/console"].rdevmajor, by["dev/console"].rdevminor) == (5, 1)
    assert by["lib/modules/6.1/kernel/x.ko"].data == b"\x7fELF fake module"
    assert by["etc/motd"].data == b"hi\n"
    for d in ("lib", "lib/modules", "lib/modules/6.1", "lib/modules/6.1/kernel", "etc"):
        assert stat.S_ISDIR(by[d].mode)

    # Every header: uid/gid 0, mtime 0 (fields 3, 4 and 6 of the newc header).
    raw = gzip.decompress(data)
    off = 0
    while True:
        f = [int(raw[off + 6 + 8 * i: off + 14 + 8 * i], 16) for i in range(13)]
        assert (f[2], f[3], f[5]) == (0, 0, 0)
        name = raw[off + 110: off + 110 + f[11] - 1]
        if name == b"TRAILER!!!":
            break
        off += 110 + f[11]
        off += -off % 4
        off += f[6]
        off += -off % 4

    if shutil.which("cpio"):
        p = subprocess.run(["cpio", "-it", "--quiet"], input=raw, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, check=True)
        assert p.stdout.decode().split() == [e.path for e in entries]


def test_initramfs_cache_by_content(tmp_path, monkeypatch, make_file):
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    one = make_file("one", b"\x7fELF one", mode=0o755)
    two = make_file("two", b"\x7fELF two", mode=0o755)
    p1 = initramfs.build_initramfs(one)
    assert p1.startswith(str(tmp_path / "cache" / "initramfs"))
    assert initramfs.build_initramfs(one) == p1
    assert initramfs.build_initramfs(two) != p1


def test_initramfs_rejects_conflicting_members(make_file):
    init = make_file("init", b"x")
    with pytest.raises(BadInput, match="two different members"):
        initramfs.build_initramfs(init, [("a", b"1"), ("a", b"2")], dest=init + ".gz")
    with pytest.raises(BadInput, match="parent directory and a file"):
        initramfs.write_newc([initramfs.regular("a", b"1"), initramfs.regular("a/b", b"2")])
    with pytest.raises(BadInput, match="cannot read"):
        initramfs.build_initramfs(init + ".missing", dest=init + ".gz")
