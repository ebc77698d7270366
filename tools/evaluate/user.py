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
import tempfile

import numpy as np

from ..errors import BadInput, ExternalToolError
from ..profile.runner import qemu_user
from ..profile.user import inside

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
    """[(label, path)] for --program specs; one-line BadInput for missing / shared
    library / non-ELF (a PIE runs at the base qemu-x86_64 picks: runner.load_bias)."""
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
        from ..relayout.user.pie import is_pie
        if image.type == 3 and not is_pie(image):
            raise BadInput(f"--program {path}: a shared library, not a program")
        if image.type != ET_EXEC and not is_pie(image):
            raise BadInput(f"--program {path}: not an executable (ELF type {image.type})")
        if not os.access(path, os.X_OK):
            raise BadInput(f"--program {path}: not executable (chmod +x)")
        out.append((label, path))
    labels = [lb for lb, _ in out]
    dup = sorted({lb for lb in labels if labels.count(lb) > 1})
    if dup:
        raise BadInput(f"--program: the label {dup[0]!r} is given twice (name them LABEL=PATH)")
    return out


def _exec_ranges(path):
    from ..image.elf import ElfImage
    from ..profile.user import exec_ranges
    lo, hi = exec_ranges(ElfImage(path))
    return (lo, hi), int((hi - lo).sum())


def program_job(path, args, caches, argv0=None, timeout=600, label="", run=0):
    """The QemuJob of one measured run: one plugin instance per cache model."""
    from ..profile.runner import USER, Plugin, QemuJob
    return QemuJob(USER, path, [Plugin(cache=c) for c in caches], args=tuple(map(str, args)),
                   argv0=argv0, timeout=timeout, check=False, mode="user", label=label, run=run)


def run_program(path, args, caches, argv0=None, timeout=600, log=None):
    """One run of ``path args`` under qemu-x86_64, one plugin per cache model.

    Returns ({cache name: PluginTrace}, {"returncode", "stdout", "stderr", "wall"})."""
    from ..profile.runner import run_job
    res = run_job(program_job(path, args, caches, argv0, timeout), log=log)
    if any(t is None for t in res.traces):
        raise ExternalToolError(f"qemu-x86_64 wrote no plugin output for "
                                f"{os.path.basename(path)} (exit {res.returncode}): "
                                f"{_last_line(res.stderr) or 'no message'}")
    return ({c["name"]: tr for c, tr in zip(caches, res.traces)},
            {"returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr,
             "wall": res.wall, "load_bias": getattr(res, "load_bias", None) or 0})


def _last_line(text):
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


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
    qemu_user()      # one clear error before anything runs
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
        b = np.uint64(res["load_bias"])        # a PIE's code runs at its link address + bias
        for name, tr in trs.items():
            inb = inside(tr.tb_addr, (ranges[0] + b, ranges[1] + b))
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
