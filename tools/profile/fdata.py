"""BOLT ``.fdata`` import and export (so profiles move between linepack and BOLT).

The format (llvm-project bolt/lib/Profile/DataReader.cpp), one record per line,
fields separated by one space:

    [no_lbr [EVENT ...]]                   optional first line: sample mode
    [boltedcollection]                     optional: profile of a BOLTed binary
    K NAME OFF K NAME OFF MISPREDS COUNT   branch mode: taken branch from -> to
    K NAME OFF COUNT                       no_lbr mode: IP samples

K is 0 (NAME is a DSO, OFF an address in it), 1 (global symbol) or 2 (local
symbol); OFF is hexadecimal without ``0x`` (offset from the symbol start);
MISPREDS and COUNT are decimal. Lines starting with 3, 4 or 5 are memory events
(ignored here). BOLT counts a function's executions as the branches landing at
offset 0.

linepack writes branch mode for profiles with branch edges (perf LBR, fdata,
QEMU with edges), no_lbr mode for IP-sample profiles, records sorted by address
so the same profile always gives the same bytes.
"""

import os
import re

import numpy as np

from ..errors import BadInput
from ..image.elf import ElfImage
from ..io import write_atomic
from .model import KIND_OUTSIDE, Profile
from .perf_script import read_text
from .symbolize import Symbolizer

_BRANCH = re.compile(rb"(?m)^([012]) (\S+) ([0-9a-fA-F]+) ([012]) (\S+) ([0-9a-fA-F]+) (-?\d+) (\d+)[ \t\r]*$")
_SAMPLE = re.compile(rb"(?m)^([012]) (\S+) ([0-9a-fA-F]+) (\d+)[ \t\r]*$")
_MEM = re.compile(rb"(?m)^[345] [^\n]*$")


def _local_ids(ft):
    """BOLT's unique names for local functions: ``name/N``, N counting same-named locals by address."""
    seen = {}
    ids = {}
    for i in range(len(ft)):
        if ft.is_local[i]:
            n = ft.name[i]
            seen[n] = seen.get(n, 0) + 1
            ids[i] = seen[n]
    return ids


def _resolve_names(sym, names, image_name):
    """Start address of each distinct fdata name (None where unknown)."""
    ft = sym.functions
    by_local = {}
    for i, k in _local_ids(ft).items():
        by_local[(ft.name[i], k)] = i
    out = {}
    for n in names:
        s = n.decode("utf-8", "replace")
        i = ft.index_of(s)
        if i is None and "/" in s:
            # BOLT names local symbols "name/N" or "name/file/N".
            parts = s.split("/")
            base = parts[0]
            try:
                i = by_local.get((base, int(parts[-1])))
            except ValueError:
                i = None
            if i is None:
                i = ft.index_of(base)
        out[n] = None if i is None else int(ft.start[i])
    return out


def _locations(kinds, names, offs, starts, image_name):
    """Link addresses for (kind, name, offset) columns; valid mask."""
    n = len(kinds)
    addr = np.zeros(n, dtype=np.uint64)
    ok = np.zeros(n, dtype=bool)
    base = np.array([starts.get(x) if starts.get(x) is not None else 0 for x in names], dtype=np.uint64)
    known = np.array([starts.get(x) is not None for x in names], dtype=bool)
    sym = kinds != 0
    addr[sym & known] = base[sym & known] + offs[sym & known]
    ok |= sym & known
    # Kind 0: a raw address in a DSO; ours when the DSO is the image itself.
    dso = (~sym) & np.array([x.decode("utf-8", "replace") in (image_name, "[unknown]") for x in names],
                             dtype=bool) if n else np.zeros(0, bool)
    addr[dso] = offs[dso]
    ok |= dso
    return addr, ok


