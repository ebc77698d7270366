"""linepack: post-link code layout for Linux kernels and x86-64 ELF binaries.

Installed as the import package ``linepack`` (see setup.cfg: ``package_dir``).
Data flow: profile -> relayout -> verify -> evaluate; ``image`` and ``kernel``
hold the ELF/x86 model and the per-table kernel metadata they all share.
"""

__version__ = "0.1.0"
