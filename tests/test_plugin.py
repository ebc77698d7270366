"""linepack's QEMU TCG plugin: build, output reader, cache model, real kernel boots.

The cache model is checked against a small Python LRU reference: a static user
program runs under qemu-x86_64 (user mode) with ``tbtrace=`` (every executed
block, in order); Python decodes each block's instructions with Capstone from
the ELF, derives the line sequence independently, replays it through an LRU
model and must match the plugin's totals and per-block counts exactly.
"""

import os
import struct
import subprocess
from collections import Counter, OrderedDict

import numpy as np
import pytest
import helpers

from linepack.errors import BadInput, LinepackError
from linepack.profile import plugin_build, trace

HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------- build, reader, configs

def test_build_is_idempotent(plugin_so):
    st = os.stat(plugin_so)
    again = plugin_build.build_plugin(log=lambda m: None)
    assert again == plugin_so
    assert os.stat(again).st_mtime_ns == st.st_mtime_ns      # not rebuilt
    assert plugin_build.header_api_version(plugin_build.fetch_header()) == 1


def test_build_plugin_verb(plugin_so):
    from linepack.cli import main
    import io
    import contextlib
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["build-plugin"]) == 0
    assert out.getvalue().strip() == plugin_so


def _fake_output(tmp_path, tbs=(), edges=(), fetches=0, misses=0, flags=1, version=1,
                 vcpus=(1, 1)):
    hsize = 144 if version >= 3 else 128
    hdr = bytearray(hsize)
    hdr[0:8] = b"LPKTRACE"
    struct.pack_into("<IIIIIIIII", hdr, 8, version, hsize, 40 if version == 1 else 48, 32, flags,
                     0, 32768, 8, 64)
    struct.pack_into("<QQQQ", hdr, 48, len(tbs), len(edges), fetches, misses)
    if version >= 3:
        struct.pack_into("<QQ", hdr, 128, *vcpus)
    body = b"".join(struct.pack("<QIIQQQ" if version == 1 else "<QIIQQQQ", *t) for t in tbs)
    body += b"".join(struct.pack("<QQQII", *e) for e in edges)
    p = tmp_path / "t.bin"
    p.write_bytes(bytes(hdr) + body)
    return p


def test_reader_roundtrip_and_errors(tmp_path):
    p = _fake_output(tmp_path, tbs=[(0xffffffff81000000, 16, 4, 10, 3, 1),
                                    (0xffffffff81000010, 8, 2, 5, 1, 0)],
                     edges=[(0xffffffff8100000c, 0xffffffff81000010, 5, 4, 1)], fetches=4, misses=1)
    t = trace.read_plugin_output(p)
    assert t.kernel_instructions == 4 * 10 + 2 * 5
    assert t.tb_addr.dtype == np.uint64 and list(t.tb_execs) == [10, 5]
    assert list(t.edge_count) == [5] and t.edge_flags[0] == trace.EDGE_FALLTHROUGH
    assert t.cache == {"size": 32768, "ways": 8, "line": 64} and (t.fetches, t.misses) == (4, 1)
    data = p.read_bytes()
    for bad in (data[:100], data[:-1], b"XXXXXXXX" + data[8:]):
        p.write_bytes(bad)
        with pytest.raises(BadInput):
            trace.read_plugin_output(p)
    with pytest.raises(BadInput):
        trace.read_plugin_output(tmp_path / "missing.bin")
    assert t.tb_first is None                      # version 1: 40-byte records, no first runs


