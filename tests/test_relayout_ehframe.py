"""``.eh_frame`` / ``.eh_frame_hdr`` kept true after relayout of a userspace executable.

A C++ fixture (tests/fixtures/c/unwind.cc) throws through functions that move,
runs a destructor during unwinding, and walks its own stack with
``_Unwind_Backtrace``, naming each frame by the FDE start the unwinder found
(``_Unwind_GetRegionStart``). Relaid out in reversed order, pack order and with
64-byte alignment it must print exactly what the original prints, and every
FDE must start at the new start of its function.
"""

import os
import subprocess

import numpy as np
import pytest
import helpers

from linepack.image.elf import ElfImage
from linepack.image.functions import FunctionTable
from linepack.relayout.driver import relayout
from linepack.relayout.user.eh_frame import (EhFrameError, EhFrameHdr, check_eh_frame,
                                        parse_eh_frame)

_requirements = helpers.requirements("g++")

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "fixtures", "c", "unwind.cc")
FLAGS = ["-O2", "-no-pie", "-fno-pie", "-Wl,--emit-relocs"]


def run(path):
    p = subprocess.run([str(path)], capture_output=True, text=True, timeout=20)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    d = tmp_path_factory.mktemp("eh")
    exe = d / "unwind"
    subprocess.run(["g++", *FLAGS, "-o", str(exe), SRC], check=True)
    rc, out, err = run(exe)
    assert rc == 0, err
    assert "caught leaf3 via leaf>cleanup>level3>level2>level1>catcher>main>" in out
    return exe, out


def fde_starts(image):
    sec = image.section(".eh_frame")
    return parse_eh_frame(image.section_bytes(sec), sec.addr)


def hotness(exe, order):
    ft = FunctionTable(ElfImage(str(exe)))
    names = list(ft.name)
    if order == "reversed":      # hot64 puts the later-defined functions first
        return {n: float(i + 1) for i, n in enumerate(names)}
    return {n: float(10 + (i * 7) % 13) for i, n in enumerate(names)}


@pytest.mark.parametrize("strategy,order", [("hot64", "reversed"), ("pack", "mixed"),
                                            ("align-all 64", "mixed")])
def test_exceptions_and_backtraces_survive(prog, tmp_path, strategy, order):
    exe, expected = prog
    out = tmp_path / "out"
    summary, plan, rw = relayout(str(exe), str(out), strategy, hotness=hotness(exe, order))
    assert summary["units_moved"] > 0
    assert summary["eh_frame.fdes_moved"] > 0
    assert not summary["problems"]
    rc, got, err = run(out)
    assert rc == 0, err
    assert got == expected

    old, new = ElfImage(str(exe)), ElfImage(str(out))
    assert check_eh_frame(new) == []
    # Every FDE that started at a function starts at that function's new address,
    # with the same range.
    oft, nft = FunctionTable(old), FunctionTable(new)
    ofde, nfde = fde_starts(old), fde_starts(new)
    assert len(ofde) == len(nfde)
    assert (ofde.pc_range == nfde.pc_range).all()
    ostart = {int(a): n for a, n in zip(oft.start, oft.name)}
    checked = 0
    for ob, nb in zip(ofde.pc_begin.tolist(), nfde.pc_begin.tolist()):
        name = ostart.get(ob)
        if name is None:
            continue
        assert nb == int(nft.start[nft.index_of(name)]), name
        checked += 1
    assert checked >= 8
    moved = sum(1 for n in ("lp_leaf", "lp_level2", "lp_catcher", "main")
                if int(oft.start[oft.index_of(n)]) != int(nft.start[nft.index_of(n)]))
    assert moved >= 3
    # The search table is sorted by the new starts and names each FDE once.
    hs = new.section(".eh_frame_hdr")
    hdr = EhFrameHdr(new.section_bytes(hs), hs.addr)
    assert (np.diff(hdr.loc.astype(np.int64)) > 0).all()
    assert sorted(hdr.fde.tolist()) == sorted((nfde.fde_off + new.section(".eh_frame").addr).tolist())


