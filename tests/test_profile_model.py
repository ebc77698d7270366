"""The Profile model: QEMU-style block constructor, on-disk format, load errors, image checks."""

import os
import zipfile

import numpy as np
import pytest

from linepack.cli import main
from linepack.errors import BadInput
from linepack.image.elf import ElfImage
from linepack.profile.model import FORMAT, KIND_CALL, KIND_INTRA, VERSION, Profile
from test_perf_import import compile_hotloop, func_lookup, one_error


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return compile_hotloop(tmp_path_factory.mktemp("model"), pie=False)


@pytest.fixture(scope="module")
def blocks(exe):
    """Synthetic TCG blocks: main calls crunch 10x and mix 10x; crunch loops."""
    ft, t = func_lookup(exe)
    c, m, mn = (int(ft.start[t[n]]) for n in ("crunch", "mix", "main"))
    addr = [c, c + 0x20, c + 0x37, m, m + 0x10, mn, mn + 0x20, c + 0x20]   # c+0x20 twice: summed
    size = [0x20, 0x17, 0x1b, 0x10, 0x1d, 0x20, 0x10, 0x17]
    insns = [6, 5, 6, 3, 9, 7, 3, 5]
    count = [10, 500, 900, 10, 200, 1, 10, 100]
    esrc = [mn + 0x20, c + 0x37, c + 0x20, mn + 0x20]
    edst = [c, c + 0x20, c + 0x37, c]
    ecnt = [6, 400, 500, 4]
    return dict(addr=addr, size=size, insns=insns, count=count, esrc=esrc, edst=edst, ecnt=ecnt,
                c=c, m=m, mn=mn, crunch=ft.name[t["crunch"]])


def _from_blocks(exe, b, **meta):
    return Profile.from_blocks(exe, b["addr"], b["size"], b["insns"], b["count"],
                               b["esrc"], b["edst"], b["ecnt"],
                               meta={"workload": "vfs-mix", "loops": 10, "cmdline": "nokaslr", **meta})


def test_from_blocks_counts(exe, blocks):
    p = _from_blocks(exe, blocks)
    b = blocks
    assert p.source == "qemu" and p.metric == "insns"
    i = p.func_name.index(b["crunch"])
    assert p.func_addr[i] == b["c"]
    assert p.func_entries[i] == 10                           # the entry block's executions
    assert p.func_blocks[i] == 10 + 600 + 900                # every block of crunch
    assert p.func_insns[i] == 10 * 6 + 600 * 5 + 900 * 6
    assert p.function_counts("entries") == {b["crunch"]: 10, "mix": 10, "main": 1}
    assert p.hot_functions(1)[0][0] == b["crunch"]
    assert [n for n, _, _ in p.hot_functions(1, "entries", per_loop=True)] == [b["crunch"], "mix"]
    # duplicates aggregated, sorted
    assert len(p.block_addr) == 7 and np.all(np.diff(p.block_addr.astype(np.int64)) > 0)
    assert len(p.edge_from) == 3
    k = dict(zip(zip(p.edge_from.tolist(), p.edge_to.tolist()), p.edge_kind.tolist()))
    assert k[(b["mn"] + 0x20, b["c"])] == KIND_CALL and k[(b["c"] + 0x37, b["c"] + 0x20)] == KIND_INTRA
    assert p.edge_count[p.edge_to == b["c"]].tolist() == [10]
    assert p.meta["workload"] == "vfs-mix" and p.meta["loops"] == 10 and p.meta["cmdline"] == "nokaslr"
    assert p.meta["build_id"] == ElfImage(exe).build_id


def test_from_blocks_unmapped(exe):
    p = Profile.from_blocks(exe, [0x10], [4], [1], [7])
    assert p.meta["unmapped"] == 7 and len(p.func_addr) == 0


