"""Little-endian words at ELF addresses, read in bulk.

One reader for every table and relocation field: relayout's dynamic-section
update reads fields of the image as patched so far, verify and the recovered
kernel references read the file. Sections with contents only (NOBITS reads as
absent); ``.data..percpu`` counts at its ELF address (0), where kernel
references to per-CPU variables point.
"""

import numpy as np

from .intervals import containing

_VIEW = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def section_spans(image):
    """(starts, ends, sections) of the allocated sections with contents, by address."""
    secs = sorted((s for s in image.sections if s.is_alloc and s.size and s.type != 8),
                  key=lambda s: s.addr)
    return (np.array([s.addr for s in secs], np.uint64),
            np.array([s.end for s in secs], np.uint64), secs)


def read_words(image, addrs, width, patched=None):
    """(values uint64, have bool) of the ``width``-byte words at ``addrs``.

    ``patched`` (section index -> that section's new bytes) is read in place of
    the file for the sections it holds. ``have`` is False (value 0) for a word
    outside every section with contents or running past its section's end."""
    addrs = np.asarray(addrs, np.uint64)
    lo, hi, secs = section_spans(image)
    k = containing(lo, hi, addrs)
    kc = np.maximum(k, 0)
    have = (k >= 0) & (addrs + np.uint64(width) <= hi[kc]) if len(secs) else np.zeros(len(addrs), bool)
    out = np.zeros(len(addrs), np.uint64)
    if not have.any():
        return out, have
    lanes = np.arange(width)[None, :]
    rows = np.nonzero(have)[0]
    ks = kc[rows]
    # by section, through section_bytes: a patched view of an image (verify's
    # mutations) answers there, and ``patched`` takes its place where given
    for j in np.unique(ks).tolist():
        sec = secs[j]
        buf = (patched or {}).get(sec.index)
        buf = np.asarray(image.section_bytes(sec) if buf is None else buf)
        m = rows[ks == j]
        p = (addrs[m] - np.uint64(sec.addr)).astype(np.int64)
        out[m] = buf[p[:, None] + lanes].copy().view(_VIEW[width]).ravel()
    return out, have


def read_s32(image, addrs, patched=None):
    """(values int64, have) of the sign-extended 32-bit words at ``addrs``."""
    v, have = read_words(image, addrs, 4, patched)
    return v.astype(np.uint32).view(np.int32).astype(np.int64), have
