"""The profile model: where the CPU executed, keyed by link-time address.

One model for every source (QEMU TCG blocks, perf LBR, perf IP samples, BOLT
fdata). All tables are numpy arrays sorted by address; names are resolved
against the image the profile belongs to (see FORMAT.md, "Profile format").

Tables (each optional, empty when the source does not provide it):

- functions: ``func_addr`` (start), ``func_size``, ``func_name`` (list),
  ``func_local``, and four counters:
    ``func_entries``  executions of the function's entry (= calls, including
                      tail calls and recursion): QEMU: count of the block at
                      the entry address; LBR/fdata: branches landing on the entry.
    ``func_blocks``   block executions inside the function: QEMU: sum of its
                      block counts; LBR/fdata: taken branches landing inside it.
    ``func_insns``    instructions executed inside it (QEMU only).
    ``func_samples``  IP samples inside it (perf).
- blocks: ``block_addr``, ``block_size``, ``block_insns``, ``block_count``, and
  optionally ``block_first``: where each block first ran in the recorded window
  (QEMU: its position in the window's sequence of executed blocks; a merged
  profile: the earliest of its inputs' positions, each as a fraction of its
  window; inf: not seen there), on the scale ``meta["first_window"]``; empty
  when the source has no order (perf, fdata, profiles written before it).
- edges: ``edge_from``, ``edge_to``, ``edge_count``, ``edge_mispred``,
  ``edge_kind`` (0 intra-function, 1 call/entry: lands on a function start,
  2 other cross-function: return or jump into a body, 3 from/to outside every
  function). ``meta["edge_from"]`` says whether ``edge_from`` is the branch
  instruction ("insn": LBR, fdata) or the source block's start ("block": QEMU).
- samples: ``sample_addr``, ``sample_count`` (IP samples, aggregated).

``meta["metric"]`` names the counter that measures hotness for this source:
"insns" (QEMU), "blocks" (LBR, fdata with branches), "samples" (IP, no_lbr).
"""

import io
import json
import os
import zipfile

import numpy as np

from ..errors import BadInput
from ..image.elf import ElfImage
from ..io import atomic_output
from .symbolize import Symbolizer

FORMAT = "linepack-profile"
VERSION = 1
SOURCES = ("qemu", "perf-lbr", "perf-ip", "fdata")
METRICS = ("insns", "blocks", "entries", "samples")

KIND_INTRA, KIND_CALL, KIND_CROSS, KIND_OUTSIDE = 0, 1, 2, 3

# Array members of the on-disk archive: name -> dtype (order = order in the file).
ARRAYS = {
    "func_addr": "<u8", "func_size": "<u8", "func_local": "u1",
    "func_entries": "<u8", "func_blocks": "<u8", "func_insns": "<u8", "func_samples": "<u8",
    "block_addr": "<u8", "block_size": "<u4", "block_insns": "<u4", "block_count": "<u8",
    "block_first": "<f8",
    "edge_from": "<u8", "edge_to": "<u8", "edge_count": "<u8", "edge_mispred": "<u8",
    "edge_kind": "u1",
    "sample_addr": "<u8", "sample_count": "<u8",
}
GROUPS = {
    "func": ("func_addr", "func_size", "func_local", "func_entries", "func_blocks", "func_insns",
             "func_samples"),
    "block": ("block_addr", "block_size", "block_insns", "block_count"),
    "edge": ("edge_from", "edge_to", "edge_count", "edge_mispred", "edge_kind"),
    "sample": ("sample_addr", "sample_count"),
}
# optional columns of a group: empty (not recorded) or one value per row
OPTIONAL = {"block_first": "block"}
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)


def min_per_key(keys, values):
    """The smallest of ``values`` per distinct key tuple, in the sorted key order
    ``_aggregate`` gives."""
    order = np.lexsort(keys[::-1])
    n = len(order)
    if not n:
        return np.zeros(0, np.float64)
    first = np.ones(n, dtype=bool)
    diff = np.zeros(n - 1, dtype=bool)
    for k in keys:
        ks = k[order]
        diff |= ks[1:] != ks[:-1]
    first[1:] = diff
    return np.minimum.reduceat(np.asarray(values, np.float64)[order], np.nonzero(first)[0])