def test_save_load_roundtrip_and_reproducible(tmp_path, exe, blocks):
    p = _from_blocks(exe, blocks)
    a, b = tmp_path / "a.lpprof", tmp_path / "sub" / "b.lpprof"
    b.parent.mkdir()
    p.save(a)
    _from_blocks(exe, blocks).save(b)
    assert a.read_bytes() == b.read_bytes()                  # byte-reproducible
    q = Profile.load(a)
    for name in ("func_addr", "func_entries", "func_blocks", "func_insns", "block_addr", "block_count",
                 "edge_from", "edge_to", "edge_count", "edge_kind"):
        assert np.array_equal(getattr(p, name), getattr(q, name)), name
    assert q.func_name == p.func_name
    assert q.meta["format"] == FORMAT and q.meta["version"] == VERSION
    assert q.function_counts() == p.function_counts()
    # no temp files left behind; members have a fixed timestamp
    assert sorted(os.listdir(tmp_path)) == ["a.lpprof", "sub"]
    with zipfile.ZipFile(a) as z:
        assert {zi.date_time for zi in z.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert "meta.json" in z.namelist()


def test_first_runs_kept_earliest_saved_and_optional(tmp_path, exe, blocks):
    """block_first: duplicates keep their earliest first run (the plugin's sentinel
    reads as never), it survives save/load with its window, and a profile without
    it writes and reads as before the column existed."""
    b = blocks
    none = np.iinfo(np.uint64).max
    first = np.array([3, 9, 12, 20, 21, 0, 1, 5], np.uint64)      # c+0x20 at 9 and 5
    first[2] = none                                                # c+0x37: not in the window
    p = Profile.from_blocks(exe, b["addr"], b["size"], b["insns"], b["count"],
                            meta={"loops": 10}, block_first=first)
    got = dict(zip(zip(p.block_addr.tolist(), p.block_size.tolist()), p.block_first.tolist()))
    assert got[(b["c"] + 0x20, 0x17)] == 5.0 and got[(b["c"], 0x20)] == 3.0
    assert got[(b["c"] + 0x37, 0x1b)] == float("inf")
    assert p.meta["first_window"] == 22.0                           # one past the latest
    p.save(tmp_path / "f.lpprof")
    q = Profile.load(tmp_path / "f.lpprof")
    assert np.array_equal(q.block_first, p.block_first) and q.meta["first_window"] == 22.0
    plain = _from_blocks(exe, b)
    plain.save(tmp_path / "plain.lpprof")
    with zipfile.ZipFile(tmp_path / "plain.lpprof") as z:
        assert "block_first.npy" not in z.namelist()
    assert len(Profile.load(tmp_path / "plain.lpprof").block_first) == 0
    # a first-run column that does not match the block table is refused on load
    bad = tmp_path / "bad.lpprof"
    with zipfile.ZipFile(tmp_path / "f.lpprof") as zin, zipfile.ZipFile(bad, "w") as zout:
        for zi in zin.infolist():
            data = zin.read(zi)
            if zi.filename == "block_first.npy":
                import io
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.zeros(2, "<f8"))
                data = buf.getvalue()
            zout.writestr(zi, data)
    with pytest.raises(BadInput, match="block_first has 2 rows"):
        Profile.load(bad)


def test_save_overwrites_atomically(tmp_path, exe, blocks):
    out = tmp_path / "p.lpprof"
    out.write_bytes(b"old")
    _from_blocks(exe, blocks).save(out)
    assert Profile.load(out).source == "qemu"