def test_reader_version_2_first_runs(tmp_path):
    none = int(trace.NO_FIRST)
    p = _fake_output(tmp_path, tbs=[(0xffffffff81000000, 16, 4, 10, 3, 1, 7),
                                    (0xffffffff81000010, 8, 2, 0, 0, 0, none),
                                    (0xffffffff81000020, 8, 2, 5, 1, 0, 0)], version=2)
    t = trace.read_plugin_output(p)
    assert t.tb_first.tolist() == [7, none, 0] and list(t.tb_execs) == [10, 0, 5]
    p = _fake_output(tmp_path, tbs=[(0xffffffff81000000, 16, 4, 10, 3, 1, none)], version=2)
    assert trace.read_plugin_output(p).tb_first is None    # no per-block helper ran
    assert t.threads == 1 and not t.approximate             # version 2: no vCPU counts
    p = _fake_output(tmp_path, tbs=[(0xffffffff81000000, 16, 4, 10, 3, 1, 0)], version=4)
    with pytest.raises(BadInput, match="version 4"):
        trace.read_plugin_output(p)


def test_reader_version_3_threads(tmp_path):
    tbs = [(0x401000, 16, 4, 10, 3, 1, 0)]
    p = _fake_output(tmp_path, tbs=tbs, version=3, vcpus=(5, 3),
                     flags=1 | trace.FLAG_THREADS | trace.FLAG_APPROX)
    t = trace.read_plugin_output(p)
    assert (t.threads, t.threads_peak, t.approximate) == (5, 3, True)
    assert list(t.tb_execs) == [10] and t.tb_first.tolist() == [0]
    p = _fake_output(tmp_path, tbs=tbs, version=3)
    t = trace.read_plugin_output(p)
    assert (t.threads, t.threads_peak, t.approximate) == (1, 1, False)
    data = p.read_bytes()
    p.write_bytes(data[:140])                      # a version 3 header cut short
    with pytest.raises(BadInput, match="truncated"):
        trace.read_plugin_output(p)


def test_cache_configs():
    names = trace.list_cache_configs()
    assert {"intel-32k-8w", "amd-64k-2w", "zen-32k-8w"} <= set(names)
    intel = trace.cache_config("intel-32k-8w")
    assert (intel["size"], intel["ways"], intel["line"], intel["sets"]) == (32768, 8, 64, 64)
    amd = trace.cache_config("amd-64k-2w")
    assert (amd["size"], amd["ways"], amd["line"], amd["sets"]) == (65536, 2, 64, 512)
    args = trace.plugin_args("/tmp/x.bin", cache="amd-64k-2w", edges=True, start=0x10)
    assert args == ["out=/tmp/x.bin", "mode=kernel", "cache=on", "size=65536", "ways=2",
                    "line=64", "edges=on", "start=0x10"]
    with pytest.raises(BadInput):
        trace.cache_config("no-such-cache")
    nlp = trace.plugin_args("/tmp/x.bin", cache="intel-32k-8w-nlp")
    assert nlp[2:] == ["cache=on", "size=32768", "ways=8", "line=64", "prefetch=on"]
    l2 = trace.plugin_args("/tmp/x.bin", cache="l2-2m-16w")
    assert l2[2:] == ["cache=on", "size=32768", "ways=8", "line=64", "l2size=2097152", "l2ways=16"]
    for name, entries, page in (("itlb-4k", 128, 4096), ("itlb-2m", 8, 2 << 20)):
        c = trace.cache_config(name)
        assert c["kind"] == "itlb" and c["line"] == page and c["size"] // page == entries
    from linepack.evaluate.cachemodel import CacheState
    with pytest.raises(BadInput, match="booted"):
        CacheState(trace.cache_config("l2-1m-16w"))
    CacheState(trace.cache_config("itlb-2m"))          # a plain LRU: the what-if replays it


def test_bad_cache_config(tmp_path):
    p = tmp_path / "odd.toml"
    p.write_text("size = 24576\nways = 8\nline = 64\n")   # 48 sets: not a power of two
    with pytest.raises(BadInput):
        trace.cache_config(str(p))
    for text in ("size = 32768\nways = 8\nline = 64\nl2_size = 100000\n",
                 "size = 32768\nways = 8\nline = 64\nprefetch = 'stream'\n",
                 "size = 32768\nways = 8\nline = 64\nprefetch = 'next-line'\nl2_size = 1048576\n"):
        p.write_text(text)
        with pytest.raises(BadInput):
            trace.cache_config(str(p))


