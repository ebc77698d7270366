"""linepack verify on small C fixtures: static-key classification and bad input."""

import json
import os
import shutil
import subprocess

import pytest

from helpers import build_c, run_linepack

NOP5 = ".byte 0x0f,0x1f,0x44,0x00,0x00"


def _build(tmp_path, name, site=NOP5, *extra):
    return build_c("static_keys.c", tmp_path / name, "-fno-pie", "-no-pie",
                   f"-DSITE_BYTES=\"{site}\"", *extra)


def _report(tmp_path, image, *args):
    out = tmp_path / "report.json"
    p = run_linepack("verify", "-q", image, "--json", out, *args)
    rep = json.loads(out.read_text()) if out.exists() else None
    return p, rep


def test_fixture_runs_and_is_clean_apart_from_improvable(tmp_path):
    exe = _build(tmp_path, "good")
    run = subprocess.run([exe], stdout=subprocess.PIPE, text=True, check=True)
    # nop sites fall through, jump sites go to their label; 4 table entries
    assert run.stdout.startswith("0 0 3 4 4 ")
    p, rep = _report(tmp_path, exe)
    keys = rep["static_keys"]
    # site_custom nop5, site_nop2 nop2, site_jmp jmp8 (assembler's choice), site_jmp32 jmp32
    assert keys == {"total": 4, "nop2": 1, "nop5": 1, "jmp8": 1, "jmp32": 1,
                    "improvable": 2, "illegal": 0}
    # The nop5 and the jmp32 reach their targets with rel8: improvable is a warning only.
    assert p.returncode == 0, p.stdout + p.stderr
    assert rep["ok"] is True
    assert {f["check"] for f in rep["findings"]} == {"static_key.improvable"}
    assert rep["tables"]["__jump_table"] == {"entries": 4, "ok": True}
    # --strict turns warnings into a failing exit status
    p2, rep2 = _report(tmp_path, exe, "--strict")
    assert p2.returncode == 1 and rep2["ok"] is False


def test_illegal_site_bytes_fail(tmp_path):
    exe = _build(tmp_path, "bad", ".byte 0x90,0x90,0x90,0x90,0x90")
    p, rep = _report(tmp_path, exe)
    assert p.returncode == 1
    assert rep["static_keys"]["illegal"] == 1
    illegal = [f for f in rep["findings"] if f["check"] == "static_key.illegal"]
    assert len(illegal) == 1 and "site_custom" in illegal[0]["message"]
    assert "static_key.illegal" in p.stdout


def test_jump_with_wrong_displacement_fails(tmp_path):
    # a jmp32 that lands one byte past the label the table names
    exe = _build(tmp_path, "disp", ".byte 0xe9\\n\\t.long %l[yes] - (1b + 5) + 1")
    p, rep = _report(tmp_path, exe)
    assert p.returncode == 1
    assert any(f["check"] == "static_key.displacement" and "site_custom" in f["message"]
               for f in rep["findings"])


def test_short_sites_are_errors_before_5_14(tmp_path):
    exe = _build(tmp_path, "old", NOP5, "-DOLD_KERNEL")
    p, rep = _report(tmp_path, exe)
    assert rep["kernel_version"].startswith("Linux version 5.10.0")
    short = [f for f in rep["findings"] if f["check"] == "static_key.short-on-old-kernel"]
    # nop2 in site_nop2 and the jmp8 in site_jmp
    assert len(short) == 2
    assert p.returncode == 1


def test_image_without_jump_table_is_fine(tmp_path):
    src = tmp_path / "plain.c"
    src.write_text("int main(void){return 0;}\n")
    exe = tmp_path / "plain"
    subprocess.run(["gcc", "-O2", str(src), "-o", str(exe)], check=True)
    p, rep = _report(tmp_path, exe)
    assert p.returncode == 0
    assert rep["static_keys"] is None
    # a userspace program: only its unwind tables
    assert set(rep["tables"]) == {".eh_frame"} and rep["tables"][".eh_frame"]["ok"]


