"""The fast decoding paths give exactly what the slow ones give: the C loop
around Capstone (image/decode.c) against the Python loop, and the batched
RIP-operand facts (image/operands.py) against Capstone's Python wrapper, on
the real vmlinux and on bytes Capstone rejects."""

import os

import numpy as np
import pytest

import helpers
from linepack.image import decode_core, disasm
from linepack.image.operands import _one, rip_relative

VMLINUX = helpers.debian_vmlinux_path()


class _Bytes:
    """An image stand-in: ``read`` from a byte string mapped at ``base``."""

    def __init__(self, data, base):
        self.data, self.base = data, base

    def read(self, addr, size):
        return self.data[addr - self.base:addr - self.base + size]


def _python_loop(monkeypatch, image, starts, sizes, first):
    monkeypatch.setattr(decode_core, "_lib", None)          # no core: the Python loop
    from linepack.image import shared
    monkeypatch.setattr(shared, "elf_image", lambda path: image)
    return disasm._decode_range("unused", starts, sizes, first)


def _same(a, b):
    for x, y in zip(a[:4], b[:4]):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert a[4] == b[4]


@pytest.fixture
def core():
    lib = decode_core.library()
    if lib is None:
        pytest.fail("the C decode loop cannot be built (gcc: tools/setup.sh installs it)")
    return lib


def test_rejected_and_known_bytes(core, monkeypatch):
    # mov; serialize (Capstone 5 rejects it: decoded by pattern); nop; ud2; two bytes
    # Capstone rejects in 64-bit mode (push es: skipped; salc = the kernel's UDB, by
    # pattern); ret;
    # pvalidate (by pattern); ret; a call cut by its range's end
    code = bytes.fromhex("4889e5" "0f01e8" "90" "0f0b" "06d6" "c3" "f20f01ff" "c3"
                         "e8000000")
    img = _Bytes(code, 0x1000)
    assert len(code) == 21
    starts, sizes = [0x1000, 0x1000 + 16, 0x1000 + 17], [16, 1, 4]
    fast = disasm._decode_range_native(core, img, starts, sizes, 7)
    slow = _python_loop(monkeypatch, img, starts, sizes, 7)
    _same(fast, slow)
    assert fast[4][:1] == [(0x1009, 7)]                       # rejected bytes are named
    rows = dict(zip(fast[0].tolist(), fast[1].tolist()))
    assert rows[0x1003] == 3 and rows[0x100C] == 4            # serialize, pvalidate
    assert rows[0x100A] == 1                                  # d6: 7.3's UDB, by pattern
    assert 0x1000 + 17 not in rows                            # the cut call decodes nothing
    assert fast[4][1:] == [(0x1011, 9), (0x1014, 9)]          # e8, then 00 00 decodes
    # bytes after each instruction's own are zero (Capstone leaves heap bytes there)
    cols = np.arange(16)[None, :]
    assert not fast[3][cols >= fast[1][:, None]].any()


def test_short_read_keeps_the_python_loop(core, monkeypatch):
    # a range running past the readable bytes: the Python loop's answer, no read past them
    img = _Bytes(bytes.fromhex("4889e5c3"), 0x2000)
    assert disasm._decode_range_native(core, img, [0x2000], [8], 0) is None
    from linepack.image import shared
    monkeypatch.setattr(shared, "elf_image", lambda path: img)
    fast = disasm._decode_range("unused", [0x2000], [8], 0)      # the core declines
    _same(fast, _python_loop(monkeypatch, img, [0x2000], [8], 0))


def test_output_arrays_grow(core, monkeypatch):
    # 3000 one-byte nops in one range: more rows than the first guess (bytes / 3)
    img = _Bytes(b"\x90" * 3000 + b"\xc3", 0x4000)
    fast = disasm._decode_range_native(core, img, [0x4000], [3001], 0)
    assert len(fast[0]) == 3001
    _same(fast, _python_loop(monkeypatch, img, [0x4000], [3001], 0))


