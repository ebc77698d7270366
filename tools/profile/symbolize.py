"""Map recorded addresses to the image's functions, and undo KASLR / PIE shifts.

Everything here works on numpy arrays of addresses (``searchsorted`` through
:class:`~linepack.image.functions.FunctionTable`), never one address at a time.

Address shifts. A profile records *runtime* addresses; the image holds *link*
addresses. They differ by a constant:

- a KASLR kernel is shifted by a multiple of 2 MiB (CONFIG_PHYSICAL_ALIGN);
- a PIE executable is loaded at a page-aligned base (its link base is ~0).

:func:`resolve_offset` measures which share of the addresses falls inside the
image's functions unshifted; when few do, it searches the constant (a multiple
of the granularity) that makes most of them land inside functions (or, when
the recording carries symbol names, exactly where the named function is). A
kernel (ET_EXEC) profile that is shifted is refused with one line naming the
shift, unless the caller passes an explicit offset or ``auto``. A PIE
(ET_DYN) profile is always shifted, so its load bias is applied automatically.
"""

import numpy as np

from ..errors import BadInput
from ..image.elf import ET_DYN
from ..image.context import ImageContext

KASLR_ALIGN = 2 << 20      # x86-64 kernel: CONFIG_PHYSICAL_ALIGN
PAGE = 4096                # userspace PIE load bias granularity
KERNEL_BASE = 0xFFFFFFFF80000000

# A shift is reported when fewer than this share of the addresses map unshifted ...
MAPPED_OK = 0.5
# ... and a candidate shift maps at least this share.
SHIFT_MIN = 0.5

_MASK64 = (1 << 64) - 1


def parse_offset(text):
    """``--kaslr-offset`` value: None, ``"auto"`` or an int (hex ``0x..`` or decimal, may be negative)."""
    if text is None:
        return None
    t = str(text).strip().lower()
    if t == "auto":
        return "auto"
    try:
        return int(t, 0)
    except ValueError:
        raise BadInput(f"--kaslr-offset: expected a number like 0x1e000000 or 'auto', got {text!r}") from None


def fmt_offset(off):
    off = int(off)
    if off >= 1 << 63:
        off -= 1 << 64
    return f"-{-off:#x}" if off < 0 else f"{off:#x}"


def is_kernel(image, functions=None):
    """True for a vmlinux-like image (ET_EXEC linked in the top 2 GiB, or with kernel labels)."""
    if image.type == ET_DYN:
        return False
    if image.symbol_address("_stext") is not None and image.symbol_address("startup_64") is not None:
        return True
    ft = functions if functions is not None else ImageContext.of(image).functions
    return bool(len(ft) and int(ft.start[0]) >= KERNEL_BASE)


