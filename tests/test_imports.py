"""The packages' imports form no circle: the library and its adapters (megatron_patches,
models).

Every module of ``PACKAGES`` is parsed (not imported: optional dependencies need not be
installed) and every import of a module of these packages is an edge, wherever it stands: at
module level and inside functions alike, so an import moved into a function to dodge a circle
still counts. ``from package import name`` points at ``package.name`` when that is a module, else
at ``package`` (its ``__init__``). The parents a dotted import initialises on the way are not
edges (Python imports them first, whatever the order). Imports of other packages (fla, triton,
torch) are not edges.
"""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ["sp_attention", "megatron_patches", "models"]   # the library and its adapters


def _modules(packages: list[str], root: str) -> dict[str, str]:
    """Module name -> file path of every ``.py`` file under each package."""
    found = {}
    for pkg in packages:
        base = os.path.join(root, *pkg.split("."))
        for folder, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                found[name] = os.path.join(folder, f)
    return found


def _imported(name: str, path: str, known: dict[str, str]) -> set[str]:
    """Modules of ``known`` that module ``name`` (file ``path``) imports, anywhere in it."""
    is_pkg = os.path.basename(path) == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known and "." in t:     # `import a.b.attr`: the module a.b
                t = t.rpartition(".")[0]
            if t in known and t != name:
                out.add(t)
    return out


def import_graph(packages: list[str], root: str = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (see the module docstring)."""
    known = _modules(packages, root)
    return {name: _imported(name, path, known) for name, path in known.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as ``[a, b, ..., a]``, or ``[]`` when the graph is a DAG."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return []


def test_no_import_circles():
    graph = import_graph(PACKAGES)
    assert len(graph) > 10, f"found only {sorted(graph)}: wrong root?"
    cycle = find_cycle(graph)
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a circle closed by an import inside a function is found."""
    pkg = tmp_path / "pkg_x"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .a import f\n")
    (pkg / "sub" / "a.py").write_text("from ..b import g\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .sub import a\n    import torch\n")
    graph = import_graph(["pkg_x"], str(tmp_path))
    assert graph == {"pkg_x": set(), "pkg_x.b": {"pkg_x.sub.a"},
                     "pkg_x.sub": {"pkg_x.sub.a"}, "pkg_x.sub.a": {"pkg_x.b"}}
    assert find_cycle(graph) == ["pkg_x.b", "pkg_x.sub.a", "pkg_x.b"]
    del graph["pkg_x.b"]
    assert find_cycle(graph) == []