def test_batches_resume_where_they_stop(core, monkeypatch):
    # a byte Capstone rejects stops the C loop (named, decoding goes on after it, as
    # in the Python loop); thousands of rows before and after it (when decode.c asked
    # cs_disasm for 1024 instructions a call, a full batch was no stop either)
    code = b"\x90" * 1500 + b"\x06" + b"\x90" * 2047 + b"\xc3"
    img = _Bytes(code, 0x8000)
    fast = disasm._decode_range_native(core, img, [0x8000], [len(code)], 3)
    assert fast[4] == [(0x8000 + 1500, 3)]
    assert len(fast[0]) == len(code) - 1
    _same(fast, _python_loop(monkeypatch, img, [0x8000], [len(code)], 3))


@pytest.mark.realkernel
def test_vmlinux_functions_same_rows(core, monkeypatch):
    assert os.path.exists(VMLINUX), f"no cached vmlinux at {VMLINUX} (tools/setup.sh fetches it)"
    from linepack.image.elf import ElfImage
    from linepack.image.functions import FunctionTable
    image = ElfImage(VMLINUX)
    ft = FunctionTable(image)
    starts, sizes = ft.start[::15].tolist(), ft.size[::15].tolist()
    fast = disasm._decode_range_native(core, image, starts, sizes, 0)
    _same(fast, _python_loop(monkeypatch, image, starts, sizes, 0))
    assert len(fast[0]) > 100_000

    # RIP-relative facts of every instruction with a mod=00 rm=101 ModRM guess, batched
    # and one by one through the wrapper
    raw, size = fast[3], fast[1].astype(np.int64)
    rows = np.arange(len(size))
    cand = np.zeros(len(size), bool)
    for imm in (0, 1, 2, 4):
        m = np.maximum(size - 5 - imm, 0)
        cand |= (size - 4 - imm >= 1) & ((raw[rows, np.minimum(m, 15)] & 0xC7) == 0x05)
    idx = np.nonzero(cand)[0][::4][:2000]
    has, off = rip_relative(raw[idx], size[idx])
    ref = [_one(raw[i], int(size[i])) for i in idx.tolist()]
    assert has.tolist() == [r[0] for r in ref]
    assert off.tolist() == [r[2] for r in ref]
    assert 50 < has.sum() < len(idx)


def test_rip_relative_batch_matches_wrapper():
    # lea 0x10(%rip),%rax; mov %eax,(%rax); cmpl $1,0x20(%rip); a rejected pair; call
    blobs = [bytes.fromhex(h) for h in ("488d0510000000", "8900", "833d2000000001", "0fff",
                                        "e800000000", "f20f01ff")]
    raw = np.zeros((len(blobs), 16), np.uint8)
    for i, b in enumerate(blobs):
        raw[i, :len(b)] = np.frombuffer(b, np.uint8)
    size = np.array([len(b) for b in blobs])
    has, off = rip_relative(raw, size)
    assert has.tolist() == [True, False, True, False, False, False]
    assert off.tolist()[0] == 3 and off.tolist()[2] == 2
    want = [_one(raw[i], int(size[i])) for i in range(len(size))]
    assert [(bool(h), int(o)) for h, o in zip(has, off)] == [(r[0], r[2]) for r in want]


def test_eip_relative_operands_are_told_apart():
    """A 67 prefix makes the operand EIP-based: ip_relative names it, rip_relative
    does not (its target is truncated to 32 bits), in the batch and one by one."""
    from linepack.image.operands import ip_relative
    blobs = [bytes.fromhex(h) for h in ("678b0500010000", "8b0500010000", "678b00")]
    raw = np.zeros((len(blobs), 16), np.uint8)
    for i, b in enumerate(blobs):
        raw[i, :len(b)] = np.frombuffer(b, np.uint8)
    size = np.array([len(b) for b in blobs])
    rip, eip, off = ip_relative(raw, size)
    assert rip.tolist() == [False, True, False] and eip.tolist() == [True, False, False]
    assert off.tolist()[:2] == [3, 2]
    assert rip_relative(raw, size)[0].tolist() == [False, True, False]
    assert [_one(raw[i], int(size[i]))[:2] for i in range(3)] == [(False, True), (True, False),
                                                                   (False, False)]


