"""The import graph: imports go only downward, and nothing imports itself round a circle.

Floors, top to bottom: ``pipeline`` (the driver) → ``cluster`` (executors) → ``stages`` → lib's
``runtime`` (a stage process: entry, threads, profiling) → ``rl`` → ``files`` and ``engine`` →
``model`` → ``distributed`` → lib's base modules (``errors``, ``dtypes``, ``options``). A module
may import any module on its own floor or below; every import counts, those inside functions too
(an import deferred to a call is still a dependency).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = {"lib": "llamarl.lib", "stages": "llamarl.stages", "pipeline": "llamarl.pipeline", "cluster": "llamarl.cluster"}
FLOORS = [  # highest first; a module's floor is its longest matching prefix
    ("llamarl.pipeline",), ("llamarl.cluster",), ("llamarl.stages",), ("llamarl.lib.runtime",), ("llamarl.lib.rl",),
    ("llamarl.lib.files", "llamarl.lib.engine"), ("llamarl.lib.model",), ("llamarl.lib.distributed",),
    ("llamarl.lib.errors", "llamarl.lib.dtypes", "llamarl.lib.options", "llamarl.lib.kernel_switch"),
]


def _modules() -> dict[str, str]:
    """Every module of the product: its dotted name → its file."""
    found = {}
    for folder, package in PACKAGES.items():
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), os.path.join(ROOT, folder))[:-3].replace(os.sep, ".")
                    name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
                    found[name] = os.path.join(d, f)
    return found


MODULES = _modules()


def _imports(name: str, path: str) -> set[str]:
    """The product modules ``name`` imports, anywhere in it."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name and not _empty(t):
                found.add(t)
    return found


def _empty(name: str) -> bool:
    """A package's ``__init__`` with nothing in it (imported on the way to its modules)."""
    if not MODULES[name].endswith("__init__.py"):
        return False
    body = ast.parse(open(MODULES[name]).read()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)  # a docstring at most


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _floor(name: str) -> int:
    for i, prefixes in enumerate(FLOORS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return len(FLOORS) - i
    raise AssertionError(f"{name} is on no floor: add it to FLOORS")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_go_only_downward(name):
    up = sorted(t for t in GRAPH[name] if _floor(t) > _floor(name))
    assert not up, f"{name} imports {', '.join(up)}, on a higher floor"


def test_no_import_circle():
    seen, stack, on_path = set(), [], set()

    def visit(m):
        seen.add(m)
        stack.append(m)
        on_path.add(m)
        for t in sorted(GRAPH[m]):
            if t in on_path:
                circle = stack[stack.index(t):] + [t]
                raise AssertionError("import circle: " + " → ".join(circle))
            if t not in seen:
                visit(t)
        stack.pop()
        on_path.discard(m)

    for m in sorted(MODULES):
        if m not in seen:
            visit(m)


def test_lib_is_at_most_six_folders():
    folders = [d for d in os.listdir(os.path.join(ROOT, "lib")) if os.path.isdir(os.path.join(ROOT, "lib", d))
               and not d.startswith(("_", "."))]
    assert len(folders) <= 6, folders
