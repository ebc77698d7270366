"""``evaluate --program``: userspace programs side by side under qemu-x86_64.

Each program (the original first, then e.g. linepack's relayout output and a
BOLT output) runs the same arguments under ``qemu-x86_64`` with linepack's TCG
plugin in ``mode=user``, one plugin instance per cache model (copies of the
.so, so they keep separate state) in one run. The numbers count every
user-mode fetch (program, libraries, dynamic loader), like a hardware counter;
``program_misses`` / ``program_instructions`` are the program's own code.

The same work must run: every program is started from the same path (a symlink
named like the first program) with that name as ``argv[0]``, stdin is empty, and stdout and the exit status are
compared with the first program's. Executed user-mode instructions must agree
within INSTRUCTION_TOLERANCE (a deterministic C program agrees exactly; an
interpreter hashing by address may differ a little).
"""

import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

from ..errors import BadInput, ExternalToolError

# Relative difference of executed user-mode instructions beyond which two
# programs are flagged as not doing the same work (Lua: ~0.1% run to run).
INSTRUCTION_TOLERANCE = 2e-3


def parse_program(spec):
    """'[LABEL=]PATH' -> (label, path). A PATH containing '=' needs a LABEL."""
    label, sep, path = str(spec).partition("=")
    if not sep:
        label, path = "", label
    if sep and not os.path.exists(path) and os.path.exists(spec):
        label, path = "", spec              # a file name with '=' in it
    return (label or os.path.basename(path)), path


def check_programs(specs):
    """[(label, path)] for --program specs; one-line BadInput for missing / PIE / non-ELF."""
    from ..image.elf import ElfImage, ET_EXEC
    out = []
    for spec in specs:
        label, path = parse_program(spec)
        if not path:
            raise BadInput(f"--program {spec}: no path")
        if not os.path.isfile(path):
            raise BadInput(f"--program {path}: no such file")
        try:
            image = ElfImage(path)
        except BadInput as e:
            msg = str(e)
            msg = msg[len(path) + 2:] if msg.startswith(f"{path}: ") else msg
            raise BadInput(f"--program {path}: {msg}") from None
        except Exception as e:                  # noqa: BLE001 - unreadable input: one line
            raise BadInput(f"--program {path}: not a readable ELF executable ({e})") from None
        if image.type == 3:
            raise BadInput(f"--program {path}: a position-independent executable (PIE): qemu "
                           "loads it at a base of its choosing; relink with -no-pie -fno-pie")
        if image.type != ET_EXEC:
            raise BadInput(f"--program {path}: not an executable (ELF type {image.type})")
        if not os.access(path, os.X_OK):
            raise BadInput(f"--program {path}: not executable (chmod +x)")
        out.append((label, path))
    labels = [lb for lb, _ in out]
    dup = sorted({lb for lb in labels if labels.count(lb) > 1})
    if dup:
        raise BadInput(f"--program: the label {dup[0]!r} is given twice (name them LABEL=PATH)")
    return out


def qemu_user():
    exe = shutil.which("qemu-x86_64")
    if exe is None:
        raise ExternalToolError("qemu-x86_64 is not installed: install qemu-user "
                                "(apt-get install qemu-user)")
    return exe


def _exec_ranges(path):
    from ..image.elf import ElfImage
    secs = [s for s in ElfImage(path).sections if s.is_code and s.is_alloc and s.size]
    return [(s.addr, s.end) for s in secs], sum(s.size for s in secs)


def _inside(addrs, ranges):
    a = np.asarray(addrs, np.uint64)
    m = np.zeros(a.shape, bool)
    for x, y in ranges:
        m |= (a >= np.uint64(x)) & (a < np.uint64(y))
    return m


