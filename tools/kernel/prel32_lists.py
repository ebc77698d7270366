"""PC-relative tables no relayout pass rewrites on its own, listed only for the
references of a kernel without link relocations (linepack.image.references):

- ``.pci_fixup`` (``__start_pci_fixups_early`` .. ``__end_pci_fixups_suspend_late``):
  ``struct pci_fixup {u16 vendor, device; u32 class; unsigned int class_shift;
  int hook_offset}`` with CONFIG_HAVE_ARCH_PREL32_RELOCATIONS (x86-64 since 4.19,
  unchanged through 7.x, include/linux/pci.h); the hook is s32 relative.
- initcalls (``__initcall_start`` .. ``__initcall_end``, ``__con_initcall_start``
  .. ``__con_initcall_end``): ``initcall_entry_t`` is an s32 offset to the
  function (include/linux/init.h, same condition).

Their fields are plain: the link's generic relocation pass keeps them right,
so they have no parse/check of their own in verify (not in ``TABLES``).
"""

import numpy as np

from .base import KernelTable


class PciFixups(KernelTable):
    name = ".pci_fixup"
    start_symbol = "__start_pci_fixups_early"
    stop_symbol = "__end_pci_fixups_suspend_late"
    dtype = np.dtype([("vendor", "<u2"), ("device", "<u2"), ("class", "<u4"),
                      ("class_shift", "<u4"), ("hook", "<i4")])
    relative_fields = ("hook",)


class Initcalls(KernelTable):
    name = "initcalls"
    start_symbol = "__initcall_start"
    stop_symbol = "__initcall_end"
    dtype = np.dtype("<i4")
    relative_fields = (None,)


class ConInitcalls(Initcalls):
    name = "con_initcalls"
    start_symbol = "__con_initcall_start"
    stop_symbol = "__con_initcall_end"