def import_fdata(path, image, meta=None, log=None):
    """Profile from a BOLT .fdata file, resolved against image (ElfImage or path)."""
    from .perf_script import hex_to_u64
    image = image if isinstance(image, ElfImage) else ElfImage(image)
    data = read_text(path)
    path = os.fspath(path)
    if b"\0" in data[:65536]:
        raise BadInput(f"{path}: binary file, not BOLT .fdata text")
    body = data
    no_lbr = False
    events = []
    first, _, rest = data.partition(b"\n")
    if first.startswith(b"no_lbr"):
        no_lbr = True
        events = [e.decode("utf-8", "replace") for e in first.split()[1:]]
        body = rest
    if body.startswith(b"boltedcollection"):
        body = body.partition(b"\n")[2]
    sym = Symbolizer(image)
    image_name = os.path.basename(image.path)
    nonblank = sum(1 for _ in re.finditer(rb"(?m)^[ \t\r]*\S", body))
    m = {"fdata_mode": "no_lbr" if no_lbr else "branch"}
    if events:
        m["fdata_events"] = events
    if meta:
        m.update(meta)
    if no_lbr:
        recs = _SAMPLE.findall(body)
        bad = nonblank - len(recs) - len(_MEM.findall(body))
        _check_bad(path, body, bad, nonblank, _SAMPLE, "K NAME OFF COUNT", len(recs))
        if not recs:
            raise BadInput(f"{path}: no samples in no_lbr .fdata")
        k, n, o, c = zip(*recs)
        names = sorted(set(n))
        starts = _resolve_names(sym, names, image_name)
        addr, ok = _locations(np.array([int(x) for x in k]), n, hex_to_u64(o), starts, image_name)
        cnt = np.array([int(x) for x in c], dtype=np.uint64)
        p = Profile.from_samples(image, addr[ok], cnt[ok], source="fdata", meta=m, symbolizer=sym)
        p.meta["unmapped"] = int(p.meta.get("unmapped", 0) + cnt[~ok].sum())
    else:
        recs = _BRANCH.findall(body)
        bad = nonblank - len(recs) - len(_MEM.findall(body))
        _check_bad(path, body, bad, nonblank, _BRANCH, "K NAME OFF K NAME OFF MISPREDS COUNT",
                   len(recs))
        if not recs:
            raise BadInput(f"{path}: no branch records in .fdata (expected lines like "
                           "'1 main 1a 1 foo 0 0 12')")
        k1, n1, o1, k2, n2, o2, mis, c = zip(*recs)
        names = sorted(set(n1) | set(n2))
        starts = _resolve_names(sym, names, image_name)
        fa, fok = _locations(np.array([int(x) for x in k1]), n1, hex_to_u64(o1), starts, image_name)
        ta, tok = _locations(np.array([int(x) for x in k2]), n2, hex_to_u64(o2), starts, image_name)
        cnt = np.array([int(x) for x in c], dtype=np.uint64)
        mp = np.array([max(int(x), 0) for x in mis], dtype=np.uint64)
        ok = fok | tok       # like BOLT: keep a branch when either end is known
        p = Profile.from_branches(image, fa[ok], ta[ok], cnt[ok], mp[ok], source="fdata", meta=m,
                                  symbolizer=sym)
        p.meta["unmapped"] = int(p.meta.get("unmapped", 0) + cnt[~ok].sum())
    unknown = [n.decode("utf-8", "replace") for n, a in starts.items() if a is None]
    if unknown:
        p.meta["unknown_names"] = len(unknown)
        if log:
            log(f"{len(unknown)} name(s) in {path} are not functions of {image.path}, e.g. {unknown[0]}")
    if len(p.func_addr) == 0:
        raise BadInput(f"{path}: no record names a function of {image.path} (profile of another binary?)")
    return p


