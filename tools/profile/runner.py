"""One QEMU job, described as data, run here, on a process pool or on a Dask worker.

Every measurement linepack makes is "run a kernel (system mode) or a program
(user mode) with N copies of the TCG plugin, then read what each copy wrote":
``profile``, ``boot``, the booted ``evaluate``, the what-if trace recording and
``evaluate --program`` all describe their run as a :class:`QemuJob` and call
:func:`run_job`.

A job is resolved (:func:`prepare`) into a :class:`Launch`: the input files
(kernel or program, initramfs, plugin .so, disk images) and plain arguments. A
Launch runs wherever those files are (:func:`execute`): this process, a pool
worker, or a Dask worker that was sent the files once (``distributed.py``).

Each plugin instance gets its own copy of the .so (QEMU loads a path once: a
copy is a separate set of globals) and its own output file; the results come
back as PluginTraces (and tbtrace arrays) in the order the plugins were given.

With ``cache=True`` a job's result is kept under ``cache_dir()/runs/`` by the
content hash of its inputs and arguments (and its ``run`` number, so repeats
are distinct boots): asking again returns it without booting.
"""

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from ..errors import ExternalToolError
from ..io import file_hash

SYSTEM, USER = "system", "user"
QEMU_USER = "qemu-x86_64"
RUN_CACHE_VERSION = 1


@dataclass
class Plugin:
    """One instance of linepack's TCG plugin and its options (see trace.plugin_args).

    ``cache``: a cache-model dict (trace.cache_config) or None; ``tbtrace``: also
    dump every executed block in order."""
    cache: "dict | None" = None
    edges: bool = False
    start: "int | None" = None
    stop: "int | None" = None
    tbtrace: bool = False


@dataclass
class QemuJob:
    """One QEMU run, as data (picklable, hashable by content)."""
    kind: str                          # SYSTEM (kernel + workload) or USER (program)
    image: str                         # the vmlinux / bzImage, or the program
    plugins: list = field(default_factory=list)
    workload: "str | None" = None      # SYSTEM: workload name (configs/workloads)
    loops: "int | None" = None
    args: tuple = ()                   # USER: the program's arguments
    argv0: "str | None" = None         # USER: argv[0] (qemu -0)
    stdin: "bytes | None" = None
    env: "dict | None" = None          # SYSTEM: more key=value words for /init; USER: environ
    preload: "str | None" = None       # USER: a library ld.so loads first (LD_PRELOAD, guest only)
    cwd: "str | None" = None           # USER: working directory
    append: "str | None" = None        # SYSTEM: command line instead of configs/kernel.toml's
    icount: bool = True
    timeout: float = 1800
    check: bool = True                 # result line (SYSTEM) / exit status 0 (USER)
    mode: str = "kernel"               # the plugin's mode= (USER jobs: "user")
    label: str = ""                    # for progress lines
    run: int = 0                       # repeat number: distinct boots are distinct jobs
    cache: bool = False                # reuse a stored result of the same content hash
    serial_log: "str | None" = None    # SYSTEM: also write the serial output there (local only)


@dataclass
class Launch:
    """A prepared job: input files by role, and plain arguments."""
    job: QemuJob
    inputs: dict                       # role -> host path ("image", "initrd", "plugin", "disk0", ...)
    append: "str | None" = None
    extra_args: tuple = ()
    want: "str | None" = None          # SYSTEM: expected result-line prefix
    workload_name: "str | None" = None
    plugin_args: list = field(default_factory=list)   # per plugin: "k=v" list without out/tbtrace


@dataclass
class JobResult:
    """What a job measured: one PluginTrace per plugin (None for a plugin without
    output), tbtrace arrays, and how the run went."""
    traces: list
    tbtraces: list
    result_line: "str | None"
    wall: float
    returncode: int
    serial: str = ""
    stdout: bytes = b""
    stderr: str = ""
    command: list = field(default_factory=list)
    cached: bool = False
    load_bias: "int | None" = None     # USER, PIE: where qemu-x86_64 loaded the program


