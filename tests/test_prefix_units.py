"""Function prefixes (``__pfx_<fn>``, CONFIG_FUNCTION_PADDING_BYTES=16): the 16
NOP bytes before a function are one unit with it, the unit starts at the
prefix and is named after the function; a prefix symbol that is not right
before a function stays a unit of its own."""

import shutil
import subprocess

import numpy as np
import pytest

from linepack.image.disasm import disassemble
from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.relayout.units import build_units

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# a: no prefix; b: 16 NOPs (__pfx_b) then b (ENDBR64 first) at a 64-byte boundary; c: a stray
# __pfx_ symbol followed by int3 fill before c (not c's prefix); d: 16 NOPs and no prefix
# symbol (an assembly function of a padded kernel).
ASM = r"""
    .section .text.hot,"ax",@progbits
    .p2align 6
    .globl a
    .type a, @function
a:  mov $1, %eax
    ret
    .size a, .-a
    .p2align 6
    .fill 48, 1, 0xcc
    .type __pfx_b, @function
__pfx_b:
    .fill 16, 1, 0x90
    .size __pfx_b, 16
    .globl b
    .type b, @function
b:  endbr64
    mov $2, %eax
    ret
    .size b, .-b
    .p2align 5
    .type __pfx_stray, @function
__pfx_stray:
    .fill 16, 1, 0x90
    .size __pfx_stray, 16
    .fill 16, 1, 0xcc
    .globl c
    .type c, @function
c:  mov $3, %eax
    ret
    .size c, .-c
    .p2align 5
    .fill 16, 1, 0xcc
    .fill 16, 1, 0x90
    .globl d
    .type d, @function
d:  mov $4, %eax
    ret
    .size d, .-d
label_code:                     # code without a function symbol (7.3's common_startup_64)
    mov $6, %eax
    ud2
    .fill 16, 1, 0x90           # e's padding, no prefix symbol
    .globl e
    .type e, @function
e:  mov $5, %eax
    ret
    .size e, .-e
    .section .rodata
    .globl skl_call_thunk_template, skl_call_thunk_tail
skl_call_thunk_template:        # the call-depth template: sarq $5, %gs:0 (9 bytes)
    .byte 0x65, 0x48, 0xc1, 0x3c, 0x25, 0, 0, 0, 0
skl_call_thunk_tail:
"""
MAIN = ("int a(void), b(void), c(void), d(void), e(void);\n"
        "int main(void) { return a() + b() + c() + d() + e() - 15; }\n")


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("pfx")
    (d / "f.s").write_text(ASM)
    (d / "main.c").write_text(MAIN)
    exe = d / "prog"
    subprocess.run(["gcc", "-O2", "-fno-pie", "-no-pie", "-o", str(exe), str(d / "main.c"),
                    str(d / "f.s")], check=True)
    assert subprocess.run([str(exe)]).returncode == 0
    return str(exe)


def _unit_of(im, units, name):
    return int(units.find([im.symbol_address(name)])[0])


def test_prefix_joins_its_function(prog):
    im = ElfImage(prog)
    fn = FunctionTable(im)
    units, _ = build_units(im, fn, lambda u: disassemble(im, u), sections=(".text",))
    pfx, b = im.symbol_address("__pfx_b"), im.symbol_address("b")
    assert b - pfx == 16 and b % 64 == 0
    u = _unit_of(im, units, "b")
    assert u == _unit_of(im, units, "__pfx_b")
    assert int(units.start[u]) == pfx and units.name[u] == "b"
    # alignment is taken at the prefix start: b stays 16 bytes after it
    assert int(units.align[u]) == 16 and int(units.phase[u]) == 0
    assert [fn.name[i] for i, _ in units.members[u]] == ["__pfx_b", "b"]
    assert [o for _, o in units.members[u]] == [0, 16]
    assert units.funcs[fn.index_of("__pfx_b")] == units.funcs[fn.index_of("b")] == u


