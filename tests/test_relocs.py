"""The relocation recipes and the one "field holds S + A [- P]" check
(linepack.image.relocs), on a small program linked with --emit-relocs."""

import numpy as np
import pytest

from linepack.image.elf import ElfImage
from linepack.image.relocs import (CHECKED_TYPES, RECIPES, R_X86_64_32S, R_X86_64_64,
                                   R_X86_64_PC32, R_X86_64_PLT32, link_field_mismatches,
                                   relocation_mismatches)
import helpers


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    d = tmp_path_factory.mktemp("relocs")
    return helpers.build_c("hotloop.c", d / "hotloop", "-fno-pie", "-no-pie", "-Wl,--emit-relocs",
                           static=True)


def test_recipes():
    assert RECIPES[R_X86_64_64][1:4] == (8, False, False)
    assert RECIPES[R_X86_64_PC32][1:4] == (4, True, True)
    assert RECIPES[R_X86_64_32S][1:4] == (4, False, True)
    assert all(not RECIPES[t].via_got for t in CHECKED_TYPES)


def _checked_rows(image):
    """(relocations, row index) of every field the check reads, per section."""
    for rel in image.relocations.values():
        if rel.target.is_alloc and rel.target.type != 8 and len(rel):
            checked, _ = link_field_mismatches(image, rel.target, rel.offset, rel.type, rel.sym,
                                               rel.addend)
            yield rel, np.nonzero(checked)[0]


def test_checked_fields_of_a_linked_program(program):
    image = ElfImage(program)
    none = np.zeros(0, np.uint64)
    checked, bad = relocation_mismatches(image, none, none)
    # static glibc's calls into ifunc PLT entries do not hold S + A - P: a few
    assert checked > 1000 and len(bad) < checked // 10
    kinds = {int(rel.type[i]) for rel, rows in _checked_rows(image) for i in rows}
    assert {R_X86_64_64, R_X86_64_PLT32} <= kinds


def test_a_changed_field_is_named(program, tmp_path):
    image = ElfImage(program)
    rel, rows = next((r, i) for r, i in _checked_rows(image)
                     if r.target.is_code and (r.type[i] == R_X86_64_PLT32).any())
    none = np.zeros(0, np.uint64)
    checked, before = relocation_mismatches(image, none, none)
    stale = {b[0] for b in before}
    k = next(int(i) for i in rows[rel.type[rows] == R_X86_64_PLT32] if int(rel.offset[i]) not in stale)
    field = int(rel.offset[k])
    off = image.vaddr_to_offset(field)
    old = int.from_bytes(image.data[off:off + 4].tobytes(), "little")
    bad_copy = helpers.patched_copy(program, tmp_path / "bad",
                                    {off: ((old + 1) & 0xFFFFFFFF).to_bytes(4, "little")})
    checked_after, bad = relocation_mismatches(ElfImage(bad_copy), none, none)
    assert checked_after == checked
    assert sorted(b[0] for b in bad) == sorted([field] + [b[0] for b in before])
    # an excluded range (a table sorted after the link) is not checked
    checked2, bad2 = relocation_mismatches(ElfImage(bad_copy), np.array([field], np.uint64),
                                           np.array([field + 4], np.uint64))
    assert bad2 == before and checked2 == checked - 1
