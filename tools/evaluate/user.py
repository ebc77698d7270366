"""``evaluate --program``: userspace programs side by side under qemu-x86_64.

Each program (the original first, then e.g. linepack's relayout output and a
BOLT output) runs the same arguments under ``qemu-x86_64`` with linepack's TCG
plugin in ``mode=user``, one plugin instance per cache model (copies of the
.so, so they keep separate state) in one run. The numbers count every
user-mode fetch (program, libraries, dynamic loader), like a hardware counter;
``program_misses`` / ``program_instructions`` are the program's own code.

The same work must run, and the counts must not depend on who runs it: every
program is started from the same path (a symlink named like the first program,
in a directory of fixed length under /tmp) with that name as ``argv[0]``, stdin
empty, and the fixed environment PROGRAM_ENV instead of the caller's (qemu-x86_64
hands its environment to the program, and its size moves the initial stack:
a longer PYTHONPATH gave one miss more). The working directory stays the
caller's (relative arguments resolve from it; it is not on the program's stack).
stdout and the exit status are compared with the first program's (``compare``
"output"; "exit": the exit status only), after ``masks`` (regular expressions;
each match replaced by ``<masked>``, e.g. timings). Executed user-mode
instructions must agree within INSTRUCTION_TOLERANCE (a deterministic C program
agrees exactly; an interpreter hashing by address may differ a little).

A program killed by a signal (or leaving no plugin output) is a crash: its rows
say so and carry no counts; the other programs' rows are kept.

Every program runs at the same libc placements (evaluate.placements: libc moved by
whole pages, as ASLR would; one placement: nothing moved). A row's counts are the
mean over placements of each placement's median over repeats; ``misses_min`` /
``misses_max`` and ``per_placement`` keep the spread. Outputs are compared within a
placement.
"""

import os
import re
import shutil
import signal
import statistics
import tempfile

import numpy as np

from ..errors import BadInput, ExternalToolError
from ..profile.runner import qemu_user
from ..profile.user import inside

# Relative difference of executed user-mode instructions beyond which two
# programs are flagged as not doing the same work (Lua: ~0.1% run to run).
INSTRUCTION_TOLERANCE = 2e-3
# The whole environment of a measured program (``env -i`` plus a PATH and the C locale).
PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C"}
COMPARE = ("output", "exit")
MASKED = b"<masked>"


def compile_masks(masks):
    """--mask REGEX list -> compiled bytes patterns (multi-line: ^/$ match at lines)."""
    out = []
    for m in masks or ():
        try:
            out.append(re.compile(str(m).encode(), re.M))
        except re.error as e:
            raise BadInput(f"--mask {m!r}: not a regular expression ({e})") from None
    return out


def masked(stdout, masks):
    """stdout with every match of every mask replaced by MASKED."""
    for rx in masks:
        stdout = rx.sub(MASKED, stdout)
    return stdout


def crash_of(returncode, traces_missing=False):
    """'SIGSEGV' etc. for a program killed by a signal, a reason when it left no
    counts, None for a program that exited."""
    if returncode is not None and returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    if traces_missing:
        return f"no counts (exit {returncode})"
    return None


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


def _dynamic(path):
    """Whether ``path`` has a dynamic loader (PT_INTERP): what a placement moves."""
    from ..image.elf import ElfImage
    return bool((ElfImage(path).phdrs["type"] == 3).any())


def _exec_ranges(path):
    from ..image.elf import ElfImage
    from ..profile.user import exec_ranges
    lo, hi = exec_ranges(ElfImage(path))
    return (lo, hi), int((hi - lo).sum())


def program_job(path, args, caches, argv0=None, timeout=600, label="", run=0, env=None,
                preload=None):
    """The QemuJob of one measured run: one plugin instance per cache model, the
    program's environment PROGRAM_ENV unless ``env`` says otherwise, ``preload`` a
    library loaded before the program's own (a placement: evaluate.placements)."""
    from ..profile.runner import USER, Plugin, QemuJob
    return QemuJob(USER, path, [Plugin(cache=c) for c in caches], args=tuple(map(str, args)),
                   argv0=argv0, timeout=timeout, check=False, mode="user", label=label, run=run,
                   env=dict(PROGRAM_ENV if env is None else env), preload=preload)