class Symbolizer:
    """Address -> function index (``-1`` outside every function) for one image."""

    def __init__(self, image, functions=None):
        self.image = image
        self.functions = functions if functions is not None else ImageContext.of(image).functions
        if len(self.functions) == 0:
            raise BadInput(f"{image.path}: no functions (STT_FUNC symbols with a size) in any code section")
        self.kernel = is_kernel(image, self.functions)
        self.granularity = KASLR_ALIGN if self.kernel else PAGE

    def find(self, addrs):
        return self.functions.find(addrs)

    def mapped_share(self, addrs, weights=None, offset=0):
        """Share (0..1) of addresses (weighted) inside a function after subtracting offset."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        if len(addrs) == 0:
            return 0.0
        a = addrs - np.uint64(offset & _MASK64)
        inside = self.find(a) >= 0
        if weights is None:
            return float(inside.mean())
        w = np.asarray(weights, dtype=np.float64)
        tot = w.sum()
        return float(w[inside].sum() / tot) if tot else 0.0

    # -- shift detection --------------------------------------------------------
    def _candidates_from_names(self, addrs, names, symoffs):
        """Offsets from (address, function name[, offset in function]) triples.

        names: sequence of str (or None/"" where unknown); symoffs: int array,
        -1 where the recording gave no offset inside the function.
        """
        starts, offs, rows = [], [], []
        index_of = self.functions.index_of
        start = self.functions.start
        for i, n in enumerate(names):
            if not n:
                continue
            j = index_of(n)
            if j is None:
                continue
            rows.append(i)
            starts.append(int(start[j]))
            offs.append(int(symoffs[i]) if symoffs is not None else -1)
        if not rows:
            return np.zeros(0, np.uint64), 0
        a = np.asarray(addrs, dtype=np.uint64)[rows]
        offs = np.asarray(offs, dtype=np.int64)
        known = offs >= 0
        d = a - np.asarray(starts, dtype=np.uint64) - np.where(known, offs, 0).astype(np.uint64)
        # Without the offset inside the function, round down to the granularity:
        # the shift is a multiple of it and most samples sit in its first stretch.
        d = np.where(known, d, d & ~np.uint64(self.granularity - 1))
        return d, len(rows)

    def _candidates_by_vote(self, addrs, weights):
        """Offsets (multiples of the granularity) that put addresses into the text span."""
        g = self.granularity
        lo = int(self.functions.start[0])
        hi = int(self.functions.end.max())
        span_steps = (hi - lo) // g + 2
        a = np.unique(np.asarray(addrs, dtype=np.uint64))
        cap = max(16, 2_000_000 // span_steps)
        if len(a) > cap:
            a = a[np.linspace(0, len(a) - 1, cap).astype(np.int64)]
        base = (a - np.uint64(lo)) & ~np.uint64(g - 1)        # shift putting a near text start
        ks = np.arange(span_steps, dtype=np.uint64) * np.uint64(g)
        cand = (base[:, None] - ks[None, :]).ravel()
        vals, counts = np.unique(cand, return_counts=True)
        order = np.argsort(-counts, kind="stable")[:24]
        return vals[order]

    def detect_offset(self, addrs, weights=None, names=None, symoffs=None):
        """(best offset, share mapped at offset 0, share mapped at best offset)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        share0 = self.mapped_share(addrs, weights)
        cands = []
        if names is not None:
            d, n = self._candidates_from_names(addrs, names, symoffs)
            if n:
                vals, counts = np.unique(d, return_counts=True)
                cands = list(vals[np.argsort(-counts, kind="stable")[:8]])
        if not cands:
            cands = list(self._candidates_by_vote(addrs, weights))
        best, best_share = 0, share0
        for c in cands:
            c = int(c)
            if c == 0:
                continue
            s = self.mapped_share(addrs, weights, c)
            if s > best_share + 1e-12:
                best, best_share = c, s
        return best, share0, best_share


def resolve_offset(sym, addrs, weights=None, option=None, names=None, symoffs=None, what="profile",
                   log=None):
    """The offset to subtract from recorded addresses (an int, 0 when none).

    option: None (detect; refuse a shifted kernel profile), "auto" (detect and
    apply), or an int (apply as given). Raises BadInput with one clear line when
    the addresses cannot belong to the image.
    """
    addrs = np.asarray(addrs, dtype=np.uint64)
    path = sym.image.path
    if len(addrs) == 0:
        raise BadInput(f"{what}: no addresses to map onto {path}")
    if isinstance(option, int):
        share = sym.mapped_share(addrs, weights, option)
        if share == 0:
            raise BadInput(f"{what}: with --kaslr-offset {fmt_offset(option)} no address falls inside a "
                           f"function of {path}")
        return option & _MASK64
    share0 = sym.mapped_share(addrs, weights)
    if share0 >= MAPPED_OK and option != "auto":
        return 0
    best, share0, share = sym.detect_offset(addrs, weights, names, symoffs)
    pie = sym.image.type == ET_DYN and not sym.kernel
    shifted = best != 0 and share > 2 * share0 and share >= (0.05 if pie else SHIFT_MIN)
    if not shifted:
        if share0 == 0:
            raise BadInput(f"{what}: none of {len(addrs)} addresses falls inside a function of {path} "
                           "(profile of another image?)")
        return 0
    if option == "auto" or (option is None and pie):
        if log:
            kind = "KASLR offset" if sym.kernel else "load bias"
            log(f"applying {kind} {fmt_offset(best)} ({share:.0%} of addresses map, "
                f"{share0:.0%} unshifted)")
        return best
    raise BadInput(f"{what}: addresses are KASLR-shifted by {fmt_offset(best)} ({share:.0%} map after "
                   f"the shift, {share0:.0%} before); record with kptr_restrict/nokaslr or pass "
                   f"--kaslr-offset {fmt_offset(best)} (or auto)")
