"""Import ``perf script`` text: LBR branch stacks or plain IP samples.

Accepted inputs (one sample per line; blank lines and ``#`` comments ignored):

- ``perf script -F ip,brstack`` (LBR, from ``perf record -j any,k`` / ``-j any,u``).
  Each branch entry is ``0xFROM/0xTO/EVENT/TX/ABORT/CYCLES`` and, depending on the
  perf version, more ``/``-separated fields:
    perf <= 5.x   ``0xffffffff81234567/0xffffffff81234600/P/-/-/0``
    perf 6.1      ``.../P/-/-/0/COND``              (branch type, or ``-``)
    perf 6.2+     ``.../P/-/-/0/COND/-``            (type and speculation state)
    perf 6.12     ``.../P/-/-/3/JCC/-``, ``.../PN/-/-/0/...`` (EVENT may carry N = not taken)
  EVENT is ``P`` (predicted), ``M`` (mispredicted) or ``-``; with ``-F ...,dso`` each
  address is followed by ``(dso)``. Trailing fields are ignored, so any of these parse.
- ``perf script -F ip`` / ``-F ip,sym`` / ``-F ip,sym,symoff,dso`` and the default
  ``perf script`` output (``comm pid time: period event: ip sym+off (dso)``):
  IP samples, function-level hotness only. Callchain output (``perf record -g``)
  is accepted: only the first frame of each sample counts.

LBR records keep their sample (line) and their index in it (``br_sample``,
``br_pos``; perf prints the stack newest first), so that the import can form
the fall-through ranges between consecutive branches and count the basic blocks
they execute (see :mod:`linepack.profile.lbr`).

Parsing is bulk: regular expressions over the whole text and vectorized hex
decoding in numpy; no object per record.
"""

import os
import re
from operator import itemgetter

import numpy as np

from ..errors import BadInput
from ..image.elf import ElfImage
from .lbr import lbr_blocks
from .model import Profile
from .symbolize import Symbolizer, fmt_offset, resolve_offset

# One branch entry; group 3 is the first char of EVENT (P, M or -).
_BR = re.compile(rb"0x([0-9a-fA-F]{1,16})(?:\([^)\n]*\))?/0x([0-9a-fA-F]{1,16})(?:\([^)\n]*\))?/([PM-])")
# The same, or a newline (to number the samples: one sample per line).
_BR_NL = re.compile(rb"(\n)|" + _BR.pattern)
_BR_ONLY_LINE = re.compile(rb"(?m)^[ \t]*0x[0-9a-fA-F]{1,16}(?:\([^)\n]*\))?/0x")
# brstacksym: symbolic branch entries (not supported: addresses are needed).
_BRSYM = re.compile(rb"(?m)[ \t][^\s/]+\+0x[0-9a-fA-F]+/[^\s/]+\+0x[0-9a-fA-F]+/[PM-]")
# A sample line: optional header ending in ": ", the IP (hex, no 0x), the rest.
_IP = re.compile(rb"(?m)^[ \t]*(?:[^\n]*:[ \t]+)?([0-9a-fA-F]{1,16})(?=[ \t\r\n]|$)([^\n]*)$")
# Callchain sample header: starts at column 0 and ends with "event:" (no IP on the line).
_CC_HEADER = re.compile(rb"(?m)^\S[^\n]*:[ \t]*$")
_BLANK = re.compile(rb"(?m)^[ \t\r]*$|^#[^\n]*$")
_SYM = re.compile(rb"^[ \t]+([^\s]+?)(?:\+0x([0-9a-fA-F]+))?(?=[ \t\r]|$)")

