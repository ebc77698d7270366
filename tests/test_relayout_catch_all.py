"""``catch (...)`` in a split function's part LSDAs.

The type table entry of ``catch (...)`` is 0. gcc's ``-fPIE`` code (its default,
also linked ``-no-pie``) encodes type entries pc-relative and indirect (0x9b),
and libgcc reads a pc-relative 0 as 0, not as an offset from the field. lsda.py
took it as one: the part LSDAs got ``old field - new field`` there, which the
personality read as a pointer to the original table's entry, itself 0: a
catch-all by luck, and verify decoded both sides the same wrong way.

``catch_all.cc`` (``catch (const Bad &)`` then ``catch (...)`` in ``guarded``,
whose handlers never run in the profile run; an int, a Bad and a long thrown
from ``work``'s cold part), built with g++'s defaults and ``-Wl,--emit-relocs``,
linked ``-no-pie`` and ``-pie``, profiled under qemu-x86_64, split by
``blocks``: each part LSDA of ``guarded`` has the original's types, its
catch-all entry 0 in its bytes; the output prints what the original prints with
every kind thrown; ``verify --against`` passes, and the old encoding written
back into the entry is named by the exception lookup check.
"""

import struct
import subprocess

import pytest
import helpers

from linepack.image.elf import ElfImage
from linepack.relayout.driver import load_profile_full, relayout
from linepack.relayout.user.eh_frame import _FORMATS, parse_eh_frame
from linepack.relayout.user.eh_frame_split import _records, check_split_lsda
from linepack.relayout.user.lsda import Lsda

_requirements = helpers.requirements("g++", "qemu-x86_64")

GUARDED = "_Z7guardediii"


def _run(path, *args):
    p = subprocess.run([path, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr)
    return p.stdout


def _lsda_records(image):
    sec = image.section(".eh_frame")
    data = bytes(image.section_bytes(sec))
    return {r.pc_begin: r for r in _records(data, sec.addr, parse_eh_frame(data, sec.addr))
            if not r.is_cie and r.lsda}


@pytest.fixture(scope="module", params=["-no-pie", "-pie"])
def case(request, tmp_path_factory):
    exe, prof = helpers.profiled_cxx(tmp_path_factory.mktemp("ca"), "catch_all.cc",
                                     request.param)
    out = exe + ".blocks"
    lp = load_profile_full(prof, exe)
    _, _, rw = relayout(exe, out, "blocks", hotness=lp.hotness, calls=lp.calls,
                        blocks=lp.blocks, profile_build_id=lp.build_id)
    sf = next(sf for sf in rw.block_split["splits"] if sf.name == GUARDED)
    return exe, out, rw, sf


def _catch_all_fields(case):
    """(original LSDA, [(part LSDA, address of its catch (...) entry)])."""
    exe, out, _, sf = case
    old_im, new_im = ElfImage(exe), ElfImage(out)
    old_rec = _lsda_records(old_im)[_sym(old_im, GUARDED)]
    old = Lsda(old_im, old_rec.lsda, old_rec.pc_begin)
    size = _FORMATS[old.ttype_enc & 0x0F][1]
    k = old.types.index(0) + 1
    new_recs = _lsda_records(new_im)
    parts = []
    for start in sf.new_start:
        ls = Lsda(new_im, new_recs[start].lsda, start) if start in new_recs else None
        if ls is not None and ls.types:     # a part whose call sites reach a catch clause
            parts.append((ls, ls.ttype_base - k * size))
    return old, parts


def _sym(im, name):
    names, syms = im.symbol_table()
    return int(syms["value"][names.index(name)])


def test_catch_all_entry_stays_zero(case):
    exe, out, rw, sf = case
    old, parts = _catch_all_fields(case)
    assert old.ttype_enc & 0x70 == 0x10            # pc-relative, as gcc's -fPIE code has it
    assert 0 in old.types and len(old.types) >= 2  # Bad's type_info, then catch (...)
    assert parts                                   # guarded was split with part LSDAs
    im = ElfImage(out)
    for ls, field in parts:
        assert ls.types == old.types
        sec = im.section_at(field)
        raw = bytes(im.section_bytes(sec))[field - sec.addr:field - sec.addr + 4]
        assert raw == b"\0\0\0\0"
    for args in ((), ("x",)):
        assert _run(out, *args) == _run(exe, *args)
    assert "caught something (kind 1)" in _run(out, "x")
    p = subprocess.run(["linepack", "verify", out, "--against", exe],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr


def test_lookup_check_names_the_old_encoding(case, tmp_path):
    """The entry as lsda.py wrote it before (the old field's offset from the new
    one) is a different catch type for the exception lookup check."""
    exe, out, rw, sf = case
    old, parts = _catch_all_fields(case)
    ls, field = parts[0]
    k = old.types.index(0) + 1
    old_field = old.ttype_base - k * _FORMATS[old.ttype_enc & 0x0F][1]
    im = ElfImage(out)
    sec = im.section_at(field)
    raw = bytearray(open(out, "rb").read())
    struct.pack_into("<i", raw, sec.offset + field - sec.addr, old_field - field)
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    probs, _ = check_split_lsda(ElfImage(exe), ElfImage(str(bad)), rw.block_split["rows"])
    assert probs and "exception lookup" in probs[0][1]
