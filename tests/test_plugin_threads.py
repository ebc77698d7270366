"""linepack's QEMU plugin on programs with several threads (qemu-x86_64, user mode).

In user mode every guest thread is a vCPU of its own and the threads run at once.
A pthreads program built here gives each thread the same deterministic work (a
loop calling eight small functions through a table, the choice depending on the
data): the profile of N threads must count exactly N times what one thread
counts in the program's own functions (blocks and edges between them), run after
run, and a profile of threads with different work must equal the sum of the
profiles of each work alone.
"""

import os
import subprocess
import time
from collections import Counter

import numpy as np
import pytest
import helpers

from linepack.profile import trace

PROG = r"""
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#define W(n) __attribute__((noinline)) unsigned long w##n(unsigned long x) { \
    for (int i = 0; i < (int)(x & 7); i++) x = x * 6364136223846793005UL + n; \
    return x ^ (x >> 13); }
W(0) W(1) W(2) W(3) W(4) W(5) W(6) W(7)
typedef unsigned long (*fn)(unsigned long);
static fn tab[8] = {w0, w1, w2, w3, w4, w5, w6, w7};
static pthread_barrier_t bar;
static long iters;
struct job { unsigned long seed, sum; };
__attribute__((noinline)) void *worker(void *p) {
    struct job *j = p;
    unsigned long x = j->seed, s = 0;
    pthread_barrier_wait(&bar);
    for (long i = 0; i < iters; i++) { x = tab[(x >> 7) & 7](x + i); s += x; }
    j->sum = s;
    return NULL;
}
/* thr [-inline|-seq|-fork] ITERS SEED...: one worker per seed
 *   (default) one thread each, all started together (a barrier)
 *   -inline   the main thread runs them: no thread is made
 *   -seq      one thread after another (each joined before the next)
 *   -fork     the main thread runs them, then forks a child that runs them again
 *             once the parent has exited, and prints the child's pid */
int main(int argc, char **argv) {
    const char *how = argc > 1 && argv[1][0] == '-' ? argv[1] : "";
    int o = *how ? 1 : 0;
    int in = !strcmp(how, "-inline") || !strcmp(how, "-fork"), seq = !strcmp(how, "-seq");
    int n = argc - 2 - o;
    iters = atol(argv[1 + o]);
    struct job *jobs = calloc(n, sizeof(*jobs));
    pthread_t *t = calloc(n, sizeof(*t));
    pthread_barrier_init(&bar, NULL, in || seq ? 1 : n);
    for (int k = 0; k < n; k++) {
        jobs[k].seed = strtoul(argv[2 + o + k], NULL, 0);
        if (in) {
            worker(&jobs[k]);
        } else {
            pthread_create(&t[k], NULL, worker, &jobs[k]);
            if (seq) pthread_join(t[k], NULL);
        }
    }
    for (int k = 0; k < n && !in && !seq; k++) pthread_join(t[k], NULL);
    for (int k = 0; k < n; k++) printf("%lu\n", jobs[k].sum);
    if (!strcmp(how, "-fork")) {
        int fd[2];
        char c;
        if (pipe(fd)) return 1;
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            close(fd[1]);
            while (read(fd[0], &c, 1) > 0) {}      /* EOF: the parent has exited */
            for (int k = 0; k < n; k++) worker(&jobs[k]);
            _exit(0);
        }
        printf("child %d\n", (int)pid);
    }
    return 0;
}
"""

FUNCS = [f"w{i}" for i in range(8)] + ["worker"]
ITERS = 100000


@pytest.fixture(scope="module")
def thr(tmp_path_factory):
    helpers.require_tool("qemu-x86_64")
    helpers.require_tool("gcc")
    d = tmp_path_factory.mktemp("threads")
    (d / "thr.c").write_text(PROG)
    subprocess.run(["gcc", "-O1", "-static", "-pthread", "-falign-functions=1", "-o",
                    str(d / "thr"), str(d / "thr.c")], check=True)
    from elftools.elf.elffile import ELFFile
    with open(d / "thr", "rb") as f:
        syms = {s.name: (s["st_value"], s["st_size"]) for s in
                ELFFile(f).get_section_by_name(".symtab").iter_symbols() if s.name in FUNCS}
    assert sorted(syms) == sorted(FUNCS)
    return d / "thr", list(syms.values())


def _mine(addrs, ranges):
    a = np.asarray(addrs, dtype=np.uint64)
    m = np.zeros(len(a), dtype=bool)
    for lo, n in ranges:
        m |= (a >= lo) & (a < lo + n)
    return m


