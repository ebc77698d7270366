"""No import circles in the linepack package: the module graph of tools/, read statically
(ast: imports at module level and inside functions both count), has no cycle."""

import ast
import os

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")

def module_names():
    """{module name relative to the package: path}; a package is named by its folder."""
    out = {}
    for root, dirs, files in os.walk(TOOLS):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(root, f), TOOLS)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(root, f)
    return out


def imports_of(name, path, modules):
    """Modules of the package that `name` imports anywhere in its source."""
    is_package = path.endswith("__init__.py")
    package = name.split(".") if is_package else name.split(".")[:-1]
    if name == "":
        package = []
    found = set()

    def add(dotted):
        # "a.b.c" may name a module, or a name inside module "a.b": take the longest module.
        parts = dotted.split(".") if dotted else []
        while parts and ".".join(parts) not in modules:
            parts.pop()
        if parts:
            found.add(".".join(parts))

    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "linepack" or a.name.startswith("linepack."):
                    add(a.name[len("linepack."):] if "." in a.name else "")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] if node.level > 1 else package
                prefix = base + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "linepack" or node.module.startswith("linepack.")):
                prefix = node.module.split(".")[1:]
            else:
                continue
            for a in node.names:
                full = ".".join(prefix + [a.name])
                if full in modules:
                    found.add(full)          # "from .x import y" where y is a module
                else:
                    add(".".join(prefix))
    found |= lazy_imports(path, package, modules)
    found.discard(name)
    found.discard("")                        # the package's __init__ holds only the version
    return found


def lazy_imports(path, package, modules):
    """Modules a file imports by name at run time (importlib.import_module of a
    relative name, e.g. tools/kernel/__init__.py's tables, loaded at first use): the
    string values of its module-level dicts that name a module of its package."""
    tree = ast.parse(open(path).read(), path)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and
             isinstance(n.func, ast.Attribute) and n.func.attr == "import_module"]
    if not calls:
        return set()
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for v in node.value.values:
                if isinstance(v, ast.Constant) and isinstance(v.value, str):
                    full = ".".join(package + [v.value])
                    if full in modules:
                        found.add(full)
    return found


def strongly_connected(graph):
    """Tarjan's algorithm; the components with more than one module (every cycle lies in one)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(tuple(sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def import_graph():
    modules = module_names()
    return {n: imports_of(n, p, modules) for n, p in modules.items()}


def test_graph_sees_known_edges():
    """The reader finds absolute, relative and function-level imports (else 'no cycle' proves nothing)."""
    g = import_graph()
    assert "image.elf" in g["relayout.driver"]
    assert "errors" in g["cli"]
    # the kernel package's tables, imported by name at first use (importlib)
    assert {"kernel.orc", "kernel.jump_table", "kernel.kallsyms"} <= g["kernel"]
    assert len(g) > 100
    assert sum(len(v) for v in g.values()) > 300


def test_no_import_cycles():
    found = strongly_connected(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_an_executables_relayout_imports_no_kernel_table(tmp_path):
    """The kernel package imports its table modules at the first use of a table name,
    so relayout of an executable (it reads kernel.base and kernel.jump_table only)
    starts without the other fourteen; asked for, TABLES has them all, in order."""
    import subprocess
    import sys

    import helpers
    exe = helpers.build_c("split_user.c", tmp_path / "su", "-Wl,--emit-relocs", "-no-pie")
    code = ("import sys; from linepack.cli import main; "
            f"rc = main(['relayout', {str(exe)!r}, '--strategy', 'align-all 64', '-q', "
            f"'-o', {str(tmp_path / 'out')!r}]); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('linepack.kernel')))); "
            "import linepack.kernel as k; print(' '.join(t.__name__ for t in k.TABLES)); "
            "sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    loaded, tables = p.stdout.splitlines()[-2:]
    assert loaded.split() == ["linepack.kernel", "linepack.kernel.base",
                              "linepack.kernel.jump_table"]
    assert tables.split() == ["JumpTable", "StaticCallSites", "Alternatives", "ParaInstructions",
                              "RetpolineSites", "ReturnSites", "SmpLocks", "CallSites",
                              "IbtEndbrSeal", "ExTable", "BugTable", "OrcTable", "McountLoc",
                              "Kallsyms", "Ksymtab", "KsymtabGpl"]
