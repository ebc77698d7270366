"""linepack against BOLT 19 on real userspace programs, same binary, same profile.

    python3 tests/bench/bench_userspace_bolt.py [--program lua|zstd|sqlite] [--pie]
        [--work DIR] [--reps 3] [--placements N] [--lock FILE] [--no-cross] [--cost-only]
        [--no-cost]

1. A real program from Debian's source package (``apt-get source``, cached under
   ~/.cache/linepack/userspace), built as people build it: its default flags (gcc's
   default PIE code), ``-Wl,--emit-relocs``, linked ``-no-pie`` or (``--pie``) ``-pie``,
   nothing else (a layout that does not fit goes to a new segment: docs/userspace.md):
   - ``lua``: lua 5.4 (``-O2``), a Lua script (sort, string patterns, gsub, closures,
     coroutines, pcall); cross-input: a second script (objects, string building,
     closures, table.insert/remove);
   - ``zstd``: zstd 1.5.4's CLI by its own Makefile (``-O3``, its Huffman assembly),
     its benchmark mode ``zstd -q -b3 -i0 FILE`` on zstd's own lib sources (2.25 MB of
     C); cross-input: the zstd executable itself (a binary file);
   - ``sqlite``: SQLite 3.40's own benchmark, ``speedtest1 --memdb --size 2``, over the
     amalgamation (``-O2``); cross-input: ``--testset orm``.
2. The training input runs under qemu-x86_64 with linepack's plugin: the profile
   (exported as BOLT .fdata too).
3. Layouts: linepack ``pack`` and ``blocks``; BOLT at its best: its own profile, made
   by its instrumentation (``llvm-bolt -instrument``, the instrumented program run
   natively on the training input), and its best flags: functions only
   (``-reorder-functions=cdsort -reorder-blocks=none``) and full
   (``-reorder-blocks=ext-tsp -reorder-functions=cdsort -split-functions
   -split-all-cold -split-eh``); and BOLT full fed linepack's exported ``.fdata``.
4. ``verify --against`` on both linepack outputs; every output run natively on both
   inputs: stdout (timings masked) and exit status as the original's.
5. Tool cost: medians of ``--reps`` rounds of relayout blocks + verify --against
   (two commands), ``relayout blocks --verify`` (one command, the same checks) and
   llvm-bolt full, interleaved (wall seconds, peak RSS, CPU seconds); linepack's
   modules run from compiled bytecode, as installed, its C cores already built
   (use_bytecode_cache), by the console script installed beside this interpreter
   (linepack_script: not pyenv's shim); the machine's load average before and after
   the rounds is printed with them (on a shared machine the ratios follow it).
6. ``evaluate --program`` (evaluate_programs) on each input with the intel-32k-8w and
   amd-64k-2w models, ``--reps`` repeats at each of ``--placements`` libc placements
   (default evaluate's: 8, the distinct ones of amd-64k-2w's 32 KiB way): L1i misses of
   every user-mode fetch, the mean over placements and their least and most. With
   ``--lock FILE`` only these QEMU runs hold an exclusive flock on FILE. ``--no-cost``
   skips step 5 (and times each rewrite once).

Prints the evaluate command lines and markdown tables.
"""

import argparse
import contextlib
import fcntl
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

LUA_SCRIPT = r'''
-- linepack userspace workload: one deterministic result line
local t = {}
for i = 1, 20000 do t[i] = (i * 7919) % 10007 end
table.sort(t)
local s = 0
for i = 1, #t do s = s + t[i] end
local words = {}
for w in string.gmatch(string.rep("the quick brown fox jumps over the lazy dog ", 2000), "%a+") do
  words[w] = (words[w] or 0) + 1
end
local keys = {}
for k in pairs(words) do keys[#keys + 1] = k end
table.sort(keys)
local parts = {}
for _, k in ipairs(keys) do parts[#parts + 1] = string.format("%s=%d", k, words[k]) end
local function fib(n) if n < 2 then return n end return fib(n - 1) + fib(n - 2) end
local co = coroutine.wrap(function() for i = 1, 3000 do coroutine.yield(i) end end)
local cs = 0
for i = 1, 3000 do cs = cs + co() end
local str = string.rep("abc", 3000):gsub("b", "xy"):upper()
local ok, err = pcall(function() error("boom") end)
local mt = setmetatable({}, {__index = function(_, k) return k * 2 end})
local ms = 0
for i = 1, 5000 do ms = ms + mt[i] end
print(s, table.concat(parts, ","), fib(22), cs, #str, ok, err, ms)
'''

