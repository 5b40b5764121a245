"""The library's floors (drawn in sp_attention/README.md): every module has one, a module imports
only from its own floor or below, nothing imports an old (deprecated) path, the module-level
imports form no circle, and no function imports a project module (an import moved into a
function to dodge a circle) but the few that need an optional third-party package.

Parsed, not imported (optional dependencies need not be installed)."""
from __future__ import annotations

import ast
import functools
import os

from tests.test_imports import ROOT, _modules, find_cycle

# Floor of each module, by the longest matching name (a package's entry covers its modules).
FLOORS = {
    "sp_attention.caches": 0,          # base: no project import
    "sp_attention.precision": 0,
    "sp_attention.triton_launch": 0,   # every Triton launch (imports caches only)
    "sp_attention._deprecated": 0,
    "sp_attention.planning": 1,        # pure planning: layouts, packing, plans, names
    "sp_attention.context": 2,         # groups: the context, collectives, shared checks
    "sp_attention.comm": 2,
    "sp_attention.peer_copy": 2,
    "sp_attention.sharding": 2,
    "sp_attention.validation": 2,
    "sp_attention.tuning": 2,
    "sp_attention.call_check": 2,
    "sp_attention.tokens": 2,
    "sp_attention.cost": 3,            # the cost model and auto's choice
    "sp_attention.linear": 4,          # the ops
    "sp_attention.softmax": 4,
    "sp_attention": 5,                 # the public API and the tools that run the ops
    "sp_attention.demo": 5,
    "sp_attention.calibrate": 5,
    "sp_attention.testing": 5,
    "megatron_patches": 6,             # the adapters: Megatron-Core, HF transformers
    "models": 6,
    "sp_train": 7,                     # the trainer (train.py's pieces)
}
FLOOR_NAMES = {0: "base", 1: "planning", 2: "groups", 3: "cost", 4: "ops", 5: "top",
               6: "adapters", 7: "trainer"}
PACKAGES = ("sp_attention", "megatron_patches", "models", "sp_train")
# Old paths of moved modules, kept for one release: they may import anything, nothing may
# import them.
DEPRECATED = {"sp_attention.layout", "sp_attention.packing", "sp_attention.machine",
              "sp_attention.auto", "sp_attention.linear.packed_plan",
              "sp_attention.softmax.plan", "sp_attention.softmax.packed_plan",
              "sp_attention.memory", "sp_attention.reduce"}


def deprecated(name: str) -> bool:
    return name in DEPRECATED or name.startswith("megatron_patches.trainer")
# Project modules a function may import: each needs an optional third-party package at
# import time (the `gpu` extra), so the library imports without it.
LAZY_OK = {
    "sp_attention.linear.kernels": "Triton kernels: importing them needs triton",
    "sp_attention.linear.dqk_kernel": "a Triton kernel: importing it needs triton",
    "sp_attention.linear.allgather_kernel": "Triton kernels: importing them needs triton",
    "sp_attention.linear.gate_kernel": "a Triton kernel: importing it needs triton",
    "sp_attention.softmax.merge_kernel": "a Triton kernel: importing it needs triton",
}
# Entry points that check the installed packages before importing the rest (their functions
# import the project lazily on purpose, not to dodge a circle).
LAUNCHERS = {"megatron_patches.pretrain_gpt": "checks megatron-core's version before any import"}
OPTIONAL = ("triton", "fla", "flash_attn", "megatron", "transformers", "liger_kernel")


def floor_of(module: str) -> int:
    best = max((name for name in FLOORS if module == name or module.startswith(name + ".")),
               key=len, default=None)
    if best is None:
        raise KeyError(module)
    return FLOORS[best]


def imports(path: str, name: str, known: dict) -> tuple[set, set, set]:
    """(project modules imported at module level, project modules imported inside functions,
    top-level third-party packages imported at module level) of module ``name``."""
    is_pkg = os.path.basename(path) == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    top, lazy, third = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known and "." in t:
                t = t.rpartition(".")[0]
            if t in known:
                if t != name:
                    (lazy if id(node) in inner else top).add(t)
            elif id(node) not in inner:
                third.add(t.split(".")[0])
    return top, lazy, third


@functools.lru_cache(maxsize=4)
def _graph(root: str = ROOT, packages: tuple = PACKAGES):
    known = _modules(list(packages), root)
    return {n: imports(p, n, known) for n, p in known.items()}


def test_every_module_has_a_floor():
    missing = []
    for name in _graph():
        if not deprecated(name):
            try:
                floor_of(name)
            except KeyError:
                missing.append(name)
    assert not missing, f"modules without a floor (add them to FLOORS): {missing}"


def test_no_import_goes_up_a_floor():
    up = [f"{a} ({FLOOR_NAMES[floor_of(a)]}) imports {b} ({FLOOR_NAMES[floor_of(b)]})"
          for a, (top, lazy, _) in _graph().items() if not deprecated(a)
          for b in top | lazy if not deprecated(b) and floor_of(b) > floor_of(a)]
    assert not up, "imports up a floor:\n" + "\n".join(sorted(up))


def test_nothing_imports_an_old_path():
    old = [f"{a} imports {b}" for a, (top, lazy, _) in _graph().items() if not deprecated(a)
           for b in top | lazy if deprecated(b)]
    assert not old, "old paths in use:\n" + "\n".join(old)


def test_module_level_imports_form_no_circle():
    graph = {n: top for n, (top, _, _) in _graph().items()}
    assert len(graph) > 40
    cycle = find_cycle(graph)
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_functions_import_only_optional_kernels():
    """A function may import a project module only where that module needs an optional
    package at import time (the gpu / train extras), so what imports it loads without it."""
    graph = _graph()
    lazy = [f"{a} imports {b} inside a function" for a, (_, inner, _) in graph.items()
            if a not in LAUNCHERS for b in inner if not graph[b][2] & set(OPTIONAL)]
    assert not lazy, "move these to module level:\n" + "\n".join(sorted(lazy))
    for name, why in LAZY_OK.items():     # the kernels stay behind their optional package
        assert graph[name][2] & set(OPTIONAL), f"{name} needs no optional package ({why})"


def test_the_walk_tells_module_level_from_function_level(tmp_path):
    pkg = tmp_path / "sp_x"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("import torch\nfrom ..b import g\n"
                                      "def f():\n    from . import c\n    import triton\n")
    (pkg / "sub" / "c.py").write_text("")
    (pkg / "b.py").write_text("class K:\n    from .sub import c\n")
    g = _graph(str(tmp_path), ("sp_x",))
    assert g["sp_x.sub.a"] == ({"sp_x.b"}, {"sp_x.sub.c"}, {"torch"})
    assert g["sp_x.b"] == ({"sp_x.sub.c"}, set(), set())
    assert g["sp_x"][0] == {"sp_x.sub.a"}