def job_key(launch):
    """Content hash of a prepared job: its input files' bytes and its arguments."""
    j = launch.job
    desc = {"v": RUN_CACHE_VERSION, "inputs": {k: file_hash(p) for k, p in
                                               sorted(launch.inputs.items())},
            "append": launch.append, "extra": [_unpath(a, launch.inputs) for a in
                                               launch.extra_args],
            "want": launch.want, "plugins": launch.plugin_args,
            "tbtrace": [p.tbtrace for p in j.plugins],
            "args": [str(a) for a in j.args], "argv0": j.argv0, "icount": j.icount,
            "stdin": hashlib.sha256(j.stdin).hexdigest() if j.stdin else None,
            "check": j.check, "run": j.run, "kind": j.kind,
            # a USER job's environment and directory change what the program does
            # (SYSTEM jobs' env is on the kernel command line: part of "append")
            "env": sorted(j.env.items()) if j.kind == USER and j.env else None,
            "cwd": os.path.abspath(j.cwd) if j.kind == USER and j.cwd else None}
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()


def _unpath(arg, inputs):
    """An argument with input paths replaced by their role (paths differ per machine)."""
    s = str(arg)
    for role, p in inputs.items():
        s = s.replace(p, "{" + role + "}")
    return s


# ---- preparing and running ---------------------------------------------------------

def plugin_so(log=None):
    from . import plugin_build
    return plugin_build.build_plugin(log=log or (lambda m: None))


def prepare(job, log=None):
    """Resolve a job into a Launch (builds the workload's initramfs, the plugin)."""
    from . import trace
    if job.kind not in (SYSTEM, USER):
        raise ValueError(f"job kind {job.kind!r}")
    inputs = {"image": os.path.abspath(job.image)}
    pargs = []
    for p in job.plugins:
        pargs.append([a for a in trace.plugin_args("-", cache=p.cache, edges=p.edges,
                                                   mode=job.mode, start=p.start, stop=p.stop)
                      if not a.startswith("out=")])
    if job.plugins:
        inputs["plugin"] = plugin_so(log)
    if job.kind == USER and job.preload:
        inputs["preload"] = os.path.abspath(job.preload)
    launch = Launch(job, inputs, plugin_args=pargs)
    if job.kind == SYSTEM:
        from . import qemu
        qemu.check_kernel_path(job.image, "kernel")
        boot = qemu.workload_boot(job.image, job.workload, job.loops, log=log, append=job.append,
                                  env=job.env)
        inputs["initrd"] = os.path.abspath(boot.initrd)
        extra = list(boot.extra_args)
        for k, a in enumerate(extra):       # disk images are inputs too (shipped like the rest)
            if a.startswith("file=") and ",if=none" in a:
                path = a[len("file="):a.index(",if=none")]
                inputs[f"disk{k}"] = path
        launch.append, launch.extra_args = boot.append, tuple(extra)
        launch.want, launch.workload_name = boot.want, boot.workload
    return launch


def run_job(job, log=None):
    """Prepare and run one job here (from the run cache when ``job.cache``)."""
    return run_jobs([job], parallel=1, log=log, progress=False)[0]


