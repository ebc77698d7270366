"""Reader of the linepack QEMU plugin's output, and cache-model configs as plugin arguments.

The plugin (``tools/profile/plugin/linepack_plugin.c``) writes one little-endian
binary file at QEMU exit::

    header (144 bytes)        magic b"LPKTRACE", version 3, record sizes, flags,
                              mode, cache geometry, counts, totals, window markers,
                              vCPUs (guest threads) created and alive at once
    TB records   (48 B each)  vaddr u64, size u32, ninsns u32, execs u64,
                              fetches u64, misses u64, first u64
                                                            -- sorted by (vaddr, size, ninsns)
    edge records (32 B each)  src u64 (last instruction of the source block),
                              dst u64 (start of the destination block), count u64,
                              src_size u32, flags u32 (1 = fall-through) -- sorted by (src, dst)

A "fetch" is one cache-line access made when the simulated instruction stream
enters a line (see the plugin source for the exact definition); ``misses`` are
L1i misses of those fetches in the configured LRU model.  Per-TB fetches and
misses let callers attribute them to functions.

Cache models live in ``configs/cache/*.toml``::

    name = "intel-32k-8w"
    size = 32768        # bytes
    ways = 8
    line = 64           # bytes
    policy = "lru"      # the only policy the plugin implements
    prefetch = "next-line"   # optional: each fetch of line L also fills L+1
    l2_size = 1048576   # optional: a second level behind this L1 (misses = L2 misses)
    l2_ways = 16

An iTLB is the same model with ``line`` = the page size (a fetch = entering a page,
size = entries x page size).

``cache_config(name_or_path)`` loads one; ``plugin_args(...)`` turns options into
the ``-plugin`` argument list.
"""

import os
from dataclasses import dataclass, field

import numpy as np

from ..errors import BadInput
from ..io import load_toml
from ..resources import data_dir

MAGIC = b"LPKTRACE"
VERSION = 3              # 1: 40-byte TB records, without "first"; 2: 128-byte header,
HEADER_SIZE = 144        # without the vCPU counts (both still read)
HEADER_SIZE_V2 = 128

HEADER_DTYPE = np.dtype([
    ("magic", "S8"), ("version", "<u4"), ("header_size", "<u4"),
    ("tb_record_size", "<u4"), ("edge_record_size", "<u4"),
    ("flags", "<u4"), ("mode", "<u4"),
    ("cache_size", "<u4"), ("cache_ways", "<u4"), ("line_size", "<u4"), ("model_flags", "<u4"),
    ("n_tbs", "<u8"), ("n_edges", "<u8"), ("fetches", "<u8"), ("misses", "<u8"),
    ("roi_start", "<u8"), ("roi_stop", "<u8"), ("translations", "<u8"),
    ("phantoms", "<u8"), ("start_count", "<u8"), ("stop_count", "<u8"),
    ("vcpus", "<u8"), ("vcpus_peak", "<u8"),
])
TB_DTYPE_V1 = np.dtype([("vaddr", "<u8"), ("size", "<u4"), ("ninsns", "<u4"),
                        ("execs", "<u8"), ("fetches", "<u8"), ("misses", "<u8")])
TB_DTYPE = np.dtype(TB_DTYPE_V1.descr + [("first", "<u8")])
NO_FIRST = np.iinfo(np.uint64).max       # "first": the block did not run in the window
EDGE_DTYPE = np.dtype([("src", "<u8"), ("dst", "<u8"), ("count", "<u8"),
                       ("src_size", "<u4"), ("flags", "<u4")])
TBTRACE_DTYPE = np.dtype([("vaddr", "<u8"), ("size", "<u4"), ("ninsns", "<u4")])
assert HEADER_DTYPE.itemsize == HEADER_SIZE and TB_DTYPE_V1.itemsize == 40 and TB_DTYPE.itemsize == 48 and EDGE_DTYPE.itemsize == 32

MODEL_PREFETCH, MODEL_L2 = 1, 2          # header model_flags
MAX_LINE = 1 << 21                        # 2 MiB: an iTLB of 2 MiB pages is a cache of such "lines"
FLAG_CACHE, FLAG_EDGES, FLAG_START, FLAG_STOP, FLAG_STARTED, FLAG_STOPPED, FLAG_SYSTEM = (
    1, 2, 4, 8, 16, 32, 64)
