"""bzImage from a (rewritten) vmlinux, made by the kernel's own build.

``make -o vmlinux bzImage`` in a prepared boot-image tree whose ``vmlinux`` is
a symlink to the given file: make treats it as up to date and never relinks
(or writes) it; ``arch/x86/tools/relocs`` extracts ``vmlinux.relocs`` from its
link relocations, and the decompressor applies them when KASLR moves the kernel.

``-o vmlinux`` also means nothing is rebuilt *because of* vmlinux, so the files
made directly from it (and everything after them) are deleted before each run.
"""

import os
import shutil

from ..errors import BadInput
from ..image.elf import ElfImage
from ..io import atomic_output
from . import banner, tree

# Made from vmlinux (directly or through the compressed payload): deleted before
# each run so that make rebuilds them from the vmlinux given this time.
_FROM_VMLINUX = [
    "arch/x86/boot/voffset.h",
    "arch/x86/boot/compressed/vmlinux.bin",
    "arch/x86/boot/compressed/vmlinux.relocs",
    "arch/x86/boot/compressed/vmlinux.bin.all",
    "arch/x86/boot/compressed/piggy.S",
    "arch/x86/boot/compressed/piggy.o",
    "arch/x86/boot/compressed/misc.o",
    "arch/x86/boot/compressed/vmlinux",
    "arch/x86/boot/zoffset.h",
    "arch/x86/boot/header.o",
    "arch/x86/boot/setup.elf",
    "arch/x86/boot/setup.bin",
    "arch/x86/boot/vmlinux.bin",
    "arch/x86/boot/bzImage",
]
_COMPRESSED_PAYLOADS = ("gz", "bz2", "lzma", "xz", "lzo", "lz4", "zst")

NO_RELOCS = ("{path}: no link relocations, so no vmlinux.relocs for KASLR (kernels >= 6.5 "
             "strip them in arch/x86/Makefile.postlink after writing vmlinux.relocs): build the kernel with linepack's "
             "kbuild hook (`linepack kbuild`, or make ARCH_POSTLINK=$(linepack kbuild "
             "--print-hook)), which makes the bzImage itself")


def check_vmlinux(path):
    """(ElfImage, BuildInfo) of a vmlinux the boot image can be made from."""
    img = ElfImage(path)
    info = banner.build_info(img)
    if not img.has_link_relocations():
        raise BadInput(NO_RELOCS.format(path=path))
    return img, info


def make_bzimage(vmlinux, out, source=None, config=None, relocs_out=None, jobs=None, log=None):
    """Write ``out`` (the bzImage) made from ``vmlinux``; returns a summary dict.

    Without ``source``/``config`` the vmlinux must be a Debian build: its exact
    source package and its image package's config are fetched and cached.
    ``relocs_out``: also write the build's ``vmlinux.relocs``.
    """
    if source is not None and config is None:
        raise BadInput("--source needs --config (the .config the vmlinux was built with)")
    vmlinux = os.path.abspath(vmlinux)
    img, info = check_vmlinux(vmlinux)
    img.close()
    if config is not None:
        tree.check_config(config)
    if source is not None:
        boot_tree, config = tree.custom_tree(source, config, info, jobs=jobs, log=log)
    else:
        boot_tree, debian_config = tree.debian_tree(info, jobs=jobs, log=log)
        if config is None:
            config = debian_config
            tree.check_config(config)
    build = boot_tree.build
    with tree.locked(os.path.dirname(build)):
        prepared = boot_tree.prepare(config)
        link = os.path.join(build, "vmlinux")
        for rel in _FROM_VMLINUX + [f"arch/x86/boot/compressed/vmlinux.bin.{c}"
                                    for c in _COMPRESSED_PAYLOADS]:
            p = os.path.join(build, rel)
            if os.path.lexists(p):
                os.unlink(p)
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(vmlinux, link)
        try:
            if log:
                log(f"make -o vmlinux bzImage in {build}")
            boot_tree.make("bzImage")
            built = os.path.join(build, "arch/x86/boot/bzImage")
            size = os.path.getsize(built)     # `out` may still be staged (OutputSet)
            _copy_out(built, out)
            if relocs_out:
                _copy_out(os.path.join(build, "arch/x86/boot/compressed/vmlinux.relocs"),
                          relocs_out)
        finally:
            # The cached tree must not keep pointing at a file that may go away.
            os.unlink(link)
    return {"bzimage": os.fspath(out), "release": info.release,
            "source": boot_tree.src, "config": config, "tree": build,
            "prepared_now": prepared, "size": size}


def _copy_out(src, dest):
    with open(src, "rb") as f, atomic_output(dest) as g:
        shutil.copyfileobj(f, g, 1 << 20)
