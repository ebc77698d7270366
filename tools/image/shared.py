"""Images parsed and disassembled once per process, shared by every caller.

``evaluate --layout`` plans and rewrites several layouts of one base image;
each used to parse the base and disassemble its ~46,000 functions again. Here
an image is opened once per (path, size, mtime) and its unit table and
disassembly are computed once per image object. Callers must not modify what
they get (the rewriter copies section bytes before patching them).
"""

import os
from collections import OrderedDict

# a few images at most: a vmlinux's disassembly is hundreds of MB
KEEP = 2
_images = OrderedDict()


def elf_image(path):
    """The ElfImage of ``path``, opened once while the file is unchanged."""
    from .elf import ElfImage
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    im = _images.get(key)
    if im is None:
        im = _images[key] = ElfImage(path)
        while len(_images) > KEEP:
            _images.popitem(last=False)
    _images.move_to_end(key)
    return im


def function_table(image):
    """The FunctionTable of an image, built once per image object."""
    got = getattr(image, "_linepack_functions", None)
    if got is None:
        from .functions import FunctionTable
        got = image._linepack_functions = FunctionTable(image)
    return got


def function_units(image, log=None):
    """(units, functions, disassembly) of an image's code, computed once per image."""
    got = getattr(image, "_linepack_units", None)
    if got is None:
        from ..relayout.units import build_units
        from .disasm import disassemble
        functions = function_table(image)
        if log:
            log(f"disassembling {len(functions)} functions")
        units, dis = build_units(image, functions, lambda u: disassemble(image, u), log=log)
        got = image._linepack_units = (units, functions, dis)
    return got


__all__ = ["elf_image", "function_table", "function_units"]
