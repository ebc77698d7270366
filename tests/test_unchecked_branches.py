"""Direct branches behind prefixes linepack's branch decoders do not read.

The fast decoders (image/disasm.py branch_targets and other_branch_targets, the
CFG's classify) read past a few prefixes only: branch hints, bnd, ld's addr32 on
a call, the 66/67 of loop, jecxz and xbegin. A jmp, jcc or call behind a REX,
segment, 66 or F3 prefix was invisible to relayout's branch fixing and to
verify: relayout copied `rex.W call` unfixed, the output trapped, and `verify
--against` said OK. Now:

- ``unchecked_branches`` finds every such row (checked against Capstone's reading
  of each encoding: its targets, and that every other branch is one the decoders
  see);
- relayout refuses an image holding one (one line, exit 2, nothing written);
- verify --against checks each one on its own: a translated target passes, a
  stale one is ``equiv.unchecked-branch``, and a 66-prefixed one (Intel ignores
  the prefix, AMD takes 16 bits: this machine's CPU traps on the fixture) passes
  only where neither it nor its target moved.

tests/fixtures/c/unchecked_branch.c is built at test time; its nop before a
call the assembler resolved is patched into a prefix.
"""

import os

import capstone
import numpy as np
import pytest

import helpers
from linepack.image.disasm import (ANY_PREFIX, _Decoder, Disassembly, has_operand_size_prefix,
                                   unchecked_branch_targets)
from linepack.image.elf import ElfImage

_requirements = helpers.requirements("gcc", "qemu-x86_64")

# (encoding, read by the decoders): every direct-branch form with the prefixes in question
ENCODINGS = [
    ("e910000000", True), ("2e3ef2e910000000", True), ("0f8510000000", True), ("74f0", True),
    ("2eeb10", True), ("e8f0ffffff", True), ("67e810000000", True), ("f2e810000000", True),
    ("e310", True), ("67e310", True), ("67e010", True), ("c7f810000000", True),
    ("66c7f81000", True),
    ("48e910000000", False), ("66e910000000", False), ("660f8410000000", False),
    ("487410", False), ("66eb10", False), ("64e910000000", False), ("f3e910000000", False),
    ("41e810000000", False), ("6648e810000000", False), ("26e810000000", False),
    ("363e67e810000000", False), ("4567e810000000", False), ("f3eb10", False),
    ("48e310", False), ("66e310", False), ("2e2e2e2ee910000000", False),
    ("48c7f810000000", False), ("677410", True),   # addr32 jcc: read, the CFG leaves it unsplit
    # other_branch_targets reads 66 on xbegin only: a 66 loop or jecxz is unchecked
    ("66e210", False), ("6667e310", False), ("2e66e010", False),
]


def _rows(encodings):
    dec = _Decoder()
    rows = []
    for code in encodings:
        r = dec.decode(bytes.fromhex(code), 0x1000)
        assert len(r) == 1 and int(r["size"][0]) == len(bytes.fromhex(code)), code
        rows.append(r)
    dec.close()
    return np.concatenate(rows)


def test_every_direct_branch_is_read_or_unchecked():
    rows = _rows([e for e, _ in ENCODINGS])
    raw, size, addr = rows["bytes"], rows["size"], rows["address"]
    dis = Disassembly(addr, size.astype(np.uint8), np.zeros(len(addr), np.int32), raw, [])
    odd = dis.unchecked_branches()
    want = [k for k, (_, known) in enumerate(ENCODINGS) if not known]
    assert odd.tolist() == want
    seen, _, _ = dis.pc_relative_branches()
    known = [k for k, (_, read) in enumerate(ENCODINGS) if read]
    assert set(known) <= set(seen.tolist())
    # the targets are Capstone's (its operand, an independent reading)
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    targets = unchecked_branch_targets(raw, addr, size, odd)
    for k, t in zip(odd.tolist(), targets.tolist()):
        ins = next(cs.disasm(bytes.fromhex(ENCODINGS[k][0]), 0x1000, 1))
        assert int(ins.op_str, 16) == t, ENCODINGS[k][0]
    wide = has_operand_size_prefix(raw, odd)
    assert [k for k, w in zip(odd.tolist(), wide.tolist()) if w] == \
        [k for k in want if "66" in ENCODINGS[k][0][:4] or ENCODINGS[k][0].startswith("6648")]


_BODIES = ["eb10", "7410", "e910000000", "e810000000", "0f8510000000", "e010", "e210", "e310",
           "c7f810000000", "c7f81000"]


