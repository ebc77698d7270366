"""KASLR seen from inside a booted guest: the workload's /init prints the
/proc/kallsyms lines it was asked for (env ``lp_kallsyms``), and the offset is
where ``_text`` landed minus where the image was linked.

The link address comes from the bzImage itself: its setup header's
``pref_address`` is the physical load address the kernel was linked for
(LOAD_PHYSICAL_ADDR), and x86-64 maps it at ``__START_KERNEL_map + pref_address``.
"""

import re

from ..image.bootimage import START_KERNEL_MAP, read_setup_header

_KALLSYMS_LINE = re.compile(r"linepack-kallsyms ([0-9a-f]+) (\w) (\S+)")


def bzimage_link_text(path):
    """Virtual address ``_text`` was linked at, from a bzImage's setup header."""
    return read_setup_header(path).link_text


def kallsyms_lines(serial):
    """{name: [(address, type), ...]} of the guest's ``linepack-kallsyms`` lines."""
    out = {}
    for m in _KALLSYMS_LINE.finditer(serial):
        out.setdefault(m.group(3), []).append((int(m.group(1), 16), m.group(2)))
    return out


def kaslr_offset(serial, link_text):
    """The boot's KASLR offset (guest ``_text`` - link-time ``_text``), or None when
    the guest printed no ``_text`` line (or zeros: kallsyms hidden)."""
    got = kallsyms_lines(serial).get("_text")
    if not got or got[0][0] == 0:
        return None
    return got[0][0] - link_text


__all__ = ["START_KERNEL_MAP", "bzimage_link_text", "kallsyms_lines", "kaslr_offset"]
