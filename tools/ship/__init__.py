"""Shipping a rewritten kernel: the bzImage the kernel's own build makes from it
(``bzimage``), and the kbuild hook for kernels that strip their relocations.

- ``banner``: what the vmlinux says about its build (release, Debian version,
  UTS version) so the boot image is made from the matching source, reproducibly.
- ``tree``: a kernel tree prepared for the x86 boot image only (host tools,
  ``arch/x86/tools/relocs``, the compressed/ and EFI stub objects), cached per
  kernel release.
- ``bzimage``: run the kernel's own ``make -o vmlinux bzImage`` on a given vmlinux.
"""
