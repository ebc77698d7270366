"""tools/native.py: the one builder of linepack's C cores (what-if replay, DWARF,
disassembly): built once per source version into the cache, errors in one line."""

import ctypes
import os

import pytest
import helpers

from linepack import native
from linepack.errors import ExternalToolError

_requirements = helpers.requirements("gcc")


def test_built_once_per_source_version(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "add.c"
    src.write_text("long lp_add(long a, long b) { return a + b; }\n")
    lib = native.build("add", [str(src)], "test", "the test core")
    lib.lp_add.argtypes = [ctypes.c_long, ctypes.c_long]
    lib.lp_add.restype = ctypes.c_long
    assert lib.lp_add(40, 2) == 42
    built = sorted(os.listdir(tmp_path / "cache" / "test"))
    assert len(built) == 1 and built[0].startswith("add-") and built[0].endswith(".so")
    mtime = os.stat(tmp_path / "cache" / "test" / built[0]).st_mtime_ns
    native.build("add", [str(src)], "test", "the test core")          # reused, not rebuilt
    assert os.stat(tmp_path / "cache" / "test" / built[0]).st_mtime_ns == mtime
    src.write_text("long lp_add(long a, long b) { return a + b + 1; }\n")
    native.build("add", [str(src)], "test", "the test core")          # new version: new object
    assert len(os.listdir(tmp_path / "cache" / "test")) == 2


def test_build_error_is_one_line_and_leaves_no_temp(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "bad.c"
    src.write_text("int lp_bad(void) { return }\n")
    with pytest.raises(ExternalToolError) as e:
        native.build("bad", [str(src)], "test", "the test core")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cannot build the test core with "), msg
    assert os.listdir(tmp_path / "cache" / "test") == []


def test_no_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "compiler", lambda: None)
    src = tmp_path / "x.c"
    src.write_text("int x;\n")
    with pytest.raises(ExternalToolError, match="the test core needs a C compiler"):
        native.build("x", [str(src)], "test", "the test core")


def test_a_compiler_that_is_not_there_is_named(tmp_path, monkeypatch):
    """$CC naming no program is the same one-line error as a failed build (the
    cores' callers then fall back to Python), not an OSError."""
    monkeypatch.setenv("LINEPACK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    src = tmp_path / "x.c"
    src.write_text("int x;\n")
    with pytest.raises(ExternalToolError, match="cannot build the test core with .*no-such-cc"):
        native.build("x", [str(src)], "test", "the test core")
    assert os.listdir(tmp_path / "cache" / "test") == []
