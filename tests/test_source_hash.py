"""Cached results name the sources that made them (resources.source_hash): evaluate's
layout cache is made again when any code a layout runs through changes (the
rewriter, the kernel tables, the image readers, the DWARF rewrite, the strategy
configs), not only the relayout folder."""

import shutil

from linepack import resources
from linepack.evaluate import layouts


def _copy(tmp_path, monkeypatch):
    pkg = tmp_path / "linepack"
    shutil.copytree(resources.PACKAGE_DIR, pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    cfg = tmp_path / "configs"
    shutil.copytree(resources.configs_dir(), cfg)
    monkeypatch.setattr(resources, "PACKAGE_DIR", str(pkg))
    monkeypatch.setenv("LINEPACK_CONFIGS", str(cfg))
    return pkg, cfg


def _touch(path):
    with open(path, "a") as f:
        f.write("\n# changed\n")


def test_layout_key_follows_every_source_a_layout_runs_through(tmp_path, monkeypatch):
    pkg, cfg = _copy(tmp_path, monkeypatch)
    before = layouts.code_hash()
    assert before == layouts.code_hash()                     # stable
    for changed in (pkg / "kernel" / "kallsyms.py", pkg / "image" / "decode.c",
                    pkg / "dwarf" / "rewrite.py", pkg / "relayout" / "passes.py",
                    cfg / "relayout" / "blocks.toml"):
        _touch(changed)
        after = layouts.code_hash()
        assert after != before, changed
        before = after
    # code no layout runs through: the cached layouts stay valid
    _touch(pkg / "evaluate" / "report.py")
    _touch(pkg / "docs_cli.py")
    assert layouts.code_hash() == before


def test_whole_package_hash_for_kernel_builds(tmp_path, monkeypatch):
    pkg, _ = _copy(tmp_path, monkeypatch)
    from linepack.ship import kbuild
    before = kbuild._linepack_code_hash()
    _touch(pkg / "evaluate" / "report.py")
    touched = kbuild._linepack_code_hash()
    assert touched != before
    # a file name is part of the hash, not only the bytes
    (pkg / "evaluate" / "report.py").rename(pkg / "evaluate" / "report2.py")
    assert kbuild._linepack_code_hash() != touched
