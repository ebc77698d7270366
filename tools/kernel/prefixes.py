"""Function prefixes and IBT entries of 6.2+ x86 kernels.

``__pfx_<fn>`` (CONFIG_PREFIX_SYMBOLS, made by objtool: an STT_FUNC of
CONFIG_FUNCTION_PADDING_BYTES bytes, 16 on Debian's 6.12 and 7.3, right before
``<fn>``) names the NOP padding into which call-depth tracking writes the
accounting thunk at boot (arch/x86/kernel/callthunks.c: ``patch_dest`` checks
that the padding is NOPs and skips the function otherwise, so a lost padding
does not crash, it silently loses the accounting). After a relayout every
prefix must still end at its function and hold only NOPs.

With CONFIG_X86_KERNEL_IBT a function that may be called indirectly starts with
ENDBR64 (f3 0f 1e fa); ``--against``: every function whose entry was an ENDBR
in the original still starts with one (a block-level split must keep the entry
block first).
"""

import numpy as np

from ..image.elf import STT_FUNC
from .base import Finding

PREFIX = "__pfx_"
ENDBR64 = b"\xf3\x0f\x1e\xfa"
NOP = 0x90
MAX_REPORT = 20


def _bytes_at(image, addrs, width):
    """(len(addrs), width) uint8 of the bytes at each address (zeros where unmapped)."""
    out = np.zeros((len(addrs), width), np.uint8)
    addrs = np.asarray(addrs, np.uint64)
    for sec in image.sections:
        if not (sec.is_alloc and sec.is_code and sec.size):
            continue
        sel = np.nonzero((addrs >= np.uint64(sec.addr)) & (addrs + np.uint64(width) <= np.uint64(sec.end)))[0]
        if not len(sel):
            continue
        data = np.asarray(image.section_bytes(sec))
        off = (addrs[sel] - np.uint64(sec.addr)).astype(np.int64)
        out[sel] = data[off[:, None] + np.arange(width)]
    return out


def prefix_symbols(image):
    """(names, addresses u64, sizes u64) of the sized ``__pfx_`` FUNC symbols."""
    names, syms = image.symbol_table()
    typ = syms["info"] & 0xF
    idx = [i for i in np.nonzero((typ == STT_FUNC) & (syms["size"] > 0))[0].tolist()
           if names[i].startswith(PREFIX)]
    return ([names[i] for i in idx], syms["value"][idx].astype(np.uint64),
            syms["size"][idx].astype(np.uint64))


def check_prefixes(ctx, findings):
    """Each prefix ends where its function starts and is all NOPs.
    Returns the census for the report (None when the image has no prefixes)."""
    image = ctx.image
    names, addr, size = prefix_symbols(image)
    if not names:
        return None
    where = ctx.symbol_addresses()
    end = (addr + size).tolist()
    detached = [k for k, (n, e) in enumerate(zip(names, end))
                if e not in where.get(n[len(PREFIX):], ())]
    width = int(size.max())
    raw = _bytes_at(image, addr, width)
    within = np.arange(width)[None, :] < size[:, None].astype(np.int64)
    not_nop = np.nonzero(((raw != NOP) & within).any(axis=1))[0].tolist()
    for k in detached[:MAX_REPORT]:
        findings.append(Finding("error", "prefix.detached", int(addr[k]),
                                f"{names[k]} ({int(addr[k]):#x}) does not end at "
                                f"{names[k][len(PREFIX):]}: the padding left its function"))
    for k in not_nop[:MAX_REPORT]:
        findings.append(Finding("error", "prefix.padding", int(addr[k]),
                                f"{names[k]} ({int(addr[k]):#x}) is not NOP padding "
                                f"({bytes(raw[k, :int(size[k])]).hex()}): call-depth "
                                "tracking cannot patch its thunk there"))
    for what, bad in (("detached", detached), ("padding", not_nop)):
        if len(bad) > MAX_REPORT:
            findings.append(Finding("error", f"prefix.{what}", None,
                                    f"{len(bad) - MAX_REPORT} more prefixes of the same "
                                    f"({len(bad)} in all)"))
    sizes = np.unique(size).tolist()
    return {"count": len(names), "bytes": [int(s) for s in sizes],
            "detached": len(detached), "not_nop": len(not_nop)}


def endbr_at(image, addrs):
    """True where the 4 bytes at each address are ENDBR64."""
    raw = _bytes_at(image, addrs, 4)
    want = np.frombuffer(ENDBR64, np.uint8)
    return (raw == want).all(axis=1)


def check_endbr_entries(octx, nctx, oi, ni, findings, counter, add):
    """Every matched function whose entry was ENDBR64 in OLD still starts with
    it in NEW (``add``: equivalence._add). Returns the count of such entries."""
    of, nf = octx.functions, nctx.functions
    if not len(oi):
        return 0
    had = endbr_at(octx.image, of.start[oi])
    has = endbr_at(nctx.image, nf.start[ni])
    lost = np.nonzero(had & ~has)[0].tolist()
    add(findings, "error", "equiv.ibt-entry", lost,
        lambda k: (int(nf.start[ni[k]]), f"{nf.name[ni[k]]} no longer starts with ENDBR64 "
                   "(an indirect call to it would fault under IBT)"), counter)
    return int(had.sum())