def test_every_prefixed_branch_capstone_reads_is_decoded_or_unchecked():
    """Every direct branch behind up to two prefixes of any kind (legacy, REX) that
    Capstone decodes at its full length is either one pc_relative_branches
    returns, with Capstone's target, or an unchecked one, never neither."""
    encodings = []
    for body in _BODIES:
        for a in [None] + list(ANY_PREFIX):
            for b in [None] + list(ANY_PREFIX):
                encodings.append(bytes(x for x in (a, b) if x is not None) + bytes.fromhex(body))
    cs = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    cs.detail = True
    dec = _Decoder()
    rows, targets = [], []
    for code in sorted(set(encodings)):
        ins = next(cs.disasm(code, 0x1000, 1), None)
        if ins is None or ins.size != len(code) or not ins.operands or \
                ins.operands[0].type != capstone.x86.X86_OP_IMM or \
                not (ins.group(capstone.CS_GRP_JUMP) or ins.group(capstone.CS_GRP_CALL)):
            continue
        r = dec.decode(code, 0x1000)
        assert len(r) == 1, code.hex()
        rows.append(r)
        targets.append(ins.operands[0].imm)
    dec.close()
    rows = np.concatenate(rows)
    assert len(rows) > 3000
    raw, size, addr = rows["bytes"], rows["size"], rows["address"]
    dis = Disassembly(addr, size.astype(np.uint8), np.zeros(len(addr), np.int32), raw, [])
    seen, seen_t, kind = dis.pc_relative_branches()
    odd = dis.unchecked_branches()
    assert not set(seen.tolist()) & set(odd.tolist())
    assert set(seen.tolist()) | set(odd.tolist()) == set(range(len(rows)))
    want = np.array(targets, np.uint64)
    # each read once, with Capstone's target (a rel16 xbegin's is truncated to 16 bits)
    assert len(np.unique(seen)) == len(seen)
    wide = kind == 2
    assert (seen_t[~wide] == want[seen[~wide]]).all()
    assert (seen_t[wide] == (want[seen[wide]] & np.uint64(0xFFFF))).all()
    assert (unchecked_branch_targets(raw, addr, size, odd) == want[odd]).all()


def _patch_at_symbol(src, dest, name, byte):
    im = ElfImage(src)
    addr = im.symbol_address(name)
    out = helpers.patched_copy(src, dest, {im.vaddr_to_offset(int(addr)): bytes([byte])})
    os.chmod(out, 0o755)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from linepack.profile.user import record_user
    d = tmp_path_factory.mktemp("unchecked")
    plain = helpers.build_c("unchecked_branch.c", d / "plain", "-Wl,--emit-relocs")
    rex = _patch_at_symbol(plain, d / "rex", "step_asm", 0x48)
    wide = _patch_at_symbol(plain, d / "wide", "step_asm", 0x66)
    prof = str(d / "plain.lpprof")
    record_user(plain, ["200000"], output=prof)
    outs = {}
    for strategy in ("pack", "blocks"):
        outs[strategy] = str(d / f"plain.{strategy}")
        p = helpers.run_linepack("relayout", plain, "--profile", prof, "--strategy", strategy,
                                 "-o", outs[strategy])
        assert p.returncode == 0, p.stderr
    return {"dir": d, "plain": plain, "rex": rex, "wide": wide, "prof": prof,
            "out": outs["pack"], "outs": outs}


