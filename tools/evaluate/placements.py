"""Libc placements for ``evaluate --program``: the offsets ASLR can give a program's libraries.

``evaluate --program`` runs without address randomization, so libc always lands at the
same offset within the span of one cache way (32 KiB for a 64 KiB 2-way L1i: 8 pages of
4 KiB). A real run gets one of those offsets, and a 2-way miss count can move several
times between them; a mean over every offset is what a layout should be judged by.

Placement k loads an empty shared library whose mapping spans BASE_PAGES + k pages before
the program's own libraries (``LD_PRELOAD``, set in the program's environment only:
qemu-x86_64 ``-E``): ld.so maps libraries one after another, so libc and every library
after it move by exactly that many pages, k modulo any way of up to BASE_PAGES pages
(256 KiB). The program and the dynamic loader stay where they were. With one placement
nothing is preloaded (evaluate's behaviour before placements); with more, every placement
preloads one (the same loader work in each, only the size differs).

The libraries are built once with gcc from a fixed source into
``<cache>/placements/pad-NNN.so`` (their span checked on every use).
"""

import os
import subprocess
import tempfile

from ..errors import ExternalToolError

PAGE = 4096
BASE_PAGES = 64
MAX_PLACEMENTS = BASE_PAGES
# The default: every distinct placement of the largest way among the cache models, at most 8
# (a 64 KiB 2-way L1i: 8; a 4 KiB way, e.g. 32 KiB 8-way: 1, every shift maps libc alike).
DEFAULT_MAX = 8

_SOURCE = ("/* linepack evaluate --program: an empty library that only takes address space */\n"
           "__attribute__((used, aligned(64))) static char lp_pad[{n}];\n"
           "int lp_pad_fn(void) {{ return 0; }}\n")
_FLAGS = ["-shared", "-fPIC", "-O2", "-nostdlib", "-Wl,--build-id=none", "-Wl,-z,norelro"]


def way_pages(cache):
    """4 KiB pages one way of a cache model spans (its L2's way for an L2 model), at least 1."""
    size, ways = cache["size"], cache["ways"]
    if cache.get("l2_size") and cache.get("l2_ways"):
        size, ways = max((size, ways), (cache["l2_size"], cache["l2_ways"]),
                         key=lambda sw: sw[0] // sw[1])
    return max(1, size // ways // PAGE)


def default_count(caches):
    """Placements by default: the distinct ones of the largest way, at most DEFAULT_MAX."""
    return min(DEFAULT_MAX, max(way_pages(c) for c in caches))


def shift_pages(k, count):
    """Pages placement k of ``count`` moves libc by (0 with a single placement)."""
    return 0 if count == 1 else BASE_PAGES + k


def pad_dir():
    from .. import targets
    return os.path.join(targets.cache_dir(), "placements")


def _span(path):
    """End of the last PT_LOAD (vaddr + memsz) of a shared library: what ld.so maps."""
    from ..image.elf import ElfImage
    ph = ElfImage(path).phdrs
    load = ph[ph["type"] == 1]
    return int((load["vaddr"] + load["memsz"]).max()) if len(load) else 0


def _pages(path):
    return -(-_span(path) // PAGE)


def _build(path, n, tmp):
    src = os.path.join(tmp, "pad.c")
    with open(src, "w") as f:
        f.write(_SOURCE.format(n=max(64, n)))
    try:
        p = subprocess.run(["gcc", *_FLAGS, "-o", path, src], capture_output=True, text=True)
    except FileNotFoundError:
        raise ExternalToolError("gcc is not installed: evaluate --placements builds its "
                                "libraries with it (apt-get install gcc)") from None
    if p.returncode:
        err = (p.stderr.strip().splitlines() or ["no message"])[-1]
        raise ExternalToolError(f"gcc could not build a placement library: {err}")


def pad_library(pages, directory=None):
    """Path of an empty shared library mapping exactly ``pages`` pages (built and cached)."""
    d = directory or pad_dir()
    path = os.path.join(d, f"pad-{pages:03d}.so")      # one length: the same environment size
    if any(c in path for c in " :\t\n"):
        raise ExternalToolError(f"{d}: a placement library's path may not hold a space or "
                                "a colon (LD_PRELOAD separates on them); set LINEPACK_CACHE")
    if os.path.isfile(path) and _span(path) == pages * PAGE:
        return path
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pad-", dir=d) as tmp:
        out = os.path.join(tmp, "pad.so")
        _build(out, 64, tmp)
        # the array (64-byte aligned: where it starts does not move) ends the RW segment:
        # grow it by what is missing
        _build(out, 64 + pages * PAGE - _span(out), tmp)
        if _span(out) != pages * PAGE:
            raise ExternalToolError(f"a placement library of {pages} pages came out spanning "
                                    f"{_span(out):#x} bytes (gcc/ld lay it out differently)")
        os.replace(out, path)
    return path


def preload(k, count, directory=None):
    """The library to preload for placement k of ``count`` (None: nothing)."""
    s = shift_pages(k, count)
    return pad_library(s, directory) if s else None


__all__ = ["way_pages", "default_count", "shift_pages", "pad_library", "preload",
           "MAX_PLACEMENTS", "BASE_PAGES", "PAGE"]