def execute(launch, paths=None):
    """Run a prepared job; ``paths`` maps input roles to local files (default: the
    launch's own paths). Returns a JobResult."""
    from . import trace
    paths = dict(launch.inputs, **(paths or {}))
    job = launch.job
    with tempfile.TemporaryDirectory(prefix="linepack-run-") as tmp:
        outs, tbts, opts = [], [], []
        for k, (p, args) in enumerate(zip(job.plugins, launch.plugin_args)):
            out = os.path.join(tmp, f"p{k}.bin")
            tbt = os.path.join(tmp, f"p{k}.tbt") if p.tbtrace else None
            so = paths["plugin"]
            if k:
                so = os.path.join(tmp, f"plugin{k}.so")     # a distinct file: its own globals
                shutil.copy(paths["plugin"], so)
            opts.append(trace.plugin_option(so, [f"out={out}"] + args +
                                            ([f"tbtrace={tbt}"] if tbt else [])))
            outs.append(out)
            tbts.append(tbt)
        plugin_opts = [x for o in opts for x in ("-plugin", o)]
        if job.kind == SYSTEM:
            res = _execute_system(launch, paths, plugin_opts)
        else:
            res = _execute_user(launch, paths, plugin_opts, tmp)
        missing = [o for o in outs if not os.path.exists(o)]
        if missing and job.check:
            raise ExternalToolError(f"QEMU wrote no plugin output for {os.path.basename(job.image)}"
                                    f" (exit {res.returncode}): "
                                    f"{_last_line(res.stderr) or 'no message'}")
        res.traces = [trace.read_plugin_output(o) if os.path.exists(o) else None for o in outs]
        res.tbtraces = [trace.read_tbtrace(t) if t and os.path.exists(t) else None for t in tbts]
    return res


def _last_line(text):
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _execute_system(launch, paths, plugin_opts):
    from . import qemu
    job = launch.job
    extra = [_repath(a, launch.inputs, paths) for a in launch.extra_args]
    r = qemu.run_kernel(paths["image"], paths["initrd"], append=launch.append, icount=job.icount,
                        timeout=job.timeout, extra_args=tuple(extra) + tuple(plugin_opts),
                        log=job.serial_log, check=job.check)
    if job.check:
        qemu.check_workload_result(qemu.WorkloadBoot(launch.workload_name, paths["initrd"],
                                                     launch.append, tuple(extra), launch.want), r)
    elif launch.want:
        from . import workloads
        r.result_line = workloads.find_result(r.serial, launch.want)
    return JobResult([], [], r.result_line, r.wall, r.returncode, serial=r.serial,
                     stderr=r.stderr, command=r.command)


def _repath(arg, inputs, paths):
    s = str(arg)
    for role, p in inputs.items():
        if paths.get(role, p) != p:
            s = s.replace(p, paths[role])
    return s


def qemu_user():
    exe = shutil.which(QEMU_USER)
    if exe is None:
        raise ExternalToolError(f"{QEMU_USER} is not installed: install qemu-user "
                                "(apt-get install qemu-user)")
    return exe


def _pie(path):
    from ..image.elf import ElfImage
    from ..relayout.user.pie import is_pie
    return is_pie(ElfImage(path))


def load_bias(page_log, path):
    """Load bias of a PIE from qemu-x86_64's ``-d page`` log: QEMU logs the main
    program's ``start_code`` (its lowest executable PT_LOAD, after the bias)."""
    from ..image.elf import ElfImage
    start = None
    with open(page_log, errors="replace") as f:
        for line in f:
            if line.startswith("start_code"):
                start = int(line.split()[1], 16)
    if start is None:
        raise ExternalToolError(f"{QEMU_USER} logged no start_code for {path} (-d page)")
    ph = ElfImage(path).phdrs
    ex = ph[(ph["type"] == 1) & ((ph["flags"] & 1) != 0)]
    return start - int(ex["vaddr"].min())


def _execute_user(launch, paths, plugin_opts, tmp=None):
    job = launch.job
    cmd = [qemu_user()]
    if job.argv0:
        cmd += ["-0", job.argv0]
    page_log = None
    if tmp is not None and _pie(paths["image"]):
        # a PIE runs at a base QEMU picks (the same on every run): its page log says which
        page_log = os.path.join(tmp, "qemu-page.log")
        cmd += ["-d", "page", "-D", page_log]
    if paths.get("preload"):
        # the program's environment only (qemu-x86_64 is itself a dynamic executable),
        # loaded before any library the environment already preloads
        theirs = (job.env or {}).get("LD_PRELOAD")
        cmd += ["-E", "LD_PRELOAD=" + paths["preload"] + (f":{theirs}" if theirs else "")]
    cmd += list(plugin_opts) + [paths["image"], *map(str, job.args)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, input=job.stdin, stdin=None if job.stdin is not None
                           else subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, cwd=job.cwd, env=job.env, timeout=job.timeout)
    except subprocess.TimeoutExpired:
        raise ExternalToolError(f"{os.path.basename(job.image)} under {QEMU_USER} did not "
                                f"finish in {job.timeout} s") from None
    wall = time.monotonic() - t0
    err = p.stderr.decode("utf-8", "replace")
    if job.check and p.returncode != 0:
        raise ExternalToolError(f"{os.path.basename(job.image)} exited with status "
                                f"{p.returncode} under {QEMU_USER}: "
                                f"{_last_line(err) or 'no message'}")
    bias = load_bias(page_log, paths["image"]) if page_log else None
    return JobResult([], [], None, wall, p.returncode, stdout=p.stdout, stderr=err,
                     command=cmd, load_bias=bias)


