"""cfi.c, the C core of relayout/user/cfi.py, against the Python code it stands in for.

The C core must give the same rows and the same program bytes as cfi.py (relayout's
outputs are byte-reproducible on machines without a compiler, where the Python code
runs), and hand back every program it does not handle:
- every FDE of real binaries (system programs and a library, a split fixture and its
  blocks output): evaluated rows, compacted programs (eh_frame_split._compact) and
  the programs of split parts from random pieces, C and Python equal;
- programs outside the plain set (expressions, registers past 31, unknown opcodes,
  malformed programs, advances off the code alignment) are the Python code's;
- a blocks output is the same file with and without a compiler, and verify's
  unwind-state comparison counts the same points both ways.
"""

import os
import random
import struct
import subprocess

import pytest

import helpers
from linepack.image.elf import ElfImage
from linepack.relayout.user import cfi
from linepack.relayout.user import eh_frame_split as E

pytestmark = pytest.mark.skipif(cfi.native_lib() is None, reason="needs a C compiler")

SYSTEM = [p for p in ("/usr/bin/gdb", "/usr/bin/python3",
                      "/usr/lib/x86_64-linux-gnu/libc.so.6") if os.path.exists(p)]

HERE = os.path.dirname(os.path.abspath(__file__))
FLAGS = ["-O2", "-fno-pie", "-no-pie", "-fno-reorder-blocks-and-partition",
         "-Wl,--emit-relocs"]


@pytest.fixture(scope="module")
def split_case(tmp_path_factory):
    """The split fixture, its profile and its blocks output (as test_relayout_blocks_user)."""
    helpers.require_tool("gcc", "qemu-x86_64")
    from linepack.profile.user import record_user
    d = str(tmp_path_factory.mktemp("cfic"))
    exe = os.path.join(d, "split_user")
    subprocess.run(["gcc", *FLAGS, "-o", exe, os.path.join(HERE, "fixtures", "c",
                                                           "split_user.c")], check=True)
    prof = exe + ".lpprof"
    record_user(exe, [], output=prof)
    out = exe + ".blocks"
    p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", "blocks",
                        "-q", "-o", out], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return exe, prof, out


def _fdes(path):
    eh = E.EhSplit(ElfImage(path), compact=False)
    return eh, eh.fdes, [eh.cie_info.get(r.cie) for r in eh.fdes]


def _python_or_error(f, *a):
    try:
        return f(*a)
    except (cfi.CfiError, IndexError, ValueError, struct.error) as e:
        return type(e)


def _check_binary(path, rnd, pieces_per_fde=2, most=None):
    eh, fdes, infos = _fdes(path)
    progs = [r.prog for r in fdes]
    # compaction: the C core's bytes are _compact's; what it leaves is not plain
    done = cfi.compact_native(progs, infos)
    for prog, info, got in zip(progs, infos, done):
        if got is not None:
            assert got == E._compact(prog, info)[0]
    n_plain = sum(g is not None for g in done)
    assert n_plain >= len(fdes) - 2          # the PLT FDEs (a CFA expression)
    # evaluation: the same rows, state for state
    plain = [k for k, g in enumerate(done) if g is not None]
    rows, first, count = cfi.evaluate_native([progs[k] for k in plain],
                                             [infos[k] for k in plain])
    assert (count >= 1).all()
    for j, k in enumerate(plain):
        nat = rows[first[j]:first[j] + count[j]]
        assert cfi.rows_from_native(nat) == cfi.evaluate(progs[k], infos[k],
                                                         infos[k].init_state)
    # split parts: random pieces (copied, inserted jmp) in a shuffled order
    checked = 0
    for j, k in enumerate(plain[:most]):
        r, info = fdes[k], infos[k]
        nat = rows[first[j]:first[j] + count[j]]
        py = cfi.evaluate(progs[k], info, info.init_state)
        for _ in range(pieces_per_fde):
            n = r.pc_range
            cuts = sorted(rnd.sample(range(1, n), min(n - 1, rnd.randint(0, 8)))) if n > 1 else []
            bounds = [0] + cuts + [n]
            segs = [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(len(bounds) - 1)]
            rnd.shuffle(segs)
            pieces, off = [], 0
            for o, ln in segs:
                inserted = rnd.random() < 0.2 and o > 0
                pieces.append((off, o, ln, not inserted, o - 1 if inserted else o))
                off += 5 if inserted else ln
            want = _python_or_error(lambda: cfi.write_program(cfi.rows_for_pieces(py, pieces),
                                                              info))
            got = cfi.pieces_program_native(nat, pieces, info)
            assert got == want or (got is None and not isinstance(want, bytes))
            checked += got is not None
    assert checked
    return len(fdes), n_plain


@pytest.mark.parametrize("path", SYSTEM, ids=os.path.basename)
def test_system_binaries_c_equals_python(path):
    n, plain = _check_binary(path, random.Random(22), pieces_per_fde=1, most=3000)
    assert n > 1000 and plain < n            # the PLT's CFA expression is Python's


def test_split_fixture_and_its_output_c_equal_python(split_case):
    exe, _, out = split_case
    for path in (exe, out):
        _check_binary(path, random.Random(7), pieces_per_fde=20)


def _cie(code_align=1, data_align=-8):
    info = cfi.CieInfo(code_align, data_align, 16, b"\x0c\x07\x08\x90\x01")
    info.init_state = cfi.evaluate(info.initial, info, None)[0][1]
    return info


