"""Function prefixes and IBT entries of 6.2+ x86 kernels.

``__pfx_<fn>`` (CONFIG_PREFIX_SYMBOLS, made by objtool: an STT_FUNC of
CONFIG_FUNCTION_PADDING_BYTES bytes, 16 on Debian's 6.12 and 7.3, right before
``<fn>``) names the NOP padding into which call-depth tracking writes the
accounting thunk at boot (arch/x86/kernel/callthunks.c: ``patch_dest`` checks
that the padding is NOPs and skips the function otherwise, so a lost padding
does not crash, it silently loses the accounting). After a relayout every
prefix must still end at its function and hold only NOPs.

What the kernel needs of the padding (Debian's 6.12 callthunks.c; 7.3's image has
the same 9-byte template and its boot patches trimmed paddings the same way;
both gcc-built cloud kernels): ``patch_dest`` compares and overwrites only the
``SKL_TMPL_SIZE`` bytes right before the entry, the size of the call-depth
template (``skl_call_thunk_tail - skl_call_thunk_template``: 9 bytes on both
images, one ``sarq $5, %gs:...``; more with CONFIG_CALL_THUNKS_DEBUG, off on
both), so a padding of that size is enough (``thunk_template_size`` measures
it on the image). The 16 B function alignment matters to ``is_callthunk``
alone, which rounds an address up to CONFIG_FUNCTION_ALIGNMENT (16) and asks
whether the template sits before it; only the BPF JIT calls it
(``x86_call_depth_emit_accounting``), with an entry address, to skip its own
accounting. For an unaligned entry it looks before the next 16-byte boundary
inside the function and answers no (unless a tiny function ends right where the
next one's patched thunk does), so the JIT accounts the call itself before
calling the entry: counted once. A yes leaves the call unaccounted, which
refills the RSB one return early (the safe side), as the stock kernel does for
every aligned entry whose padding was patched. Nothing else uses the padding:
no ``__cfi_`` symbols (kCFI/FineIBT need clang's CFI; gcc 14 built both), and
ITS picks its thunks from the branch's own address at boot.
With ``--against`` (``check_prefix_room``): every function that had a prefix in
the original has at least the template's size of single-byte NOPs right before
its entry in the new image. A layout made with ``prefix_padding = "none"`` (opt-in:
hot functions keep no padding, the output must not boot with retbleed=stuff or
indirect_target_selection=stuff) declares it in its block map's header; the
missing paddings are then the warnings ``prefix.dropped`` / ``equiv.prefix-dropped``
instead of errors.

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
    """(names, addresses u64, sizes u64) of the ``__pfx_`` FUNC symbols (sized 0 where
    a layout dropped the whole padding: ``prefix_padding = "none"``)."""
    names, syms = image.symbol_table()
    typ = syms["info"] & 0xF
    idx = [i for i in np.nonzero((typ == STT_FUNC) & (syms["shndx"] != 0))[0].tolist()
           if names[i].startswith(PREFIX)]
    return ([names[i] for i in idx], syms["value"][idx].astype(np.uint64),
            syms["size"][idx].astype(np.uint64))


TEMPLATE_SYMBOLS = ("skl_call_thunk_template", "skl_call_thunk_tail")


def thunk_template_size(image):
    """Bytes of the call-depth accounting template the kernel patches before a
    function (``SKL_TMPL_SIZE``), from the image's symbols; None without them."""
    a, z = (image.symbol_address(n) for n in TEMPLATE_SYMBOLS)
    if a is None or z is None or not 0 < z - a <= 16:
        return None
    return int(z - a)


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
    tmpl = thunk_template_size(image)
    short = np.nonzero(size < np.uint64(tmpl))[0].tolist() if tmpl else []
    level, what = _missing_level(image)
    for k in short[:MAX_REPORT]:
        findings.append(Finding(level, f"prefix.{what}", int(addr[k]),
                                f"{names[k]} ({int(addr[k]):#x}) holds {int(size[k])} bytes, "
                                f"less than the {tmpl}-byte call-depth thunk"
                                + (NO_PADDING_NOTE if what == "dropped" else "")))
    if len(short) > MAX_REPORT:
        findings.append(Finding(level, f"prefix.{what}", None,
                                f"{len(short) - MAX_REPORT} more prefixes of the same "
                                f"({len(short)} in all)"))
    sizes = np.unique(size).tolist()
    return {"count": len(names), "bytes": [int(s) for s in sizes],
            "detached": len(detached), "not_nop": len(not_nop), "short": len(short),
            "thunk_template": tmpl}


NO_PADDING_NOTE = (" (dropped by prefix_padding = \"none\": do not boot with retbleed=stuff or "
                   "indirect_target_selection=stuff)")


def _missing_level(image):
    """(level, name) of a finding for a prefix too short for the thunk: a named
    warning where the layout declares it dropped such paddings on purpose (its block
    map's FLAG_NO_PADDING, ``prefix_padding = "none"``), else an error."""
    from ..image import blockmap as bm
    if bm.read_flags(image) & bm.FLAG_NO_PADDING:
        return "warning", "dropped"
    return "error", "short"


def check_prefix_room(octx, nctx, oi, ni, findings, counter, add):
    """Every matched function that had a prefix in OLD has at least the call-depth
    template's size (measured on OLD) of single-byte NOPs right before its entry in
    NEW (``add``: equivalence._add): an error, or the named warning
    ``equiv.prefix-dropped`` where NEW's block map says the layout dropped paddings
    on purpose (``prefix_padding = "none"``). Returns the number of such functions."""
    tmpl = thunk_template_size(octx.image)
    names, paddr, psize = prefix_symbols(octx.image)
    if not tmpl or not names or not len(oi):
        return 0
    of, nf = octx.functions, nctx.functions
    # a function had a prefix when one ends at its entry (by address: static
    # functions share names, and not every copy need have a prefix)
    ends = np.unique((paddr + psize).astype(np.uint64))
    k = np.nonzero(np.isin(of.start[oi].astype(np.uint64), ends))[0].astype(np.int64)
    if not len(k):
        return 0
    entry = nf.start[ni[k]].astype(np.uint64)
    raw = _bytes_at(nctx.image, entry - np.uint64(tmpl), tmpl)
    lost = np.nonzero((raw != NOP).any(axis=1))[0].tolist()
    level, what = _missing_level(nctx.image)
    name = "equiv.prefix-dropped" if what == "dropped" else "equiv.prefix-room"
    add(findings, level, name, lost,
        lambda q: (int(entry[q]), f"{nf.name[ni[k[q]]]}: the {tmpl} bytes before its entry "
                   f"{int(entry[q]):#x} are not NOPs ({bytes(raw[q]).hex()}): call-depth "
                   "tracking cannot patch its thunk there"
                   + (NO_PADDING_NOTE if what == "dropped" else "")), counter)
    return int(len(k))


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