def first_window(first):
    """The scale of first-run positions: one past the latest finite one (1.0 when none)."""
    f = np.asarray(first, np.float64)
    f = f[np.isfinite(f)]
    return float(f.max()) + 1.0 if len(f) else 1.0


def _u64(x):
    return np.asarray(x if x is not None else [], dtype=np.uint64).ravel()


def _aggregate(keys, *values):
    """Unique keys (1-D u64, or tuple of them) and the sum of each value array per key."""
    if isinstance(keys, tuple):
        order = np.lexsort(keys[::-1])
        ks = [k[order] for k in keys]
        n = len(order)
        first = np.ones(n, dtype=bool)
        if n:
            diff = np.zeros(n - 1, dtype=bool)
            for k in ks:
                diff |= k[1:] != k[:-1]
            first[1:] = diff
        starts = np.nonzero(first)[0]
        out_keys = tuple(k[starts] for k in ks)
        sums = [np.add.reduceat(v[order].astype(np.uint64), starts) if n else
                np.zeros(0, np.uint64) for v in values]
        return out_keys, sums
    (uk,), sums = _aggregate((np.asarray(keys, dtype=np.uint64),), *values)
    return uk, sums


class Profile:
    """Counts of one workload on one image. Build with the ``from_*`` constructors or ``load``."""

    def __init__(self, meta, arrays, func_name):
        self.meta = dict(meta)
        for name, dt in ARRAYS.items():
            setattr(self, name, np.asarray(arrays.get(name, np.zeros(0, dt)), dtype=dt))
        self.func_name = list(func_name)
        self._validate()

    def _validate(self, path=None):
        where = f"{path}: " if path else ""
        for group, names in GROUPS.items():
            lens = {len(getattr(self, n)) for n in names}
            if len(lens) > 1:
                raise BadInput(f"{where}corrupt profile: {group} arrays have different lengths")
        for name, group in OPTIONAL.items():
            n = len(getattr(self, name))
            if n and n != len(getattr(self, GROUPS[group][0])):
                raise BadInput(f"{where}corrupt profile: {name} has {n} rows, the {group} "
                               f"table {len(getattr(self, GROUPS[group][0]))}")
        if len(self.func_name) != len(self.func_addr):
            raise BadInput(f"{where}corrupt profile: {len(self.func_name)} function names for "
                           f"{len(self.func_addr)} functions")

    # -- constructors -----------------------------------------------------------------
    @staticmethod
    def _base_meta(image, source, meta):
        if source not in SOURCES:
            raise ValueError(f"unknown profile source {source!r}")
        m = {
            "format": FORMAT, "version": VERSION, "source": source,
            "build_id": image.build_id, "image": os.path.basename(image.path),
            "image_path": os.path.abspath(image.path),
            "workload": None, "loops": None, "cmdline": None, "kaslr_offset": 0,
        }
        if meta:
            m.update(meta)
        return m

    @classmethod
    def _finish(cls, image, sym, meta, func_idx_counts, blocks=None, edges=None, samples=None):
        """Assemble a profile: func_idx_counts maps counter name -> (function index array, counts)."""
        ft = sym.functions
        used = []
        for idx, cnt in func_idx_counts.values():
            used.append(idx[(idx >= 0) & (cnt > 0)])
        fidx = np.unique(np.concatenate(used)) if used else np.zeros(0, np.int64)
        arrays = {"func_addr": ft.start[fidx], "func_size": ft.size[fidx],
                  "func_local": ft.is_local[fidx].astype(np.uint8)}
        for counter in ("func_entries", "func_blocks", "func_insns", "func_samples"):
            out = np.zeros(len(fidx), dtype=np.uint64)
            if counter in func_idx_counts:
                idx, cnt = func_idx_counts[counter]
                ok = (idx >= 0) & (cnt > 0)
                p = np.searchsorted(fidx, idx[ok])
                np.add.at(out, p, cnt[ok].astype(np.uint64))
            arrays[counter] = out
        for group in (blocks, edges, samples):
            if group:
                arrays.update(group)
        names = [ft.name[i] for i in fidx.tolist()]
        return cls(meta, arrays, names)

    @classmethod
    def from_blocks(cls, image, block_addr, block_size, block_insns, block_count,
                    edge_src=None, edge_dst=None, edge_count=None, meta=None, block_first=None):
        """A profile from per-translation-block counts (the QEMU TCG plugin path).

        block_*: one row per executed block (duplicates are summed by address and
        size). Per function: ``entries`` = executions of the block starting at its
        entry address (its call count); ``blocks`` = executions of all its blocks;
        ``insns`` = sum of count * instructions. Edges (optional) go from the source
        block's start to the destination block's start (``meta["edge_from"] = "block"``).
        Addresses must be link-time addresses (run the kernel with ``nokaslr``).
        block_first (optional): per row, the position of the block's first execution
        in the window (trace.NO_FIRST or inf: not there); duplicates keep the earliest.
        """
        image = image if isinstance(image, ElfImage) else ElfImage(image)
        sym = Symbolizer(image)
        ba, bs = _u64(block_addr), _u64(block_size)
        bi, bc = _u64(block_insns), _u64(block_count)
        if not (len(ba) == len(bs) == len(bi) == len(bc)):
            raise ValueError("block arrays differ in length")
        bf = None
        if block_first is not None:
            bf = np.asarray(block_first)
            if len(bf) != len(ba):
                raise ValueError("block_first differs in length from the block arrays")
            if bf.dtype.kind == "u":
                bf = np.where(bf == np.iinfo(bf.dtype).max, np.inf, bf.astype(np.float64))
            bf = min_per_key((ba, bs, bi), bf)
        (ba, bs, bi), (bc,) = _aggregate((ba, bs, bi), bc)
        m = cls._base_meta(image, "qemu", meta)
        fi = sym.find(ba)
        is_entry = np.zeros(len(ba), dtype=bool)
        inside = fi >= 0
        is_entry[inside] = ba[inside] == sym.functions.start[fi[inside]]
        counters = {
            "func_entries": (np.where(is_entry, fi, -1), bc),
            "func_blocks": (fi, bc),
            "func_insns": (fi, bc * bi),
        }
        blocks = {"block_addr": ba, "block_size": bs.astype(np.uint32),
                  "block_insns": bi.astype(np.uint32), "block_count": bc}
        if bf is not None:
            blocks["block_first"] = bf
            m["first_window"] = first_window(bf)
        edges = None
        if edge_src is not None:
            es, ed, ec = _u64(edge_src), _u64(edge_dst), _u64(edge_count)
            if not (len(es) == len(ed) == len(ec)):
                raise ValueError("edge arrays differ in length")
            (es, ed), (ec,) = _aggregate((es, ed), ec)
            edges = cls._edges(sym, es, ed, ec, np.zeros(len(es), np.uint64))
            if "edge_from" not in m and len(es):
                # Sources that are mostly not block starts are branch instructions.
                at_start = np.isin(es, ba).mean()
                m["edge_from"] = "block" if at_start >= 0.5 else "insn"
        m.setdefault("edge_from", "block")
        m.update({"metric": "insns",
                  "blocks": int(len(ba)), "block_executions": int(bc.sum()),
                  "instructions": int((bc * bi).sum()),
                  "edges": int(len(edges["edge_from"])) if edges else 0,
                  "unmapped": int(bc[~inside].sum())})
        return cls._finish(image, sym, m, counters, blocks=blocks, edges=edges)

    @staticmethod
    def _edges(sym, efrom, eto, ecount, emis):
        ff, ft_ = sym.find(efrom), sym.find(eto)
        start = sym.functions.start
        kind = np.full(len(efrom), KIND_OUTSIDE, dtype=np.uint8)
        both = (ff >= 0) & (ft_ >= 0)
        to_in = ft_ >= 0
        at_entry = np.zeros(len(eto), dtype=bool)
        at_entry[to_in] = eto[to_in] == start[ft_[to_in]]
        kind[both & (ff == ft_)] = KIND_INTRA
        kind[both & (ff != ft_)] = KIND_CROSS
        kind[to_in & at_entry & (eto != efrom)] = KIND_CALL   # recursion and calls from outside too
        return {"edge_from": efrom, "edge_to": eto, "edge_count": ecount, "edge_mispred": emis,
                "edge_kind": kind}

    @classmethod
    def from_branches(cls, image, br_from, br_to, br_count, br_mispred=None,
                      sample_addr=None, sample_count=None, source="perf-lbr", meta=None,
                      symbolizer=None):
        """A profile from taken branches (LBR or fdata), link-time addresses, aggregated or not.

        Per function: ``entries`` = branch counts landing on its entry; ``blocks`` =
        branch counts landing anywhere in it; ``samples`` from the optional IP samples.
        """
        image = image if isinstance(image, ElfImage) else ElfImage(image)
        sym = symbolizer or Symbolizer(image)
        f, t = _u64(br_from), _u64(br_to)
        c = _u64(br_count) if br_count is not None else np.ones(len(f), np.uint64)
        mis = _u64(br_mispred) if br_mispred is not None else np.zeros(len(f), np.uint64)
        (f, t), (c, mis) = _aggregate((f, t), c, mis)
        edges = cls._edges(sym, f, t, c, mis)
        fi_to = sym.find(t)
        counters = {
            "func_entries": (np.where(edges["edge_kind"] == KIND_CALL, fi_to, -1), c),
            "func_blocks": (fi_to, c),
        }
        samples = None
        m = cls._base_meta(image, source, meta)
        if sample_addr is not None and len(sample_addr):
            sa = _u64(sample_addr)
            sc = _u64(sample_count) if sample_count is not None else np.ones(len(sa), np.uint64)
            sa, (sc,) = _aggregate(sa, sc)
            counters["func_samples"] = (sym.find(sa), sc)
            samples = {"sample_addr": sa, "sample_count": sc}
            m["samples"] = int(sc.sum())
        m.setdefault("samples", 0)
        m.update({"metric": "blocks", "edge_from": "insn", "edges": int(len(f)),
                  "branches": int(c.sum()), "mispredicts": int(mis.sum()),
                  "unmapped": int(c[(edges["edge_kind"] == KIND_OUTSIDE) & (fi_to < 0)].sum())})
        return cls._finish(image, sym, m, counters, edges=edges, samples=samples)

    @classmethod
    def from_lbr(cls, image, br_from, br_to, br_count=None, br_mispred=None,
                 sample_addr=None, sample_count=None, blocks=None, block_meta=None,
                 source="perf-lbr", meta=None, symbolizer=None):
        """``from_branches`` plus the blocks executed along LBR fall-through ranges.

        blocks: dict of ``block_addr``, ``block_size``, ``block_insns``, ``block_count``
        (see :func:`linepack.profile.lbr.lbr_blocks`); they fill the block table and
        ``func_insns`` (instructions run inside the ranges: a lower bound).
        ``func_entries`` / ``func_blocks`` stay the taken-branch counts of
        ``from_branches`` (what BOLT fdata carries, so fdata round trips keep them).
        block_meta: extra header keys (range statistics).
        """
        sym = symbolizer or Symbolizer(image if isinstance(image, ElfImage) else ElfImage(image))
        p = cls.from_branches(sym.image, br_from, br_to, br_count, br_mispred, sample_addr,
                              sample_count, source=source, meta=meta, symbolizer=sym)
        if block_meta:
            p.meta.update(block_meta)
        if not blocks or not len(blocks["block_addr"]):
            return p
        (ba, bs, bi), (bc,) = _aggregate((_u64(blocks["block_addr"]), _u64(blocks["block_size"]),
                                          _u64(blocks["block_insns"])), _u64(blocks["block_count"]))
        fi = sym.find(ba)
        inside = fi >= 0
        fstart = sym.functions.start[fi[inside]]
        pos = np.searchsorted(p.func_addr, fstart)
        pos_c = np.minimum(pos, max(len(p.func_addr) - 1, 0))
        known = (pos < len(p.func_addr)) & (p.func_addr[pos_c] == fstart) if len(p.func_addr) else \
            np.zeros(len(fstart), dtype=bool)
        insns = np.zeros(len(p.func_addr), dtype=np.uint64)
        np.add.at(insns, pos_c[known], (bc * bi)[inside][known])
        p.func_insns = insns
        p.block_addr, p.block_size = ba, bs.astype(np.uint32)
        p.block_insns, p.block_count = bi.astype(np.uint32), bc
        p.meta.update({"blocks": int(len(ba)), "block_executions": int(bc.sum()),
                       "instructions": int((bc * bi).sum())})
        p._validate()
        return p

    @classmethod
    def from_samples(cls, image, sample_addr, sample_count=None, source="perf-ip", meta=None,
                     symbolizer=None):
        """A profile from IP samples only: function-level hotness (``samples``)."""
        image = image if isinstance(image, ElfImage) else ElfImage(image)
        sym = symbolizer or Symbolizer(image)
        sa = _u64(sample_addr)
        sc = _u64(sample_count) if sample_count is not None else np.ones(len(sa), np.uint64)
        sa, (sc,) = _aggregate(sa, sc)
        fi = sym.find(sa)
        m = cls._base_meta(image, source, meta)
        m.update({"metric": "samples", "samples": int(sc.sum()), "edges": 0,
                  "unmapped": int(sc[fi < 0].sum())})
        return cls._finish(image, sym, m, {"func_samples": (fi, sc)},
                           samples={"sample_addr": sa, "sample_count": sc})

    # -- queries ---------------------------------------------------------------------
    @property
    def source(self):
        return self.meta.get("source")

    @property
    def metric(self):
        return self.meta.get("metric") or "samples"

    def counts(self, metric=None):
        """The per-function counter array for metric (default: the source's own)."""
        metric = metric or self.metric
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
        return getattr(self, "func_" + metric)

    def function_counts(self, metric=None):
        """{function name: count} for functions with a nonzero count."""
        c = self.counts(metric).tolist()
        return {n: v for n, v in zip(self.func_name, c) if v}

    def hot_functions(self, threshold=1, metric=None, per_loop=False):
        """[(name, address, count)] with count >= threshold, hottest first (ties by address).

        per_loop: compare count / meta["loops"] against threshold (e.g. 1.0 = "runs
        at least once per workload iteration on average").
        """
        c = self.counts(metric).astype(np.float64)
        if per_loop and self.meta.get("loops"):
            c = c / float(self.meta["loops"])
        keep = np.nonzero(c >= threshold)[0]
        order = keep[np.lexsort((self.func_addr[keep], -c[keep]))]
        raw = self.counts(metric)
        return [(self.func_name[i], int(self.func_addr[i]), int(raw[i])) for i in order.tolist()]

    def total(self, metric=None):
        return int(self.counts(metric).sum())

    def check_image(self, image):
        """Raise BadInput unless this profile was recorded for image."""
        want, have = self.meta.get("build_id"), image.build_id
        if want and have:
            if want != have:
                raise BadInput(f"profile was recorded for build-id {want}, image {image.path} has {have}")
            return
        if not len(self.func_addr):
            return
        sym = Symbolizer(image)
        idx = sym.find(self.func_addr)
        bad = []
        for k, i in enumerate(idx.tolist()):
            n = self.func_name[k]
            if i < 0 or int(sym.functions.start[i]) != int(self.func_addr[k]) or (
                    sym.functions.name[i] != n and sym.functions.index_of(n) != i):
                bad.append(k)
        if bad:
            k = bad[0]
            raise BadInput(f"profile does not match {image.path} (no build-id to compare): "
                           f"{len(bad)} of {len(self.func_addr)} functions differ, e.g. "
                           f"{self.func_name[k]} at {int(self.func_addr[k]):#x}")

    def summary(self, top=10):
        """Human summary lines."""
        m = self.meta
        lines = [f"profile: source {m.get('source')}, image {m.get('image')}, "
                 f"build-id {m.get('build_id') or 'none'}"]
        extra = [f"{k} {m[k]}" for k in ("workload", "loops") if m.get(k) is not None]
        if m.get("kaslr_offset"):
            from .symbolize import fmt_offset
            extra.append(f"address shift {fmt_offset(m['kaslr_offset'])} removed (KASLR / load bias)")
        if extra:
            lines.append("  " + ", ".join(extra))
        stats = [f"{len(self.func_addr)} functions"]
        for key, label in (("samples", "samples"), ("branches", "branches"), ("edges", "edges"),
                           ("blocks", "blocks"), ("block_executions", "block executions"),
                           ("instructions", "instructions"), ("unmapped", "unmapped")):
            if m.get(key):
                stats.append(f"{m[key]} {label}")
        lines.append("  " + ", ".join(stats))
        c = self.counts()
        tot = int(c.sum())
        hot = self.hot_functions(1)[:top]
        if hot:
            lines.append(f"  hottest by {self.metric}:")
            cum = 0
            for name, addr, cnt in hot:
                cum += cnt
                lines.append(f"    {cnt:>12} {100.0 * cnt / tot:6.2f}% {100.0 * cum / tot:6.2f}%  "
                             f"{addr:#x} {name}")
            # Coverage: how many functions hold 50/90/99% of the count.
            srt = np.sort(c)[::-1].astype(np.float64)
            cs = np.cumsum(srt) / max(tot, 1)
            cov = [f"{int(np.searchsorted(cs, q) + 1)} functions hold {int(q * 100)}%"
                   for q in (0.5, 0.9, 0.99)]
            lines.append("  coverage: " + ", ".join(cov))
        return lines

    # -- on disk ------------------------------------------------------------------------
    def save(self, path):
        """Write atomically (temp file + rename); identical profiles give identical bytes."""
        path = os.fspath(path)
        meta = dict(self.meta)
        meta["format"], meta["version"] = FORMAT, VERSION
        meta["counts"] = {g: int(len(getattr(self, names[0]))) for g, names in GROUPS.items()}
        members = [("meta.json", (json.dumps(meta, sort_keys=True, indent=1) + "\n").encode())]
        names_blob = "\n".join(self.func_name).encode("utf-8")
        members.append(("func_name.txt", names_blob))
        for name, dt in ARRAYS.items():
            if name in OPTIONAL and not len(getattr(self, name)):
                continue            # not recorded: the file reads as before the column existed
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(getattr(self, name), dtype=dt),
                                      allow_pickle=False)
            members.append((name + ".npy", buf.getvalue()))
        with atomic_output(path) as f:
            with zipfile.ZipFile(f, "w") as z:
                for name, data in members:
                    zi = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
                    zi.compress_type = zipfile.ZIP_DEFLATED
                    zi.create_system = 3
                    zi.external_attr = 0o644 << 16
                    z.writestr(zi, data, compresslevel=6)

    @classmethod
    def load(cls, path):
        """Read a profile; any problem is one BadInput line."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise BadInput(f"{path}: no such profile")
        if os.path.isdir(path):
            raise BadInput(f"{path}: is a directory, not a profile")
        try:
            z = zipfile.ZipFile(path)
        except zipfile.BadZipFile:
            raise BadInput(f"{path}: not a linepack profile (expected a {FORMAT} archive; "
                           "truncated or another file type)") from None
        except OSError as e:
            raise BadInput(f"{path}: cannot read: {e.strerror}") from None
        try:
            with z:
                names = set(z.namelist())
                if "meta.json" not in names:
                    raise BadInput(f"{path}: not a linepack profile (zip archive without meta.json)")
                try:
                    meta = json.loads(z.read("meta.json").decode("utf-8"))
                except ValueError:
                    raise BadInput(f"{path}: corrupt profile (meta.json is not JSON)") from None
                if not isinstance(meta, dict) or meta.get("format") != FORMAT:
                    raise BadInput(f"{path}: not a linepack profile (format "
                                   f"{meta.get('format') if isinstance(meta, dict) else '?'!r})")
                v = meta.get("version")
                if not isinstance(v, int) or v > VERSION or v < 1:
                    raise BadInput(f"{path}: profile format version {v} is not supported by this "
                                   f"linepack (reads version {VERSION})")
                arrays = {}
                for name, dt in ARRAYS.items():
                    member = name + ".npy"
                    if member not in names:
                        continue
                    a = np.lib.format.read_array(io.BytesIO(z.read(member)), allow_pickle=False)
                    if a.dtype != np.dtype(dt) or a.ndim != 1:
                        raise BadInput(f"{path}: corrupt profile ({member} has type {a.dtype}, "
                                       f"expected {np.dtype(dt)})")
                    arrays[name] = a
                blob = z.read("func_name.txt").decode("utf-8") if "func_name.txt" in names else ""
                fnames = blob.split("\n") if blob else []
        except BadInput:
            raise
        except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
            raise BadInput(f"{path}: corrupt profile ({e})") from None
        p = cls.__new__(cls)
        p.meta = meta
        for name, dt in ARRAYS.items():
            setattr(p, name, arrays.get(name, np.zeros(0, dt)))
        p.func_name = fnames
        p._validate(path)
        return p

    def __repr__(self):
        return (f"<Profile {self.source} {self.meta.get('image')} {len(self.func_addr)} functions "
                f"{len(self.edge_from)} edges>")