def test_unrelated_prefix_symbol_is_not_joined(prog):
    im = ElfImage(prog)
    fn = FunctionTable(im)
    units, _ = build_units(im, fn, lambda u: disassemble(im, u), sections=(".text",))
    # int3 fill between __pfx_stray and c: not c's prefix, its own unit
    assert _unit_of(im, units, "__pfx_stray") != _unit_of(im, units, "c")
    assert units.name[_unit_of(im, units, "c")] == "c"
    assert _unit_of(im, units, "a") not in (_unit_of(im, units, "b"), _unit_of(im, units, "c"))


def test_padding_without_prefix_symbol_joins_its_function(prog):
    """In a kernel with prefix symbols, an assembly function has the 16 NOPs of padding
    but no symbol for them (7.3's memcpy, __tdcall...): they move with it, else the
    kernel finds int3 fill where call-depth tracking writes its thunk."""
    im = ElfImage(prog)
    fn = FunctionTable(im)
    units, _ = build_units(im, fn, lambda u: disassemble(im, u), sections=(".text",))
    d, c = im.symbol_address("d"), im.symbol_address("c")
    u = _unit_of(im, units, "d")
    assert int(units.start[u]) == d - 16 and units.name[u] == "d"
    assert [(fn.name[i], o) for i, o in units.members[u]] == [("d", 16)]
    # c follows int3 fill: its unit starts at c
    assert int(units.start[_unit_of(im, units, "c")]) == c
    # e's padding follows code without a symbol, which stays with d: e still takes it
    e = im.symbol_address("e")
    assert int(units.start[_unit_of(im, units, "e")]) == e - 16
    assert int(units.end[_unit_of(im, units, "d")]) == e - 16


def test_verify_prefix_check(prog, tmp_path):
    from linepack.kernel.base import ImageContext
    from linepack.kernel.prefixes import check_prefixes
    im = ElfImage(prog)
    findings = []
    census = check_prefixes(ImageContext(im), findings)
    assert census["count"] == 2 and census["bytes"] == [16]
    # __pfx_stray names no function at its end: detached; __pfx_b is fine
    assert census["detached"] == 1 and census["not_nop"] == 0
    assert [f.address for f in findings if f.check == "prefix.detached"] == \
        [im.symbol_address("__pfx_stray")]
    # b's padding overwritten by int3 (a layout that re-created the fill)
    bad = tmp_path / "prog"
    data = bytearray(open(prog, "rb").read())
    sec = im.section_at(im.symbol_address("__pfx_b"))
    off = sec.offset + im.symbol_address("__pfx_b") - sec.addr
    data[off:off + 16] = b"\xcc" * 16
    bad.write_bytes(bytes(data))
    findings = []
    census = check_prefixes(ImageContext(ElfImage(str(bad))), findings)
    assert census["not_nop"] == 1
    assert any(f.check == "prefix.padding" and f.address == im.symbol_address("__pfx_b")
               for f in findings)


def test_against_endbr_entry_kept(prog, tmp_path):
    from linepack.kernel.base import ImageContext
    from linepack.kernel.prefixes import check_endbr_entries
    from linepack.verify.addrmap import match_functions
    from linepack.verify.findings import add_findings as _add
    b = ElfImage(prog).symbol_address("b")
    im = ElfImage(prog)
    sec = im.section_at(b)
    data = bytearray(open(prog, "rb").read())
    off = sec.offset + b - sec.addr
    assert data[off:off + 4] == b"\xf3\x0f\x1e\xfa"
    data[off:off + 4] = b"\x0f\x1f\x40\x00"          # nop4: what IBT sealing writes
    bad = tmp_path / "prog"
    bad.write_bytes(bytes(data))
    for new, lost in ((prog, 0), (str(bad), 1)):
        octx, nctx = ImageContext(ElfImage(prog)), ImageContext(ElfImage(new))
        oi, ni, _ = match_functions(octx, nctx)
        findings, counter = [], {}
        assert check_endbr_entries(octx, nctx, oi, ni, findings, counter, _add) == 1
        assert counter["equiv.ibt-entry"] == lost
        assert [f.address for f in findings] == [b] * lost