def describe(job):
    """A short name of a job for progress lines."""
    what = job.label or os.path.basename(job.image)
    if job.kind == SYSTEM:
        what += f" {job.workload}"
    return what + (f" run {job.run + 1}" if job.run else "")


__all__ = ["Plugin", "QemuJob", "Launch", "JobResult", "prepare", "execute", "run_job",
           "job_key", "file_hash", "describe", "SYSTEM", "USER"]


# ---- many jobs: a process pool here, or a Dask cluster ---------------------------------

def default_jobs():
    """Parallel jobs by default: the cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _cache_path(launch):
    from ..targets import cache_dir
    return os.path.join(cache_dir(), "runs", job_key(launch) + ".pkl")


def _load_cached(launch):
    path = _cache_path(launch)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            res = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
        return None                    # a damaged entry: run again and replace it
    res.cached = True
    return res


def _store_cached(launch, res):
    from ..io import atomic_output
    path = _cache_path(launch)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with atomic_output(path) as f:
        pickle.dump(res, f, protocol=pickle.HIGHEST_PROTOCOL)


def run_jobs(jobs, parallel=None, scheduler=None, log=None, progress=True):
    """Run independent jobs; returns their JobResults in the order of ``jobs``.

    ``parallel``: how many at once on a local process pool (default: the cores;
    1 = one after another in this process). ``scheduler``: a Dask scheduler
    address (or a distributed.Client) instead: the jobs run on that cluster.
    One progress line per finished job goes to ``log``. The jobs are prepared
    here first (initramfs, plugin), so workers only run QEMU.
    """
    log = log or (lambda m: None)
    jobs = list(jobs)
    launches = [prepare(j, log=log) for j in jobs]
    results = [None] * len(jobs)
    todo = []
    for k, la in enumerate(launches):
        if la.job.cache:
            results[k] = _load_cached(la)
        if results[k] is None:
            todo.append(k)
    done = [len(jobs) - len(todo)]

    def finished(k, res):
        results[k] = res
        done[0] += 1
        if launches[k].job.cache:
            _store_cached(launches[k], res)
        if progress:
            log(f"[{done[0]}/{len(jobs)}] {describe(jobs[k])}: {res.wall:.1f} s")

    if scheduler is not None:
        from .cluster import run_on_cluster
        run_on_cluster([launches[k] for k in todo], scheduler,
                       lambda i, res: finished(todo[i], res), execute, log=log)
        return results
    n = default_jobs() if parallel is None else max(1, int(parallel))
    if n == 1 or len(todo) <= 1:
        for k in todo:
            finished(k, execute(launches[k]))
        return results
    import concurrent.futures as cf
    import multiprocessing
    # fork: the workers need nothing but this module; QEMU does the work
    with cf.ProcessPoolExecutor(max_workers=min(n, len(todo)),
                                mp_context=multiprocessing.get_context("fork")) as pool:
        futs = {pool.submit(execute, launches[k]): k for k in todo}
        try:
            for f in cf.as_completed(futs):
                finished(futs[f], f.result())
        except BaseException:
            for f in futs:
                f.cancel()
            raise
    return results
