"""Profile (and measure) a userspace program under ``qemu-x86_64`` with linepack's plugin.

QEMU's user mode runs the program's own code at its link-time addresses when it
is a non-PIE executable (ET_EXEC), so the plugin's block addresses (``mode=user``)
are the ELF's addresses and ``Profile.from_blocks`` symbolizes them directly.
Shared libraries and the dynamic loader run too; their blocks are outside the
image and are left out of the profile (counted in ``meta["outside_instructions"]``),
but they do go through the simulated cache, like on hardware.

A program's threads are counted each on its own (the plugin's vCPUs) and summed:
the profile is exact for any number of threads; ``meta["threads"]`` says how many
ran (when more than one).

PIE executables (ET_DYN with an interpreter) are loaded at a base QEMU picks,
the same on every run of one QEMU build; each run reads it from QEMU's own
``-d page`` log (``start_code``, runner.load_bias) and takes it off the
program's block and edge addresses, so a PIE's profile holds link addresses
like a non-PIE's. Shared libraries are refused.

    record_user(program, args, output=...)      -> Profile (edges on)
    run_user(program, args, cache="intel-32k-8w") -> (PluginTrace, UserRun)  measurement
"""

import os
from dataclasses import dataclass

import numpy as np

from ..errors import BadInput, ExternalToolError
from ..image.elf import ET_EXEC, ElfImage
from . import trace
from .runner import QEMU_USER, qemu_user
from .model import Profile

ET_DYN = 3


@dataclass
class UserRun:
    """What the program did: exit status, output, wall time, the command."""
    returncode: int
    stdout: bytes
    stderr: bytes
    wall: float
    command: list
    load_bias: int = 0               # PIE: runtime address - link address of the program


def check_program(path):
    """The program as an ElfImage; refuses what user-mode profiling cannot place."""
    if not os.path.exists(path):
        raise BadInput(f"{path}: no such program")
    image = ElfImage(path)
    from ..relayout.user.pie import is_pie
    if image.type == ET_DYN and not is_pie(image):
        raise BadInput(f"{path}: a shared library, not a program (ET_DYN without an "
                       "interpreter): profile a program that loads it")
    if image.type != ET_EXEC and not is_pie(image):
        raise BadInput(f"{path}: not an executable (ELF type {image.type})")
    return image


def exec_ranges(image, bias=0):
    """(starts, ends) of the executable sections, sorted: for image.intervals.containing;
    ``bias``: where a PIE ran (its runtime ranges)."""
    secs = sorted((s for s in image.sections if s.is_code and s.is_alloc and s.size),
                  key=lambda s: s.addr)
    lo = np.array([s.addr + bias for s in secs], np.uint64)
    hi = np.array([s.end + bias for s in secs], np.uint64)
    return lo, hi


def unbias(addrs, inb, bias):
    """Link addresses of the program's runtime addresses (``inb``); others unchanged."""
    if not bias:
        return addrs
    return np.where(inb, addrs - np.uint64(bias), addrs)


def inside(addrs, ranges):
    """True where an address lies in one of the exec_ranges."""
    from ..image.intervals import containing
    return containing(ranges[0], ranges[1], addrs) >= 0


def run_user(program, args=(), cache=None, edges=False, stdin=None, cwd=None, env=None,
             timeout=600, log=None, start=None, stop=None, check=True):
    """Run ``program args`` under qemu-x86_64 with the plugin (mode=user).

    cache: None or a cache model name/path/dict (then fetches and misses are
    simulated). Returns (PluginTrace, UserRun). A non-zero exit raises
    ExternalToolError when ``check``.
    """
    from .runner import USER, Plugin, QemuJob, run_job
    check_program(program)
    cfg = trace.cache_config(cache) if isinstance(cache, str) else cache
    res = run_job(QemuJob(USER, program, [Plugin(cache=cfg, edges=edges, start=start, stop=stop)],
                          args=tuple(map(str, args)), stdin=stdin, env=env, cwd=cwd,
                          timeout=timeout, check=check, mode="user"), log=log)
    if res.traces[0] is None and res.returncode < 0:
        raise ExternalToolError(f"{os.path.basename(program)} was killed by signal "
                                f"{-res.returncode} under {QEMU_USER}: "
                                f"{(res.stderr.strip().splitlines() or ['no message'])[-1]}")
    if res.traces[0] is None:
        raise ExternalToolError(f"{QEMU_USER} wrote no plugin output (exit {res.returncode}): "
                                f"{(res.stderr.strip().splitlines() or ['no message'])[-1]}")
    run = UserRun(res.returncode, res.stdout, res.stderr.encode(), res.wall, res.command,
                  getattr(res, "load_bias", None) or 0)
    return res.traces[0], run


