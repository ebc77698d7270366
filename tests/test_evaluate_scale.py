"""evaluate at scale: one interval index, one job runner, -j N on a process pool,
and the same jobs on a Dask cluster (in-process LocalCluster; scheduler and
workers as separate processes on loopback; a worker killed mid-sweep).

Every sweep here is the same small one (2 images x 2 workloads x 2 cache
models, 3 loops, booted on Debian's 6.1 vmlinux) and must give exactly the
numbers of the sequential run: boots under -icount are deterministic."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import helpers

from linepack.image.intervals import containing

CACHES = ("intel-32k-8w", "amd-64k-2w")
WORKLOADS = "vfs-mix,pipe"
# numbers that depend on the host, not on the measurement
TIMING = ("time_s", "wall", "wall_spread")


def test_interval_index_matches_brute_force():
    rng = np.random.default_rng(7)
    starts = np.sort(rng.choice(10_000, 300, replace=False)).astype(np.uint64)
    gaps = np.diff(np.append(starts, np.uint64(10_100))).astype(np.int64)
    ends = starts + rng.integers(0, gaps + 1).astype(np.uint64)      # empty ranges too
    addrs = np.arange(0, 10_200, dtype=np.uint64)
    want = np.full(len(addrs), -1, np.int64)
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist())):
        want[s:e] = i
    assert np.array_equal(containing(starts, ends, addrs), want)
    assert containing(starts[:0], ends[:0], addrs).tolist() == [-1] * len(addrs)


def test_every_lookup_is_the_interval_index():
    """AddressMap answers through containing(): the address at an end belongs to
    nothing, a start to its range (FunctionTable, Disassembly, UnitTable likewise)."""
    from linepack.image.addrmap import AddressMap
    amap = AddressMap(np.array([0x100, 0x200], np.uint64), np.array([0x180, 0x240], np.uint64),
                      np.array([0x300, 0x100], np.uint64), [(0x100, 0x240)], {})
    q = np.array([0xff, 0x100, 0x17f, 0x180, 0x1ff, 0x200, 0x240], np.uint64)
    assert amap.piece(q).tolist() == [-1, 0, 0, -1, -1, 1, -1]
    assert amap.in_extent(q).tolist() == [False, True, True, True, True, True, False]


def test_plugin_option_is_built_one_way(make_file, debian_vmlinux):
    from linepack.profile import qemu, trace
    so = make_file("p.so", b"")
    args = ["out=/x.bin", "mode=kernel", "cache=on"]
    cmd = qemu.qemu_command(debian_vmlinux, "i.gz", plugin=so, plugin_args=args)
    assert cmd[cmd.index("-plugin") + 1] == trace.plugin_option(so, args)


def _sweep(kernel, out, *extra, env=None, popen=False):
    args = [sys.executable, "-m", "linepack", "evaluate", "--kernel", kernel,
            "--kernel", f"copy={kernel}", "--workload", WORKLOADS, "--loops", "3",
            *[x for c in CACHES for x in ("--cache", c)], "--json", str(out),
            "--csv", str(out)[:-len(".json")] + ".csv", *extra]
    if popen:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)
    p = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                       timeout=1800)
    assert p.returncode == 0, p.stderr
    return p


def _table(path):
    rows = json.load(open(path))["results"]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.fixture(scope="module")
def sequential(debian_vmlinux, tmp_path_factory):
    """The reference: every boot one after another (-j 1)."""
    out = tmp_path_factory.mktemp("seq") / "seq.json"
    p = _sweep(debian_vmlinux, out, "-j", "1")
    return _table(out), p.stderr, p.stdout, out


@pytest.mark.qemu
@pytest.mark.realkernel
def test_sequential_table_is_complete(sequential):
    rows = sequential[0]
    assert len(rows) == 2 * 2 * 2
    keys = {(r["layout"], r["workload"], r["cache"]) for r in rows}
    assert keys == {(lay, w, c) for lay in ("vmlinux", "copy") for w in WORKLOADS.split(",")
                    for c in CACHES}
    for r in rows:
        assert r["misses"] > 0 and r["instructions"] > 0 and r["result_line"]


@pytest.mark.qemu
@pytest.mark.realkernel
def test_parallel_equals_sequential(debian_vmlinux, sequential, tmp_path):
    out = tmp_path / "par.json"
    p = _sweep(debian_vmlinux, out, "-j", "2")
    assert _table(out) == sequential[0]
    progress = re.findall(r"^evaluate: \[(\d)/4\] ", p.stderr, re.M)
    assert sorted(progress) == ["1", "2", "3", "4"], p.stderr


@pytest.mark.qemu
@pytest.mark.realkernel
def test_report_renders_the_result_files(sequential, tmp_path):
    """--report DIR prints the table evaluate printed, from its JSON and from its CSV."""
    import shutil
    _, _, stdout, out = sequential
    for kind in ("json", "csv"):
        d = tmp_path / kind
        d.mkdir()
        shutil.copy(str(out)[:-len("json")] + kind, d / f"seq.{kind}")
        p = subprocess.run([sys.executable, "-m", "linepack", "evaluate", "--report", str(d),
                            "--plot", str(tmp_path / f"{kind}.png")], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert p.stdout == f"== seq.{kind}\n" + stdout, p.stdout
        assert (tmp_path / f"{kind}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad"
    bad.mkdir()
    for doc in ('{"results": [{"layout": "a"}]}',
                # the columns --report checks up front, but not the rest of the table's
                '{"results": [{"layout": "a", "cache": "c", "misses": 1}]}',
                '{"results": [{"layout": "a", "cache": "c", "misses": "many"}]}'):
        (bad / "x.json").write_text(doc)
        p = subprocess.run([sys.executable, "-m", "linepack", "evaluate", "--report", str(bad)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "Traceback" not in p.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def worker_inputs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("worker-inputs"))


@pytest.mark.qemu
@pytest.mark.realkernel
def test_local_cluster_equals_local_run(debian_vmlinux, sequential, tmp_path, worker_inputs,
                                        monkeypatch):
    distributed = pytest.importorskip("distributed")
    monkeypatch.setenv("LINEPACK_WORKER_INPUTS", worker_inputs)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  host="127.0.0.1", dashboard_address=None) as cluster:
        out = tmp_path / "dask.json"
        p = _sweep(debian_vmlinux, out, "--scheduler", cluster.scheduler_address)
    assert _table(out) == sequential[0]
    shipped = re.findall(r"^evaluate: shipping (\S+)", p.stderr, re.M)
    # kernel, initramfs of each workload, plugin: each once (the workers share this disk)
    assert sorted(set(shipped)) == sorted(shipped) and "vmlinux" in shipped, p.stderr
    assert len(os.listdir(worker_inputs)) == len(shipped)


@pytest.fixture
def process_cluster(worker_inputs):
    """A scheduler and two workers, each its own process group, on loopback."""
    port = _free_port()
    env = dict(os.environ, LINEPACK_WORKER_INPUTS=worker_inputs)
    procs = [subprocess.Popen([sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1",
                               "--port", str(port), "--no-dashboard"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)]
    addr = f"tcp://127.0.0.1:{port}"
    for _ in range(2):
        procs.append(subprocess.Popen([sys.executable, "-m", "dask", "worker", addr, "--nthreads",
                                       "1", "--host", "127.0.0.1", "--no-dashboard"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
    try:
        from distributed import Client
        with Client(addr, timeout=60) as c:
            c.wait_for_workers(2, timeout=120)
        yield addr, procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


@pytest.mark.qemu
@pytest.mark.realkernel
def test_separate_process_cluster_and_a_killed_worker(debian_vmlinux, sequential, tmp_path,
                                                      process_cluster):
    pytest.importorskip("distributed")
    addr, procs = process_cluster
    out = tmp_path / "cli.json"
    _sweep(debian_vmlinux, out, "--scheduler", addr)
    assert _table(out) == sequential[0]
    # again, and kill one worker (with its QEMU) once the first boot is done: the
    # sweep still ends with the full, correct table
    out2 = tmp_path / "killed.json"
    p = _sweep(debian_vmlinux, out2, "--scheduler", addr, popen=True)
    err = []
    killed = False
    while True:
        line = p.stderr.readline()
        if not line:
            break
        err.append(line)
        if not killed and re.match(r"evaluate: \[1/4\] ", line):
            assert p.poll() is None
            os.killpg(procs[1].pid, signal.SIGKILL)
            killed = True
    p.wait(timeout=1800)
    assert killed and p.returncode == 0, "".join(err)
    assert _table(out2) == sequential[0]
    assert procs[1].wait(timeout=30) is not None


def test_shared_image_rewrites_like_a_fresh_process(tmp_path):
    """Layouts rewritten one after another from the one shared parse and disassembly
    of the input are byte for byte what a process rewriting only that layout writes."""
    import hashlib
    helpers.require_tool("g++")
    exe = tmp_path / "unwind"
    subprocess.run(["g++", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(os.path.dirname(__file__), "fixtures", "c", "unwind.cc")],
                   check=True)
    from linepack.relayout.driver import relayout
    specs = ("align-all:32", "align-all:8", "align-all:64")
    together = {}
    for s in specs:
        out = tmp_path / f"together-{s[-2:]}"
        relayout(str(exe), str(out), s)
        together[s] = hashlib.sha256(out.read_bytes()).hexdigest()
    assert len(set(together.values())) == 3            # three different layouts
    for s in specs:
        out = tmp_path / f"alone-{s[-2:]}"
        subprocess.run([sys.executable, "-m", "linepack", "relayout", str(exe), "-o", str(out),
                        "--strategy", s], check=True, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
        assert hashlib.sha256(out.read_bytes()).hexdigest() == together[s], s


def test_layouts_disassemble_the_base_once(tmp_path, monkeypatch):
    """evaluate --layout: planning and rewriting several layouts of one base parse
    and disassemble it once in the process (image/shared.py)."""
    helpers.require_tool("g++")
    exe = tmp_path / "unwind"
    subprocess.run(["g++", "-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs", "-o", str(exe),
                    os.path.join(os.path.dirname(__file__), "fixtures", "c", "unwind.cc")],
                   check=True)
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    from linepack.evaluate.layouts import Layouts
    from linepack.image import disasm, elf
    calls = {"disassemble": 0, "parse": 0}
    real_dis, real_init = disasm.disassemble, elf.ElfImage.__init__

    def counting_dis(*a, **k):
        calls["disassemble"] += 1
        return real_dis(*a, **k)

    def counting_init(self, path, *a, **k):
        if os.path.realpath(str(path)) == str(exe.resolve()):
            calls["parse"] += 1
        return real_init(self, path, *a, **k)
    from linepack.image import context
    # the functions (image/context.py) and the sweep of other code (disasm.sweep_sections)
    monkeypatch.setattr(disasm, "disassemble", counting_dis)
    monkeypatch.setattr(context, "disassemble", counting_dis)
    monkeypatch.setattr(elf.ElfImage, "__init__", counting_init)
    L = Layouts(str(exe))
    seen = []
    for spec in ("align-all:32", "align-all:8", "align-all:64"):
        assert L.plan(spec) is not None
        assert os.path.exists(L.image_path(spec))
        seen.append(dict(calls))
    # the functions, and the code outside the laid-out section (.init, .plt, .fini): once each
    assert seen == [{"disassemble": 2, "parse": 1}] * 3, seen


def test_run_cache_is_keyed_by_content(tmp_path, monkeypatch):
    """A job with cache=True runs once; the same inputs again come from the store;
    other program bytes (same path), another repeat number, environment or
    working directory run again."""
    helpers.require_tool("qemu-x86_64")
    helpers.require_tool("gcc")
    from linepack.errors import LinepackError
    from linepack.profile import plugin_build
    from linepack.profile.runner import USER, Plugin, QemuJob, run_job
    from linepack.profile.trace import cache_config
    from linepack.profile import runner
    try:
        so = plugin_build.build_plugin(log=lambda m: None)
    except LinepackError as e:
        pytest.fail(f"the QEMU plugin cannot be built (tools/setup.sh builds it): {e}")
    # a private store of runs; the plugin built above (not rebuilt in that cache)
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(runner, "plugin_so", lambda log=None: so)
    src = tmp_path / "p.c"
    exe = tmp_path / "p"

    def build(n):
        src.write_text("#include <stdio.h>\nint main(void){unsigned s=0;for(int i=0;i<%d;i++)"
                       "s=s*31+i;printf(\"%%u\\n\",s);return 0;}\n" % n)
        subprocess.run(["gcc", "-O1", "-no-pie", "-fno-pie", "-o", str(exe), str(src)], check=True)

    def job(run=0, env=None, cwd=None):
        return QemuJob(USER, str(exe), [Plugin(cache=cache_config("intel-32k-8w"))], mode="user",
                       cache=True, run=run, env=env, cwd=cwd)
    build(1000)
    first = run_job(job())
    again = run_job(job())
    assert not first.cached and again.cached
    assert (again.traces[0].misses, again.stdout) == (first.traces[0].misses, first.stdout)
    assert not run_job(job(run=1)).cached
    # the program's environment and working directory are part of the job
    assert not run_job(job(env={"LC_ALL": "C"})).cached
    assert run_job(job(env={"LC_ALL": "C"})).cached
    assert not run_job(job(cwd=str(tmp_path))).cached
    build(200000)
    other = run_job(job())
    assert not other.cached and other.stdout != first.stdout
