"""linepack against BOLT 19 on a real userspace program, same binary, same profile.

    python3 tests/bench/bench_userspace_bolt.py [--work DIR] [--reps 3] [--pie]

1. Debian's lua5.4 source (``apt-get source lua5.4``, cached under
   ~/.cache/linepack/userspace) built as people build it: ``-O2`` (gcc's
   default PIE code), linked ``-no-pie -Wl,--emit-relocs`` against the system
   libc (dynamic), nothing else: a layout that does not fit in place goes to a
   new segment (docs/userspace.md). BOLT gets the same binary.
2. A Lua workload (sort, string patterns, gsub, closures, coroutines, pcall)
   runs under qemu-x86_64 with linepack's plugin (mode=user, edges=on): the
   profile. It is exported as BOLT .fdata with linepack's exporter.
3. Layouts: linepack ``pack``; linepack ``blocks`` (hot/cold splitting, each
   cold part with its own FDE), and explicitly with its hot blocks in original
   order (``blocks-original``) and in ext-TSP order (``blocks-ext-tsp``). BOLT at
   its best: its own profile, made by its instrumentation (``llvm-bolt
   -instrument``, the instrumented lua run natively on the same workload), and its
   best flags: functions only (``-reorder-functions=cdsort -reorder-blocks=none``)
   and full (``-reorder-blocks=ext-tsp -reorder-functions=cdsort -split-functions
   -split-all-cold -split-eh``); and BOLT full fed linepack's exported ``.fdata``
   (``BOLT full, linepack fdata``), the same profile linepack uses.
4. Each binary runs the workload under the plugin (cache=on, mode=user) with
   several L1i models, as ``evaluate --program`` runs it (fixed environment, one
   path and argv[0] for all); misses of every user-mode fetch (program + libc +
   ld.so) and of the program's own code; instructions; the output must be identical.
   Medians of ``--reps`` runs (Lua hashes some objects by address, so
   instruction counts vary by ~0.1% between runs).
5. Rewriting time: median of ``--reps`` wall times of ``linepack relayout`` (CLI)
   and ``llvm-bolt-19`` on the same input.

``--pie``: the same with lua built ``-fpie`` and linked ``-pie -Wl,--emit-relocs``
(a position-independent executable; qemu-x86_64 loads it at its own base, which
the profile takes off: tools/profile/user.py). BOLT gets the same PIE.

Prints a markdown table. Training and measured runs use the same workload.
"""

import argparse
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
MODELS = ["intel-32k-8w", {"name": "8k-8w", "size": 8192, "ways": 8, "line": 64},
          {"name": "8k-4w", "size": 8192, "ways": 4, "line": 64}]


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
    times = []
    for _ in range(reps):
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True)
        times.append(time.monotonic() - t0)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} failed: {p.stderr.strip()[-500:]}")
    return statistics.median(times)