def threads_note(tr):
    """', summed over N threads (at most M at once)' for a run of several guest threads."""
    if tr.threads <= 1:
        return ""
    return f", summed over {tr.threads} threads (at most {tr.threads_peak} at once)"


def record_user(program, args=(), output=None, meta=None, log=None, stdin=None, cwd=None,
                env=None, timeout=600, exit_ok=frozenset({0})):
    """Profile ``program args`` (blocks + edges) under qemu-x86_64; returns the Profile.

    ``exit_ok``: the exit statuses a run may end with (None: any); any other status,
    or a signal, raises ExternalToolError: the profile of a run that failed is not
    what its user meant to measure unless they say so."""
    image = check_program(program)
    if log:
        log(f"running {os.path.basename(program)} {' '.join(map(str, args))} under "
            f"{QEMU_USER} + plugin (mode=user, edges=on)")
    tr, run = run_user(program, args, edges=True, stdin=stdin, cwd=cwd, env=env,
                       timeout=timeout, log=log, check=False)
    if run.returncode < 0 or (exit_ok is not None and run.returncode not in exit_ok):
        what = (f"was killed by signal {-run.returncode}" if run.returncode < 0
                else f"exited with status {run.returncode} (to keep such a run: "
                     f"--exit-status {run.returncode})")
        err = run.stderr.decode("utf-8", "replace").strip().splitlines()
        raise ExternalToolError(f"{os.path.basename(program)} {what} under {QEMU_USER}: "
                                f"{err[-1] if err else 'no message'}")
    if tr.approximate:
        raise ExternalToolError(f"{os.path.basename(program)}: the plugin could not count all "
                                f"{tr.threads} threads' blocks (a thread index beyond its table): "
                                "no profile written")
    ranges = exec_ranges(image, run.load_bias)
    inb = inside(tr.tb_addr, ranges)
    outside = int(np.dot(tr.tb_insns[~inb].astype(np.uint64), tr.tb_execs[~inb]))
    src_in, dst_in = inside(tr.edge_src, ranges), inside(tr.edge_dst, ranges)
    ine = src_in | dst_in
    last = run.stdout.decode("utf-8", "replace").strip().splitlines()
    m = {"workload": os.path.basename(program), "loops": None,
         "cmdline": " ".join([os.path.basename(program)] + [str(a) for a in args]),
         "result_line": last[-1] if last else "", "exit_status": run.returncode,
         "mode": "user", "outside_instructions": outside}
    if tr.threads > 1:
        m["threads"] = tr.threads
    if run.load_bias:
        m["load_bias"] = f"{run.load_bias:#x}"
    m.update(meta or {})
    b = run.load_bias
    prof = Profile.from_blocks(image, unbias(tr.tb_addr, inb, b)[inb], tr.tb_size[inb],
                               tr.tb_insns[inb], tr.tb_execs[inb],
                               edge_src=unbias(tr.edge_src, src_in, b)[ine],
                               edge_dst=unbias(tr.edge_dst, dst_in, b)[ine],
                               edge_count=tr.edge_count[ine], meta=m)
    if not len(prof.func_addr):
        raise BadInput(f"{program}: no executed block falls in a function of the program "
                       "(stripped, or not the binary that ran?)")
    if log:
        log(f"{prof.meta['instructions']:,} instructions in the program "
            f"({outside:,} in libraries and the loader), {len(prof.func_addr)} functions, "
            f"{len(prof.edge_from):,} edges{threads_note(tr)} ({run.wall:.1f} s)")
    if output:
        prof.save(output)
    return prof


def measure_user(program, args=(), cache="intel-32k-8w", stdin=None, cwd=None, timeout=600,
                 log=None):
    """Simulated user-mode L1i of one run: {"fetches", "misses", "instructions",
    "program_instructions", "stdout", "wall"}. Counts every user-mode fetch
    (program, libraries, loader) like a hardware counter would."""
    image = check_program(program)
    tr, run = run_user(program, args, cache=cache, stdin=stdin, cwd=cwd, timeout=timeout, log=log)
    inb = inside(tr.tb_addr, exec_ranges(image, run.load_bias))
    return {"fetches": tr.fetches, "misses": tr.misses, "instructions": tr.instructions,
            "program_instructions": int(np.dot(tr.tb_insns[inb].astype(np.uint64),
                                               tr.tb_execs[inb])),
            "program_misses": int(tr.tb_misses[inb].sum()),
            "stdout": run.stdout, "wall": run.wall}


__all__ = ["check_program", "run_user", "record_user", "measure_user", "UserRun", "qemu_user",
           "threads_note"]
