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
from .sites import CallSites, IbtEndbrSeal, RetpolineSites, ReturnSites, SmpLocks
from .static_calls import StaticCallSites

TABLES = [JumpTable, StaticCallSites, Alternatives, ParaInstructions, RetpolineSites,
          ReturnSites, SmpLocks, CallSites, IbtEndbrSeal, ExTable, BugTable, OrcTable, McountLoc,
          Kallsyms, Ksymtab, KsymtabGpl]


def table_by_name(name):
    for cls in TABLES:
        if cls.name == name:
            return cls
    return None