@pytest.mark.parametrize("prog", [
    b"\x41\x0f\x02\x77\x08\x41",             # DW_CFA_def_cfa_expression
    b"\x41\x10\x03\x02\x77\x00",             # DW_CFA_expression (register rule)
    b"\x41\x16\x03\x01\x30",                 # DW_CFA_val_expression
    b"\x41\x05\x28\x02",                     # register 40
    b"\x41\x0c\x21\x10",                     # CFA in register 33
    b"\x41\x1d\x00",                         # an opcode cfi.py does not know
    b"\x41\x01\x00\x10\x00\x00\x00\x00\x00\x00",   # DW_CFA_set_loc
    b"\x41\x0b",                             # restore_state, nothing remembered
    b"\x41\x0e",                             # a LEB128 running past the end
    b"\x41\x03\x10",                         # advance_loc2 running past the end
    b"\x0e\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",   # a value past 63 bits
    b"\x41\x86\x80\x80\x80\x80\x02",     # a register's offset past 32 bits (-8 << 29)
], ids=["cfa-expr", "expr", "valexpr", "reg40", "cfa-reg33", "unknown", "set-loc",
        "restore-empty", "truncated-leb", "truncated-advance", "huge", "rule-past-32-bits"])
def test_programs_outside_the_plain_set_are_pythons(prog):
    info = _cie()
    assert cfi.evaluate_native([prog], [info]) is None
    rows, first, count = cfi.evaluate_native([b"\x41\x0e\x10", prog], [info, info], partial=True)
    assert count.tolist()[1] == -1 and count.tolist()[0] == 2
    assert cfi.compact_native([prog], [info]) == [None]
    # what the Python code makes of it: rows with a rule C does not hold, or an error
    py = _python_or_error(cfi.evaluate, prog, info, info.init_state)
    if isinstance(py, list):
        assert any(st[0][0] == "expr" or st[0][1] >= 32 or
                   any(r >= 32 or rule[0] in ("expr", "valexpr") or
                       (len(rule) > 1 and abs(rule[1]) >= 1 << 31) for r, rule in st[1]) or
                   any(abs(v) >= 1 << 63 for v in (st[0][2], st[2]))
                   for _, st in py)
    else:
        assert issubclass(py, (cfi.CfiError, IndexError, struct.error))


def test_plain_programs_and_their_edges():
    """remember/restore (args_size kept), restore to the CIE's rule, negative and
    factored offsets, val_offset, register-in-register, undefined, same value,
    GNU_args_size, nop padding: C and Python the same rows and compaction."""
    info = _cie()
    progs = [
        b"\x41\x0e\x10\x86\x02\x0a\x44\x0e\x08\xc6\x0b\x41\x2e\x10\x00\x00",
        b"\x42\x0c\x06\x10\x8c\x03\x14\x0d\x02\x15\x0e\x7e\x09\x03\x06\x07\x05\x08\x0f\x41\x06\x03",
        b"\x44\x13\x7e\x11\x03\x7f\x2f\x04\x02\x02\xff\x03\x00\x01\x0d\x07"
        b"\x04\x00\x00\x01\x00\x0e\x08",
        b"\x0a\x41\x0e\x18\x0a\x41\x0e\x20\x0b\x41\x0b\x41\x0e\x18\x41\x0e\x08",
        b"\x41\x0e\x10\x41\x0e\x08\x41\x0e\x10\x41\x0e\x08\x41\x0e\x10\x41\x0e\x08",
    ]
    for prog in progs:
        rows, first, count = cfi.evaluate_native([prog], [info])
        assert cfi.rows_from_native(rows) == cfi.evaluate(prog, info, info.init_state), prog
        assert cfi.compact_native([prog], [info]) == [E._compact(prog, info)[0]], prog
        py = cfi.evaluate(prog, info, info.init_state)
        pieces = [(0, 0, 3, True, 0), (3, 8, 100, True, 8), (103, 3, 5, True, 3),
                  (108, 2, 0, False, 1)]
        assert cfi.pieces_program_native(rows, pieces, info) == \
            cfi.write_program(cfi.rows_for_pieces(py, pieces), info)


def test_advance_off_the_code_alignment_is_pythons():
    info = _cie(code_align=4)
    prog = b"\x41\x0e\x10\x41\x0e\x08"
    rows, _, _ = cfi.evaluate_native([prog], [info])
    py = cfi.evaluate(prog, info, info.init_state)
    pieces = [(0, 0, 4, True, 0), (6, 4, 4, True, 4)]      # 6: not a multiple of 4
    assert cfi.pieces_program_native(rows, pieces, info) is None
    with pytest.raises(cfi.CfiError):
        cfi.write_program(cfi.rows_for_pieces(py, pieces), info)


def test_a_cie_outside_the_plain_set_is_pythons():
    info = cfi.CieInfo(1, -8, 16, b"\x0f\x02\x77\x08")        # CFA expression
    info.init_state = cfi.evaluate(info.initial, info, None)[0][1]
    assert cfi.native_cie(info) is None
    assert cfi.evaluate_native([b"\x41"], [info]) is None
    assert cfi.compact_native([b"\x41"], [info]) == [None]


def test_same_output_without_a_compiler(split_case, tmp_path):
    """The whole blocks rewrite without any C core (CC names no compiler) writes the
    same bytes; verify's unwind-state pass counts the same points on cfi.py's rows."""
    exe, prof, out = split_case
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"))
    plain = tmp_path / "python.blocks"
    p = subprocess.run(["linepack", "relayout", exe, "--profile", prof, "--strategy", "blocks",
                        "-q", "-o", str(plain)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert plain.read_bytes() == open(out, "rb").read()
    from linepack.image import blockmap as bm
    rows = bm.read_blockmap(ElfImage(out))
    parsed = E.parse_for_check(ElfImage(exe), ElfImage(out))
    native = E._all_states_equal(*parsed, rows)
    python = E._all_states_equal(*E.parse_for_check(ElfImage(exe), ElfImage(out)), rows,
                                 native=False)
    assert native == python and native > 20