def _capstone_text():
    """Real compiled code on every machine that runs these tests: the .text of the
    Capstone library itself (a few hundred KB of gcc output)."""
    from capstone import _cs
    from linepack.image.elf import ElfImage
    image = ElfImage(_cs._name)
    sec = image.section(".text")
    return image.section_bytes(sec), sec.addr


def test_quiet_printer_gives_the_same_rows(core):
    """Capstone's text printer is a no-op inside the C loop where its field is
    confirmed: the same rows as with the printer, and the printer is back after."""
    import ctypes
    import capstone
    from capstone import _cs
    code, base = _capstone_text()
    assert len(code) > 100_000
    dec = disasm._Decoder()
    try:
        handle = dec.handle.value
        off = decode_core._printer_field(handle)
        if capstone.__version__.startswith("5."):
            assert off == 8             # cs_priv.h: arch, mode, then the printer
        else:                           # another layout: never guessed
            assert off is None
            return
        args = (core, handle, code, [base], [len(code)], 0, lambda k, pos, rest: 0)
        plain, quiet = decode_core._decode(*args, -1), decode_core._decode(*args, off)
        assert len(plain[0]) > 20_000
        for a, b in zip(plain, quiet):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        # the printer is Capstone's again: a plain cs_disasm on this handle has text
        insn = ctypes.POINTER(capstone._cs_insn)()
        n = _cs.cs_disasm(handle, b"\x48\x89\xe5", 3, 0, 0, ctypes.byref(insn))
        assert n == 1
        assert bytes(insn[0].mnemonic).rstrip(b"\0") == b"mov"
        _cs.cs_free(insn, n)
    finally:
        dec.close()


def test_quiet_printer_is_used_only_when_confirmed(core, monkeypatch):
    code, base = _capstone_text()
    dec = disasm._Decoder()
    try:
        handle = dec.handle.value
        monkeypatch.setattr(decode_core, "_quiet", None)
        monkeypatch.setenv("LINEPACK_DECODE_PLAIN", "1")
        assert decode_core.quiet_printer_offset(core, handle, code) == -1
        monkeypatch.delenv("LINEPACK_DECODE_PLAIN")
        # too few bytes to check on: the printer, and nothing decided yet
        assert decode_core.quiet_printer_offset(core, handle, code[:100]) == -1
        assert decode_core._quiet is None
        # a field that the syntax option does not change is not the printer
        monkeypatch.setattr(decode_core, "_PRINTER_FIELD", 16)
        assert decode_core._printer_field(handle) is None
        assert decode_core.quiet_printer_offset(core, handle, code) == -1
        assert decode_core._quiet == -1                          # decided: no guessing again
    finally:
        dec.close()



def test_quiet_printer_verdict_is_kept_per_capstone_build(core, monkeypatch, tmp_path):
    """The double decode that confirms the quiet printer runs once per Capstone build:
    its verdict is kept in the cache and read back by the next process (no decode);
    a kept 'keep the printer' verdict is honoured as well."""
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path))
    code, base = _capstone_text()
    dec = disasm._Decoder()
    try:
        handle = dec.handle.value
        off = decode_core._printer_field(handle)
        if off is None:
            pytest.skip("this Capstone's handle layout is not 5.x's: nothing to keep")
        monkeypatch.setattr(decode_core, "_quiet", None)
        assert decode_core.quiet_printer_offset(core, handle, code) == off
        path = decode_core._verdict_path(core, off)
        assert path.startswith(str(tmp_path)) and os.path.exists(path)
        # a later process: the verdict read back, nothing decoded to get it
        monkeypatch.setattr(decode_core, "_quiet", None)

        def no_decode(*a):
            raise AssertionError("decoded again")
        monkeypatch.setattr(decode_core, "_decode", no_decode)
        assert decode_core.quiet_printer_offset(core, handle, code) == off
        monkeypatch.setattr(decode_core, "_quiet", None)
        with open(path, "w") as f:
            f.write("-1\n")
        assert decode_core.quiet_printer_offset(core, handle, code) == -1
        # another printer offset is another key: checked, not taken from this verdict
        assert decode_core._verdict_path(core, off + 8) != path
    finally:
        dec.close()
