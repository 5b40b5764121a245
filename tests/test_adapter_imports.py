"""The adapters' import graph has no circle: every ``import`` in megatron_patches/ and models/
(module level or inside a function) is read from the source, and the graph of our own modules
must be acyclic. Also: the option table and train.py's argument checks import no Megatron."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megatron_patches", "models", "sp_attention")


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path: str, name: str) -> set:
    """Our modules ``path`` imports (absolute and relative, anywhere in the file)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[:len(parts) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out |= {t for t in targets if t.split(".")[0] in PACKAGES}
    return out


def _graph() -> dict:
    files = {}
    for pkg in ("megatron_patches", "models"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, pkg)):
            for n in names:
                if n.endswith(".py"):
                    path = os.path.join(dirpath, n)
                    files[_module_name(path)] = path
    graph = {}
    for name, path in files.items():
        # keep edges between our adapter modules (a name may be a module or a symbol in one)
        deps = set()
        for t in _imports(path, name):
            while t and t not in files:
                t = t.rpartition(".")[0]
            if t and t != name:
                deps.add(t)
        graph[name] = deps
    return graph


def _cycle(graph: dict):
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = "done"
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_adapter_imports_have_no_circle():
    graph = _graph()
    assert "megatron_patches.options" in graph and "models.hf.attention" in graph
    # a package __init__ importing its own submodules is not a circle of behaviour
    graph = {n: {m for m in deps if not n.startswith(m + ".") and not (
        n in ("megatron_patches", "models.hf") and m.startswith(n + "."))}
        for n, deps in graph.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cli_modules_import_no_megatron():
    code = ("import sys, megatron_patches.options, megatron_patches.args, "
            "megatron_patches.trainer.args; print(sorted(m for m in sys.modules "
            "if m.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
