"""Kernel-only parts of relayout (the KernelTarget of relayout/target.py): the
kernel tables that follow a layout, kallsyms grown for ``.cold`` parts."""