# several vCPUs ran (user mode: guest threads, each counted on its own and summed);
# approximate: a window (start=/stop=) with several threads, or executions not counted
FLAG_THREADS, FLAG_APPROX = 128, 256
EDGE_FALLTHROUGH = 1
MODES = ("kernel", "user", "all")

CONFIG_DIRS = [os.path.join(data_dir("configs"), "cache")]     # not $LINEPACK_CONFIGS


@dataclass
class PluginTrace:
    """One plugin run: per-block arrays, edges, and cache totals."""
    tb_addr: np.ndarray
    tb_size: np.ndarray
    tb_insns: np.ndarray
    tb_execs: np.ndarray
    tb_fetches: np.ndarray
    tb_misses: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_count: np.ndarray
    edge_src_size: np.ndarray
    edge_flags: np.ndarray
    fetches: int
    misses: int
    mode: str
    cache: dict            # {"size", "ways", "line"} or {} when the model was off
    edges_recorded: bool
    roi: dict = field(default_factory=dict)   # start/stop addresses, started/stopped flags
    translations: int = 0
    phantoms: int = 0      # page-crossing phantom instructions the plugin dropped (QEMU 7.2 quirk)
    # per block: position of its first execution in the window (in executed blocks from the
    # window's start), NO_FIRST where it did not run there; None: not recorded (counts-only
    # run or a version 1 output)
    tb_first: np.ndarray = None
    threads: int = 1       # vCPUs the run created: guest threads in user mode (1: one)
    threads_peak: int = 1  # most of them alive at once
    approximate: bool = False   # the plugin could not count exactly (FLAG_APPROX)

    @property
    def kernel_instructions(self):
        """Executed instructions in the recorded mode: sum(tb_insns * tb_execs)."""
        return int(np.dot(self.tb_insns.astype(np.uint64), self.tb_execs))

    instructions = kernel_instructions

    @property
    def block_executions(self):
        return int(self.tb_execs.sum())

    def executed(self):
        """Boolean mask of TB records that ran at least once."""
        return self.tb_execs > 0


def _bad(path, why):
    return BadInput(f"{path}: not a linepack plugin output ({why})")