def test_stale_eh_frame_hdr_is_named(tmp_path):
    exe = _build(tmp_path, "eh")
    from linepack.image.elf import ElfImage
    im = ElfImage(exe)
    hdr = im.section(".eh_frame_hdr")
    raw = bytes(im.section_bytes(hdr))
    assert raw[0] == 1 and raw[3] == 0x3B            # version 1, table: datarel sdata4
    count = int.from_bytes(raw[8:12], "little")
    assert count >= 3
    # swap the first two (initial location, FDE) pairs: the table is no longer sorted
    table = hdr.offset + 12
    data = bytearray(open(exe, "rb").read())
    a, b = data[table:table + 8], data[table + 8:table + 16]
    data[table:table + 8], data[table + 8:table + 16] = b, a
    bad = tmp_path / "eh-bad"
    bad.write_bytes(bytes(data))
    p, rep = _report(tmp_path, bad)
    assert p.returncode == 1
    assert any(f["check"] == "eh_frame.hdr" and "not sorted" in f["message"] for f in rep["findings"])


# -- bad input: one line on stderr, exit 2, no traceback -----------------------------

def _bad(path, expect):
    p = run_linepack("verify", path)
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert expect in lines[0], lines[0]


def test_missing_file(tmp_path):
    _bad(tmp_path / "nope", "no such file")


def test_directory(tmp_path):
    _bad(tmp_path, "is a directory")


def test_not_elf(tmp_path):
    f = tmp_path / "text"
    f.write_text("hello, this is not an ELF file at all\n" * 10)
    _bad(f, "not an ELF file")


def test_elf32(tmp_path):
    # binutils' own assembler makes a 32-bit object on any x86-64 host (gcc -m32 may
    # need gcc-multilib)
    src = tmp_path / "a32.s"
    src.write_text(".text\n.globl f\nf:\n  movl 4(%esp), %eax\n  incl %eax\n  ret\n")
    obj = tmp_path / "a32.o"
    subprocess.run(["as", "--32", str(src), "-o", str(obj)], check=True, stderr=subprocess.PIPE)
    _bad(obj, "32-bit ELF")


def test_other_machine(tmp_path):
    exe = _build(tmp_path, "m")
    data = bytearray(open(exe, "rb").read())
    data[18:20] = (183).to_bytes(2, "little")     # EM_AARCH64
    f = tmp_path / "aarch64"
    f.write_bytes(data)
    _bad(f, "is not x86-64")


def test_truncated(tmp_path):
    exe = _build(tmp_path, "t")
    data = open(exe, "rb").read()
    f = tmp_path / "truncated"
    f.write_bytes(data[: len(data) // 2])
    _bad(f, "truncated")


def test_stripped(tmp_path):
    exe = _build(tmp_path, "s")
    stripped = tmp_path / "stripped"
    shutil.copy(exe, stripped)
    subprocess.run(["strip", str(stripped)], check=True)
    _bad(stripped, "no symbol table")


def test_input_never_modified(tmp_path):
    exe = _build(tmp_path, "ro")
    before = open(exe, "rb").read()
    st = os.stat(exe)
    _report(tmp_path, exe)
    assert open(exe, "rb").read() == before
    assert os.stat(exe).st_mtime_ns == st.st_mtime_ns


def test_usage_error_exit_2():
    p = run_linepack("verify")
    assert p.returncode == 2 and "Traceback" not in p.stderr


@pytest.mark.parametrize("content,expect", [
    (b"f\t1000\t2000\t10\njunk line\n", ":2: not a layout map line"),
    (b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)), "not a layout map (function, old, "
     "new, size): not text"),
])
def test_bad_layout_map_one_line_exit_2(tmp_path, content, expect):
    exe = _build(tmp_path, "lm")
    bad = tmp_path / "map.tsv"
    bad.write_bytes(content)
    p = run_linepack("verify", exe, "--against", exe, "--layout-map", bad)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert expect in lines[0], lines[0]