CFLAGS = ["-O2", "-DLUA_COMPAT_5_3", "-DLUA_USE_LINUX"]
LDFLAGS = ["-no-pie", "-Wl,--emit-relocs"]
BOLT = "llvm-bolt-19"
# BOLT's best: ext-TSP block order, cdsort function order, hot/cold splitting (EH too)
BOLT_FULL = ["-reorder-blocks=ext-tsp", "-reorder-functions=cdsort", "-split-functions",
             "-split-all-cold", "-split-eh", "-dyno-stats"]
BOLT_FUNCS = ["-reorder-functions=cdsort", "-reorder-blocks=none", "-dyno-stats"]
MODELS = ["intel-32k-8w", "amd-64k-2w"]


def cache_root():
    try:
        from linepack.targets import cache_dir
        return os.path.join(cache_dir(), "userspace")
    except Exception:   # noqa: BLE001
        return os.path.expanduser("~/.cache/linepack/userspace")


def lua_source(log=print):
    """Directory of Debian's lua5.4 source tree (downloaded once with apt-get source)."""
    root = cache_root()
    found = sorted(glob.glob(os.path.join(root, "lua5.4-*", "src", "lvm.c")))
    if found:
        return os.path.dirname(os.path.dirname(found[-1]))
    os.makedirs(root, exist_ok=True)
    log("apt-get source lua5.4")
    p = subprocess.run(["apt-get", "source", "lua5.4"], cwd=root, capture_output=True, text=True)
    found = sorted(glob.glob(os.path.join(root, "lua5.4-*", "src", "lvm.c")))
    if p.returncode != 0 or not found:
        raise RuntimeError(f"apt-get source lua5.4 failed: {p.stderr.strip()[-300:]}")
    return os.path.dirname(os.path.dirname(found[-1]))


PIE_CFLAGS = ["-O2", "-fpie", "-DLUA_COMPAT_5_3", "-DLUA_USE_LINUX"]
PIE_LDFLAGS = ["-pie", "-Wl,--emit-relocs"]


def build_lua(out_dir, src=None, log=print, pie=False):
    """Build lua (non-PIE, or PIE with ``pie``; --emit-relocs) into out_dir; returns its path."""
    src = src or lua_source(log)
    cflags, ldflags = (PIE_CFLAGS, PIE_LDFLAGS) if pie else (CFLAGS, LDFLAGS)
    obj = os.path.join(out_dir, "obj")
    os.makedirs(obj, exist_ok=True)
    with open(os.path.join(obj, "lua5.4-deb-multiarch.h"), "w") as f:
        f.write('#define DEB_HOST_MULTIARCH "x86_64-linux-gnu"\n')
    cs = sorted(c for c in glob.glob(os.path.join(src, "src", "*.c"))
                if os.path.basename(c) != "luac.c")
    procs = [subprocess.Popen(["gcc", *cflags, "-I", obj, "-c", c, "-o",
                               os.path.join(obj, os.path.basename(c)[:-2] + ".o")])
             for c in cs]
    if any(p.wait() for p in procs):
        raise RuntimeError("compiling lua failed")
    exe = os.path.join(out_dir, "lua")
    objs = [os.path.join(obj, os.path.basename(c)[:-2] + ".o") for c in cs]
    subprocess.run(["gcc", *ldflags, "-o", exe, *objs, "-lm", "-ldl"], check=True)
    return exe


def _timed(cmd, reps):
    return _timed_rss(cmd, reps)[0]


def _run_rusage(cmd):
    """Run cmd; (wall seconds, peak RSS in KiB of that child, returncode, stderr)."""
    t0 = time.monotonic()
    run = [linepack_script(), *cmd[1:]] if cmd[0] == "linepack" else cmd
    p = subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=LINEPACK_ENV if cmd[0] == "linepack" else None)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    key = cmd[0] if cmd[0] != "linepack" else \
        f"linepack {cmd[1]}" + (" --verify" if "--verify" in cmd else "")
    CPU_SECONDS[key] = CPU_SECONDS.get(key, []) + [ru.ru_utime + ru.ru_stime]
    return time.monotonic() - t0, ru.ru_maxrss, p.returncode, err


def linepack_script():
    """The ``linepack`` console script installed beside this interpreter (what a user's
    install runs), not the first one on PATH: under pyenv that is a bash shim that starts
    ``pyenv exec`` first (0.07 s of every command here, none of it linepack's); BOLT
    (/usr/bin/llvm-bolt-19) runs directly."""
    beside = os.path.join(os.path.dirname(sys.executable), "linepack")
    return beside if os.access(beside, os.X_OK) else shutil.which("linepack") or "linepack"


# linepack's commands run with their modules' bytecode compiled, as from an installed
# package (pip compiles it at install): this environment sets PYTHONDONTWRITEBYTECODE,
# and an editable checkout would otherwise compile ~100 modules from source in every
# command (0.08-0.1 s of CPU each). The bytecode goes to a cache of the bench's own
# (PYTHONPYCACHEPREFIX, set by use_bytecode_cache), never into the source tree.
LINEPACK_ENV = None


