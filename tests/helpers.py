"""Shared test helpers: build C fixtures at test time, patch copies of images."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")


def build_c(src_name, out, *flags, static=False):
    """Compile tests/fixtures/c/<src_name> to out with gcc; skip if gcc is absent."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc not installed")
    cmd = ["gcc", "-O2", *(["-static"] if static else []), *flags,
           os.path.join(FIXTURES, "c", src_name), "-o", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return str(out)


def run_linepack(*args, timeout=900):
    """Run the CLI as a user would: returns CompletedProcess with text output."""
    return subprocess.run([sys.executable, "-m", "linepack", *map(str, args)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


def patched_copy(src, dest, patches):
    """Copy src to dest and apply {file offset: bytes} patches to the copy."""
    shutil.copyfile(src, dest)
    with open(dest, "r+b") as f:
        for off, data in patches.items():
            f.seek(off)
            f.write(data)
    return str(dest)