# ---------------------------------------------------------------- user mode: exact reference

PROG = r"""
#include <stdio.h>
#include <stdlib.h>
#define F(n) __attribute__((noinline)) unsigned long f##n(unsigned long x) { \
    for (int i = 0; i < (int)(x & 7); i++) x = x * 6364136223846793005UL + n; \
    return x ^ (x >> 13); }
F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
typedef unsigned long (*fn)(unsigned long);
static fn tab[16] = {f0,f1,f2,f3,f4,f5,f6,f7,f8,f9,f10,f11,f12,f13,f14,f15};
__attribute__((noinline)) void roi_begin(void) { __asm__ volatile(""); }
__attribute__((noinline)) void roi_end(void) { __asm__ volatile(""); }
int main(int argc, char **argv) {
    unsigned long x = argc, s = 0;
    int n = argc > 1 ? atoi(argv[1]) : 20000;
    roi_begin();
    for (int i = 0; i < n; i++) { x = tab[(x >> 7) & 15](x + i); s += x; }
    roi_end();
    printf("%lu\n", s);
    return 0;
}
"""


@pytest.fixture(scope="session")
def user_prog(tmp_path_factory):
    helpers.require_tool("qemu-x86_64")
    helpers.require_tool("gcc")
    d = tmp_path_factory.mktemp("userprog")
    (d / "prog.c").write_text(PROG)
    # -falign-functions=1: functions start anywhere, so instructions straddle lines
    subprocess.run(["gcc", "-O1", "-static", "-falign-functions=1", "-o", str(d / "prog"),
                    str(d / "prog.c")], check=True)
    return d / "prog"