def run_program(path, args, caches, argv0=None, timeout=600, log=None):
    """One run of ``path args`` under qemu-x86_64, one plugin per cache model.

    Returns ({cache name: PluginTrace}, {"returncode", "stdout", "stderr", "wall"})."""
    from ..profile import plugin_build, trace
    q = qemu_user()
    so = plugin_build.build_plugin(log=log or (lambda m: None))
    with tempfile.TemporaryDirectory(prefix="linepack-evaluser-") as tmp:
        outs = [os.path.join(tmp, f"c{k}.bin") for k in range(len(caches))]
        cmd = [q]
        if argv0:
            cmd += ["-0", argv0]
        for k, (c, o) in enumerate(zip(caches, outs)):
            so_k = so
            if k:
                so_k = os.path.join(tmp, f"plugin{k}.so")
                shutil.copy(so, so_k)
            cmd += ["-plugin", trace.plugin_option(so_k, trace.plugin_args(o, cache=c,
                                                                            mode="user"))]
        cmd += [os.path.abspath(path), *map(str, args)]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ExternalToolError(f"{os.path.basename(path)} under qemu-x86_64 did not finish "
                                    f"in {timeout} s") from None
        wall = time.monotonic() - t0
        missing = [o for o in outs if not os.path.exists(o)]
        if missing:
            err = p.stderr.decode("utf-8", "replace").strip().splitlines()
            raise ExternalToolError(f"qemu-x86_64 wrote no plugin output for "
                                    f"{os.path.basename(path)} (exit {p.returncode}): "
                                    f"{err[-1] if err else 'no message'}")
        trs = {c["name"]: trace.read_plugin_output(o) for c, o in zip(caches, outs)}
    return trs, {"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "wall": wall}


def _med(runs, key):
    return statistics.median(r[key] for r in runs)


def _spread(runs, key):
    vals = [r[key] for r in runs]
    m = statistics.median(vals)
    return (max(vals) - min(vals)) / m if m else 0.0


def evaluate_programs(specs, caches, args=(), repeat=1, timeout=600, log=None):
    """Rows (one per program and cache model, the first program the baseline of each
    model) and problems (output, exit status or instruction count differing from the
    first program's, or differing between repeats)."""
    log = log or (lambda m: None)
    progs = check_programs(specs)
    qemu_user()
    caches = [c if isinstance(c, dict) else _cache(c) for c in caches]
    argv0 = os.path.basename(progs[0][1])
    runs = {}           # label -> cache -> [run dicts]
    outputs = {}        # label -> [(returncode, stdout)]
    info = {}
    # Every program runs from the same path (a symlink in one directory): the executable's
    # name is on the initial stack (AT_EXECFN), and its length shifts what libc and the
    # loader do by a few instructions.
    stage = tempfile.mkdtemp(prefix="linepack-evalprog-")
    try:
        for label, path in progs:
            ranges, code_bytes = _exec_ranges(path)
            info[label] = {"path": path, "code_bytes": code_bytes}
            link = os.path.join(stage, argv0)
            if os.path.lexists(link):
                os.unlink(link)
            os.symlink(os.path.abspath(path), link)
            _measure(label, link, ranges, args, caches, argv0, repeat, timeout, log, runs,
                     outputs, info)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    rows = []
    for c in caches:
        for label, _ in progs:
            rs = runs[label][c["name"]]
            rc, out = outputs[label][0]
            rows.append({"program": label, "cache": c["name"], "mode": "user",
                         "misses": _med(rs, "misses"), "fetches": _med(rs, "fetches"),
                         "miss_rate": _med(rs, "miss_rate"),
                         "instructions": _med(rs, "instructions"),
                         "program_misses": _med(rs, "program_misses"),
                         "program_instructions": _med(rs, "program_instructions"),
                         "code_bytes": info[label]["code_bytes"], "time_s": _med(rs, "wall"),
                         "repeats": len(rs), "misses_spread": _spread(rs, "misses"),
                         "instructions_spread": _spread(rs, "instructions"),
                         "exit_status": rc, "stdout_bytes": len(out),
                         "same_output": None, "image": os.path.abspath(info[label]["path"])})
    return rows, cross_check(rows, outputs, progs)


def _measure(label, path, ranges, args, caches, argv0, repeat, timeout, log, runs, outputs, info):
    for k in range(repeat):
        trs, res = run_program(path, args, caches, argv0=argv0, timeout=timeout, log=log)
        outputs.setdefault(label, []).append((res["returncode"], res["stdout"]))
        for name, tr in trs.items():
            inb = _inside(tr.tb_addr, ranges)
            runs.setdefault(label, {}).setdefault(name, []).append({
                "fetches": tr.fetches, "misses": tr.misses, "instructions": tr.instructions,
                "miss_rate": tr.misses / tr.fetches if tr.fetches else 0.0,
                "program_instructions": int(np.dot(tr.tb_insns[inb].astype(np.uint64),
                                                   tr.tb_execs[inb])),
                "program_misses": int(tr.tb_misses[inb].sum()), "wall": res["wall"]})
        first = next(iter(trs.values()))
        log(f"{label} run {k + 1}/{repeat}: " + ", ".join(
            f"{n} {tr.misses:,} misses" for n, tr in trs.items()) +
            f"; {first.instructions:,} instructions, exit {res['returncode']} "
            f"({res['wall']:.1f} s)")


def _cache(name):
    from ..profile.trace import cache_config
    return cache_config(name)


def cross_check(rows, outputs, progs):
    """Fill rows' same_output; problems against the first program."""
    problems = []
    base_label = progs[0][0]
    brc, bout = outputs[base_label][0]
    for label, _ in progs:
        seen = set(outputs[label])
        if len(seen) > 1:
            problems.append(f"{label}: output or exit status differs between repeats")
        rc, out = outputs[label][0]
        same = (rc, out) == (brc, bout)
        for r in rows:
            if r["program"] == label:
                r["same_output"] = same
        if label == base_label:
            continue
        if out != bout:
            problems.append(f"{label}: stdout differs from {base_label}'s ({len(out):,} vs "
                            f"{len(bout):,} bytes): not the same work")
        if rc != brc:
            problems.append(f"{label}: exit status {rc} vs {brc} for {base_label}")
    first_cache = rows[0]["cache"]
    rs = [r for r in rows if r["cache"] == first_cache]      # one model: all from the same runs
    b = rs[0]
    for r in rs[1:]:
        bi, mi = b["instructions"], r["instructions"]
        if bi and abs(mi - bi) / bi > INSTRUCTION_TOLERANCE:
            problems.append(f"{r['program']}: {mi:,.0f} user-mode instructions vs {bi:,.0f} for "
                            f"{b['program']} ({(mi - bi) / bi:+.3%}, tolerance "
                            f"{INSTRUCTION_TOLERANCE:.1%}): different work, or a rewrite that "
                            "changes the executed code (e.g. BOLT's block reordering); MPKI "
                            "normalises for it")
    return problems


def format_rows(rows, args=()):
    """One table per cache model, like the kernel evaluate's; the first program is the base."""
    out = []
    w = max([16] + [len(r["program"]) for r in rows])
    for cache in dict.fromkeys(r["cache"] for r in rows):
        rs = [r for r in rows if r["cache"] == cache]
        base = rs[0]
        hdr = (f"{'program':<{w}} {'L1i misses':>12} {'vs base':>8} {'prog misses':>11} "
               f"{'fetches':>13} {'miss rate':>9} {'MPKI':>7} {'instructions':>14} "
               f"{'code bytes':>10} {'output':>6} {'time s':>7}")
        n = rs[0]["repeats"]
        out += [f"user-mode L1i, {cache} (qemu-x86_64, all user code incl. libraries; "
                f"{'median of ' + str(n) + ' runs' if n > 1 else '1 run'})", hdr, "-" * len(hdr)]
        bm = base["misses"]
        for r in rs:
            sp = r.get("misses_spread")
            same = "base" if r is base else ("same" if r["same_output"] else "DIFF")
            out.append(
                f"{r['program']:<{w}} {r['misses']:>12,.0f} "
                f"{(r['misses'] - bm) / bm if bm else 0:>+8.2%} {r['program_misses']:>11,.0f} "
                f"{r['fetches']:>13,.0f} {r['miss_rate']:>9.2%} "
                f"{1000.0 * r['misses'] / r['instructions'] if r['instructions'] else 0:>7.3f} "
                f"{r['instructions']:>14,.0f} {r['code_bytes']:>10,} {same:>6} "
                f"{r['time_s']:>7.2f}" + (f" ±{sp:.3%}" if sp else ""))
        out.append("")
    return "\n".join(out).rstrip("\n")


__all__ = ["evaluate_programs", "format_rows", "check_programs", "parse_program",
           "INSTRUCTION_TOLERANCE"]
