"""`llvm-dwarfdump --verify` on a seeded sample of a big image's units.

On Debian's 6.1 vmlinux the whole-file verify never finishes: llvm 19's
call-site check (DWARFVerifier::verifyDebugInfoCallSite) walks up from a
DW_TAG_call_site with ``Curr = Die.getParent()`` instead of
``Curr.getParent()``, so a call site whose parent is a lexical block loops
forever (fixed upstream in llvm-project PR #186413, 2026; Debian 12 has llvm
19). Measured: the stock vmlinux, 12 minutes, still in unit 2 of 2,172, every
sample spent in that loop. ``--debug-info=OFFSET`` does not narrow
``--verify`` either. So the check runs on a seeded sample of the units that
llvm 19 can verify (no call site directly inside a lexical block), the same
units of OLD and NEW.

So the sample is verified in a small ELF of its own: the chosen units of
``.debug_info`` back to back (a unit refers to its own DIEs by unit-relative
offsets, and to the other sections by offsets that stay valid), every other
``.debug_*`` section copied whole, ``.debug_aranges`` keeping the chosen units'
sets with their new offsets. The same unit indices are taken from OLD and NEW
(relayout keeps every .debug_info offset), so their error counts compare.
"""

import random
import re
import struct
import subprocess

import numpy as np

from linepack.dwarf import encoding as enc
from linepack.image.elf import ElfImage

SHT_PROGBITS, SHT_STRTAB = 1, 3


DW_TAG_call_site, DW_TAG_GNU_call_site = 0x48, 0x4109
DW_TAG_subprogram, DW_TAG_inlined_subroutine = 0x2E, 0x1D


def llvm19_can_verify(info, un, table):
    """False when a call site's parent is neither a subprogram nor an inlined
    subroutine (llvm 19's verifier loops forever on it)."""
    parents = []
    for off, tag, attrs, code in enc.walk_dies(info, un, table):
        while parents and parents[-1][1] <= off:
            parents.pop()
        if tag in (DW_TAG_call_site, DW_TAG_GNU_call_site) and parents and \
                parents[-1][0] not in (DW_TAG_subprogram, DW_TAG_inlined_subroutine):
            return False
        if table[code][1]:
            parents.append((tag, _children_end(info, un, table, off)))
    return True


def _children_end(info, un, table, off):
    """Offset just after the null entry that closes the children of the DIE at ``off``."""
    depth = 0
    p = off
    while p < un.end:
        code, p = enc.uleb(info, p)
        if code == 0:
            depth -= 1
            if depth == 0:
                return p
            continue
        ab = table[code]
        for at, form, ic in ab[2]:
            f, q = form, p
            if f == enc.DW_FORM_indirect:
                f, q = enc.uleb(info, p)
            p = enc.skip_form(info, q, f, un.asz, un.osz, un.version)
        if ab[1]:
            depth += 1
        elif depth == 0:
            return p
    return un.end


def sample_units(image_path, k, seed=12, max_bytes=None, among=None):
    """Seeded indices of ``k`` compile units llvm 19 can verify, each at most
    ``max_bytes`` long; ``among``: draw from these unit indices only."""
    im = ElfImage(str(image_path))
    info = bytes(im.section_bytes(im.section(".debug_info")))
    abbrev = bytes(im.section_bytes(im.section(".debug_abbrev")))
    units = enc.units(info)
    pool = [i for i, u in enumerate(units) if u.unit_type in (enc.DW_UT_compile, enc.DW_UT_partial)
            and (max_bytes is None or u.end - u.off <= max_bytes)
            and (among is None or i in among)]
    random.Random(seed).shuffle(pool)
    out = []
    for i in pool:
        if len(out) == k:
            break
        table = enc.parse_abbrevs(abbrev, units[i].abbrev_off)[0]
        if llvm19_can_verify(info, units[i], table):
            out.append(i)
    return sorted(out)


def write_unit_sample(image_path, unit_indices, out_path):
    """Write the small ELF holding ``unit_indices`` of the image's .debug_info."""
    im = ElfImage(str(image_path))
    secs = {s.name: s for s in im.sections if s.name.startswith(".debug_") and s.size}
    info = bytes(im.section_bytes(secs[".debug_info"]))
    units = enc.units(info)
    new_info, moved = bytearray(), {}
    for i in unit_indices:
        u = units[i]
        moved[u.off] = len(new_info)
        new_info += info[u.off:u.end]
    contents = {}
    for name, s in secs.items():
        if name == ".debug_info":
            contents[name] = bytes(new_info)
        elif name == ".debug_aranges":
            contents[name] = _aranges_for(bytes(im.section_bytes(s)), moved)
        elif not name.startswith(".debug_names"):        # name indexes point at all units
            contents[name] = bytes(im.section_bytes(s))
    _write_elf(out_path, contents)