def test_address_at_a_moved_piece_end_that_a_staying_unit_starts():
    """Contiguous units (6.12: each function's prefix right after the previous
    function's end): region 0 moves, region 1 (pinned, e.g. cut around a unit
    with an unexplained reference) stays. Its start is its own address, not the
    end of the moved unit before it."""
    from types import SimpleNamespace
    from linepack.image.addrmap import AddressMap
    from linepack.relayout.units import Region, UnitTable
    regs = [Region("r0", 0x1000, 0x1060, 1), Region("r1", 0x1060, 0x1080, 1, pinned=True)]
    units = UnitTable([0x1000, 0x1030, 0x1060], [0x30, 0x30, 0x20], [0, 0, 1], regs)
    # r0's two units swap; the second (old 0x1030..0x1060) now ends at 0x1030
    plan = SimpleNamespace(units=units, new_start=np.array([0x1030, 0x1000, 0x1060], np.uint64),
                           moved=np.array([True, True, False]),
                           region_new_start=[0x1000, 0x1060])
    amap = AddressMap.from_plan(plan)
    new, ok = amap.map(np.array([0x1060, 0x1065, 0x1030, 0x1000], np.uint64))
    assert ok.all()
    assert new.tolist() == [0x1060, 0x1065, 0x1000, 0x1030]


def _patched(prog, tmp_path, name, writes):
    """A copy of ``prog`` with ``writes`` ({address: bytes}) applied to its file and,
    for ``("sym", index, field)`` keys, symbol-table fields set (value / size)."""
    im = ElfImage(prog)
    data = bytearray(open(prog, "rb").read())
    for where, b in writes.items():
        if isinstance(where, tuple):
            _, i, field = where
            sec = next(x for x in im.sections if x.type == 2)          # SHT_SYMTAB
            off = sec.offset + 24 * i + (8 if field == "value" else 16)
            data[off:off + 8] = int(b).to_bytes(8, "little")
            continue
        sec = im.section_at(where)
        off = sec.offset + where - sec.addr
        data[off:off + len(b)] = b
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return str(out)


def test_thunk_template_and_prefix_room(prog, tmp_path):
    """The call-depth template's size comes from the image's symbols; --against, every
    function that had a prefix keeps that many NOPs right before its entry: a padding
    trimmed to it (the prefix symbol moved and sized to match) is clean, a NOP short of
    it or overwritten is found (prefix.short / equiv.prefix-room)."""
    from linepack.kernel.base import ImageContext
    from linepack.kernel.prefixes import check_prefix_room, check_prefixes, thunk_template_size
    from linepack.verify.addrmap import match_functions
    from linepack.verify.findings import add_findings as _add
    im = ElfImage(prog)
    assert thunk_template_size(im) == 9
    b, pfx = im.symbol_address("b"), im.symbol_address("__pfx_b")
    names, _ = im.symbol_table()
    k = names.index("__pfx_b")
    int3 = b"\xcc"
    cases = {
        # trimmed as relayout does: the front 7 bytes are no longer padding
        "trimmed": ({pfx: int3 * 7, ("sym", k, "value"): pfx + 7, ("sym", k, "size"): 9}, [], []),
        "short": ({pfx: int3 * 8, ("sym", k, "value"): pfx + 8, ("sym", k, "size"): 8},
                  ["prefix.short"], [b]),
        "overwritten": ({b - 9: int3 * 9}, ["prefix.padding"], [b]),
    }
    for name, (writes, standalone, room) in cases.items():
        new = _patched(prog, tmp_path, name, writes)
        findings = []
        census = check_prefixes(ImageContext(ElfImage(new)), findings)
        assert census["thunk_template"] == 9
        assert sorted({f.check for f in findings} - {"prefix.detached"}) == standalone, name
        octx, nctx = ImageContext(ElfImage(prog)), ImageContext(ElfImage(new))
        oi, ni, _ = match_functions(octx, nctx)
        findings, counter = [], {}
        assert check_prefix_room(octx, nctx, oi, ni, findings, counter, _add) == 1   # b
        assert [f.address for f in findings if f.check == "equiv.prefix-room"] == room, name
