"""Architecture rules, checked on the source (nothing is imported): the
package's modules import each other without cycles, files stay small, and
Monitor keeps few attributes, all set in ``__init__``."""

from __future__ import annotations

import ast
from pathlib import Path

PKG_DIR = Path(__file__).resolve().parents[1] / "hookcap"
MAX_LINES = 600
MAX_MONITOR_LINES = 450
MAX_MONITOR_ATTRS = 25


def package_modules(pkg_dir: Path, pkg_name: str) -> dict[str, Path]:
    """Dotted name -> source file of every module under ``pkg_dir`` (a
    package is its ``__init__.py``)."""
    modules = {}
    for f in sorted(pkg_dir.rglob("*.py")):
        parts = list(f.relative_to(pkg_dir).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([pkg_name, *parts])] = f
    return modules


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds when it runs (top level, also under if/try/with)."""
    names, todo = set(), list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).partition(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        else:
            todo += [c for c in ast.iter_child_nodes(node) if isinstance(c, (ast.stmt, ast.excepthandler))]
    return names


def import_graph(pkg_dir: Path, pkg_name: str) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of its first import} over every
    explicit import in the package, at any depth (in functions, under
    ``if``/``try``), relative or absolute. Importing ``a.b`` also runs
    ``a/__init__.py``, but that implicit edge is left out: a package's
    ``__init__`` may import its children, and only a child's explicit import
    of its package back is a cycle."""
    modules = package_modules(pkg_dir, pkg_name)
    trees = {m: ast.parse(f.read_text(encoding="utf-8"), filename=str(f)) for m, f in modules.items()}

    def targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names if a.name in modules]
        if node.level:
            base = (module if modules[module].name == "__init__.py" else module.rpartition(".")[0]).split(".")
            if node.level > len(base):
                return []
            base = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module
        if base not in modules:
            return []
        # `from X import name`: the submodule X.name if there is one, else X,
        # except a package X that does not bind name: name is then a
        # submodule without source (the compiled extension), which imports
        # nothing of ours.
        found = []
        for a in node.names:
            if f"{base}.{a.name}" in modules:
                found.append(f"{base}.{a.name}")
            elif (a.name == "*" or modules[base].name != "__init__.py"
                  or a.name in _bound_names(trees[base])):
                found.append(base)
        return found

    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in targets(node, module):
                    graph[module].setdefault(target, node.lineno)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` for each strongly connected component of
    more than one module, and for each module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:
        start = min(comp)
        if len(comp) == 1 and start not in graph[start]:
            continue
        # Shortest way back to `start` inside the component.
        members, prev, frontier = set(comp), {}, [start]
        while start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path, v = [start], prev[start]
        while v != start:
            path.append(v)
            v = prev[v]
        cycles.append([start, *reversed(path[1:]), start])
    return sorted(cycles)


def _spell(cycle: list[str], graph: dict[str, dict[str, int]], files: dict[str, Path]) -> str:
    hops = [f"{a} imports {b} ({files[a].relative_to(PKG_DIR.parent)}:{graph[a][b]})"
            for a, b in zip(cycle, cycle[1:])]
    return "  " + " -> ".join(cycle) + "\n" + "\n".join("    " + h for h in hops)


def test_no_import_cycle():
    graph = import_graph(PKG_DIR, "hookcap")
    assert graph.get("hookcap"), "the import walker found no import in hookcap/__init__.py"
    cycles = import_cycles(graph)
    files = package_modules(PKG_DIR, "hookcap")
    assert not cycles, "import cycles in hookcap (break them by moving the shared part down a layer):\n" + \
        "\n".join(_spell(c, graph, files) for c in cycles)


def test_cycle_finder_finds_planted_cycles(tmp_path):
    files = {
        "__init__.py": "from .c import C\n",
        "a.py": "from . import b\n",
        "b.py": "import os\n\ndef f():\n    from .a import x\n    return x\n",  # in a function
        "c.py": "import pkg\nC = 1\n",  # back to the package's __init__
        "d.py": "try:\n    from pkg.e import g\nexcept ImportError:\n    pass\n",
        "e.py": "def g():\n    from .e import g\n",  # itself
        "f.py": "from pkg import C\n",  # a name the package's __init__ binds
        "sub/__init__.py": "from .leaf import L\n",
        # helper and _ext (no source: like a compiled extension) are
        # submodules, not names of sub/__init__.
        "sub/leaf.py": "from . import helper, _ext\nfrom .. import a\nL = 1\n",
        "sub/helper.py": "",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path / "pkg", "pkg")
    assert graph["pkg.sub.leaf"] == {"pkg.sub.helper": 1, "pkg.a": 2}
    assert graph["pkg.d"] == {"pkg.e": 2}
    assert graph["pkg.f"] == {"pkg": 1}
    assert import_cycles(graph) == [["pkg", "pkg.c", "pkg"], ["pkg.a", "pkg.b", "pkg.a"], ["pkg.e", "pkg.e"]]


def test_file_sizes():
    too_long = []
    for f in sorted(PKG_DIR.rglob("*.py")):
        n = len(f.read_text(encoding="utf-8").splitlines())
        limit = MAX_MONITOR_LINES if f == PKG_DIR / "monitor.py" else MAX_LINES
        if n > limit:
            too_long.append(f"  {f.relative_to(PKG_DIR.parent)}: {n} lines (limit {limit})")
    assert not too_long, "files too long (split them by concept):\n" + "\n".join(too_long)


def _stored_self_attributes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """X of every ``self.X`` that ``fn`` stores to: plain, annotated,
    augmented and unpacking assignments, ``for``/``with`` targets."""
    args = fn.args.posonlyargs + fn.args.args
    if not args or any(isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod")
                       for d in fn.decorator_list):
        return set()
    me = args[0].arg
    return {n.attr for n in ast.walk(fn)
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name) and n.value.id == me}


def test_monitor_attributes():
    tree = ast.parse((PKG_DIR / "monitor.py").read_text(encoding="utf-8"))
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Monitor"), None)
    assert cls is not None, "hookcap/monitor.py defines no class Monitor"
    setters: dict[str, set[str]] = {}  # attribute -> methods storing it
    for fn in cls.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for attr in _stored_self_attributes(fn):
                setters.setdefault(attr, set()).add(fn.name)
    problems = []
    if len(setters) > MAX_MONITOR_ATTRS:
        problems.append(f"Monitor has {len(setters)} distinct self attributes (limit {MAX_MONITOR_ATTRS}): "
                        + ", ".join(sorted(setters)))
    late = {a: sorted(m) for a, m in setters.items() if "__init__" not in m}
    if late:
        problems.append("Monitor attributes not set in __init__:\n" + "\n".join(
            f"  self.{a} (set in {', '.join(m)})" for a, m in sorted(late.items())))
    assert not problems, "\n".join(problems)