def _aranges_for(b, moved):
    out = bytearray()
    p = 0
    while p + 4 <= len(b):
        ln = enc.u(b, p, 4)
        if ln == 0xFFFFFFFF:
            break
        off = enc.u(b, p + 6, 4)
        if off in moved:
            s = bytearray(b[p:p + 4 + ln])
            s[6:10] = moved[off].to_bytes(4, "little")
            out += s
        p += 4 + ln
    return bytes(out)


def _write_elf(path, contents):
    names = list(contents)
    shstr = bytearray(b"\0")
    name_off = []
    for n in names + [".shstrtab"]:
        name_off.append(len(shstr))
        shstr += n.encode() + b"\0"
    body = bytearray()
    offs = []
    for n in names:
        while len(body) % 8:
            body += b"\0"
        offs.append(64 + len(body))
        body += contents[n]
    offs.append(64 + len(body))
    body += shstr
    while len(body) % 8:
        body += b"\0"
    shoff = 64 + len(body)
    ehdr = struct.pack("<4sBBBBB7sHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, bytes(7),
                       2, 62, 1, 0, 0, shoff, 0, 64, 0, 0, 64, len(names) + 2, len(names) + 1)
    sh = bytearray(bytes(64))
    for k, n in enumerate(names):
        sh += struct.pack("<IIQQQQIIQQ", name_off[k], SHT_PROGBITS, 0, 0, offs[k],
                          len(contents[n]), 0, 0, 1, 0)
    sh += struct.pack("<IIQQQQIIQQ", name_off[-1], SHT_STRTAB, 0, 0, offs[-1], len(shstr),
                      0, 0, 1, 0)
    with open(path, "wb") as f:
        f.write(ehdr + body + sh)


def verify_errors(path, tool, timeout=1800):
    """(error lines, {(message, DIE offset)}) of ``llvm-dwarfdump --verify`` on
    ``path``. An error about a location list is printed once per list entry, so a
    list whose entry now spans two pieces repeats it: distinct (message, DIE)
    pairs are what compares between OLD and NEW (their DIE offsets agree)."""
    p = subprocess.run([tool, "--verify", str(path)], capture_output=True, text=True,
                       timeout=timeout)
    text = p.stdout + p.stderr
    if p.returncode == 0:
        assert "No errors." in text, text[-2000:]
    errs, keys = [], set()
    pending = None
    for ln in text.splitlines():
        m = re.match(r"\s*error: (.*)", ln)
        if m:
            if "occurred" in ln or "Aggregated" in ln:
                continue
            errs.append(ln)
            pending = m.group(1).strip()
            continue
        m = re.match(r"(0x[0-9a-f]+): DW_TAG", ln)
        if m and pending is not None:
            keys.add((pending, int(m.group(1), 16)))
            pending = None
    return errs, keys


def units_with_code_in(image_path, lo, hi):
    """Indices of the units whose .debug_aranges sets meet any [lo[i], hi[i])
    (sorted uint64 arrays of OLD addresses)."""
    im = ElfImage(str(image_path))
    ar = bytes(im.section_bytes(im.section(".debug_aranges")))
    info = bytes(im.section_bytes(im.section(".debug_info")))
    index = {u.off: i for i, u in enumerate(enc.units(info))}
    lo, hi = np.asarray(lo, np.uint64), np.asarray(hi, np.uint64)
    out = set()
    p = 0
    while p + 4 <= len(ar):
        ln = enc.u(ar, p, 4)
        if ln == 0xFFFFFFFF:
            break
        off = enc.u(ar, p + 6, 4)
        q = p + 16
        while q + 16 <= p + 4 + ln:
            a, n = enc.u(ar, q, 8), enc.u(ar, q + 8, 8)
            q += 16
            if a == 0 and n == 0:
                break
            k = np.searchsorted(lo, np.uint64(a + n))          # pieces starting before the end
            if k > 0 and hi[k - 1] > a and off in index:        # sorted, disjoint
                out.add(index[off])
        p += 4 + ln
    return out


def compare_verify(old_path, new_path, units, workdir, tool):
    """(OLD's, NEW's) verify_errors on the same units."""
    import os
    res = []
    for name, path in (("old", old_path), ("new", new_path)):
        elf = os.path.join(str(workdir), f"units-{name}.elf")
        write_unit_sample(path, units, elf)
        res.append(verify_errors(elf, tool))
        os.unlink(elf)
    return res
