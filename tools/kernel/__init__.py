"""Kernel tables, one module each, behind the ``KernelTable`` interface (base.py).

Adding a table = one module with a ``KernelTable`` subclass + one line here.

The table modules are imported at the first use of a name of this package
(``TABLES``, ``REFERENCE_TABLES``, ``table_by_name`` or a table class), not with
the package: relayout of an executable reads ``kernel.base`` and
``kernel.jump_table`` only, and importing every table there was part of each
command's start.
"""

import importlib

# each table class and the module that defines it
_CLASSES = {
    "Alternatives": "alternatives", "BugTable": "bug_table", "ExTable": "ex_table",
    "JumpTable": "jump_table", "Kallsyms": "kallsyms", "Ksymtab": "ksymtab",
    "KsymtabGpl": "ksymtab", "McountLoc": "mcount", "OrcTable": "orc",
    "ParaInstructions": "paravirt", "ConInitcalls": "prel32_lists", "Initcalls": "prel32_lists",
    "PciFixups": "prel32_lists", "RuntimeConsts": "prel32_lists", "CallSites": "sites",
    "IbtEndbrSeal": "sites", "RetpolineSites": "sites", "ReturnSites": "sites",
    "SmpLocks": "sites", "StaticCallSites": "static_calls",
}

_TABLE_ORDER = ["JumpTable", "StaticCallSites", "Alternatives", "ParaInstructions",
                "RetpolineSites", "ReturnSites", "SmpLocks", "CallSites", "IbtEndbrSeal",
                "ExTable", "BugTable", "OrcTable", "McountLoc", "Kallsyms", "Ksymtab",
                "KsymtabGpl"]


def _class(name):
    cls = getattr(importlib.import_module(f".{_CLASSES[name]}", __name__), name)
    globals()[name] = cls
    return cls


def _lists():
    tables = [_class(n) for n in _TABLE_ORDER]
    # Tables whose PC-relative fields make up a kernel's data-to-code references
    # when it has no link relocations (image/references.py): every table above
    # that declares relative fields, and the plain lists no pass rewrites itself.
    refs = [t for t in tables if t.relative_fields or t.relative64_fields] + \
        [_class(n) for n in ("PciFixups", "Initcalls", "ConInitcalls", "RuntimeConsts")]
    globals().update(TABLES=tables, REFERENCE_TABLES=refs)


def __getattr__(name):
    if name in _CLASSES:
        return _class(name)
    if name in ("TABLES", "REFERENCE_TABLES"):
        _lists()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def table_by_name(name):
    for cls in __getattr__("TABLES"):
        if cls.name == name:
            return cls
    return None