def test_stale_hdr_is_detected(prog, tmp_path, monkeypatch):
    """Without the update the binary terminates: the test above is meaningful."""
    import linepack.relayout.user.eh_frame as eh
    exe, _ = prog
    monkeypatch.setattr(eh, "update_eh_frame", lambda rw, log=None: {})
    out = tmp_path / "stale"
    relayout(str(exe), str(out), "hot64", hotness=hotness(exe, "reversed"))
    assert check_eh_frame(ElfImage(str(out)))
    rc, _, _ = run(out)
    assert rc != 0


def _with_fde_encoding(exe, dst, enc):
    """A copy of exe whose first 'zR' CIE declares FDE pointer encoding ``enc``."""
    img = ElfImage(str(exe))
    sec = img.section(".eh_frame")
    data = bytes(img.section_bytes(sec))
    i = data.index(b"zR\0")
    # code align (uleb 1), data align (sleb -8), RA register, aug length, then the encoding
    pos = i + 3 + 4
    assert data[pos] == 0x1B
    blob = bytearray(open(exe, "rb").read())
    blob[sec.offset + pos] = enc
    dst.write_bytes(bytes(blob))
    os.chmod(dst, 0o755)
    return dst


def test_unsupported_encoding_is_refused(prog, tmp_path):
    exe, _ = prog
    bad = _with_fde_encoding(exe, tmp_path / "bad", 0x5B)    # DW_EH_PE_aligned|sdata4
    with pytest.raises(EhFrameError, match="encoding 0x5b is not supported"):
        relayout(str(bad), str(tmp_path / "o"), "hot64", hotness=hotness(exe, "reversed"))
    assert not (tmp_path / "o").exists()
    p = subprocess.run(["linepack", "relayout", str(bad), "--strategy", "align-all 64", "-o",
                        str(tmp_path / "o2")], capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    assert "encoding" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o2").exists()


def test_c_with_fexceptions(tmp_path):
    """Plain C: -fexceptions + _Unwind_Backtrace through moved functions."""
    src = tmp_path / "bt.c"
    src.write_text(r'''
#include <stdio.h>
#include <unwind.h>
int f1(int), f2(int), f3(int);
static void *fns[4]; static const char *names[4] = {"f1", "f2", "f3", "main"};
static char out[128];
static _Unwind_Reason_Code cb(struct _Unwind_Context *c, void *a) {
    void *s = (void *)_Unwind_GetRegionStart(c);
    for (int i = 0; i < 4; i++) if (fns[i] == s) { strcat(out, names[i]); strcat(out, ">"); }
    return _URC_NO_REASON;
}
__attribute__((noinline)) int f3(int x) { if (x == 2) _Unwind_Backtrace(cb, 0); return x + 1; }
__attribute__((noinline)) int f2(int x) { return f3(x) * 2; }
__attribute__((noinline)) int f1(int x) { return f2(x) - 1; }
int main(void) {
    fns[0] = f1; fns[1] = f2; fns[2] = f3; fns[3] = main;
    int s = 0; for (int i = 0; i < 4; i++) s += f1(i);
    printf("%d %s\n", s, out); return 0;
}
''')
    exe = tmp_path / "bt"
    subprocess.run(["gcc", "-include", "string.h", "-fexceptions", *FLAGS, "-o", str(exe),
                    str(src)], check=True)
    rc, expected, _ = run(exe)
    assert rc == 0 and "f3>f2>f1>main>" in expected
    out = tmp_path / "bt.rev"
    summary, _, _ = relayout(str(exe), str(out), "hot64", hotness=hotness(exe, "reversed"))
    assert summary["eh_frame.fdes_moved"] > 0
    assert run(out)[1] == expected
    assert check_eh_frame(ElfImage(str(out))) == []