def _zip(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for n, d in members.items():
            z.writestr(n, d)


@pytest.mark.parametrize("case,needle", [
    ("missing", "no such profile"),
    ("dir", "is a directory"),
    ("text", "not a linepack profile"),
    ("zip-no-meta", "without meta.json"),
    ("foreign", "not a linepack profile (format 'something-else')"),
    ("future", "version 99 is not supported"),
    ("bad-json", "meta.json is not JSON"),
    ("truncated", "not a linepack profile"),
    ("bad-array", "corrupt profile"),
])
def test_load_errors(tmp_path, exe, blocks, case, needle):
    path = tmp_path / "p.lpprof"
    if case == "dir":
        path.mkdir()
    elif case == "text":
        path.write_text("hello\n")
    elif case == "zip-no-meta":
        _zip(path, {"x.npy": b"123"})
    elif case == "foreign":
        _zip(path, {"meta.json": '{"format": "something-else", "version": 1}'})
    elif case == "future":
        _zip(path, {"meta.json": '{"format": "%s", "version": 99}' % FORMAT})
    elif case == "bad-json":
        _zip(path, {"meta.json": "{nope"})
    elif case == "truncated":
        _from_blocks(exe, blocks).save(path)
        data = path.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif case == "bad-array":
        _zip(path, {"meta.json": '{"format": "%s", "version": 1}' % FORMAT, "func_addr.npy": b"garbage"})
    with pytest.raises(BadInput) as e:
        Profile.load(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_show_bad_profile_exit_2(tmp_path, capsys):
    p = tmp_path / "x.lpprof"
    p.write_text("not a profile")
    assert main(["profile", "--show", str(p)]) == 2
    assert "not a linepack profile" in one_error(capsys.readouterr().err)


def test_build_id_mismatch(tmp_path, exe, blocks, capsys):
    other = compile_hotloop(tmp_path, name="other", pie=False, extra=("-DVARIANT=1", "-O1"))
    assert ElfImage(other).build_id != ElfImage(exe).build_id
    p = _from_blocks(exe, blocks)
    p.check_image(ElfImage(exe))
    with pytest.raises(BadInput) as e:
        p.check_image(ElfImage(other))
    want, have = ElfImage(exe).build_id, ElfImage(other).build_id
    assert str(e.value) == f"profile was recorded for build-id {want}, image {other} has {have}"
    path = tmp_path / "p.lpprof"
    p.save(path)
    assert main(["profile", "--show", str(path), "--image", other]) == 2
    assert "profile was recorded for build-id" in one_error(capsys.readouterr().err)


def test_no_build_id_falls_back_to_names(tmp_path):
    a = compile_hotloop(tmp_path, name="a", pie=False, extra=("-Wl,--build-id=none",))
    b = compile_hotloop(tmp_path, name="b", pie=False, extra=("-Wl,--build-id=none", "-O1"))
    assert ElfImage(a).build_id is None
    ft, t = func_lookup(a)
    p = Profile.from_samples(a, [int(ft.start[t["crunch"]]) + 2, int(ft.start[t["mix"]]) + 1])
    p.check_image(ElfImage(a))
    with pytest.raises(BadInput) as e:
        p.check_image(ElfImage(b))
    assert "profile does not match" in str(e.value) and "no build-id" in str(e.value)


def test_summary_and_show(tmp_path, exe, blocks, capsys):
    p = _from_blocks(exe, blocks)
    path = tmp_path / "p.lpprof"
    p.save(path)
    assert main(["profile", "--show", str(path), "--image", exe]) == 0
    out = capsys.readouterr().out
    assert "source qemu" in out and blocks["crunch"] in out and "coverage:" in out
    assert "workload vfs-mix" in out and "loops 10" in out


def test_qemu_hook_when_not_built(tmp_path, capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "linepack.profile.record", None)   # as if the module were absent
    rc = main(["profile", "--kernel", "/nonexistent/vmlinux", "--workload", "vfs-mix", "-o",
               str(tmp_path / "k.lpprof")])
    assert rc == 2 and "QEMU profiling is not built yet" in one_error(capsys.readouterr().err)


def test_qemu_hook_calls_record_qemu(tmp_path, capsys, monkeypatch, exe, blocks):
    import sys
    import types
    calls = {}

    def record_qemu(kernel, workload, loops, output, meta, log):
        calls.update(kernel=kernel, workload=workload, loops=loops, output=output, meta=meta)
        return _from_blocks(exe, blocks)
    fake = types.ModuleType("linepack.profile.record")
    fake.record_qemu = record_qemu
    monkeypatch.setitem(sys.modules, "linepack.profile.record", fake)
    out = str(tmp_path / "k.lpprof")
    assert main(["profile", "--kernel", exe, "--workload", "pipe", "--loops", "7", "-o", out]) == 0
    assert calls["kernel"] == exe and calls["workload"] == "pipe" and calls["loops"] == 7
    assert Profile.load(out).source == "qemu"
    assert capsys.readouterr().out.count("\n") == 1


def test_nothing_to_do(capsys):
    assert main(["profile"]) == 2
    assert "nothing to do" in one_error(capsys.readouterr().err)