def run_program(path, args, caches, argv0=None, timeout=600, log=None, allow_crash=False,
                preload=None):
    """One run of ``path args`` under qemu-x86_64, one plugin per cache model.

    Returns ({cache name: PluginTrace} (None for a crash with ``allow_crash``),
    {"returncode", "stdout", "stderr", "wall", "load_bias", "crash"})."""
    from ..profile.runner import run_job
    res = run_job(program_job(path, args, caches, argv0, timeout, preload=preload), log=log)
    missing = any(t is None for t in res.traces)
    crash = crash_of(res.returncode, missing)
    info = {"returncode": res.returncode, "stdout": res.stdout, "stderr": res.stderr,
            "wall": res.wall, "load_bias": getattr(res, "load_bias", None) or 0, "crash": crash}
    if crash and allow_crash:
        return None, info
    if missing:
        raise ExternalToolError(f"qemu-x86_64 wrote no plugin output for "
                                f"{os.path.basename(path)} (exit {res.returncode}): "
                                f"{_last_line(res.stderr) or 'no message'}")
    return {c["name"]: tr for c, tr in zip(caches, res.traces)}, info


def _last_line(text):
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _med(runs, key):
    return statistics.median(r[key] for r in runs)


def _spread(runs, key):
    vals = [r[key] for r in runs]
    m = statistics.median(vals)
    return (max(vals) - min(vals)) / m if m else 0.0


_COUNTS = ("misses", "fetches", "miss_rate", "instructions", "program_misses",
           "program_instructions")


def check_placements(n):
    from .placements import MAX_PLACEMENTS
    if n is None:
        return None
    if not isinstance(n, int) or not 1 <= n <= MAX_PLACEMENTS:
        raise BadInput(f"--placements {n}: expected 1 to {MAX_PLACEMENTS}")
    return n


def evaluate_programs(specs, caches, args=(), repeat=1, timeout=600, log=None, compare="output",
                      masks=(), placements=None):
    """Rows (one per program and cache model, the first program the baseline of each
    model) and problems (a crash; output, exit status or instruction count differing
    from the first program's, or differing between repeats).

    ``placements``: run every program with libc at that many placements (page shifts,
    evaluate.placements; default: the distinct ones of the largest cache way, at most 8);
    a row's counts are the mean over placements of each placement's median over repeats,
    its ``placements`` list holds each placement's own."""
    from . import placements as plc
    log = log or (lambda m: None)
    if compare not in COMPARE:
        raise BadInput(f"--compare {compare}: expected one of {', '.join(COMPARE)}")
    masks = compile_masks(masks)
    progs = check_programs(specs)
    qemu_user()      # one clear error before anything runs
    caches = [c if isinstance(c, dict) else _cache(c) for c in caches]
    n = check_placements(placements) or plc.default_count(caches)
    shifts = [plc.shift_pages(k, n) for k in range(n)]
    preloads = [plc.preload(k, n) for k in range(n)]       # built before anything runs
    if n > 1:
        for label, path in progs:
            if not _dynamic(path):
                log(f"{label}: statically linked: nothing to move, its placements are alike")
    argv0 = os.path.basename(progs[0][1])
    runs = {}           # label -> placement -> cache -> [run dicts]
    outputs = {}        # label -> placement -> [(returncode, masked stdout)]
    crashes = {}        # label -> (signal or reason, last stderr line)
    info = {}
    # Every program runs from the same path (a symlink in one directory): the executable's
    # name is on the initial stack (AT_EXECFN), and its length shifts what libc and the
    # loader do by a few instructions. /tmp, not $TMPDIR: the same length for every caller.
    stage = tempfile.mkdtemp(prefix="linepack-evalprog-", dir="/tmp")
    try:
        for label, path in progs:
            ranges, code_bytes = _exec_ranges(path)
            info[label] = {"path": path, "code_bytes": code_bytes}
            link = os.path.join(stage, argv0)
            if os.path.lexists(link):
                os.unlink(link)
            os.symlink(os.path.abspath(path), link)
            for k, pre in enumerate(preloads):
                if label in crashes:
                    break
                where = f" placement {k + 1}/{n} (libc +{shifts[k]} pages)" if n > 1 else ""
                _measure(label, link, ranges, args, caches, argv0, repeat, timeout, log,
                         runs.setdefault(label, {}).setdefault(k, {}),
                         outputs.setdefault(label, {}).setdefault(k, []), crashes, masks,
                         pre, where)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    rows = []
    for c in caches:
        for label, _ in progs:
            crash = crashes.get(label)
            per = [] if crash else [runs[label][k].get(c["name"], []) for k in range(n)]
            rc, out = outputs[label][0][0]
            row = {"program": label, "cache": c["name"], "mode": "user",
                   "crashed": crash[0] if crash else None}
            places = [dict({key: _med(rs, key) for key in _COUNTS}, shift_pages=shifts[k])
                      for k, rs in enumerate(per)]
            for key in _COUNTS:
                row[key] = statistics.fmean(p[key] for p in places) if places else None
            vals = [p["misses"] for p in places]
            walls = [r["wall"] for rs in per for r in rs]
            row.update({"code_bytes": info[label]["code_bytes"],
                        "time_s": statistics.median(walls) if walls else None,
                        "repeats": len(outputs[label][0]),
                        "misses_spread": (max(_spread(rs, "misses") for rs in per)
                                          if per else None),
                        "instructions_spread": (max(_spread(rs, "instructions") for rs in per)
                                                if per else None),
                        "placements": n, "shift_pages": shifts,
                        "misses_min": min(vals) if vals else None,
                        "misses_max": max(vals) if vals else None,
                        "misses_stdev": statistics.pstdev(vals) if vals else None,
                        "per_placement": places,
                        "exit_status": rc, "stdout_bytes": len(out), "same_output": None,
                        "image": os.path.abspath(info[label]["path"])})
            rows.append(row)
    return rows, cross_check(rows, outputs, progs, compare, crashes)