_HEXVAL = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEXVAL[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEXVAL[_c] = 10 + _i
_HEXVAL[0] = 254    # padding


def hex_to_u64(tokens):
    """Vectorized int(t, 16) for a sequence of ASCII hex byte strings (<= 16 digits)."""
    if len(tokens) == 0:
        return np.zeros(0, dtype=np.uint64)
    a = np.array(tokens, dtype="S16")
    b = a.view(np.uint8).reshape(len(a), 16)
    v = _HEXVAL[b]
    out = np.zeros(len(a), dtype=np.uint64)
    for col in range(16):
        d = v[:, col]
        digit = d < 16
        if not digit.any():
            break
        out = np.where(digit, (out << np.uint64(4)) | d.astype(np.uint64), out)
    return out


class PerfScript:
    """Parsed ``perf script`` text: per-sample IPs and per-entry branches (raw, unaggregated)."""

    def __init__(self, path):
        self.path = path
        self.kind = None            # "lbr" or "ip"
        self.style = None           # brstack flavour seen: "5.x", "6.1", "6.2+"
        self.ip = np.zeros(0, np.uint64)
        self.ip_rest = None         # text after each IP when it has a symbol column, else None
        self.br_from = np.zeros(0, np.uint64)
        self.br_to = np.zeros(0, np.uint64)
        self.br_mispred = np.zeros(0, np.uint8)
        self.br_sample = np.zeros(0, np.int64)   # line number (0-based) of each record's sample
        self.br_pos = np.zeros(0, np.int64)      # index of the record in its sample (0 = newest)
        self.lines = 0
        self.bad_lines = 0


    @property
    def has_symbols(self):
        return self.ip_rest is not None

    def symbols(self, rows):
        """(names, offsets) of the symbol column for sample rows: "" / -1 where unknown."""
        names, offs = [], []
        for i in rows:
            mm = _SYM.match(self.ip_rest[i])
            if mm is None or mm.group(1).startswith(b"0x") or mm.group(1) == b"[unknown]":
                names.append("")
                offs.append(-1)
            else:
                names.append(mm.group(1).decode("utf-8", "replace"))
                offs.append(int(mm.group(2), 16) if mm.group(2) else -1)
        return names, np.asarray(offs, dtype=np.int64)


def _first_bad_line(data):
    for n, line in enumerate(data.split(b"\n"), 1):
        if _BLANK.fullmatch(line) or _IP.fullmatch(line) or _CC_HEADER.fullmatch(line):
            continue
        return n, line.decode("utf-8", "replace").strip()
    return None, None


def parse(data, path="perf script"):
    """Parse perf script text (bytes). Raises BadInput when it is not perf script output."""
    ps = PerfScript(path)
    if b"\0" in data[:65536]:
        raise BadInput(f"{path}: binary file, not `perf script` text (run `perf script -F ip,brstack` "
                       "or `perf script -F ip,sym` on the perf.data first)")
    if data.startswith(b"PERFILE"):
        raise BadInput(f"{path}: this is perf.data; convert it with `perf script -F ip,brstack`")
    lines = data.count(b"\n") + (0 if data.endswith(b"\n") or not data else 1)
    ps.lines = lines
    if _BRSYM.search(data[:1 << 20]) and not _BR.search(data[:1 << 20]):
        raise BadInput(f"{path}: symbolic branch stacks (brstacksym) are not supported; "
                       "use `perf script -F ip,brstack`")

    # IP samples (with optional symbol column).
    callchain = _CC_HEADER.search(data) is not None
    if callchain:
        ips, rests = _parse_callchain(data)
        matched = None
    else:
        m = _IP.findall(data)
        matched = len(m)
        ips = list(map(itemgetter(0), m))
        rests = list(map(itemgetter(1), m))

    # Branch stacks.
    br = _BR_NL.findall(data) if _BR.search(data) else []
    if br:
        ps.kind = "lbr"
        # Newline matches carry group 1; records carry groups 2-4 (from, to, event).
        nl = np.array(list(map(itemgetter(0), br)), dtype="S1").view(np.uint8) == ord("\n")
        rec = np.nonzero(~nl)[0]
        ev = np.array(list(map(itemgetter(3), br)), dtype="S1").view(np.uint8)[rec]
        ps.br_sample = np.cumsum(nl)[rec]
        first = np.ones(len(rec), dtype=bool)
        first[1:] = ps.br_sample[1:] != ps.br_sample[:-1]
        ar = np.arange(len(rec), dtype=np.int64)
        ps.br_pos = ar - np.maximum.accumulate(np.where(first, ar, 0))
        ps.br_from = hex_to_u64(list(map(itemgetter(1), br)))[rec]
        ps.br_to = hex_to_u64(list(map(itemgetter(2), br)))[rec]
        del br[:]
        ps.br_mispred = (ev == ord("M")).astype(np.uint8)
        ps.style = _style(data)
        keep = (ps.br_from != 0) & (ps.br_to != 0)
        if not keep.all():
            ps.br_from, ps.br_to, ps.br_mispred = ps.br_from[keep], ps.br_to[keep], ps.br_mispred[keep]
            ps.br_sample, ps.br_pos = ps.br_sample[keep], ps.br_pos[keep]
    elif ips:
        ps.kind = "ip"

    if not ips and ps.kind is None:
        n, line = _first_bad_line(data)
        where = f" (line {n}: {line[:80]!r})" if n else ""
        raise BadInput(f"{path}: no perf samples found{where}; expected `perf script -F ip,brstack` "
                       "or `perf script -F ip,sym` output")

    # Unrecognized lines: tolerate a few (a truncated last line), refuse many.
    if matched is not None:
        # (the empty "line" after a final newline matches _BLANK but is no line)
        blank = len(_BLANK.findall(data)) - (1 if data.endswith(b"\n") else 0)
        if ps.kind == "lbr":
            matched += len(_BR_ONLY_LINE.findall(data))     # `-F brstack`: no IP column
        bad = lines - matched - blank
        ps.bad_lines = max(bad, 0)
        if bad > max(2, lines // 100):
            n, line = _first_bad_line(data)
            raise BadInput(f"{path}: {bad} of {lines} lines are not `perf script` samples (first: line "
                           f"{n}: {line[:80]!r}); expected `perf script -F ip,brstack` or "
                           "`perf script -F ip,sym` output")

    ps.ip = hex_to_u64(ips)
    # Symbol column: first token after the IP unless it is a branch entry. Parsed
    # lazily (ps.symbols) for the few samples shift detection looks at.
    if rests and any(r.strip()[:2] not in (b"", b"0x") for r in rests[:1000]):
        ps.ip_rest = rests
    return ps


def _style(data):
    m = re.search(rb"0x[0-9a-fA-F]+(?:\([^)\n]*\))?/0x[0-9a-fA-F]+(?:\([^)\n]*\))?/([^\s]*)", data)
    if not m:
        return None
    nfields = m.group(1).count(b"/") + 1
    return {4: "5.x", 5: "6.1", 6: "6.2+"}.get(nfields, f"{nfields} flag fields")


def _parse_callchain(data):
    """Callchain output: a header line, then indented frames; keep the first frame."""
    ips, rests = [], []
    want = False
    frame = re.compile(rb"^[ \t]+([0-9a-fA-F]{1,16})((?:[ \t][^\n]*)?)$")
    for line in data.split(b"\n"):
        if not line.strip():
            want = False
            continue
        if _CC_HEADER.fullmatch(line):
            want = True
            continue
        if want:
            mm = frame.match(line)
            if mm:
                ips.append(mm.group(1))
                rests.append(mm.group(2))
            want = False
            continue
        mm = _IP.fullmatch(line) if not line[:1].isspace() else None
        if mm:
            ips.append(mm.group(1))
            rests.append(mm.group(2))
    return ips, rests


def read_text(path):
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise BadInput(f"{path}: no such file") from None
    except IsADirectoryError:
        raise BadInput(f"{path}: is a directory, not perf script output") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read: {e.strerror}") from None


def import_perf_script(path, image, kaslr_offset=None, meta=None, log=None, ranges=True):
    """Profile from a ``perf script`` text file for image (an ElfImage or a path).

    kaslr_offset: None (detect; refuse a KASLR-shifted kernel profile), "auto" or an int.
    ranges: for LBR input, also derive the executed blocks from the fall-through
    ranges between consecutive branch records (:mod:`linepack.profile.lbr`): the
    block table, ``func_insns`` and ``meta["lbr_ranges"]`` / ``["lbr_ranges_invalid"]``.
    """
    image = image if isinstance(image, ElfImage) else ElfImage(image)
    data = path if isinstance(path, bytes) else read_text(path)
    name = "perf script" if isinstance(path, bytes) else os.fspath(path)
    if log:
        log(f"parsing {name} ({len(data) / 1e6:.1f} MB)")
    ps = parse(data, name)
    if ps.bad_lines and log:
        log(f"ignored {ps.bad_lines} unrecognized line(s)")
    sym = Symbolizer(image)

    names = None
    if ps.has_symbols and len(ps.ip):
        # (ip, name, offset) triples whose name is a function of the image give an
        # exact shift and ignore samples in other DSOs (libc, the kernel, ...).
        _, first = np.unique(ps.ip, return_index=True)
        if len(first) > 20000:
            first = np.sort(first)[np.linspace(0, len(first) - 1, 20000).astype(np.int64)]
        allnames, alloffs = ps.symbols(first.tolist())
        index_of = sym.functions.index_of
        keep = [k for k, n in enumerate(allnames) if n and index_of(n) is not None]
        if keep:
            if len(keep) > 5000:
                keep = [keep[k] for k in np.linspace(0, len(keep) - 1, 5000).astype(np.int64).tolist()]
            names = [allnames[k] for k in keep]
            sel = first[keep]
            symoffs = alloffs[keep]
    if names is not None:
        off = resolve_offset(sym, ps.ip[sel], None, kaslr_offset, names, symoffs,
                             what=name, log=log)
    else:
        ua, ucount = np.unique(np.concatenate([ps.ip, ps.br_from, ps.br_to]), return_counts=True)
        off = resolve_offset(sym, ua, ucount, kaslr_offset, what=name, log=log)

    m = {"kaslr_offset": int(off), "perf_style": ps.style, "samples": int(len(ps.ip))}
    if meta:
        m.update(meta)
    shift = np.uint64(off)
    if ps.kind == "lbr":
        bf, bt = ps.br_from - shift, ps.br_to - shift
        blocks, bmeta = None, None
        if ranges:
            blocks, st = lbr_blocks(image, sym, bf, bt, ps.br_sample, ps.br_pos)
            bad = st["ranges_invalid"]
            bmeta = {"lbr_ranges": st["ranges"], "lbr_ranges_invalid": bad}
            if log:
                nbad = sum(bad.values())
                why = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in bad.items() if v)
                log(f"{st['ranges']} fall-through ranges -> {len(blocks['block_addr'])} blocks in "
                    f"{st['functions']} functions; {nbad} invalid range(s) dropped"
                    + (f" ({why})" if why else ""))
        p = Profile.from_lbr(image, bf, bt, None, ps.br_mispred, ps.ip - shift, None,
                             blocks=blocks, block_meta=bmeta, source="perf-lbr", meta=m,
                             symbolizer=sym)
    else:
        p = Profile.from_samples(image, ps.ip - shift, None, source="perf-ip", meta=m, symbolizer=sym)
    p.meta["samples"] = int(len(ps.ip))
    if log:
        extra = f", shift {fmt_offset(off)}" if off else ""
        log(f"{len(ps.ip)} samples, {len(ps.br_from)} branch records{extra}")
    return p
