"""image/words.py: the one reader of little-endian words at ELF addresses."""

import numpy as np

import helpers
from linepack.image.elf import ElfImage
from linepack.image.words import read_s32, read_words


def test_words_by_address(tmp_path):
    img = ElfImage(helpers.build_c("words.c", tmp_path / "words", "-no-pie"))
    w64 = img.symbol_address("word64")
    n32 = img.symbol_address("negative32")
    bss = img.symbol_address("zeroed")
    v, have = read_words(img, [w64, bss, 0x10], 8)
    assert have.tolist() == [True, False, False]              # .bss and unmapped: absent
    assert int(v[0]) == 0x1122334455667788 and int(v[1]) == 0 and int(v[2]) == 0
    assert read_words(img, [w64 + 4], 4)[0].tolist() == [0x11223344]
    assert read_words(img, [n32], 4)[0].tolist() == [0xFFFFFFFB]
    s, have = read_s32(img, [n32, w64])
    assert s.tolist() == [-5, 0x55667788] and have.all()
    # past its section's end: absent, not read from the next section
    sec = next(x for x in img.sections if x.addr <= w64 < x.end)
    assert not read_words(img, [sec.end - 4], 8)[1][0]


def test_patched_bytes_take_the_files_place(tmp_path):
    img = ElfImage(helpers.build_c("words.c", tmp_path / "words", "-no-pie"))
    w64 = img.symbol_address("word64")
    sec = next(x for x in img.sections if x.addr <= w64 < x.end)
    buf = np.array(img.section_bytes(sec), np.uint8)
    buf[w64 - sec.addr:w64 - sec.addr + 8] = np.frombuffer((42).to_bytes(8, "little"), np.uint8)
    assert read_words(img, [w64], 8, {sec.index: buf})[0].tolist() == [42]
    assert read_words(img, [w64], 8)[0].tolist() == [0x1122334455667788]      # the file is untouched