def _check_bad(path, body, bad, total, rx, shape, nrecs):
    if bad <= 0 or (nrecs and bad <= max(1, total // 100)):
        return
    for n, line in enumerate(body.split(b"\n"), 1):
        if line.strip() and not rx.fullmatch(line.rstrip(b"\r")) and not _MEM.fullmatch(line):
            raise BadInput(f"{path}: {bad} of {total} lines are not .fdata records (first: line {n}: "
                           f"{line.decode('utf-8', 'replace')[:80]!r}; expected '{shape}')")


# -- export ---------------------------------------------------------------------------

def _names_for(profile, sym, addrs):
    """(kind, name, offset) columns for addresses; kind 0 with the image name outside functions."""
    ft = sym.functions
    idx = ft.find(addrs)
    inside = idx >= 0
    ic = np.where(inside, idx, 0)
    off = np.where(inside, addrs - ft.start[ic], addrs)
    kind = np.where(inside, np.where(ft.is_local[ic], 2, 1), 0)
    return kind, idx, off


def _is_branch(raw, conditional=False):
    """Whether an instruction (its leading bytes) transfers control: jmp, jcc, ret,
    call, indirect jmp or call (BOLT refuses a branch record from anything else);
    ``conditional``: whether it is a conditional jump."""
    from ..image.cfg import classify
    from ..image.disasm import skip_prefixes

    class _One:
        def __init__(self, row):
            self.raw = row.reshape(1, -1)

        def __len__(self):
            return 1
    one = _One(np.asarray(raw, dtype=np.uint8))
    if conditional:
        return bool(classify(one)[0] == 2)
    if classify(one)[0] in (1, 2, 3, 7, 8):
        return True
    # indirect call (ff /2, ff /3), possibly after a REX prefix
    skip, op, op2 = skip_prefixes(one.raw, (0x2E, 0x3E, 0xF2, 0xF3))
    s = int(skip[0])
    b = one.raw[0, s:].tolist()
    if b and 0x40 <= b[0] <= 0x4F:
        b = b[1:]
    return len(b) > 1 and b[0] == 0xFF and ((b[1] >> 3) & 7) in (2, 3)


def _branches_at(image, addrs, conditional=False):
    """Per address: whether an instruction starting there is a branch (_is_branch;
    ``conditional``: a conditional jump)."""
    from ..image.disasm import _Decoder
    uniq, inv = np.unique(np.asarray(addrs, dtype=np.uint64), return_inverse=True)
    ok = np.zeros(len(uniq), dtype=bool)
    dec = _Decoder()
    try:
        for k, a in enumerate(uniq.tolist()):
            code = b""
            for n in range(16, 0, -1):      # an instruction at the end of its section
                try:
                    code = bytes(image.read(a, n))
                    break
                except ValueError:
                    continue
            if not code:
                continue
            ins = dec.decode(code, a)
            ok[k] = bool(len(ins)) and _is_branch(ins["bytes"][0], conditional)
    finally:
        dec.close()
    return ok[inv]


def _block_branch_sites(image, profile, src):
    """Address of the last instruction of the block starting at each src (QEMU edges),
    where that instruction is a branch: a QEMU block can also end at a page or size
    limit, and its edge to the next block is then no branch at all."""
    from ..image.disasm import _Decoder
    pos = np.searchsorted(profile.block_addr, src)
    pos = np.minimum(pos, max(len(profile.block_addr) - 1, 0))
    out = np.zeros(len(src), dtype=np.uint64)
    ok = np.zeros(len(src), dtype=bool)
    dec = _Decoder()
    try:
        cache = {}
        for k, (a, p) in enumerate(zip(src.tolist(), pos.tolist())):
            if not len(profile.block_addr) or int(profile.block_addr[p]) != a:
                continue
            size = int(profile.block_size[p])
            if (a, size) not in cache:
                try:
                    code = bytes(image.read(a, size))
                except ValueError:
                    cache[(a, size)] = None
                    continue
                ins = dec.decode(code, a)
                cache[(a, size)] = (int(ins["address"][-1])
                                    if len(ins) and _is_branch(ins["bytes"][-1]) else None)
            last = cache[(a, size)]
            if last is not None:
                out[k], ok[k] = last, True
    finally:
        dec.close()
    return out, ok


def export_fdata(profile, path, image=None, log=None):
    """Write profile as BOLT .fdata (atomically). Returns the number of records written."""
    image = image if image is None or isinstance(image, ElfImage) else ElfImage(image)
    if image is None:
        ip = profile.meta.get("image_path")
        if not ip or not os.path.exists(ip):
            raise BadInput("fdata export needs the image the profile was recorded for "
                           f"({profile.meta.get('image')}); pass --image")
        image = ElfImage(ip)
    profile.check_image(image)
    sym = Symbolizer(image)
    ft = sym.functions
    out = []
    local_id = _local_ids(ft)
    names = [f"{n}/{local_id[i]}" if i in local_id else n for i, n in enumerate(ft.name)]
    if len(profile.edge_from):
        f, t = profile.edge_from, profile.edge_to
        c, mis = profile.edge_count, profile.edge_mispred
        keep = profile.edge_kind != KIND_OUTSIDE
        keep |= (sym.find(f) >= 0) | (sym.find(t) >= 0)
        if len(profile.block_addr):
            # An edge to the end of the block holding its source is a fall-through
            # (BOLT infers those from the taken branches), not a taken branch.
            ba = profile.block_addr
            be = ba + profile.block_size.astype(np.uint64)
            pos = np.searchsorted(ba, f, side="right") - 1
            pc = np.maximum(pos, 0)
            fall = (pos >= 0) & (f < be[pc]) & (t == be[pc])
            if profile.source == "qemu" and profile.meta.get("edge_from") == "insn":
                # ... unless the source is a conditional jump: then it is the branch's
                # not-taken edge, counted exactly, written from the jump to the next
                # instruction as BOLT's own instrumentation writes it (BOLT's guess
                # from the taken branches alone misplaces blocks)
                fall &= ~_branches_at(image, f, conditional=True)
            keep &= ~fall
        if profile.meta.get("edge_from") == "block" and len(profile.block_addr):
            # QEMU edges that join block starts: the branch is the source block's
            # last instruction.
            site, ok = _block_branch_sites(image, profile, f)
            keep &= ok
            f = site
        # An end outside every function of the image (the PLT, a library, the loader)
        # is written as BOLT's own instrumentation writes it, "0 [unknown] 0", never as
        # an address in the executable (BOLT cannot place one there): a branch out of
        # the image is kept, an entry from outside only where it lands on a function's
        # start (main from libc, a callback); a return from a library lands mid-function
        # after the call, a fall-through BOLT infers, and is dropped.
        f_in, t_in = sym.functions.find(f) >= 0, sym.functions.find(t) >= 0
        keep &= (f_in & t_in) | (f_in & ~t_in) | (~f_in & np.isin(t, sym.functions.start))
        if profile.source == "qemu":
            # QEMU's edges (LBR sources are branches by construction): the source must
            # be a branch instruction, but QEMU also joins a `rep` string instruction
            # to itself, and BOLT drops a record from anything else.
            keep &= ~f_in | _branches_at(image, f)
        f, t, c, mis = f[keep], t[keep], c[keep], mis[keep]
        order = np.lexsort((t, f))
        f, t, c, mis = f[order], t[order], c[order], mis[order]
        k1, i1, o1 = _names_for(profile, sym, f)
        k2, i2, o2 = _names_for(profile, sym, t)
        recs = {}           # outside ends collapse into one "[unknown]": counts add up
        for a in zip(k1.tolist(), i1.tolist(), o1.tolist(), k2.tolist(), i2.tolist(), o2.tolist(),
                     mis.tolist(), c.tolist()):
            ka, ia, oa, kb, ib, ob, m, n = a
            key = (f"{ka} {names[ia]} {oa:x}" if ka else "0 [unknown] 0",
                   f"{kb} {names[ib]} {ob:x}" if kb else "0 [unknown] 0")
            pm, pn = recs.get(key, (0, 0))
            recs[key] = (pm + m, pn + n)
        out = [f"{a} {b} {m} {n}\n" for (a, b), (m, n) in recs.items()]
        header = ""
    else:
        if len(profile.sample_addr):
            sa, sc = profile.sample_addr, profile.sample_count
        elif len(profile.block_addr):
            sa, sc = profile.block_addr, profile.block_count * profile.block_insns.astype(np.uint64)
        else:
            raise BadInput("profile has no branches, samples or blocks to export")
        k, i, o = _names_for(profile, sym, sa)
        keep = k != 0
        for kk, ii, oo, n in zip(k[keep].tolist(), i[keep].tolist(), o[keep].tolist(), sc[keep].tolist()):
            out.append(f"{kk} {names[ii]} {oo:x} {n}\n")
        event = "cpu-clock" if profile.source == "perf-ip" else "instructions"
        header = f"no_lbr {profile.meta.get('fdata_events', [event])[0] if profile.meta.get('fdata_events') else event}\n"
    if not out:
        raise BadInput("no profile record falls inside a function of the image; nothing to export")
    text = header + "".join(out)
    write_atomic(path, text.encode("utf-8"))
    if log:
        log(f"wrote {len(out)} {'samples' if header else 'branches'} to {path}")
    return len(out)