def bolt_runtime_lib():
    """``-runtime-instrumentation-lib=`` value for llvm-bolt-19: Debian's bolt-19
    prepends /usr/lib/ to it, so the path of libbolt_rt_instr.a relative to /usr/lib."""
    found = sorted(glob.glob("/usr/lib/llvm-19/lib/libbolt_rt_instr.a")) or \
        sorted(glob.glob("/usr/lib/llvm-*/lib/libbolt_rt_instr.a"))
    if not found:
        raise RuntimeError("libbolt_rt_instr.a not found under /usr/lib/llvm-*/lib (bolt-19)")
    return os.path.relpath(found[-1], "/usr/lib")


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
    p = subprocess.run([BOLT, exe, "-instrument", "-o", instr,
                        f"-instrumentation-file={fdata}",
                        f"-runtime-instrumentation-lib={bolt_runtime_lib()}"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{BOLT} -instrument failed: {p.stderr.strip()[-500:]}")
    r = subprocess.run([instr, *map(str, args)], capture_output=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    secs = time.monotonic() - t0
    if r.returncode != 0 or not os.path.exists(fdata) or not os.path.getsize(fdata):
        raise RuntimeError(f"instrumented {name} (exit {r.returncode}) wrote no profile to {fdata}")
    log(f"BOLT instrumentation profile: {sum(1 for _ in open(fdata))} records ({secs:.1f} s)")
    return fdata, r.stdout, secs


def make_layouts(exe, script, work, reps=3, log=print):
    """Profile, fdata, linepack pack, BOLT functions-only and full.

    Returns ({label: path}, {label: rewrite seconds}, profile)."""
    from linepack.profile.fdata import export_fdata
    from linepack.profile.user import record_user
    prof_path = os.path.join(work, "prof.lpprof")
    prof = record_user(exe, [script], output=prof_path, log=log)
    fdata = os.path.join(work, "prof.fdata")
    export_fdata(prof, fdata, image=exe)
    out = {"original": exe}
    secs = {}
    for label, strategy, name in (("linepack pack", "pack", "lua.pack"),
                                  ("linepack blocks", "blocks", "lua.blocks"),
                                  # hot-block order, both ways whatever the default
                                  ("blocks-original", "blocks-original", "lua.blocks-orig"),
                                  ("blocks-ext-tsp", "blocks-ext-tsp", "lua.blocks-exttsp")):
        out[label] = os.path.join(work, name)
        secs[label] = _timed(["linepack", "relayout", exe, "--profile", prof_path,
                              "--strategy", strategy, "-q", "-o", out[label]], reps)
    instr_fdata, _, secs["BOLT instrumentation"] = bolt_instrument_profile(exe, [script], work,
                                                                           log=log)
    for label, flags, name, data in (
            ("BOLT functions", BOLT_FUNCS, "lua.bolt-fn", instr_fdata),
            ("BOLT full", BOLT_FULL, "lua.bolt", instr_fdata),
            ("BOLT full, linepack fdata", BOLT_FULL, "lua.bolt-lpfdata", fdata)):
        out[label] = os.path.join(work, name)
        skip = []
        while True:
            # BOLT names a function it cannot rewrite ("Consider adding this function
            # to --skip-funcs"): on the PIE, luaV_execute; skip exactly those, say so
            extra = [f"--skip-funcs={','.join(skip)}"] if skip else []
            try:
                secs[label] = _timed([BOLT, exe, "-o", out[label], f"-data={data}", *flags,
                                      *extra], reps)
                break
            except RuntimeError as e:
                # the name as BOLT spells it (``luaV_execute/1``): the plain name does not match
                m = re.search(r"in function (\S+?)\. Consider adding this function to "
                              r"--skip-funcs", str(e))
                if not m or m.group(1) in skip or len(skip) >= 5:
                    raise
                skip.append(m.group(1))
                log(f"{label}: BOLT cannot rewrite {m.group(1)}; retrying with --skip-funcs")
        if skip:
            BOLT_SKIPPED[label] = skip
    return out, secs, prof


BOLT_SKIPPED = {}         # label -> functions BOLT was told to skip (it refused them)


def measure(binaries, script, reps=3, models=MODELS, log=print):
    """{label: {model: {...medians...}}} and, per binary, whether its output is the
    first binary's. Measured as ``evaluate --program`` measures: one run per binary
    and repeat with every model at once, a fixed environment and the same path and
    argv[0] for all (so the numbers match an ``evaluate --program`` run's)."""
    from linepack.evaluate.user import evaluate_programs
    rows, _ = evaluate_programs([f"{label}={path}" for label, path in binaries.items()],
                                models, [script], repeat=reps, log=log)
    res, outputs = {}, {}
    for r in rows:
        res.setdefault(r["program"], {})[r["cache"]] = {
            k: r[k] for k in ("misses", "program_misses", "instructions", "program_instructions")}
        # the first binary's output, or this one's differing from it
        outputs[r["program"]] = {"same" if r["same_output"] else f"differs: {r['program']}"}
    return res, outputs


def text_size(path):
    from linepack.image.elf import ElfImage
    im = ElfImage(path)
    return sum(s.size for s in im.sections if s.is_code and s.is_alloc)


def table(res, secs, binaries, models=MODELS):
    names = [m if isinstance(m, str) else m["name"] for m in models]
    head = ["layout"]
    for n in names:
        head += [f"{n} misses (all user)", "vs original", "vs BOLT full", f"{n} program misses"]
    head += ["program insns", "code bytes", "rewrite s (median)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in binaries:
        r = [label]
        for n in names:
            m = res[label][n]["misses"]
            r += [f"{m:,.0f}", f"{m / res['original'][n]['misses'] - 1:+.1%}",
                  f"{m / res['BOLT full'][n]['misses']:.2f}x", f"{res[label][n]['program_misses']:,.0f}"]
        r += [f"{res[label][names[0]]['program_instructions']:,.0f}", f"{text_size(binaries[label]):,}",
              f"{secs[label]:.2f}" if label in secs else "-"]
        rows.append("| " + " | ".join(r) + " |")
    return "\n".join(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pie", action="store_true", help="build lua as a PIE (-fpie -pie)")
    a = ap.parse_args(argv)
    if not shutil.which(BOLT) or not shutil.which("qemu-x86_64"):
        print(f"needs {BOLT} (bolt-19) and qemu-x86_64 (qemu-user)", file=sys.stderr)
        return 2
    work = a.work or tempfile.mkdtemp(prefix="linepack-bolt-")
    os.makedirs(work, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731
    exe = build_lua(work, log=log, pie=a.pie)
    script = os.path.join(work, "bench.lua")
    with open(script, "w") as f:
        f.write(LUA_SCRIPT)
    binaries, secs, prof = make_layouts(exe, script, work, reps=a.reps, log=log)
    verdicts = {}
    for label in ("linepack blocks", "blocks-original", "blocks-ext-tsp"):
        v = subprocess.run(["linepack", "verify", binaries[label], "--against", exe],
                           capture_output=True, text=True)
        verdict = next((ln for ln in v.stdout.splitlines() if ln.startswith("result:")), "?")
        verdicts[label] = (v.returncode, verdict.strip())
        log(f"verify {os.path.basename(binaries[label])} --against lua: exit {v.returncode}, "
            f"{verdict}")
    res, outputs = measure(binaries, script, reps=a.reps, log=log)
    same = len({o for s in outputs.values() for o in s}) == 1
    print(f"lua 5.4 (Debian source{', PIE' if a.pie else ''}), workload {prof.meta['instructions']:,} program instructions, "
          f"{len(prof.func_addr)} executed functions; outputs identical: {same}\n")
    print(table(res, secs, binaries))
    print(f"\nBOLT's profile: llvm-bolt -instrument + the instrumented lua run natively, "
          f"{secs['BOLT instrumentation']:.2f} s (BOLT rows' rewrite s exclude it)")
    for label, (rc, verdict) in verdicts.items():
        print(f"\nverify {os.path.basename(binaries[label])} --against lua: exit {rc} ({verdict})")
    for label, funcs in BOLT_SKIPPED.items():
        print(f"{label}: BOLT refused {', '.join(funcs)} (--skip-funcs); left in place")
    return 0 if same and not any(rc for rc, _ in verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