def _measure(label, path, ranges, args, caches, argv0, repeat, timeout, log, runs, outputs,
             crashes, masks, preload=None, where=""):
    """``repeat`` runs of one program at one placement: ``runs`` (cache -> [run dicts])
    and ``outputs`` ([(returncode, masked stdout)]) filled."""
    for k in range(repeat):
        trs, res = run_program(path, args, caches, argv0=argv0, timeout=timeout, log=log,
                               allow_crash=True, preload=preload)
        outputs.append((res["returncode"], masked(res["stdout"], masks)))
        if trs is None:
            crashes[label] = (res["crash"], _last_line(res["stderr"]))
            log(f"{label}{where} run {k + 1}/{repeat}: crashed ({res['crash']}) "
                f"{_last_line(res['stderr'])}")
            return                                  # a crash is not measured again
        b = np.uint64(res["load_bias"])        # a PIE's code runs at its link address + bias
        for name, tr in trs.items():
            inb = inside(tr.tb_addr, (ranges[0] + b, ranges[1] + b))
            runs.setdefault(name, []).append({
                "fetches": tr.fetches, "misses": tr.misses, "instructions": tr.instructions,
                "miss_rate": tr.misses / tr.fetches if tr.fetches else 0.0,
                "program_instructions": int(np.dot(tr.tb_insns[inb].astype(np.uint64),
                                                   tr.tb_execs[inb])),
                "program_misses": int(tr.tb_misses[inb].sum()), "wall": res["wall"]})
        first = next(iter(trs.values()))
        log(f"{label}{where} run {k + 1}/{repeat}: " + ", ".join(
            f"{n} {tr.misses:,} misses" for n, tr in trs.items()) +
            f"; {first.instructions:,} instructions, exit {res['returncode']} "
            f"({res['wall']:.1f} s)")


def _cache(name):
    from ..profile.trace import cache_config
    return cache_config(name)


def cross_check(rows, outputs, progs, compare="output", crashes=None):
    """Fill rows' same_output; problems: crashes first, then against the first program.
    ``outputs``: label -> placement -> [(returncode, masked stdout) per repeat]; outputs
    are compared within a placement (a program may print addresses)."""
    crashes = crashes or {}
    outputs = {lb: ({0: o} if isinstance(o, list) else o) for lb, o in outputs.items()}
    problems = [f"{label}: crashed ({why}) under qemu-x86_64" + (f": {err}" if err else "")
                for label, (why, err) in crashes.items()]
    base_label = progs[0][0]
    base = outputs[base_label]
    for label, _ in progs:
        if label in crashes:
            continue
        mine = outputs[label]
        if any(len({rc if compare == "exit" else (rc, out) for rc, out in reps}) > 1
               for reps in mine.values()):
            what = "exit status" if compare == "exit" else "output or exit status"
            problems.append(f"{label}: {what} differs between repeats")
        # nothing to compare with when the first program crashed
        pairs = [(mine[k][0], base[k][0]) for k in mine if k in base]
        same = None if base_label in crashes else all(
            rc == brc and (compare == "exit" or out == bout) for (rc, out), (brc, bout) in pairs)
        for r in rows:
            if r["program"] == label:
                r["same_output"] = same
        if label == base_label or base_label in crashes:
            continue
        for (rc, out), (brc, bout) in pairs:
            if compare == "output" and out != bout:
                problems.append(f"{label}: stdout differs from {base_label}'s ({len(out):,} vs "
                                f"{len(bout):,} bytes"
                                f"{', masked' if _was_masked(out, bout) else ''}): "
                                "not the same work (--mask REGEX for volatile text, or "
                                "--compare exit)")
                break
        for (rc, out), (brc, bout) in pairs:
            if rc != brc:
                problems.append(f"{label}: exit status {rc} vs {brc} for {base_label}")
                break
    first_cache = rows[0]["cache"]
    rs = [r for r in rows if r["cache"] == first_cache and r["instructions"] is not None]
    if rs and rs[0]["program"] == base_label:
        b = rs[0]
        for r in rs[1:]:
            bi, mi = b["instructions"], r["instructions"]
            if bi and abs(mi - bi) / bi > INSTRUCTION_TOLERANCE:
                problems.append(
                    f"{r['program']}: {mi:,.0f} user-mode instructions vs {bi:,.0f} for "
                    f"{b['program']} ({(mi - bi) / bi:+.3%}, tolerance "
                    f"{INSTRUCTION_TOLERANCE:.1%}): different work, or a rewrite that changes "
                    "the executed code (e.g. BOLT's block reordering); MPKI normalises for it")
    return problems