def read_plugin_output(path):
    """Read the plugin's output file into a :class:`PluginTrace` (numpy arrays)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise BadInput(f"{path}: cannot read plugin output: {e.strerror}") from None
    if len(data) < HEADER_SIZE_V2:
        raise _bad(path, f"truncated: {len(data)} bytes, header needs {HEADER_SIZE_V2}")
    if data[:8] == MAGIC and int.from_bytes(data[8:12], "little") == VERSION:
        if len(data) < HEADER_SIZE:
            raise _bad(path, f"truncated: {len(data)} bytes, header needs {HEADER_SIZE}")
        h = np.frombuffer(data, HEADER_DTYPE, 1)[0]
    else:       # versions 1 and 2: the 128-byte header
        h = np.frombuffer(data[:HEADER_SIZE_V2] + bytes(HEADER_SIZE - HEADER_SIZE_V2),
                          HEADER_DTYPE, 1)[0]
    if bytes(h["magic"]) != MAGIC:
        raise _bad(path, "bad magic")
    version = int(h["version"])
    if version not in (1, 2, VERSION):
        raise BadInput(f"{path}: plugin output version {version}, this linepack reads "
                       f"versions 1 to {VERSION} (rebuild with 'linepack build-plugin')")
    tb_dtype = TB_DTYPE if version >= 2 else TB_DTYPE_V1
    hs, ts, es = int(h["header_size"]), int(h["tb_record_size"]), int(h["edge_record_size"])
    if (hs != (HEADER_SIZE if version == VERSION else HEADER_SIZE_V2) or
            ts != tb_dtype.itemsize or es != EDGE_DTYPE.itemsize):
        raise _bad(path, "unexpected record sizes")
    ntb, ne = int(h["n_tbs"]), int(h["n_edges"])
    need = hs + ntb * ts + ne * es
    if len(data) != need:
        raise _bad(path, f"truncated or oversized: {len(data)} bytes, expected {need}")
    tbs = np.frombuffer(data, tb_dtype, ntb, hs)
    edges = np.frombuffer(data, EDGE_DTYPE, ne, hs + ntb * ts)
    flags = int(h["flags"])
    mode = int(h["mode"])
    first = None
    if version >= 2:
        first = tbs["first"].copy()
        if ntb and not (first != NO_FIRST).any():
            first = None                   # no per-block helper ran: not recorded
    cache = ({"size": int(h["cache_size"]), "ways": int(h["cache_ways"]),
              "line": int(h["line_size"])} if flags & FLAG_CACHE else {})
    if cache and int(h["model_flags"]) & MODEL_PREFETCH:
        cache["prefetch"] = "next-line"
    if cache and int(h["model_flags"]) & MODEL_L2:
        cache["l2"] = True             # misses are L2 misses
    roi = {}
    if flags & (FLAG_START | FLAG_STOP):
        roi = {"start": int(h["roi_start"]) if flags & FLAG_START else None,
               "stop": int(h["roi_stop"]) if flags & FLAG_STOP else None,
               "start_count": int(h["start_count"]), "stop_count": int(h["stop_count"]),
               "started": bool(flags & FLAG_STARTED), "stopped": bool(flags & FLAG_STOPPED)}
    return PluginTrace(
        tb_addr=tbs["vaddr"].copy(), tb_size=tbs["size"].copy(), tb_insns=tbs["ninsns"].copy(),
        tb_execs=tbs["execs"].copy(), tb_fetches=tbs["fetches"].copy(),
        tb_misses=tbs["misses"].copy(),
        edge_src=edges["src"].copy(), edge_dst=edges["dst"].copy(),
        edge_count=edges["count"].copy(), edge_src_size=edges["src_size"].copy(),
        edge_flags=edges["flags"].copy(),
        fetches=int(h["fetches"]), misses=int(h["misses"]),
        mode=MODES[mode] if mode < len(MODES) else str(mode), cache=cache,
        edges_recorded=bool(flags & FLAG_EDGES), roi=roi, translations=int(h["translations"]),
        phantoms=int(h["phantoms"]), tb_first=first,
        threads=int(h["vcpus"]) or 1, threads_peak=int(h["vcpus_peak"]) or 1,
        approximate=bool(flags & FLAG_APPROX))


def read_tbtrace(path):
    """Read a ``tbtrace=`` dump: executed blocks in order (vaddr, size, ninsns)."""
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise BadInput(f"{path}: cannot read tbtrace: {e.strerror}") from None
    if size % TBTRACE_DTYPE.itemsize:
        raise BadInput(f"{path}: truncated tbtrace ({size} bytes)")
    return np.fromfile(path, TBTRACE_DTYPE)


# ---- cache configs ----

def list_cache_configs():
    """Names of the cache models shipped in configs/cache."""
    out = []
    for d in CONFIG_DIRS:
        if os.path.isdir(d):
            out += [n[:-5] for n in sorted(os.listdir(d)) if n.endswith(".toml")]
    return out


def cache_config(name_or_path):
    """Load a cache model: a path to a .toml file, or a name in configs/cache."""
    path = name_or_path
    if not os.path.exists(path):
        for d in CONFIG_DIRS:
            cand = os.path.join(d, name_or_path if name_or_path.endswith(".toml")
                                else name_or_path + ".toml")
            if os.path.exists(cand):
                path = cand
                break
        else:
            raise BadInput(f"unknown cache model '{name_or_path}' (known: "
                           f"{', '.join(list_cache_configs()) or 'none'})")
    cfg = load_toml(path)
    try:
        size, ways, line = int(cfg["size"]), int(cfg["ways"]), int(cfg["line"])
    except (KeyError, TypeError, ValueError) as e:
        raise BadInput(f"{path}: cache model needs integer size, ways and line ({e})") from None
    policy = str(cfg.get("policy", "lru")).lower()
    if policy != "lru":
        raise BadInput(f"{path}: policy '{policy}' is not supported (only lru)")
    sets = size // (ways * line) if ways > 0 and line > 0 else 0
    if (line <= 0 or line & (line - 1) or line > MAX_LINE or ways < 1 or ways > 64 or sets < 1
            or size != sets * ways * line or sets & (sets - 1) or size >= 1 << 31):
        raise BadInput(f"{path}: cache geometry size={size} ways={ways} line={line}: "
                       "size/(ways*line) must be a power of two, line a power of two "
                       f"<= {MAX_LINE}, ways 1..64")
    out = {"name": str(cfg.get("name", os.path.basename(path)[:-5])), "size": size,
           "ways": ways, "line": line, "policy": policy, "sets": sets,
           "kind": str(cfg.get("kind", "l1i"))}
    prefetch = str(cfg.get("prefetch", "none")).lower()
    if prefetch not in ("none", "next-line"):
        raise BadInput(f"{path}: prefetch '{prefetch}' is not supported (none or next-line)")
    if prefetch != "none":
        out["prefetch"] = prefetch
    if "l2_size" in cfg:
        try:
            l2s, l2w = int(cfg["l2_size"]), int(cfg.get("l2_ways", 16))
        except (TypeError, ValueError) as e:
            raise BadInput(f"{path}: l2_size and l2_ways must be integers ({e})") from None
        l2sets = l2s // (l2w * line) if l2w > 0 else 0
        if (l2w < 1 or l2w > 64 or l2sets < 1 or l2s != l2sets * l2w * line
                or l2sets & (l2sets - 1) or l2s >= 1 << 31):
            raise BadInput(f"{path}: L2 geometry l2_size={l2s} l2_ways={l2w} line={line}: "
                           "l2_size/(l2_ways*line) must be a power of two, l2_ways 1..64")
        if prefetch != "none":
            raise BadInput(f"{path}: prefetch and l2_size cannot be combined")
        out.update({"l2_size": l2s, "l2_ways": l2w})
    return out


def plugin_args(out, cache=None, edges=False, mode="kernel", start=None, stop=None, tbtrace=None,
                start_count=None, stop_count=None):
    """The plugin's argument list (``k=v`` strings).

    cache: None (no simulation), a config name/path, or a dict from cache_config().
    start/stop: region-of-interest marker addresses; start_count/stop_count: which
    executions of them open and close the window (default 1).
    """
    if mode not in MODES:
        raise BadInput(f"mode must be one of {', '.join(MODES)}, not '{mode}'")
    args = [f"out={out}", f"mode={mode}"]
    if cache is not None:
        c = cache if isinstance(cache, dict) else cache_config(cache)
        args += ["cache=on", f"size={c['size']}", f"ways={c['ways']}", f"line={c['line']}"]
        if c.get("prefetch"):
            args.append("prefetch=on")
        if c.get("l2_size"):
            args += [f"l2size={c['l2_size']}", f"l2ways={c['l2_ways']}"]
    if edges:
        args.append("edges=on")
    if start is not None:
        args.append(f"start={int(start):#x}")
    if stop is not None:
        args.append(f"stop={int(stop):#x}")
    if start_count is not None:
        args.append(f"start_count={int(start_count)}")
    if stop_count is not None:
        args.append(f"stop_count={int(stop_count)}")
    if tbtrace:
        args.append(f"tbtrace={tbtrace}")
    for a in args:
        if "," in a:
            raise BadInput(f"plugin argument '{a}' contains a comma (QEMU splits on commas)")
    return args


REBOOT_SYMBOL = "__x64_sys_reboot"


def reboot_marker(kernel):
    """Address of ``__x64_sys_reboot`` in a vmlinux (path or ElfImage).

    Pass it as ``stop=``: counting then ends when /init calls reboot(). After
    that, the ACPI power-off path spins in delay_tsc until QEMU's main loop acts
    on the shutdown request, and how long that takes depends on host timing. It
    was the only run-to-run difference seen under -icount (up to ~1e5
    instructions, in one run of three).
    """
    from ..image.elf import ElfImage
    img = kernel if isinstance(kernel, ElfImage) else ElfImage(kernel)
    addr = img.symbol_address(REBOOT_SYMBOL)
    if not addr:
        raise BadInput(f"{img.path}: no symbol {REBOOT_SYMBOL} (not an x86-64 Linux vmlinux?)")
    return int(addr)


def plugin_option(so_path, args):
    """The value of QEMU's ``-plugin`` option (the one place it is built)."""
    for a in args:
        if "," in str(a):
            k, _, v = str(a).partition("=")
            raise BadInput(f"plugin argument {k}={v!r}: QEMU cannot pass commas")
    return ",".join([str(so_path)] + [str(a) for a in args])


__all__ = ["PluginTrace", "read_plugin_output", "read_tbtrace", "cache_config",
           "list_cache_configs", "plugin_args", "plugin_option", "reboot_marker", "TB_DTYPE",
           "EDGE_DTYPE"]