def use_bytecode_cache(work):
    """Compile linepack's modules once into ``work``/pycache and run every linepack
    command with that cache."""
    global LINEPACK_ENV
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(work, "pycache")
    import linepack
    subprocess.run([sys.executable, "-m", "compileall", "-q",
                    os.path.dirname(os.path.realpath(linepack.__file__))], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    # the C cores (decode.c, ext_tsp.c, verify's blocks.c, relayout/user/cfi.c) are built at
    # first use and cached: built here, so that no timed command counts a first build
    subprocess.run([sys.executable, "-c", "from linepack.image.decode_core import library; "
                    "from linepack.relayout.block_order import _native_lib; "
                    "import linepack.verify.blocks as vb; "
                    "import linepack.relayout.user.cfi as cfi; "
                    "library(); _native_lib(); getattr(vb, '_native_lib', lambda: 0)(); "
                    "getattr(cfi, 'native_lib', lambda: 0)()"],
                   env=env, check=True)
    LINEPACK_ENV = env


CPU_SECONDS = {}    # command -> CPU seconds (user + system, with its children) of each run


def _timed_rss(cmd, reps):
    """Medians of ``reps`` runs of cmd: (wall seconds, peak RSS KiB); raises on failure."""
    times, rss = [], []
    for _ in range(reps):
        secs, kib, rc, err = _run_rusage(cmd)
        if rc != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {err.strip()[-500:]}")
        times.append(secs)
        rss.append(kib)
    return statistics.median(times), statistics.median(rss)


def bolt_runtime_lib():
    """``-runtime-instrumentation-lib=`` value for llvm-bolt-19: Debian's bolt-19
    prepends /usr/lib/ to it, so the path of libbolt_rt_instr.a relative to /usr/lib."""
    found = sorted(glob.glob("/usr/lib/llvm-19/lib/libbolt_rt_instr.a")) or \
        sorted(glob.glob("/usr/lib/llvm-*/lib/libbolt_rt_instr.a"))
    if not found:
        raise RuntimeError("libbolt_rt_instr.a not found under /usr/lib/llvm-*/lib (bolt-19)")
    return os.path.relpath(found[-1], "/usr/lib")


def bolt_refused(message):
    """The function BOLT says it cannot rewrite ("... in function NAME. Consider adding
    this function to --skip-funcs"), as --skip-funcs takes it: BOLT's own spelling
    (``luaV_execute/1``: the plain name does not match) without the ``(*2)`` it adds
    for a function with several fragments; None when the message names none."""
    m = re.search(r"in function (\S+?)\. Consider adding this function to --skip-funcs",
                  message)
    return re.sub(r"\(\*\d+\)$", "", m.group(1)) if m else None


def bolt_instrument_profile(exe, args, work, log=print, timeout=600):
    """BOLT's own profile of ``exe args``: ``llvm-bolt -instrument``, the instrumented
    binary run natively (same arguments, same working directory), its .fdata.

    Returns (fdata path, the instrumented run's stdout, seconds of instrument + run)."""
    name = os.path.basename(exe)
    instr = os.path.join(work, name + ".bolt-instr")
    fdata = os.path.abspath(os.path.join(work, name + ".instr.fdata"))
    if os.path.exists(fdata):
        os.unlink(fdata)
    t0 = time.monotonic()
    skip = []
    while True:
        # as for the optimizing runs: a function BOLT names as one it cannot rewrite
        # (lua's PIE: luaV_execute) is skipped, and only that one
        extra = [f"--skip-funcs={','.join(skip)}"] if skip else []
        p = subprocess.run([BOLT, exe, "-instrument", "-o", instr,
                            f"-instrumentation-file={fdata}",
                            f"-runtime-instrumentation-lib={bolt_runtime_lib()}", *extra],
                           capture_output=True, text=True)
        if p.returncode == 0:
            break
        name_ = bolt_refused(p.stderr)
        if not name_ or name_ in skip or len(skip) >= 5:
            raise RuntimeError(f"{BOLT} -instrument failed: {p.stderr.strip()[-500:]}")
        skip.append(name_)
        log(f"BOLT -instrument cannot rewrite {name_}; retrying with --skip-funcs")
    if skip:
        BOLT_SKIPPED["BOLT instrumentation"] = skip
    r = subprocess.run([instr, *map(str, args)], capture_output=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    secs = time.monotonic() - t0
    if r.returncode != 0 or not os.path.exists(fdata) or not os.path.getsize(fdata):
        raise RuntimeError(f"instrumented {name} (exit {r.returncode}) wrote no profile to {fdata}")
    log(f"BOLT instrumentation profile: {sum(1 for _ in open(fdata))} records ({secs:.1f} s)")
    return fdata, r.stdout, secs


LUA_CROSS_SCRIPT = r"""
-- a second Lua workload (cross-input): objects, string building, closures, integer maths
local Account = {}
Account.__index = Account
function Account.new(id) return setmetatable({id = id, log = {}, balance = 0}, Account) end
function Account:deposit(v) self.balance = self.balance + v; self.log[#self.log + 1] = v end
local accts = {}
for i = 1, 400 do accts[i] = Account.new(i) end
for r = 1, 60 do
  for i = 1, #accts do accts[i]:deposit((i * r) % 97) end
end
local total = 0
for _, a in ipairs(accts) do total = total + a.balance end
local buf = {}
for i = 1, 6000 do buf[#buf + 1] = string.format("%05d:%x", i, i * 31) end
local joined = table.concat(buf, ";")
local n = 0
for a, b in joined:gmatch("(%d+):(%x+)") do n = n + #a + #b end
local rev = {}
for i = 1, 3000 do rev[i] = string.char(65 + i % 26) end
local s = table.concat(rev):reverse():lower()
local function compose(f, g) return function(x) return f(g(x)) end end
local inc = function(x) return x + 1 end
local dbl = function(x) return x * 2 end
local h = compose(inc, dbl)
local acc = 0
for i = 1, 100000 do acc = (acc + h(i)) % 1000003 end
local q = {}
for i = 1, 20000 do table.insert(q, i) end
local popped = 0
while #q > 0 do popped = popped + table.remove(q) end
print(total, #joined, n, s:sub(1, 12), acc, popped, math.floor(math.sqrt(total)))
"""


def zstd_source(log=print):
    """Directory of Debian's zstd source tree (``apt-get source zstd``: libzstd-*)."""
    return _debian_source("zstd", "libzstd-*", os.path.join("programs", "zstdcli.c"), log)


def sqlite_source(log=print):
    """Directory of Debian's sqlite3 source tree (``apt-get source sqlite3``)."""
    return _debian_source("sqlite3", "sqlite3-*", os.path.join("test", "speedtest1.c"), log)


def _debian_source(package, pattern, marker, log=print):
    root = cache_root()
    found = sorted(glob.glob(os.path.join(root, pattern, marker)))
    if not found:
        os.makedirs(root, exist_ok=True)
        log(f"apt-get source {package}")
        p = subprocess.run(["apt-get", "source", package], cwd=root, capture_output=True,
                           text=True)
        found = sorted(glob.glob(os.path.join(root, pattern, marker)))
        if p.returncode != 0 or not found:
            raise RuntimeError(f"apt-get source {package} failed: {p.stderr.strip()[-300:]}")
    return found[-1][:-len(marker) - 1]


def build_zstd(out_dir, log=print, pie=False):
    """zstd's CLI built by its own Makefile with its default flags (``-O3``, gcc's
    default PIE code, its x86-64 Huffman assembly) and ``-Wl,--emit-relocs`` (PIE or
    ``-no-pie``); the optional compression libraries off (not installed here)."""
    src = zstd_source(log)
    tree = os.path.join(out_dir, "zstd-src")
    if not os.path.isdir(tree):
        shutil.copytree(src, tree, symlinks=True)
    env = dict(os.environ, LDFLAGS=("-pie " if pie else "-no-pie ") + "-Wl,--emit-relocs")
    env.pop("CFLAGS", None)
    p = subprocess.run(["make", "-C", "programs", "zstd", "HAVE_ZLIB=0", "HAVE_LZMA=0",
                        "HAVE_LZ4=0", "-j2"], cwd=tree, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"building zstd failed: {p.stderr.strip()[-500:]}")
    exe = os.path.join(out_dir, "zstd")
    shutil.copy2(os.path.join(tree, "programs", "zstd"), exe)
    os.unlink(os.path.join(tree, "programs", "zstd"))
    return exe


def sqlite_amalgamation(log=print):
    """Directory with sqlite3.c/sqlite3.h made from Debian's source (configure; make
    sqlite3.c: needs tclsh), cached beside the source."""
    src = sqlite_source(log)
    out = src.rstrip("/") + "-amalgamation"
    if os.path.exists(os.path.join(out, "sqlite3.c")):
        return out
    log("making the sqlite3.c amalgamation")
    with tempfile.TemporaryDirectory(prefix="linepack-sqlite-") as bld:
        for cmd in ([os.path.join(src, "configure")], ["make", "sqlite3.c"]):
            p = subprocess.run(cmd, cwd=bld, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()[-500:]}")
        os.makedirs(out + ".tmp", exist_ok=True)
        for f in ("sqlite3.c", "sqlite3.h"):
            shutil.copy2(os.path.join(bld, f), os.path.join(out + ".tmp", f))
    os.replace(out + ".tmp", out)
    return out


def build_sqlite(out_dir, log=print, pie=False):
    """SQLite's own benchmark, speedtest1 (test/speedtest1.c), over the amalgamation:
    ``-O2``, gcc's default PIE code, ``-Wl,--emit-relocs`` (PIE or ``-no-pie``)."""
    src, amal = sqlite_source(log), sqlite_amalgamation(log)
    obj = os.path.join(out_dir, "obj-sqlite")
    os.makedirs(obj, exist_ok=True)
    procs = [subprocess.Popen(["gcc", "-O2", "-I", amal, "-c", c, "-o",
                               os.path.join(obj, os.path.basename(c)[:-2] + ".o")])
             for c in (os.path.join(amal, "sqlite3.c"), os.path.join(src, "test", "speedtest1.c"))]
    if any(p.wait() for p in procs):
        raise RuntimeError("compiling speedtest1 failed")
    exe = os.path.join(out_dir, "speedtest1")
    subprocess.run(["gcc", "-pie" if pie else "-no-pie", "-Wl,--emit-relocs", "-o", exe,
                    os.path.join(obj, "sqlite3.o"), os.path.join(obj, "speedtest1.o"),
                    "-lm", "-ldl", "-lpthread"], check=True)
    return exe


def _lua_inputs(work, exe, log):
    paths = []
    for name, text in (("bench.lua", LUA_SCRIPT), ("cross.lua", LUA_CROSS_SCRIPT)):
        paths.append(os.path.join(work, name))
        with open(paths[-1], "w") as f:
            f.write(text)
    return [paths[0]], [paths[1]]


def _zstd_inputs(work, exe, log):
    """Training: zstd's own lib/*/*.c concatenated (2.25 MB of C); cross-input: a binary,
    the zstd executable under test. ``-i0``: one timed run each way (the inputs are big
    enough that a run takes longer than zstd's 0.5 ms minimum, natively too, so the
    work done does not depend on the speed)."""
    src = zstd_source(log)
    text = os.path.join(work, "zstd-lib-src.txt")
    with open(text, "wb") as out:
        for c in sorted(glob.glob(os.path.join(src, "lib", "*", "*.c"))):
            with open(c, "rb") as f:
                out.write(f.read())
    binary = os.path.join(work, "zstd-exe.bin")
    shutil.copy2(exe, binary)
    return ["-q", "-b3", "-i0", text], ["-q", "-b3", "-i0", binary]


def _sqlite_inputs(work, exe, log):
    return ["--memdb", "--size", "2"], ["--memdb", "--size", "2", "--testset", "orm"]


# name -> (build, inputs(work, exe, log) -> (training args, cross-input args), --mask REGEXes)
PROGRAMS = {
    "lua": (build_lua, _lua_inputs, []),
    # zstd -b prints its speeds, right-aligned in a fixed width
    "zstd": (build_zstd, _zstd_inputs, [r" *[0-9.]+ MB/s"]),
    # speedtest1 prints each test's time
    "sqlite": (build_sqlite, _sqlite_inputs, [r"[0-9]+\.[0-9]+s$"]),
}


EXE_NAME = {"lua": "lua", "zstd": "zstd", "sqlite": "speedtest1"}


def make_layouts(exe, args, work, reps=3, log=print):
    """Profile, fdata, linepack pack and blocks, BOLT's instrumentation profile, BOLT
    functions-only and full (its profile) and full fed linepack's fdata.

    Returns ({label: path}, {label: (rewrite seconds, peak RSS KiB)}, profile)."""
    from linepack.profile.fdata import export_fdata
    from linepack.profile.user import record_user
    name = os.path.basename(exe)
    prof_path = os.path.join(work, name + ".lpprof")
    prof = record_user(exe, list(args), output=prof_path, log=log)
    fdata = os.path.join(work, name + ".fdata")
    export_fdata(prof, fdata, image=exe)
    out = {"original": exe}
    cost = {}
    for label, strategy in (("linepack pack", "pack"), ("linepack blocks", "blocks")):
        out[label] = os.path.join(work, f"{name}.{strategy}")
        cost[label] = _timed_rss(["linepack", "relayout", exe, "--profile", prof_path,
                                  "--strategy", strategy, "-q", "-o", out[label]], reps)
    instr_fdata, _, secs = bolt_instrument_profile(exe, args, work, log=log)
    cost["BOLT instrumentation"] = (secs, 0)
    for label, flags, suffix, data in (
            ("BOLT functions", BOLT_FUNCS, "bolt-fn", instr_fdata),
            ("BOLT full", BOLT_FULL, "bolt", instr_fdata),
            ("BOLT full, linepack fdata", BOLT_FULL, "bolt-lpfdata", fdata)):
        out[label] = os.path.join(work, f"{name}.{suffix}")
        skip = []
        while True:
            # BOLT names a function it cannot rewrite ("Consider adding this function
            # to --skip-funcs"): on lua's PIE, luaV_execute; skip exactly those, say so
            extra = [f"--skip-funcs={','.join(skip)}"] if skip else []
            try:
                cost[label] = _timed_rss([BOLT, exe, "-o", out[label], f"-data={data}", *flags,
                                          *extra], reps)
                break
            except RuntimeError as e:
                name_ = bolt_refused(str(e))
                if not name_ or name_ in skip or len(skip) >= 5:
                    raise
                skip.append(name_)
                log(f"{label}: BOLT cannot rewrite {name_}; retrying with --skip-funcs")
        if skip:
            BOLT_SKIPPED[label] = skip
    return out, cost, prof


BOLT_SKIPPED = {}         # label -> functions BOLT was told to skip (it refused them)


def tool_cost(exe, prof_path, bolt_data, work, reps=3, bolt_extra=()):
    """Medians of ``reps`` rounds, each round relayout blocks + verify --against as two
    commands (wall seconds summed, the larger peak RSS of the two), ``relayout blocks
    --verify`` (one command, the same checks) then llvm-bolt full (its instrumentation
    profile given), interleaved so that all see the same machine load.

    Returns ((linepack s, KiB), (BOLT s, KiB), (relayout --verify s, KiB))."""
    name = os.path.basename(exe)
    out = os.path.join(work, f"{name}.blocks-cost")
    out1 = os.path.join(work, f"{name}.blocks-cost1")
    bolt_out = os.path.join(work, f"{name}.bolt-cost")
    lp, one, bolt = [], [], []
    if LINEPACK_ENV is None:
        use_bytecode_cache(work)
    LOAD[:] = [os.getloadavg()[0]]
    for _ in range(reps):
        s1, r1, rc1, e1 = _run_rusage(["linepack", "relayout", exe, "--profile", prof_path,
                                       "--strategy", "blocks", "-q", "-o", out])
        s2, r2, rc2, e2 = _run_rusage(["linepack", "verify", out, "--against", exe])
        s4, r4, rc4, e4 = _run_rusage(["linepack", "relayout", exe, "--profile", prof_path,
                                       "--strategy", "blocks", "-q", "-o", out1, "--verify"])
        s3, r3, rc3, e3 = _run_rusage([BOLT, exe, "-o", bolt_out, f"-data={bolt_data}",
                                       *BOLT_FULL, *bolt_extra])
        if rc1 or rc2 or rc3 or rc4:
            raise RuntimeError(f"relayout/verify/BOLT failed: "
                               f"{(e1 + e2 + e3 + e4).strip()[-500:]}")
        lp.append((s1 + s2, max(r1, r2)))
        one.append((s4, r4))
        bolt.append((s3, r3))
    LOAD.append(os.getloadavg()[0])
    med = lambda xs, i: statistics.median(x[i] for x in xs)   # noqa: E731
    return (med(lp, 0), med(lp, 1)), (med(bolt, 0), med(bolt, 1)), (med(one, 0), med(one, 1))


# the machine's 1-minute load average before and after the tool-cost rounds: on a
# shared 2-core machine the wall ratios follow it (a second core is not always free)
LOAD = []


def load_note():
    return f"load average {LOAD[0]:.1f} -> {LOAD[-1]:.1f}" if LOAD else ""


def measure(binaries, args, reps=3, models=MODELS, masks=(), log=print, placements=None):
    """{label: {model: {...means over placements of medians...}}} and {label: same output
    as the first}. Measured by ``evaluate --program`` itself (evaluate_programs): one run
    per binary, placement and repeat with every model at once, a fixed environment, the
    same path and argv[0] for all, stdout compared after ``masks``."""
    from linepack.evaluate.user import evaluate_programs
    rows, _ = evaluate_programs([f"{label}={path}" for label, path in binaries.items()],
                                models, list(args), repeat=reps, log=log, masks=masks,
                                placements=placements)
    res, same = {}, {}
    for r in rows:
        if r.get("crashed"):
            res.setdefault(r["program"], {})[r["cache"]] = None
            same[r["program"]] = False
            continue
        res.setdefault(r["program"], {})[r["cache"]] = dict(
            {k: r[k] for k in ("misses", "program_misses", "instructions", "program_instructions",
                               "misses_min", "misses_max", "placements")},
            per_placement=[p["misses"] for p in r["per_placement"]])
        same[r["program"]] = same.get(r["program"], True) and bool(r["same_output"])
    return res, same


def native_same(binaries, args, masks, cwd):
    """Each binary run natively: stdout (masked) and exit status equal to the first's."""
    from linepack.evaluate.user import compile_masks, masked
    ms = compile_masks(masks)
    ref, same = None, {}
    for label, path in binaries.items():
        p = subprocess.run([path, *args], capture_output=True, cwd=cwd,
                           stdin=subprocess.DEVNULL, timeout=600)
        got = (p.returncode, masked(p.stdout, ms))
        ref = ref or got
        same[label] = got == ref
    return same


def text_size(path):
    from linepack.image.elf import ElfImage
    im = ElfImage(path)
    return sum(s.size for s in im.sections if s.is_code and s.is_alloc)


def table(res, binaries, models=MODELS):
    names = [m if isinstance(m, str) else m["name"] for m in models]
    head = ["program"]
    places = max((g["placements"] for lb in binaries for g in res[lb].values() if g), default=1)
    for n in names:
        head += [f"{n} misses", "vs original", "vs BOLT full"]
        if places > 1:
            head += [f"{n} min-max", "fewer than BOLT full"]
    head += ["program insns"]
    rows = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for label in binaries:
        r = [label]
        for n in names:
            got = res[label][n]
            if got is None:
                r += ["CRASHED", "", ""] + (["", ""] if places > 1 else [])
                continue
            m = got["misses"]
            base, bolt = res["original"][n], res["BOLT full"][n]
            r += [f"{m:,.0f}", f"{m / base['misses'] - 1:+.1%}" if base else "-",
                  f"{m / bolt['misses']:.2f}x" if bolt else "-"]
            if places > 1:
                fewer = (f"{sum(a < b for a, b in zip(got['per_placement'], bolt['per_placement']))}"
                         f"/{len(got['per_placement'])}" if bolt and label != "BOLT full"
                         else "-")
                r += [f"{got['misses_min']:,.0f}-{got['misses_max']:,.0f}", fewer]
        first = next((res[label][n] for n in names if res[label][n]), None)
        r += [f"{first['program_instructions']:,.0f}" if first else "-"]
        rows.append("| " + " | ".join(r) + " |")
    return "\n".join(rows)


def cost_only(exe, train, work, reps, log):
    """Print the tool cost line alone: profiles made if --work has none."""
    from linepack.profile.user import record_user
    name = os.path.basename(exe)
    prof_path = os.path.join(work, name + ".lpprof")
    if not os.path.exists(prof_path):
        record_user(exe, list(train), output=prof_path, log=log)
    fdata = os.path.join(work, name + ".instr.fdata")
    if not os.path.exists(fdata):
        fdata = bolt_instrument_profile(exe, train, work, log=log)[0]
    skip = []
    while True:
        try:
            (lp_s, lp_rss), (b_s, b_rss), (one_s, one_rss) = tool_cost(
                exe, prof_path, fdata, work, reps=reps,
                bolt_extra=[f"--skip-funcs={','.join(skip)}"] if skip else [])
            break
        except RuntimeError as e:
            name_ = bolt_refused(str(e))
            if not name_ or name_ in skip or len(skip) >= 5:
                raise
            skip.append(name_)
    print(f"{name}: relayout blocks + verify --against {lp_s:.2f} s, {lp_rss / 1024:.0f} MiB; "
          f"llvm-bolt full {b_s:.2f} s, {b_rss / 1024:.0f} MiB; {lp_s / b_s:.2f}x time, "
          f"{lp_rss / b_rss:.2f}x memory (medians of {reps}; {load_note()})"
          + (f"; BOLT skipped {','.join(skip)}" if skip else ""))
    print(f"  relayout blocks --verify (one command) {one_s:.2f} s, {one_rss / 1024:.0f} MiB; "
          f"{one_s / b_s:.2f}x time, {one_rss / b_rss:.2f}x memory")
    print("  CPU seconds (medians): " + ", ".join(
        f"{k} {statistics.median(v[-reps:]):.2f}" for k, v in CPU_SECONDS.items()))
    return 0


@contextlib.contextmanager
def heavy_lock(path, log=print):
    if not path:
        yield
        return
    with open(path, "a") as f:
        log(f"waiting for {path}")
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", choices=sorted(PROGRAMS), default="lua")
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--placements", type=int, metavar="N",
                    help="libc placements of every evaluate run (default evaluate's: 8 here)")
    ap.add_argument("--no-cost", action="store_true",
                    help="skip the tool-cost rounds (each rewrite timed once); reuses "
                         "--work's built program when there")
    ap.add_argument("--pie", action="store_true", help="link it -pie (default: -no-pie)")
    ap.add_argument("--lock", metavar="FILE",
                    help="hold an exclusive flock on FILE during the evaluate runs only "
                         "(the QEMU measurements; a shared machine's heavy-job lock)")
    ap.add_argument("--cost-only", action="store_true",
                    help="the tool cost alone (reuses --work's profiles when there)")
    ap.add_argument("--no-cross", action="store_true", help="skip the cross-input run")
    a = ap.parse_args(argv)
    if not shutil.which(BOLT) or not shutil.which("qemu-x86_64"):
        print(f"needs {BOLT} (bolt-19) and qemu-x86_64 (qemu-user)", file=sys.stderr)
        return 2
    work = os.path.abspath(a.work or tempfile.mkdtemp(prefix="linepack-bolt-"))
    os.makedirs(work, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    build, inputs, masks = PROGRAMS[a.program]
    built = os.path.join(work, EXE_NAME[a.program])
    reuse = (a.cost_only or a.no_cost) and os.path.exists(built)
    exe = built if reuse else build(work, log=log, pie=a.pie)
    train, cross = inputs(work, exe, log)
    if a.cost_only:
        return cost_only(exe, train, work, a.reps, log)
    binaries, cost, prof = make_layouts(exe, train, work, reps=1 if a.no_cost else a.reps,
                                        log=log)
    name = os.path.basename(exe)
    ok = True
    for label in ("linepack pack", "linepack blocks"):
        v = subprocess.run(["linepack", "verify", binaries[label], "--against", exe],
                           capture_output=True, text=True)
        verdict = next((ln for ln in v.stdout.splitlines() if ln.startswith("result:")), "?")
        ok &= v.returncode == 0
        print(f"verify {os.path.basename(binaries[label])} --against {name}: exit "
              f"{v.returncode} ({verdict.strip()})")
    runs = [("training input", train)] + ([] if a.no_cross else [("cross-input", cross)])
    for what, args in runs:
        same = native_same(binaries, args, masks, work)
        ok &= all(same.values())
        print(f"native run, {what}: output as the original's: "
              + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    prof_path = os.path.join(work, name + ".lpprof")
    skip = BOLT_SKIPPED.get("BOLT full")
    if not a.no_cost:
        print_cost(exe, prof_path, work, a, cost, skip)
    mask_args = " ".join(f"--mask '{m}'" for m in masks)
    for what, args in runs:
        with heavy_lock(a.lock, log):
            res, same = measure(binaries, args, reps=a.reps, masks=masks, log=log,
                                placements=a.placements)
        ok &= all(same.values())
        print(f"\n{a.program} ({'PIE' if a.pie else 'non-PIE'}), {what} "
              f"({' '.join(os.path.basename(x) for x in args)}); profiles from the training "
              f"input ({prof.meta['instructions']:,} program instructions); outputs as the "
              f"original's: {all(same.values())}")
        progs = " ".join(f"--program {k.replace(' ', '-').replace(',', '')}={v}"
                         for k, v in binaries.items())
        caches = " ".join(f"--cache {m if isinstance(m, str) else m['name']}" for m in MODELS)
        pl = f" --placements {a.placements}" if a.placements else ""
        print(f"  linepack evaluate {progs} {caches} --repeat {a.reps}{pl} {mask_args} -- "
              f"{' '.join(args)}\n")
        print(table(res, binaries))
    for label, funcs in BOLT_SKIPPED.items():
        print(f"{label}: BOLT refused {', '.join(funcs)} (--skip-funcs); left in place")
    return 0 if ok else 1


def print_cost(exe, prof_path, work, a, cost, skip):
    name = os.path.basename(exe)
    lp_cost, (bolt_secs, bolt_rss), (one_s, one_rss) = tool_cost(
        exe, prof_path, os.path.join(work, name + ".instr.fdata"), work, reps=a.reps,
        bolt_extra=[f"--skip-funcs={','.join(skip)}"] if skip else [])
    print(f"\ntool cost (medians of {a.reps}): relayout blocks + verify --against "
          f"{lp_cost[0]:.2f} s, {lp_cost[1] / 1024:.0f} MiB peak; llvm-bolt full "
          f"{bolt_secs:.2f} s, {bolt_rss / 1024:.0f} MiB peak; ratio "
          f"{lp_cost[0] / bolt_secs:.2f}x time, {lp_cost[1] / bolt_rss:.2f}x memory "
          f"(BOLT's instrumentation profile: {cost['BOLT instrumentation'][0]:.2f} s more; "
          f"{load_note()})")
    print(f"  relayout blocks --verify (one command) {one_s:.2f} s, {one_rss / 1024:.0f} MiB; "
          f"{one_s / bolt_secs:.2f}x time, {one_rss / bolt_rss:.2f}x memory")
    print("  CPU seconds (medians): " + ", ".join(
        f"{k} {statistics.median(v[-a.reps:]):.2f}" for k, v in CPU_SECONDS.items()))
    for label, (secs, rss) in cost.items():
        if rss:
            print(f"  {label}: {secs:.2f} s, {rss / 1024:.0f} MiB")


if __name__ == "__main__":
    sys.exit(main())