def _was_masked(*outs):
    return any(MASKED in o for o in outs)


# (header, width, format of a value) of each column after the program's name
_COLUMNS = (
    ("L1i misses", 12, lambda r, b: f"{r['misses']:,.0f}"),
    ("vs base", 8, lambda r, b: f"{(r['misses'] - b) / b:+.2%}" if b else "-"),
    ("prog misses", 11, lambda r, b: f"{r['program_misses']:,.0f}"),
    ("fetches", 13, lambda r, b: f"{r['fetches']:,.0f}"),
    ("miss rate", 9, lambda r, b: f"{r['miss_rate']:.2%}"),
    ("MPKI", 7, lambda r, b: f"{1000.0 * r['misses'] / r['instructions']:.3f}"
     if r["instructions"] else "-"),
    ("instructions", 14, lambda r, b: f"{r['instructions']:,.0f}"),
)


def _beats(r, base):
    """'k/N': placements where ``r`` misses less than ``base`` at the same placement."""
    mine, theirs = r.get("per_placement") or [], base.get("per_placement") or []
    if r is base or not mine or len(mine) != len(theirs):
        return "-"
    return f"{sum(a['misses'] < b['misses'] for a, b in zip(mine, theirs))}/{len(mine)}"


def format_rows(rows, args=()):
    """One table per cache model, like the kernel evaluate's; the first program is the
    base. Every column has a header; a crashed program's row says so instead of counts.
    Over several libc placements: the mean, and the least and most misses of a placement,
    and on how many placements a program misses less than the base."""
    out = []
    w = max([16] + [len(r["program"]) for r in rows])
    for cache in dict.fromkeys(r["cache"] for r in rows):
        rs = [r for r in rows if r["cache"] == cache]
        base = rs[0]
        n = max(r["repeats"] for r in rs)
        places = max(r.get("placements") or 1 for r in rs)
        hdr = (f"{'program':<{w}} " + " ".join(f"{h:>{cw}}" for h, cw, _ in _COLUMNS) +
               (f" {'min':>12} {'max':>12} {'fewer':>6}" if places > 1 else "") +
               f" {'code bytes':>10} {'output':>8} {'time s':>7} {'misses ±':>9}")
        runs = f"{'median of ' + str(n) + ' runs' if n > 1 else '1 run'}"
        if places > 1:
            sh = base.get("shift_pages") or []
            what = (f"mean over {places} libc placements"
                    f"{f' (+{sh[0]}..+{sh[-1]} pages)' if sh else ''}, each {runs}; min/max: "
                    "the placements' least and most misses; fewer: placements with fewer "
                    "misses than the base's; ")
        else:
            what = f"{runs}; "
        out += [f"user-mode L1i, {cache} (qemu-x86_64, all user code incl. libraries; "
                f"{what}misses ±: their spread between runs)", hdr, "-" * len(hdr)]
        bm = base["misses"] if not base.get("crashed") else None
        for r in rs:
            extra = ""
            if r.get("crashed"):
                span = sum(cw + 1 for _, cw, _ in _COLUMNS) - 1     # the count columns
                if places > 1:
                    span += 33
                cells = f"{'CRASHED (' + r['crashed'] + ')':<{span}}"
                same = "crashed"
            else:
                cells = " ".join(f"{f(r, bm):>{cw}}" for _, cw, f in _COLUMNS)
                if places > 1:
                    extra = (f" {r['misses_min']:>12,.0f} {r['misses_max']:>12,.0f} "
                             f"{_beats(r, base):>6}")
                same = "base" if r is base else {True: "same", False: "DIFF"}.get(
                    r["same_output"], "-")
            sp = r.get("misses_spread")
            t = r.get("time_s")
            out.append(f"{r['program']:<{w}} {cells}{extra} {r['code_bytes']:>10,} {same:>8} "
                       f"{'-' if t is None else format(t, '.2f'):>7} "
                       f"{'-' if sp is None or r['repeats'] < 2 else format(sp, '.3%'):>9}")
        out.append("")
    return "\n".join(out).rstrip("\n")


__all__ = ["evaluate_programs", "format_rows", "check_programs", "parse_program",
           "check_placements",
           "INSTRUCTION_TOLERANCE", "PROGRAM_ENV", "COMPARE", "compile_masks", "masked"]
