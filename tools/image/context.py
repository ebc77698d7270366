"""One context per image: what every layer derives from an ElfImage, computed on first
use and kept (functions, their disassembly, the byte coverage, symbol lookups, the
kernel version).

``ImageContext.of(image)`` is the shared context of an image object (held in its
``context``): relayout's planning, its rewriter and its kernel-table updates,
evaluate's layouts and the DWARF rewrite all see one FunctionTable and one
disassembly. Layers above the image model (relayout's units, the kernel's patch
sites) keep what they derive in the same context through ``derived(name, build)``.
"""

import re

import numpy as np

from .disasm import disassemble, sweep_sections
from .functions import FunctionTable

def kernel_version_of(image):
    """(major, minor, patch) and the banner text from linux_banner, or (None, None)."""
    addr = image.symbol_address("linux_banner")
    if addr is None:
        return None, None
    sec = image.section_at(addr)
    if sec is None:
        return None, None
    try:
        raw = bytes(image.read(addr, min(256, sec.end - addr)))
    except ValueError:
        return None, None
    text = raw.split(b"\0", 1)[0].decode("ascii", "replace").strip()
    m = re.match(r"Linux version (\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        return None, text
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)), text


class cached:
    """A property computed once and kept in ``_<name>`` (None = not computed yet).

    Keeping it in a plain attribute lets a caller that already has the value (the
    relayout driver's disassembly, verify's merged coverage) supply it before first
    use, and lets ``copy.copy(ctx)`` share what was computed (verify/mutation.py)."""

    def __init__(self, build):
        self.build, self.slot = build, "_" + build.__name__
        self.__doc__ = build.__doc__

    def __set_name__(self, owner, name):
        setattr(owner, self.slot, None)        # ctx._<name> reads None until computed

    def __get__(self, ctx, owner=None):
        if ctx is None:
            return self
        got = getattr(ctx, self.slot)
        if got is None:
            got = self.build(ctx)
            setattr(ctx, self.slot, got)
        return got


class ImageContext:
    """What the layers share about one image, computed lazily once."""

    # image/references.py References when the image's relocations were recovered
    # (relayout --vmlinuz) instead of read from its link relocations
    recovered = None

    @classmethod
    def of(cls, image, log=None):
        """The one context of an image object (built on first use, then shared)."""
        ctx = getattr(image, "context", None)      # ElfImage.context; a stand-in may lack it
        if ctx is None:
            ctx = image.context = cls(image, log=log)
        return ctx

    def __init__(self, image, log=None):
        self.image = image
        self.log = log or (lambda msg: None)
        self.version, self.banner = kernel_version_of(image)
        text = image.section(".text")
        self.text_start = image.symbol_address("_stext", text.addr if text else 0)
        self.text_end = image.symbol_address("_etext", text.end if text else 0)

    def derived(self, name, build):
        """``build()`` once per context, for data of the layers above the image model."""
        slot = "_derived_" + name
        got = self.__dict__.get(slot)
        if got is None:
            got = build()
            setattr(self, slot, got)
        return got

    def forget(self, *names):
        """Drop what ``derived`` built under ``names``; it is built again on next use."""
        for name in names:
            self.__dict__.pop("_derived_" + name, None)

    def drop_instructions(self):
        """Forget every decoded instruction held here (decoded again on next use):
        relayout's last passes need none, and on a distribution kernel they are
        a few hundred MB that the DWARF rewrite needs for itself."""
        self._disasm = self._function_disasm = None
        self.forget("units", "other_code")

    def swept(self, sections):
        """Linear-sweep Disassembly of whole ``sections``, once per context: the
        code sections relayout does not lay out (the rewriter and reference
        recovery both read them)."""
        done = self.derived("other_code", dict)
        key = tuple(s.index for s in sections)
        if key not in done:
            done[key] = sweep_sections(self.image, sections)
        return done[key]

    @property
    def is_kernel(self):
        return self.version is not None and self.image.symbol_address("_stext") is not None

    @cached
    def functions(self):
        """The FunctionTable of the image (the one place it is built)."""
        return FunctionTable(self.image)

    @cached
    def function_disasm(self):
        """Instructions of the sized FUNC symbols only."""
        self.log(f"disassembling {len(self.functions)} functions")
        return disassemble(self.image, self.functions)

    @cached
    def coverage(self):
        """The partition of every executable byte (linepack.image.coverage);
        computed before ``disasm``, which merges its instructions."""
        from .coverage import CodeCoverage
        return CodeCoverage(self.image, self.functions, self.function_disasm)

    @cached
    def disasm(self):
        """Every decoded instruction of every executable section: functions
        (``func`` = their index) and the code outside them (``func`` = -1)."""
        from .coverage import merge
        functions, extra = self.function_disasm, self.coverage.extra
        # the merged arrays hold every function instruction: keep one copy (the
        # function rows are dropped column by column as merge copies them)
        self._function_disasm = None
        merged = merge(functions, extra, release=True)
        # the decode's transients, freed, go back to the system before the next phase
        from ..native import release_free_memory
        release_free_memory()
        return merged

    def in_code(self, addrs):
        """True where an address lies in an executable allocated section."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        ok = np.zeros(len(addrs), dtype=bool)
        for s in self.code_sections:
            ok |= (addrs >= np.uint64(s.addr)) & (addrs < np.uint64(s.end))
        return ok

    @cached
    def code_sections(self):
        """The allocated sections holding code (image/elf.py code_sections: 7.x kexec
        code inside a writable, executable .data counts; the rest of it does not)."""
        from .elf import code_sections
        return code_sections(self.image)

    @cached
    def sym_addrs(self):
        where = {}
        names, syms = self.image.symbol_table()
        for nm, v, t in zip(names, syms["value"].tolist(), (syms["info"] & 0xF).tolist()):
            if nm and t not in (3, 4):       # not SECTION / FILE
                where.setdefault(nm, set()).add(v)
        return where

    def symbol_addresses(self):
        """{name: set of addresses} over the ELF symtab (names repeat for statics)."""
        return self.sym_addrs

    def code_section_ends(self, addrs):
        """True where an address is exactly the end of a code section (terminators)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        ends = [s.end for s in self.code_sections]
        return np.isin(addrs, np.array(ends, dtype=np.uint64))

    @cached
    def code_symbols(self):
        names, syms = self.image.symbol_table()
        typ = syms["info"] & 0xF
        v = syms["value"][(typ != 3) & (typ != 4)].astype(np.uint64)
        return np.unique(v[self.in_code(v)])

    def code_piece(self, addrs):
        """Index of the stretch between consecutive code symbols holding each address."""
        return np.searchsorted(self.code_symbols, np.asarray(addrs, np.uint64), side="right")

    def symbol_at(self, addr):
        """'func+0xoff' for messages."""
        ft = self.functions
        i = int(ft.find([addr])[0])
        if i < 0:
            return f"{int(addr):#x}"
        return f"{ft.name[i]}+{int(addr) - int(ft.start[i]):#x}"


__all__ = ["ImageContext", "kernel_version_of"]