def _run(so, prog, ranges, args, opts=("edges=on",), tmp=None):
    """Plugin run of ``thr args``; (blocks, edges, fetches, misses) of the program's own
    functions (edges: both ends inside them), and the PluginTrace."""
    out = os.path.join(tmp, "o.bin")
    p = subprocess.run(["qemu-x86_64", "-plugin", trace.plugin_option(
        so, [f"out={out}", "mode=user", *opts]), str(prog), *map(str, args)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    t = trace.read_plugin_output(out)
    m = _mine(t.tb_addr, ranges)
    blocks = Counter()
    for a, s, n, c in zip(t.tb_addr[m].tolist(), t.tb_size[m].tolist(), t.tb_insns[m].tolist(),
                          t.tb_execs[m].tolist()):
        blocks[(a, s, n)] += c
    em = _mine(t.edge_src, ranges) & _mine(t.edge_dst, ranges)
    edges = Counter({(s, d): c for s, d, c in zip(t.edge_src[em].tolist(),
                                                  t.edge_dst[em].tolist(),
                                                  t.edge_count[em].tolist())})
    return blocks, edges, (int(t.tb_fetches[m].sum()), int(t.tb_misses[m].sum())), t, p.stdout


def _times(c, n):
    return Counter({k: n * v for k, v in c.items()})


def test_threads_count_n_times_one_thread(plugin_so, thr, tmp_path):
    """4 threads doing the same work at once: 4x one thread's blocks and edges, exactly,
    on every run (the inline counters and the shared edge table lost or corrupted
    counts: 17 to 43 thousand edges where one thread makes 16 thousand, or crashed)."""
    prog, ranges = thr
    b1, e1, _, t1, out1 = _run(plugin_so, prog, ranges, ["-inline", ITERS, 1], tmp=tmp_path)
    assert t1.threads == 1 and sum(b1.values()) > ITERS and len(e1) > 20
    for _ in range(3):
        b4, e4, _, t4, out4 = _run(plugin_so, prog, ranges, [ITERS, 1, 1, 1, 1], tmp=tmp_path)
        assert out4 == out1 * 4
        assert b4 == _times(b1, 4)
        assert e4 == _times(e1, 4)
        # every executed block but each thread's first is an edge's destination
        assert int(t4.tb_execs.sum()) - int(t4.edge_count.sum()) == 5
        assert (t4.threads, t4.threads_peak, t4.approximate) == (5, 5, False)


def test_threads_one_after_another(plugin_so, thr, tmp_path):
    """Threads made one after another (QEMU hands the same vCPU index to each): no edge
    joins one thread's last block to the next thread's first."""
    prog, ranges = thr
    b1, e1, _, _, _ = _run(plugin_so, prog, ranges, ["-inline", ITERS, 3], tmp=tmp_path)
    b3, e3, _, t3, _ = _run(plugin_so, prog, ranges, ["-seq", ITERS, 3, 3, 3], tmp=tmp_path)
    assert b3 == _times(b1, 3) and e3 == _times(e1, 3)
    # each of the 4 threads starts a chain: no edge from an exited thread's last block
    assert int(t3.tb_execs.sum()) - int(t3.edge_count.sum()) == 4
    assert (t3.threads, t3.threads_peak) == (4, 2)


def test_threads_cache_model_per_thread(plugin_so, thr, tmp_path):
    """cache=on: each thread has a cache model of its own, so 4 threads with the same
    work fetch and miss 4x what one thread does in the program's functions."""
    prog, ranges = thr
    opts = ("cache=on", "size=32768", "ways=8", "line=64")
    b1, _, fm1, t1, _ = _run(plugin_so, prog, ranges, [ITERS, 5], opts, tmp=tmp_path)
    assert t1.threads == 2 and fm1[0] > ITERS and fm1[1] > 0
    for _ in range(2):
        b4, _, fm4, t4, _ = _run(plugin_so, prog, ranges, [ITERS, 5, 5, 5, 5], opts, tmp=tmp_path)
        assert b4 == _times(b1, 4)
        assert fm4 == (4 * fm1[0], 4 * fm1[1])
        assert int(t4.tb_fetches.sum()) == t4.fetches and int(t4.tb_misses.sum()) == t4.misses


def test_threads_first_runs_follow_the_tbtrace(plugin_so, thr, tmp_path):
    """With threads, tbtrace= lists every executed block once, and each block's first
    run is where the dump first lists it (one order for both)."""
    prog, ranges = thr
    tbt = tmp_path / "t.bin"
    _, _, _, t, _ = _run(plugin_so, prog, ranges, [20000, 1, 2, 3],
                         ("edges=on", f"tbtrace={tbt}"), tmp=tmp_path)
    tt = trace.read_tbtrace(tbt)
    assert t.threads == 4 and len(tt) == int(t.tb_execs.sum())
    _, at = np.unique(tt["vaddr"], return_index=True)
    want = {int(tt["vaddr"][i]): int(i) for i in at}
    ran = t.tb_first != trace.NO_FIRST
    got = {}
    for a, f in zip(t.tb_addr[ran].tolist(), t.tb_first[ran].tolist()):
        got[a] = min(f, got.get(a, f))
    assert got == want


def test_threads_window_is_approximate(plugin_so, thr, tmp_path):
    """start=/stop= with several threads cannot be exact (one thread opens the window
    for all): the output says so; the same window with one thread does not."""
    prog, ranges = thr
    from elftools.elf.elffile import ELFFile
    with open(prog, "rb") as f:
        w = {s.name: s["st_value"] for s in ELFFile(f).get_section_by_name(".symtab")
             .iter_symbols() if s.name == "worker"}["worker"]
    opts = ("edges=on", f"start={w:#x}")
    _, _, _, t, _ = _run(plugin_so, prog, ranges, [1000, 1, 2], opts, tmp=tmp_path)
    assert t.threads == 3 and t.approximate
    _, _, _, t, _ = _run(plugin_so, prog, ranges, ["-inline", 1000, 1, 2], opts, tmp=tmp_path)
    assert t.threads == 1 and not t.approximate and t.roi["started"]


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_fork_child_leaves_the_profile_alone(plugin_so, thr, tmp_path):
    """A fork() child inherits the plugin's state; when it exits after the parent it
    must not replace the parent's profile with its own."""
    prog, ranges = thr
    b1, e1, _, _, _ = _run(plugin_so, prog, ranges, ["-inline", ITERS, 7], tmp=tmp_path)
    bf, ef, _, t, out = _run(plugin_so, prog, ranges, ["-fork", ITERS, 7], tmp=tmp_path)
    pid = int(out.split("child ")[1])
    deadline = time.monotonic() + 120
    while not _gone(pid):
        assert time.monotonic() < deadline, "the forked child did not finish"
        time.sleep(0.05)
    t2 = trace.read_plugin_output(tmp_path / "o.bin")
    assert int(t2.tb_execs.sum()) == int(t.tb_execs.sum())      # the file was not replaced
    assert bf == b1 and ef == e1


def test_profile_of_threads_is_the_sum_of_their_profiles(plugin_so, thr, tmp_path):
    """`profile --program` of three threads with different work gives relayout the
    same input as the three works profiled one at a time, summed: per function of the
    program its calls, blocks and instructions, per block its count, and the edges."""
    from linepack.cli import main
    from linepack.profile.model import Profile
    import contextlib
    import io
    prog, ranges = thr

    def profile(name, *args):
        out = tmp_path / f"{name}.lpprof"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["profile", "--program", str(prog), "--output", str(out), "--",
                         *map(str, args)]) == 0
        return Profile.load(str(out)), buf.getvalue()

    def view(p):
        f = _mine(p.func_addr, ranges)
        funcs = {a: (e, b, i) for a, e, b, i in zip(
            p.func_addr[f].tolist(), p.func_entries[f].tolist(), p.func_blocks[f].tolist(),
            p.func_insns[f].tolist())}
        b = _mine(p.block_addr, ranges)
        blocks = Counter(dict(zip(zip(p.block_addr[b].tolist(), p.block_size[b].tolist()),
                                  p.block_count[b].tolist())))
        e = _mine(p.edge_from, ranges) & _mine(p.edge_to, ranges)
        edges = Counter(dict(zip(zip(p.edge_from[e].tolist(), p.edge_to[e].tolist()),
                                 p.edge_count[e].tolist())))
        return funcs, blocks, edges

    parts = [view(profile(f"s{s}", ITERS, s)[0]) for s in (1, 2, 3)]
    whole, line = profile("all", ITERS, 1, 2, 3)
    assert "4 threads summed" in line
    assert whole.meta["threads"] == 4
    funcs, blocks, edges = view(whole)
    want_funcs = {}
    for pf, _, _ in parts:
        for a, v in pf.items():
            want_funcs[a] = tuple(x + y for x, y in zip(want_funcs.get(a, (0, 0, 0)), v))
    assert funcs == want_funcs and len(funcs) == len(FUNCS)
    assert blocks == sum((pb for _, pb, _ in parts), Counter())
    assert edges == sum((pe for _, _, pe in parts), Counter())
    single, line = profile("one", "-inline", ITERS, 1)     # no thread made: nothing said
    assert "threads" not in single.meta and "threads summed" not in line
    assert view(single) == parts[0][:1] + view(single)[1:]   # same per-function counts
