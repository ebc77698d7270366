"""ELF64 little-endian reader on a read-only memory map, with numpy tables.

pyelftools is correct but builds one Python object per symbol or relocation;
vmlinux has ~150k symbols and ~1.5M relocations, so the bulk tables here are
numpy structured arrays viewed straight out of the mapped file.
"""

import mmap
import os
import stat

import numpy as np

from ..errors import BadInput

# ELF constants we use (from the System V gABI / x86-64 psABI).
ET_EXEC, ET_DYN, ET_REL = 2, 3, 1
EM_X86_64 = 62
SHT_PROGBITS, SHT_SYMTAB, SHT_STRTAB, SHT_RELA, SHT_NOBITS, SHT_NOTE = 1, 2, 3, 4, 8, 7
SHF_WRITE, SHF_ALLOC, SHF_EXECINSTR = 0x1, 0x2, 0x4
STT_NOTYPE, STT_OBJECT, STT_FUNC, STT_SECTION, STT_FILE = 0, 1, 2, 3, 4
STB_LOCAL, STB_GLOBAL, STB_WEAK = 0, 1, 2
SHN_UNDEF, SHN_ABS = 0, 0xFFF1
NT_GNU_BUILD_ID = 3

EHDR = np.dtype([
    ("ident", "u1", 16), ("type", "<u2"), ("machine", "<u2"), ("version", "<u4"),
    ("entry", "<u8"), ("phoff", "<u8"), ("shoff", "<u8"), ("flags", "<u4"),
    ("ehsize", "<u2"), ("phentsize", "<u2"), ("phnum", "<u2"), ("shentsize", "<u2"),
    ("shnum", "<u2"), ("shstrndx", "<u2")])
SHDR = np.dtype([
    ("name", "<u4"), ("type", "<u4"), ("flags", "<u8"), ("addr", "<u8"), ("offset", "<u8"),
    ("size", "<u8"), ("link", "<u4"), ("info", "<u4"), ("addralign", "<u8"), ("entsize", "<u8")])
PHDR = np.dtype([
    ("type", "<u4"), ("flags", "<u4"), ("offset", "<u8"), ("vaddr", "<u8"), ("paddr", "<u8"),
    ("filesz", "<u8"), ("memsz", "<u8"), ("align", "<u8")])
SYM = np.dtype([
    ("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
    ("value", "<u8"), ("size", "<u8")])
RELA = np.dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])


# Code inside a writable section, by its bounding symbols: 7.3 links kexec's
# relocate_kernel into .data (arch/x86/kernel/relocate_kernel_64.S); objtool lists
# its call sites, alternatives and ORC entries like any code's.
EMBEDDED_CODE = (("__relocate_kernel_start", "__relocate_kernel_end"),)


def code_sections(image):
    """Allocated executable sections, plus each EMBEDDED_CODE range as a
    section-like piece of its (writable) section: what is decoded as code."""
    out = [s for s in image.sections if s.is_code and s.is_alloc and s.size and s.type != SHT_NOBITS]
    for lo_name, hi_name in EMBEDDED_CODE:
        lo, hi = image.symbol_address(lo_name), image.symbol_address(hi_name)
        parent = image.section_at(lo) if lo is not None else None
        if parent is None or hi is None or not (parent.flags & SHF_EXECINSTR) or parent.is_code \
                or not lo < hi <= parent.end:
            continue
        piece = object.__new__(Section)
        for f in Section.__slots__:
            setattr(piece, f, getattr(parent, f))
        piece.addr, piece.size = lo, hi - lo
        piece.offset = parent.offset + (lo - parent.addr)
        piece.flags = parent.flags & ~SHF_WRITE
        out.append(piece)
    return out


class Section:
    """One section header, with its name resolved."""

    __slots__ = ("index", "name", "type", "flags", "addr", "offset", "size", "link",
                 "info", "addralign", "entsize")

    def __init__(self, index, name, row):
        self.index = index
        self.name = name
        for field in SHDR.names:
            if field != "name":
                setattr(self, field, int(row[field]))

    @property
    def end(self):
        return self.addr + self.size

    @property
    def is_code(self):
        # a writable section is data even with SHF_EXECINSTR: 7.3's .data carries
        # it for kexec's relocate_kernel, code bounded by its own symbols
        # (EMBEDDED_CODE, code_sections)
        return bool(self.flags & SHF_EXECINSTR) and not self.flags & SHF_WRITE

    @property
    def is_alloc(self):
        return bool(self.flags & SHF_ALLOC)

    def __repr__(self):
        return f"<Section {self.index} {self.name} {self.addr:#x}+{self.size:#x}>"