def _run_user(so, prog, args, n=20000):
    p = subprocess.run(["qemu-x86_64", "-plugin", trace.plugin_option(so, args), str(prog), str(n)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return p


class _Code:
    """Instruction decoding of a static (non-PIE) executable, from its file."""

    def __init__(self, path):
        import capstone
        from elftools.elf.elffile import ELFFile
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.segs = [(s["p_vaddr"], s.data()) for s in elf.iter_segments()
                         if s["p_type"] == "PT_LOAD"]
            self.syms = {s.name: s["st_value"] for s in elf.get_section_by_name(".symtab")
                         .iter_symbols() if s.name}
        self.md = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)

    def insns(self, va, size, n):
        for base, data in self.segs:
            if base <= va < base + len(data):
                # Only instructions wholly inside the block: QEMU 7.2 may list a
                # phantom page-crossing last instruction, which the plugin drops.
                return [(a, ln) for a, ln, _, _ in
                        self.md.disasm_lite(data[va - base:va - base + size], va, n)]
        raise AssertionError(f"block {va:#x} is outside the program")


def _lru(sets, nsets, ways, li):
    """Access li in a list of OrderedDict sets; True on a miss (li becomes MRU)."""
    s = sets[li % nsets]
    if li in s:
        s.move_to_end(li)
        return False
    s[li] = True
    if len(s) > ways:
        s.popitem(last=False)
    return True


def _reference(code, tt, size, ways, line, prefetch=False, l2=None):
    """Python LRU replay of the executed blocks: fetches, misses, per-block, edges.

    prefetch: every fetch of line L also fills L+1 (MRU unless present, uncounted);
    l2: (size, ways) of a second level that L1 misses look up; misses are then L2 misses.
    """
    nsets = size // (ways * line)
    keys = list(zip(tt["vaddr"].tolist(), tt["size"].tolist(), tt["ninsns"].tolist()))
    info = {}
    for k in set(keys):
        ins = code.insns(*k)
        lines = []
        for a, ln in ins:
            for li in range(a // line, (a + ln - 1) // line + 1):
                if not lines or lines[-1] != li:
                    lines.append(li)
        info[k] = (lines, (k[0], sum(ln for _, ln in ins), len(ins)), ins[-1])
    sets = [OrderedDict() for _ in range(nsets)]
    if l2:
        l2sets_n = l2[0] // (l2[1] * line)
        l2sets = [OrderedDict() for _ in range(l2sets_n)]
    last = None
    fetches = misses = 0
    per = {}
    edges = Counter()
    prev = None
    for k in keys:
        lines, outkey, last_insn = info[k]
        f = m = 0
        for li in lines:
            if li == last:
                continue
            last = li
            f += 1
            miss = _lru(sets, nsets, ways, li)
            if prefetch:
                s = sets[(li + 1) % nsets]
                if li + 1 not in s:
                    s[li + 1] = True
                    if len(s) > ways:
                        s.popitem(last=False)
            if miss and l2:
                miss = _lru(l2sets, l2sets_n, l2[1], li)
            m += miss
        fetches += f
        misses += m
        p = per.setdefault(outkey, [0, 0, 0])
        p[0] += 1
        p[1] += f
        p[2] += m
        if prev is not None:
            edges[(prev[0], k[0])] += 1
        prev = last_insn
    return fetches, misses, per, edges


@pytest.mark.parametrize("geom", [(1024, 2, 64), (2048, 4, 32), (32768, 8, 64),
                                  (1024, 2, 64, "prefetch"), (2048, 4, 32, "prefetch"),
                                  (512, 2, 64, (2048, 4)), (1024, 2, 32, (4096, 16)),
                                  (4 * 4096, 2, 4096)])      # an iTLB: 4 entries of 4 KiB pages
def test_cache_model_matches_python_lru(plugin_so, user_prog, tmp_path, geom):
    size, ways, line = geom[:3]
    prefetch = len(geom) > 3 and geom[3] == "prefetch"
    l2 = geom[3] if len(geom) > 3 and isinstance(geom[3], tuple) else None
    extra = (["prefetch=on"] if prefetch else []) + \
        ([f"l2size={l2[0]}", f"l2ways={l2[1]}"] if l2 else [])
    out, tbt = tmp_path / "o.bin", tmp_path / "t.bin"
    _run_user(plugin_so, user_prog, [f"out={out}", "mode=user", "cache=on", f"size={size}",
                                     f"ways={ways}", f"line={line}", "edges=on", f"tbtrace={tbt}",
                                     *extra])
    t = trace.read_plugin_output(out)
    tt = trace.read_tbtrace(tbt)
    assert t.cache.get("prefetch") == ("next-line" if prefetch else None)
    assert t.cache.get("l2", False) == bool(l2)
    fetches, misses, per, edges = _reference(_Code(user_prog), tt, size, ways, line,
                                             prefetch=prefetch, l2=l2)
    assert (t.fetches, t.misses) == (fetches, misses)
    assert 0 < t.misses < t.fetches
    got = {(int(a), int(s), int(n)): [int(e), int(f), int(m)] for a, s, n, e, f, m in
           zip(t.tb_addr, t.tb_size, t.tb_insns, t.tb_execs, t.tb_fetches, t.tb_misses)}
    assert got == per
    assert int(t.tb_fetches.sum()) == t.fetches and int(t.tb_misses.sum()) == t.misses
    got_edges = {(int(s), int(d)): int(c) for s, d, c in zip(t.edge_src, t.edge_dst, t.edge_count)}
    assert got_edges == dict(edges)
    assert t.kernel_instructions == sum(v[0] * k[2] for k, v in per.items())


def test_counts_only_agree_with_full_run(plugin_so, user_prog, tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    _run_user(plugin_so, user_prog, [f"out={a}", "mode=user"])
    _run_user(plugin_so, user_prog, [f"out={b}", "mode=user", "cache=on", "edges=on"])
    ta, tb = trace.read_plugin_output(a), trace.read_plugin_output(b)
    assert ta.kernel_instructions == tb.kernel_instructions > 100_000
    assert ta.fetches == 0 and ta.cache == {} and not ta.edges_recorded and len(ta.edge_src) == 0
    # deterministic output: the same run gives the same bytes
    c = tmp_path / "c.bin"
    _run_user(plugin_so, user_prog, [f"out={c}", "mode=user"])
    assert a.read_bytes() == c.read_bytes()


def test_region_of_interest(plugin_so, user_prog, tmp_path):
    code = _Code(user_prog)
    start, stop = code.syms["roi_begin"], code.syms["roi_end"]
    full, roi, tbt = tmp_path / "full.bin", tmp_path / "roi.bin", tmp_path / "t.bin"
    _run_user(plugin_so, user_prog, [f"out={full}", "mode=user", "cache=on"])
    _run_user(plugin_so, user_prog, [f"out={roi}", "mode=user", "cache=on", f"start={start:#x}",
                                     f"stop={stop:#x}", f"tbtrace={tbt}"])
    tf, tr = trace.read_plugin_output(full), trace.read_plugin_output(roi)
    assert tr.roi == {"start": start, "stop": stop, "start_count": 1, "stop_count": 1,
                      "started": True, "stopped": True}
    assert 0 < tr.kernel_instructions < tf.kernel_instructions
    assert 0 < tr.fetches < tf.fetches
    # the window holds exactly the loop: every block executed in it was traced
    tt = trace.read_tbtrace(tbt)
    assert int(tr.tb_execs.sum()) == len(tt)
    executed = tr.tb_addr[tr.tb_execs > 0]
    f_lo = min(code.syms[f"f{i}"] for i in range(16))
    assert executed.min() >= min(f_lo, code.syms["main"])
    # roughly 20000 calls of f0..f15 inside the window
    in_f = sum(int(e) for a, e in zip(tr.tb_addr, tr.tb_execs) if a == code.syms["f3"])
    assert 500 < in_f < 3000


def test_first_runs_are_the_tbtrace_positions(plugin_so, user_prog, tmp_path):
    """Each block's first run in the window is where tbtrace= first lists it; a
    counts-only run records none."""
    code = _Code(user_prog)
    start, stop = code.syms["roi_begin"], code.syms["roi_end"]
    out, tbt, plain = tmp_path / "o.bin", tmp_path / "t.bin", tmp_path / "c.bin"
    _run_user(plugin_so, user_prog, [f"out={out}", "mode=user", "edges=on", f"start={start:#x}",
                                     f"stop={stop:#x}", f"tbtrace={tbt}"])
    t, tt = trace.read_plugin_output(out), trace.read_tbtrace(tbt)
    _, at = np.unique(tt["vaddr"], return_index=True)
    want = {int(tt["vaddr"][i]): int(i) for i in at}
    ran = t.tb_first != trace.NO_FIRST
    got = {}
    for a, f in zip(t.tb_addr[ran].tolist(), t.tb_first[ran].tolist()):
        got[a] = min(f, got.get(a, f))
    assert got == want and len(got) > 20
    assert (ran == (t.tb_execs > 0)).all()       # ran in the window <=> counted there
    # the loop calls f0..f15 in a data-dependent order: their first runs say which first
    order = sorted(range(16), key=lambda i: want[code.syms[f"f{i}"]])
    assert order != list(range(16))
    _run_user(plugin_so, user_prog, [f"out={plain}", "mode=user"])
    assert trace.read_plugin_output(plain).tb_first is None


def test_unknown_argument_is_an_error(plugin_so, user_prog, tmp_path):
    for bad in ("bogus=1", "cache=maybe", "mode=kern", "ways=3", "size=1000", "l2size=1000",
                "prefetch=maybe", "line=4194304", "prefetch=on,l2size=65536"):
        p = subprocess.run(["qemu-x86_64", "-plugin", f"{plugin_so},out={tmp_path}/x.bin,{bad}",
                            str(user_prog), "10"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, timeout=60)
        assert p.returncode != 0, bad
        assert "linepack plugin:" in p.stderr, (bad, p.stderr)
    p = subprocess.run(["qemu-x86_64", "-plugin", f"{plugin_so},mode=user", str(user_prog), "10"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert p.returncode != 0 and "out=" in p.stderr


# ---------------------------------------------------------------- the real kernel

INIT_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
#include <sys/reboot.h>
#include <sys/syscall.h>
int main(void) {
    long s = 0;
    for (int i = 0; i < 20000; i++) {
        s += syscall(SYS_getpid);
        int fd = open("/init", O_RDONLY);
        if (fd >= 0) close(fd);
    }
    printf("linepack-result mini s=%ld\n", s);
    fflush(stdout);
    reboot(RB_POWER_OFF);
    return 0;
}
"""


@pytest.fixture(scope="session")
def vmlinux():
    from linepack import targets
    try:
        return targets.debian_vmlinux(helpers.debian_abi())
    except LinepackError as e:
        pytest.fail(f"Debian vmlinux not available (tools/setup.sh fetches it): {e}")


@pytest.fixture(scope="session")
def boot(vmlinux, tmp_path_factory):
    """boot(plugin_args: dict) -> serial text; VFS-mix through linepack.profile.qemu if it
    is there, else a minimal getpid/open/close /init booted by hand."""
    helpers.require_tool("qemu-system-x86_64")
    run_workload = None
    if not os.environ.get("LINEPACK_TEST_MINI_INIT"):    # set to test the fallback path
        try:
            from linepack.profile.qemu import run_workload
        except ImportError:
            pass
    if run_workload is not None:
        def run(so, args, loops=1000):
            return run_workload(vmlinux, "vfs-mix", loops=loops, icount=True, plugin=so,
                                plugin_args=args, timeout=900).serial
        return run

    d = tmp_path_factory.mktemp("mini-init")
    (d / "init.c").write_text(INIT_C)
    subprocess.run(["gcc", "-O2", "-static", "-o", str(d / "init"), str(d / "init.c")], check=True)
    cpio = subprocess.run(["cpio", "-o", "-H", "newc", "--reproducible"], input=b"init\n",
                          cwd=d, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True)
    (d / "init.cpio").write_bytes(cpio.stdout)

    def run(so, args, loops=None):
        opt = ",".join([so] + [f"{k}={v}" for k, v in (args or {}).items()])
        cmd = ["qemu-system-x86_64", "-m", "512", "-nographic", "-no-reboot", "-smp", "1",
               "-icount", "shift=0,sleep=off", "-rtc", "base=2020-01-01T00:00:00,clock=vm",
               "-kernel", vmlinux, "-initrd", str(d / "init.cpio"),
               "-append", "console=ttyS0 rdinit=/init panic=-1 quiet", "-plugin", opt]
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, timeout=900)
        out = p.stdout.decode(errors="replace")
        assert p.returncode == 0 and "linepack-result" in out, p.stderr.decode()[-500:]
        return out
    return run


def _exec_sections(vmlinux):
    from elftools.elf.elffile import ELFFile
    with open(vmlinux, "rb") as f:
        elf = ELFFile(f)
        return {s.name: (s["sh_addr"], s["sh_addr"] + s["sh_size"]) for s in elf.iter_sections()
                if s["sh_flags"] & 4 and s["sh_size"]}


@pytest.mark.qemu
@pytest.mark.realkernel
def test_boot_with_plugin(plugin_so, boot, vmlinux, tmp_path):
    out = tmp_path / "boot.bin"
    boot(plugin_so, {"out": out, "cache": "on", "size": 32768, "ways": 8, "line": 64,
                     "edges": "on", "stop": hex(trace.reboot_marker(vmlinux))})
    t = trace.read_plugin_output(out)
    assert t.roi["stopped"] and not t.roi["start"]
    insns = t.kernel_instructions
    assert insns > 1e8
    assert 0 < t.misses <= t.fetches
    assert np.all(t.tb_misses <= t.tb_fetches)
    assert int(t.tb_fetches.sum()) == t.fetches and int(t.tb_misses.sum()) == t.misses
    assert np.all(t.tb_addr >= 0xffff800000000000)            # kernel mode only
    # every executed block lies in executable sections of the vmlinux, mostly in .text
    secs = _exec_sections(vmlinux)
    w = t.tb_insns.astype(np.uint64) * t.tb_execs
    inside = np.zeros(len(t.tb_addr), bool)
    for lo, hi in secs.values():
        inside |= (t.tb_addr >= lo) & (t.tb_addr + t.tb_size <= hi)
    assert w[inside].sum() >= 0.9999 * insns, [hex(a) for a in t.tb_addr[~inside][:10]]
    lo, hi = secs[".text"]
    assert w[(t.tb_addr >= lo) & (t.tb_addr < hi)].sum() > 0.5 * insns
    # edges: as many transitions as block executions, give or take the user-mode gaps
    assert t.edges_recorded and len(t.edge_src) > 1000
    assert 0.5 * t.block_executions < int(t.edge_count.sum()) <= t.block_executions
    assert np.all(t.tb_addr[1:] >= t.tb_addr[:-1])              # sorted by address
    assert np.all(t.edge_src[1:] >= t.edge_src[:-1])


@pytest.mark.qemu
@pytest.mark.realkernel
@pytest.mark.slow
def test_icount_runs_repeat(plugin_so, boot, vmlinux, tmp_path):
    # stop= at reboot(): the power-off tail after it runs for a host-timed while
    stop = hex(trace.reboot_marker(vmlinux))
    res = []
    for i in range(2):
        out = tmp_path / f"r{i}.bin"
        boot(plugin_so, {"out": out, "cache": "on", "size": 32768, "ways": 8, "line": 64,
                         "edges": "on", "stop": stop})
        t = trace.read_plugin_output(out)
        res.append((t.kernel_instructions, t.misses, t.fetches))
    (i0, m0, f0), (i1, m1, f1) = res
    di, dm = abs(i0 - i1) / i0, abs(m0 - m1) / max(m0, 1)
    print(f"\nicount repeatability: instructions {i0} vs {i1} ({di:.2e}), "
          f"misses {m0} vs {m1} ({dm:.2e}), fetches {f0} vs {f1}")
    assert di <= 1e-5 and dm <= 1e-5          # the 0.001 %


@pytest.mark.qemu
@pytest.mark.realkernel
def test_kernel_region_of_interest(plugin_so, boot, vmlinux, tmp_path):
    """A window between executions of a syscall handler both workloads call every loop."""
    from linepack.image.elf import ElfImage
    close = ElfImage(vmlinux).symbol_address("__x64_sys_close")
    assert close
    res = {}
    for hits in (20, 40):
        out = tmp_path / f"roi{hits}.bin"
        boot(plugin_so, {"out": out, "cache": "on", "size": 32768, "ways": 8, "line": 64,
                         "start": hex(close), "stop": hex(close), "start_count": 201,
                         "stop_count": hits})
        t = trace.read_plugin_output(out)
        assert t.roi["started"] and t.roi["stopped"] and t.roi["start_count"] == 201
        res[hits] = t
    a, b = res[20], res[40]
    print(f"\nROI window of 20 close() calls: {a.kernel_instructions} instructions, "
          f"{a.fetches} fetches, {a.misses} misses; 40 calls: {b.kernel_instructions}, "
          f"{b.fetches}, {b.misses}")
    assert 1e4 < a.kernel_instructions < 1e8
    assert 1.8 < b.kernel_instructions / a.kernel_instructions < 2.2
    assert 0 < a.misses <= a.fetches and b.misses <= b.fetches
    assert b.fetches > a.fetches
