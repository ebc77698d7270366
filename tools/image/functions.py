"""Functions and the regions they must stay inside.

A function is an STT_FUNC symbol with a size inside an executable section.
Aliases (several names at one address) collapse to one function with one
canonical name. A region is a stretch of code bounded by labels that are not
functions (``__sched_text_start`` ...): relayout moves code inside a region,
never across a boundary, because the kernel tests addresses against them.
"""

import numpy as np

from .elf import STB_GLOBAL, STB_LOCAL, STB_WEAK, STT_FUNC
from .intervals import containing

# Labels that bound kernel text regions (pairs are start/end; singles are edges).
KERNEL_REGION_LABELS = (
    "_text", "_stext", "_etext",
    "__noinstr_text_start", "__noinstr_text_end",
    "__sched_text_start", "__sched_text_end",
    "__cpuidle_text_start", "__cpuidle_text_end",
    "__lock_text_start", "__lock_text_end",
    "__kprobes_text_start", "__kprobes_text_end",
    "__entry_text_start", "__entry_text_end",
    "__irqentry_text_start", "__irqentry_text_end",
    "__softirqentry_text_start", "__softirqentry_text_end",
    "__static_call_text_start", "__static_call_text_end",
    "__indirect_thunk_start", "__indirect_thunk_end",
    "__x86_cpu_dev_start", "__x86_cpu_dev_end",
    "__start_rodata",
)


class FunctionTable:
    """Sorted, de-aliased functions: arrays ``start``, ``size``, ``section``, ``name``."""

    def __init__(self, image):
        names, syms = image.symbol_table()
        code_secs = {s.index for s in image.sections if s.is_code and s.is_alloc}
        info = syms["info"]
        typ = info & 0xF
        bind = info >> 4
        shndx = syms["shndx"].astype(np.int64)
        mask = (typ == STT_FUNC) & (syms["size"] > 0) & np.isin(shndx, list(code_secs))
        idx = np.nonzero(mask)[0]
        start = syms["value"][idx].astype(np.uint64)
        size = syms["size"][idx].astype(np.uint64)
        # Prefer global over weak over local names at one address; then the symtab order.
        rank = np.where(bind[idx] == STB_GLOBAL, 0, np.where(bind[idx] == STB_WEAK, 1, 2))
        order = np.lexsort((idx, rank, start))
        start, size, idx = start[order], size[order], idx[order]
        first = np.ones(len(start), dtype=bool)
        first[1:] = start[1:] != start[:-1]
        self.start = start[first]
        # An alias with a larger size wins the size (rare: e.g. asm entry aliases).
        self.size = np.maximum.reduceat(size, np.nonzero(first)[0]) if len(size) else size
        self.sym_index = idx[first]
        self.section = shndx[self.sym_index].astype(np.int32)
        self.name = [names[i] for i in self.sym_index.tolist()]
        self.is_local = (bind[self.sym_index] == STB_LOCAL)
        self.end = self.start + self.size
        self._by_name = None
        # Other names of each function (aliases), for lookups by any name.
        self._alias_names = {}
        for i in np.nonzero(~first)[0].tolist():
            j = int(np.searchsorted(self.start, start[i], side="right")) - 1
            self._alias_names[names[idx[i]]] = j

    def __len__(self):
        return len(self.start)

    def index_of(self, name):
        """Index of the function with this name (or alias), or None."""
        if self._by_name is None:
            self._by_name = {}
            for i, n in enumerate(self.name):
                self._by_name.setdefault(n, i)
            for n, i in self._alias_names.items():
                self._by_name.setdefault(n, i)
        return self._by_name.get(name)

    def find(self, addrs):
        """Index of the function containing each address, -1 where none.

        An address exactly at a function's end belongs to no function (it is
        the next function's start, padding, or an end marker).
        """
        return containing(self.start, self.end, addrs)

    def overlaps(self):
        """Pairs (i, i+1) where function i runs into function i+1."""
        bad = np.nonzero(self.end[:-1] > self.start[1:])[0]
        return [(int(i), int(i) + 1) for i in bad]


class Region:
    """A stretch of one code section that code must not leave."""

    __slots__ = ("name", "start", "end", "section")

    def __init__(self, name, start, end, section):
        self.name, self.start, self.end, self.section = name, start, end, section

    def __repr__(self):
        return f"<Region {self.name} {self.start:#x}..{self.end:#x}>"


def regions(image):
    """Regions of every code section, split at the kernel's boundary labels."""
    out = []
    for sec in image.sections:
        if not (sec.is_code and sec.is_alloc and sec.size):
            continue
        cuts = {sec.addr: "start of " + sec.name}
        for label in KERNEL_REGION_LABELS:
            a = image.symbol_address(label)
            if a is not None and sec.addr < a < sec.end:
                cuts.setdefault(a, label)
        points = sorted(cuts)
        for k, a in enumerate(points):
            b = points[k + 1] if k + 1 < len(points) else sec.end
            if b > a:
                out.append(Region(f"{sec.name}:{cuts[a]}", a, b, sec.index))
    return out


def text_size(image):
    """Bytes of kernel text, ``_etext - _stext`` (a userspace image: its .text section):
    the base every ".text growth" percentage is taken of (relayout, evaluate, README)."""
    a, b = image.symbol_address("_stext"), image.symbol_address("_etext")
    if a is None or b is None:
        s = image.section(".text")
        return s.size if s else 0
    return b - a