def _run(path):
    import subprocess
    p = subprocess.run([path, "1000"], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout


def test_the_fixture_holds_such_a_call(built):
    """The patched byte makes a call no decoder reads, with no relocation on it
    (the case branch fixing alone handles), which the plain build's layout moves."""
    for name in ("rex", "wide"):
        im = ElfImage(built[name])
        dis = Disassembly(*_decoded(im, "step_asm"))
        assert len(dis.unchecked_branches()) == 1, name
    rel = ElfImage(built["plain"]).relocations[".text"]
    at = ElfImage(built["plain"]).symbol_address("step_asm")
    assert not ((rel.offset >= at) & (rel.offset < at + 6)).any()
    assert _run(built["rex"]) == _run(built["plain"])


def _decoded(im, name):
    addr = int(im.symbol_address(name))
    dec = _Decoder()
    rows = dec.decode(bytes(im.read(addr, 7)), addr)
    dec.close()
    return (rows["address"], rows["size"].astype(np.uint8), np.zeros(len(rows), np.int32),
            rows["bytes"], [])


@pytest.mark.parametrize("strategy", ["pack", "blocks"])
@pytest.mark.parametrize("name", ["rex", "wide"])
def test_relayout_refuses_them(built, name, strategy, tmp_path):
    out = tmp_path / "out"
    p = helpers.run_linepack("relayout", "-q", built[name], "--profile", built["prof"], "--strategy",
                             strategy, "-o", out)
    line = helpers.refusal_line(p)
    assert "behind prefixes linepack does not decode" in line and "step_asm" in line, line
    assert not out.exists() and not os.listdir(tmp_path)


@pytest.mark.parametrize("strategy", ["pack", "blocks"])
def test_one_that_moves_with_its_target_is_kept_and_proven(built, strategy):
    """spin_asm's `rex.W jnz` into itself: the layout moves the function whole
    (never split), the branch keeps its bytes, the output runs and verifies."""
    out = built["outs"][strategy]
    old, new = ElfImage(built["plain"]), ElfImage(out)
    a_old, a_new = int(old.symbol_address("spin_asm")), int(new.symbol_address("spin_asm"))
    assert a_old != a_new
    body = bytes(old.read(a_old, 24))
    end = body.index(bytes.fromhex("4875")) + 4          # through the jnz and the ret
    assert bytes(new.read(a_new, end)) == body[:end]
    assert _run(out) == _run(built["plain"])
    p = helpers.run_linepack("verify", out, "--against", built["plain"])
    assert p.returncode == 0, p.stdout


def test_verify_names_a_kept_one_that_went_stale(built, tmp_path):
    """The same `rex.W jnz` with its displacement off by one in the output."""
    out = built["out"]
    new = ElfImage(out)
    at = int(new.symbol_address("spin_asm"))
    body = bytes(new.read(at, 24))
    pos = body.index(bytes.fromhex("4875")) + 2
    bad = helpers.patched_copy(out, tmp_path / "bad",
                               {new.vaddr_to_offset(at + pos): bytes([(body[pos] - 1) & 0xFF])})
    p, rep = helpers.verify_json(bad, tmp_path, "--against", built["plain"])
    errors = [f for f in rep["findings"] if f["severity"] == "error"]
    assert p.returncode == 1 and [f["check"] for f in errors] == ["equiv.unchecked-branch"]
    assert "spin_asm" in errors[0]["message"]


def _call_field(path):
    """(file offset, value) of the rel32 of step_asm's call (after the patched byte)."""
    im = ElfImage(path)
    off = im.vaddr_to_offset(int(im.symbol_address("step_asm")) + 2)
    with open(path, "rb") as f:
        f.seek(off)
        return off, f.read(4)


def test_verify_proves_a_translated_one_and_names_a_stale_one(built, tmp_path):
    out = built["out"]
    # the layout's own call, translated, behind the REX the original now has
    good = _patch_at_symbol(out, tmp_path / "good", "step_asm", 0x48)
    assert _run(good) == _run(built["rex"])
    p = helpers.run_linepack("verify", good, "--against", built["rex"])
    assert p.returncode == 0, p.stdout
    # the call's field left as the original had it (what relayout wrote before the fix)
    _, orig = _call_field(built["rex"])
    off, now = _call_field(good)
    assert orig != now
    stale = helpers.patched_copy(good, tmp_path / "stale", {off: orig})
    p, rep = helpers.verify_json(stale, tmp_path, "--against", built["rex"])
    errors = [f for f in rep["findings"] if f["severity"] == "error"]
    assert p.returncode == 1 and [f["check"] for f in errors] == ["equiv.unchecked-branch"]
    assert "step_asm" in errors[0]["message"] and "now goes to" in errors[0]["message"]
    # with 66 even the translated target is not proven: the CPU decides where it goes
    wide = _patch_at_symbol(out, tmp_path / "wide", "step_asm", 0x66)
    p, rep = helpers.verify_json(wide, tmp_path, "--against", built["wide"])
    errors = [f for f in rep["findings"] if f["severity"] == "error"]
    assert p.returncode == 1 and [f["check"] for f in errors] == ["equiv.unchecked-branch"]
    assert "Intel and AMD" in errors[0]["message"]


def test_a_66_branch_that_did_not_move_passes(built, tmp_path):
    """Nothing moved: the wide original against itself copied is no finding."""
    same = helpers.patched_copy(built["wide"], tmp_path / "same", {})
    p = helpers.run_linepack("verify", same, "--against", built["wide"])
    assert p.returncode == 0, p.stdout
