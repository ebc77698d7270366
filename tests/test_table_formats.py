"""Kernel table formats by version (6.1, 6.12, 7.3), cross-checked against the
table's size: a size that does not fit the version's record is refused in one
line (exit 2) by verify and by the reference recovery."""

import numpy as np
import pytest

from linepack.errors import BadInput
from linepack.kernel import BugTable
from linepack.kernel.base import TableFormatError, for_version


class _Sec:
    def __init__(self, name, addr, size):
        self.name, self.addr, self.size = name, addr, size


class _Image:
    """Just enough of an ElfImage for locate(): two symbols and one section."""

    def __init__(self, size, section_size=None):
        self.syms = {"__start___bug_table": 0x1000, "__stop___bug_table": 0x1000 + size}
        self.sec = _Sec("__bug_table", 0x1000, size if section_size is None else section_size)

    def symbol_address(self, name, default=None):
        return self.syms.get(name, default)

    def section(self, name):
        return self.sec if name == self.sec.name else None


class _Ctx:
    def __init__(self, version, size, section_size=None):
        self.version, self.image = version, _Image(size, section_size)


def test_bug_entry_size_by_version():
    assert for_version(BugTable.layouts, (6, 1, 192)).itemsize == 12
    assert for_version(BugTable.layouts, (6, 12, 118)).itemsize == 12
    assert for_version(BugTable.layouts, (7, 3, 4)).itemsize == 16
    assert for_version(BugTable.layouts, (7, 3, 4)).names == ("bug_addr", "format", "file", "line", "flags")
    t = BugTable()
    t.select_layout(_Ctx((7, 3, 4), 32))
    assert t.relative_fields == ("bug_addr", "format", "file")
    t.select_layout(_Ctx((6, 12, 118), 36))
    assert t.relative_fields == ("bug_addr", "file")


def test_bug_table_size_must_fit_the_version():
    assert BugTable().locate(_Ctx((7, 3, 4), 16 * 7)) == (0x1000, 7)
    assert BugTable().locate(_Ctx((6, 12, 118), 12 * 7)) == (0x1000, 7)
    # 7 16-byte records read with the 12-byte format of 6.12: refused
    with pytest.raises(TableFormatError, match="__bug_table: 112 bytes are not whole 12-byte"):
        BugTable().locate(_Ctx((6, 12, 118), 16 * 7))
    with pytest.raises(TableFormatError, match="kernel 7.3.4"):
        BugTable().locate(_Ctx((7, 3, 4), 12 * 5))
    # the section disagrees with the symbols' span
    with pytest.raises(TableFormatError, match="section of 100 bytes"):
        BugTable().locate(_Ctx((7, 3, 4), 16 * 6, section_size=100))
    assert issubclass(TableFormatError, BadInput)        # exit 2, one line


class _SymImage:
    def __init__(self, *names):
        self.names = set(names)

    def symbol_address(self, name, default=None):
        return 0x2000 if name in self.names else default


class _SymCtx:
    def __init__(self, version, *names):
        self.version, self.image = version, _SymImage(*names)


def test_kallsyms_offsets_format_by_version_and_image():
    from linepack.kernel.kallsyms import BASE_RELATIVE, PC_RELATIVE, offsets_format
    assert offsets_format(_SymCtx((6, 12, 118), "kallsyms_relative_base")) == BASE_RELATIVE
    assert offsets_format(_SymCtx((7, 3, 4))) == PC_RELATIVE
    # the image says otherwise than its version: refused
    with pytest.raises(TableFormatError, match="kallsyms: kernel 7.3.4 should use pc-relative"):
        offsets_format(_SymCtx((7, 3, 4), "kallsyms_relative_base"))
    with pytest.raises(TableFormatError, match="has no kallsyms_relative_base"):
        offsets_format(_SymCtx((6, 12, 118)))
