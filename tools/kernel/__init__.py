"""Kernel tables, one module each, behind the ``KernelTable`` interface (base.py).

Adding a table = one module with a ``KernelTable`` subclass + one line here.
"""

from .alternatives import Alternatives
from .bug_table import BugTable
from .ex_table import ExTable
from .jump_table import JumpTable
from .kallsyms import Kallsyms
from .ksymtab import Ksymtab, KsymtabGpl
from .mcount import McountLoc
from .orc import OrcTable
from .paravirt import ParaInstructions
from .prel32_lists import ConInitcalls, Initcalls, PciFixups, RuntimeConsts
from .sites import CallSites, IbtEndbrSeal, RetpolineSites, ReturnSites, SmpLocks
from .static_calls import StaticCallSites

TABLES = [JumpTable, StaticCallSites, Alternatives, ParaInstructions, RetpolineSites,
          ReturnSites, SmpLocks, CallSites, IbtEndbrSeal, ExTable, BugTable, OrcTable, McountLoc,
          Kallsyms, Ksymtab, KsymtabGpl]

# Tables whose PC-relative fields make up a kernel's data-to-code references
# when it has no link relocations (image/references.py): every table above
# that declares relative fields, and the plain lists no pass rewrites itself.
REFERENCE_TABLES = [t for t in TABLES if t.relative_fields or t.relative64_fields] + \
    [PciFixups, Initcalls, ConInitcalls, RuntimeConsts]


def table_by_name(name):
    for cls in TABLES:
        if cls.name == name:
            return cls
    return None
