"""PC-relative tables no relayout pass rewrites on its own, listed only for the
references of a kernel without link relocations (linepack.image.references):

- ``.pci_fixup`` (``__start_pci_fixups_early`` .. ``__end_pci_fixups_suspend_late``):
  ``struct pci_fixup {u16 vendor, device; u32 class; unsigned int class_shift;
  int hook_offset}`` with CONFIG_HAVE_ARCH_PREL32_RELOCATIONS (x86-64 since 4.19,
  unchanged through 7.x, include/linux/pci.h); the hook is s32 relative.
- initcalls (``__initcall_start`` .. ``__initcall_end``, ``__con_initcall_start``
  .. ``__con_initcall_end``): ``initcall_entry_t`` is an s32 offset to the
  function (include/linux/init.h, same condition).

- runtime constants (6.11+, CONFIG_RUNTIME_CONST: ``runtime_ptr_<name>``,
  ``runtime_shift_<name>`` sections, and from 7.x ``runtime_mask_<name>``
  (``runtime_const_mask_32``), arch/x86/include/asm/runtime-const.h): s32 offsets
  to the immediates patched at boot. They point inside an instruction, so the
  scan for unexplained references does not see a list left out here: its sites
  keep their old addresses and the boot writes the constant into whatever code
  is there (7.3's ``runtime_mask___futex_mask``).

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


class RuntimeConsts(KernelTable):
    """Every ``runtime_ptr_*`` / ``runtime_shift_*`` / ``runtime_mask_*`` section:
    s32 site lists."""
    name = "runtime_const"
    dtype = np.dtype("<i4")
    relative_fields = (None,)
    prefixes = ("runtime_ptr_", "runtime_shift_", "runtime_mask_")

    def _sections(self, ctx):
        return [s for s in ctx.image.sections if s.is_alloc and s.size and s.addr and
                s.name.startswith(self.prefixes)]

    def ranges(self, ctx):
        return [(s.addr, s.size // 4, 4) for s in self._sections(ctx)]

    def references(self, ctx):
        out = [np.zeros(0, np.uint64)]
        for s in self._sections(ctx):
            raw = ctx.image.section_bytes(s)[:s.size // 4 * 4].view("<i4")
            addr = np.uint64(s.addr) + np.arange(len(raw), dtype=np.uint64) * np.uint64(4)
            out.append(addr[raw != 0])
        a = np.concatenate(out)
        return a, np.full(len(a), 4, np.uint8)
