"""Images parsed once per process, shared by every caller.

``evaluate --layout`` plans and rewrites several layouts of one base image;
each used to parse the base and disassemble its ~46,000 functions again. Here
an image is opened once per (path, size, mtime); what is derived from it
(functions, units, disassembly) is computed once per image object in its
context (image/context.py). Callers must not modify what they get (the
rewriter copies section bytes before patching them).
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


__all__ = ["elf_image"]