class Relocations:
    """All entries of one SHT_RELA section as arrays (offset, type, symbol, addend)."""

    def __init__(self, section, target, rows):
        self.section = section          # the .rela.* section
        self.target = target            # the section the relocations apply to
        self.offset = rows["offset"]    # virtual address of the field (ET_EXEC)
        self.addend = rows["addend"]
        self._rows = rows
        self._type = self._sym = None

    # type and symbol are split out of r_info on first use: a kernel's
    # .rela.debug_* (10 M entries) is read only by the code that needs it
    @property
    def type(self):
        if self._type is None:
            self._type = (self._rows["info"] & 0xFFFFFFFF).astype(np.uint32)
        return self._type

    @type.setter
    def type(self, value):
        self._type = value

    @property
    def sym(self):
        if self._sym is None:
            self._sym = (self._rows["info"] >> 32).astype(np.uint32)
        return self._sym

    @sym.setter
    def sym(self, value):
        self._sym = value

    def __len__(self):
        return len(self.offset)


class ElfImage:
    """A read-only view of an x86-64 ELF64 file.

    Never writes to the input: the file is mapped with ACCESS_READ.
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        # what is derived from this image (functions, disassembly, ...): its one
        # ImageContext (image/context.py), built by ImageContext.of on first use
        self.context = None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise BadInput(f"{self.path}: no such file") from None
        except OSError as e:
            raise BadInput(f"{self.path}: cannot read: {e.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise BadInput(f"{self.path}: is a directory, not an ELF file")
        if st.st_size < 64:
            raise BadInput(f"{self.path}: not an ELF file (only {st.st_size} bytes)")
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise BadInput(f"{self.path}: cannot read: {e.strerror}") from None
        self.size = st.st_size
        self.data = np.frombuffer(self._mm, dtype=np.uint8)
        self._parse_header()
        self._symtab = None
        self._strtab_cache = {}
        self._relocs = None
        self._alloc = None
        self._last_section = None      # (lo, hi, section): section_at's last answer

    # -- header and sections ------------------------------------------------
    def _parse_header(self):
        ident = bytes(self.data[:16])
        if ident[:4] != b"\x7fELF":
            raise BadInput(f"{self.path}: not an ELF file")
        if ident[4] != 2:
            raise BadInput(f"{self.path}: 32-bit ELF; linepack handles x86-64 ELF64 only")
        if ident[5] != 1:
            raise BadInput(f"{self.path}: big-endian ELF; linepack handles x86-64 only")
        self.ehdr = self.data[:EHDR.itemsize].view(EHDR)[0]
        if int(self.ehdr["machine"]) != EM_X86_64:
            raise BadInput(f"{self.path}: ELF machine {int(self.ehdr['machine'])} is not x86-64")
        self.type = int(self.ehdr["type"])
        self.entry = int(self.ehdr["entry"])
        shoff, shnum = int(self.ehdr["shoff"]), int(self.ehdr["shnum"])
        if shoff == 0 or shnum == 0:
            raise BadInput(f"{self.path}: ELF file has no section headers")
        if int(self.ehdr["shentsize"]) != SHDR.itemsize:
            raise BadInput(f"{self.path}: unexpected section header size")
        if shoff + shnum * SHDR.itemsize > self.size:
            raise BadInput(f"{self.path}: truncated ELF file (section headers past end of file)")
        self.shdrs = self.data[shoff:shoff + shnum * SHDR.itemsize].view(SHDR)
        phoff, phnum = int(self.ehdr["phoff"]), int(self.ehdr["phnum"])
        if phoff + phnum * PHDR.itemsize > self.size:
            raise BadInput(f"{self.path}: truncated ELF file (program headers past end of file)")
        self.phdrs = self.data[phoff:phoff + phnum * PHDR.itemsize].view(PHDR)
        shstr = self.shdrs[int(self.ehdr["shstrndx"])]
        self._shstr_off = int(shstr["offset"])
        self.sections = []
        for i, row in enumerate(self.shdrs):
            name = self._cstr(self._shstr_off + int(row["name"]))
            sec = Section(i, name, row)
            if sec.type != SHT_NOBITS and sec.offset + sec.size > self.size:
                raise BadInput(f"{self.path}: truncated ELF file (section {name} past end of file)")
            self.sections.append(sec)
        self.by_name = {}
        for s in self.sections:
            self.by_name.setdefault(s.name, s)

    def _cstr(self, off):
        end = self._mm.find(b"\0", off)
        if end < 0:
            raise BadInput(f"{self.path}: truncated string table")
        return self._mm[off:end].decode("utf-8", "replace")

    def section(self, name):
        return self.by_name.get(name)

    def section_bytes(self, sec):
        if sec.type == SHT_NOBITS:
            return np.zeros(sec.size, dtype=np.uint8)
        return self.data[sec.offset:sec.offset + sec.size]

    def alloc_sections(self):
        """Allocated sections with an address, in header order (computed once)."""
        if self._alloc is None:
            self._alloc = [(s.addr, s.end, s) for s in self.sections
                           if s.is_alloc and s.size and s.addr]
        return [s for _, _, s in self._alloc]

    def section_at(self, addr):
        """The allocated section holding virtual address addr, or None."""
        if self._alloc is None:
            self.alloc_sections()
        last = self._last_section
        if last is not None and last[0] <= addr < last[1]:
            return last[2]              # reads come in runs within one section
        for k, (lo, hi, s) in enumerate(self._alloc):
            if lo <= addr < hi:
                # kept only where no earlier section overlaps it (.tbss does), so the
                # answer stays the first match in header order
                if not any(lo2 < hi and lo < hi2 for lo2, hi2, _ in self._alloc[:k]):
                    self._last_section = (lo, hi, s)
                return s
        return None

    def vaddr_to_offset(self, addr):
        s = self.section_at(addr)
        if s is None or s.type == SHT_NOBITS:
            return None
        return s.offset + (addr - s.addr)

    def read(self, addr, size):
        """Bytes at virtual address addr (must lie in one file-backed section)."""
        s = self.section_at(addr)
        if s is None or s.type == SHT_NOBITS or addr + size > s.end:
            raise ValueError(f"address {addr:#x}+{size} is not file-backed")
        off = s.offset + (addr - s.addr)
        return self.data[off:off + size]

    def view(self, addr, count, dtype):
        """count records of dtype at virtual address addr, as a numpy view."""
        dtype = np.dtype(dtype)
        return self.read(addr, count * dtype.itemsize).view(dtype)

    # -- symbols ------------------------------------------------------------
    @property
    def symtab(self):
        """The .symtab as a numpy SYM array (raises BadInput when stripped)."""
        if self._symtab is None:
            sec = next((s for s in self.sections if s.type == SHT_SYMTAB), None)
            if sec is None or sec.size == 0:
                raise BadInput(f"{self.path}: no symbol table (stripped); linepack needs the "
                               "unstripped image")
            self._symtab_sec = sec
            self._symtab = self.section_bytes(sec).view(SYM)
        return self._symtab

    def symbol_names(self):
        """Names of all symtab entries (list of str, same order as symtab)."""
        syms = self.symtab
        strsec = self.sections[self._symtab_sec.link]
        blob = bytes(self.section_bytes(strsec))
        out = []
        find = blob.find
        for off in syms["name"].tolist():
            out.append(blob[off:find(b"\0", off)].decode("utf-8", "replace"))
        return out

    def symbol_table(self):
        """Cached (names, symtab) pair."""
        if "names" not in self._strtab_cache:
            self._strtab_cache["names"] = self.symbol_names()
        return self._strtab_cache["names"], self.symtab

    def symbol_address(self, name, default=None):
        """Address of the first symbol with this name (dict built once)."""
        d = self._strtab_cache.get("addr")
        if d is None:
            names, syms = self.symbol_table()
            d = {}
            values = syms["value"].tolist()
            types = (syms["info"] & 0xF).tolist()
            for n, v, t in zip(names, values, types):
                if n and t != STT_FILE and t != STT_SECTION and n not in d:
                    d[n] = v
            self._strtab_cache["addr"] = d
        return d.get(name, default)

    # -- relocations --------------------------------------------------------
    @property
    def relocations(self):
        """{target section name: Relocations} for every SHT_RELA section."""
        if self._relocs is None:
            self._relocs = {}
            for s in self.sections:
                if s.type != SHT_RELA or s.size == 0:
                    continue
                target = self.sections[s.info] if s.info < len(self.sections) else None
                if target is None:
                    continue
                rows = self.section_bytes(s).view(RELA)
                self._relocs[target.name] = Relocations(s, target, rows)
        return self._relocs

    def has_link_relocations(self):
        """True when the executable kept its link relocations (--emit-relocs)."""
        rel = self.relocations
        return any(r.target.is_code and r.target.is_alloc and len(r) for r in rel.values())

    # -- notes --------------------------------------------------------------
    @property
    def build_id(self):
        """GNU build-id as hex, or None."""
        for s in self.sections:
            if s.type != SHT_NOTE:
                continue
            buf = bytes(self.section_bytes(s))
            pos = 0
            while pos + 12 <= len(buf):
                namesz, descsz, ntype = np.frombuffer(buf[pos:pos + 12], "<u4").tolist()
                name = buf[pos + 12:pos + 12 + namesz]
                dpos = pos + 12 + ((namesz + 3) & ~3)
                desc = buf[dpos:dpos + descsz]
                if ntype == NT_GNU_BUILD_ID and name.rstrip(b"\0") == b"GNU":
                    return desc.hex()
                pos = dpos + ((descsz + 3) & ~3)
        return None

    def close(self):
        self.data = None
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass  # numpy views still alive; the map goes with them
