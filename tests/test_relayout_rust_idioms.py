"""What ripgrep 14.1.1 (rustc 1.95, linked by its default linker, lld) showed.

- Data fields of a PIE that the linker left 0 for the loader: lld does not write
  a RELA-relocated field unless given --apply-dynamic-relocs; ld.so fills it from
  the R_X86_64_RELATIVE addend. relayout read such a field as its link
  relocation's S + A, added the symbol's move to 0 and wrote that delta into the
  field (ripgrep: 1,242 fields); the output ran (ld.so overwrites the field) but
  verify named every one (``equiv.data-pointer``). Now a field that held 0 stays
  0 and its addend follows the layout.
- .debug_ranges (DWARF 4) entries whose end is the next function's start (rustc
  lists every function of a unit there; functions are not always padded): the
  end was mapped as a start, i.e. to the next function's new place (ripgrep: 211
  units, verify's ``debuginfo.unit-range``). It maps as the end of the code
  before it now.
- verify named every subprogram the link discarded (its DWARF left with low_pc 0,
  lld's tombstone and GNU ld's) as a unit that does not cover its range (188 on
  ripgrep, the original against itself too); such a subprogram has no code to
  cover and is skipped.

tests/fixtures/c/unapplied_rela.c, built with gcc and GNU ld (-fpie -pie
-Wl,--emit-relocs): its R_X86_64_64 fields that have a RELATIVE relocation
zeroed in the file as lld leaves them; and again with -gdwarf-4
-ffunction-sections -falign-functions=1 -Wl,--gc-sections (functions end where
the next begins; an unused one discarded).
Relaid out with ``pack`` from a JSON profile (no QEMU): the code moves to a new
segment.
"""

import json
import os
import subprocess

import numpy as np
import pytest
import helpers

from linepack.image.elf import RELA, ElfImage

_requirements = helpers.requirements("gcc")

R_X86_64_64, R_X86_64_RELATIVE = 1, 8


def _fields(path):
    """{address: (file offset, section)} of the R_X86_64_64 data fields that also
    have a RELATIVE dynamic relocation."""
    img = ElfImage(path)
    dyn = img.section(".rela.dyn")
    rows = np.array(img.section_bytes(dyn)).view(RELA)
    relative = set(rows["offset"][(rows["info"] & 0xFFFFFFFF) == R_X86_64_RELATIVE].tolist())
    out = {}
    for name, rel in img.relocations.items():
        tgt = rel.target
        if not tgt.is_alloc or tgt.is_code:
            continue
        for off, typ in zip(rel.offset.tolist(), rel.type.tolist()):
            if typ == R_X86_64_64 and off in relative:
                out[off] = (tgt.offset + off - tgt.addr, tgt.name)
    return out


def _word(path, off):
    with open(path, "rb") as f:
        f.seek(off)
        return int.from_bytes(f.read(8), "little")


def _run(path):
    p = subprocess.run([path, "777"], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("unapplied"))
    exe = os.path.join(d, "ua")
    subprocess.run(["gcc", "-O2", "-fpie", "-pie", "-Wl,--emit-relocs", "-o", exe,
                    os.path.join(helpers.FIXTURES, "c", "unapplied_rela.c")], check=True)
    fields = _fields(exe)
    data = bytearray(open(exe, "rb").read())
    for off, _ in fields.values():
        data[off:off + 8] = bytes(8)
    lld = exe + ".lld"
    with open(lld, "wb") as f:
        f.write(data)
    os.chmod(lld, 0o755)
    prof = os.path.join(d, "prof.json")
    with open(prof, "w") as f:
        json.dump({"functions": {"main": 1, "op_add": 1000, "op_mul": 1000}}, f)
    return d, exe, lld, fields, prof


def _relayout(src, prof, out):
    p = subprocess.run(["linepack", "relayout", src, "--profile", prof, "--strategy", "pack",
                        "-o", out, "-q"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    v = subprocess.run(["linepack", "verify", out, "--against", src],
                       capture_output=True, text=True, timeout=300)
    return v.returncode, v.stdout + v.stderr


def test_fields_left_zero_stay_zero(built):
    d, exe, lld, fields, prof = built
    names = {sec for _, sec in fields.values()}
    assert {".data.rel.ro", ".data", ".init_array"} <= names, names
    assert _run(lld) == _run(exe)            # ld.so fills the zeroed fields
    out = os.path.join(d, "ua.lld.pack")
    rc, report = _relayout(lld, prof, out)
    assert rc == 0, report
    assert "equiv.data-pointer 0" in report
    assert [_word(out, off) for off, _ in fields.values()] == [0] * len(fields)
    assert _run(out) == _run(lld)


def test_fields_ld_wrote_follow_the_layout(built):
    """GNU ld's form (the field holds its target) is translated as before."""
    d, exe, lld, fields, prof = built
    out = os.path.join(d, "ua.pack")
    rc, report = _relayout(exe, prof, out)
    assert rc == 0, report
    new = ElfImage(out)
    for name in ("op_add", "op_mul"):
        addr = new.symbol_address(name)
        old = ElfImage(exe).symbol_address(name)
        assert addr != old
        held = [a for a, (off, _) in fields.items() if _word(exe, off) == old]
        assert held and all(_word(out, fields[a][0]) == addr for a in held)
    assert _run(out) == _run(exe)


def test_range_list_ends_at_the_next_function(built, tmp_path):
    """.debug_ranges (DWARF 4) pairs whose end is the next function's start, as
    rustc's units list every function (ripgrep: 211 units): the end maps as the
    end of the code before it. It was mapped as a start (the next function's new
    place), giving ranges like [0x5a3b20, 0x56e580); verify named them
    (``debuginfo.unit-range``)."""
    d, exe, lld, fields, prof = built
    src = str(tmp_path / "ud")
    subprocess.run(["gcc", "-O2", "-g", "-gdwarf-4", "-ffunction-sections",
                    "-falign-functions=1", "-fpie", "-pie", "-Wl,--emit-relocs",
                    "-Wl,--gc-sections", "-o", src,
                    os.path.join(helpers.FIXTURES, "c", "unapplied_rela.c")], check=True)
    img = ElfImage(src)
    starts = {img.symbol_address(n) for n in ("op_add", "op_sub", "op_mul", "op_xor")}
    rng = img.section(".debug_ranges")
    words = np.array(img.section_bytes(rng)).view("<u8").reshape(-1, 2)
    assert any(int(e) in starts for b, e in words if b and b < e)   # the case is there
    assert img.symbol_address("op_unused") is None                   # and a discarded one
    out = src + ".pack"
    rc, report = _relayout(src, prof, out)
    assert rc == 0, report
    assert "debuginfo.unit-range 0" in report
    assert _run(out) == _run(src)
