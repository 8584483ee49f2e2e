"""A stage's YAML options, listed for ``llamarl stage NAME --help``: read from its config class's
source (names, defaults and the docstring under each field), so the CLI does not import the stage
(and torch) to print its help."""

from __future__ import annotations

import ast
import importlib.util
import re


def describe(module: str, cls: str, skip: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """One line per option of ``module.cls``: ``name = default: doc``; nested config classes of
    the same module are listed as ``outer.inner``."""
    path = importlib.util.find_spec(module).origin
    with open(path) as f:
        src = f.read()
    tree = ast.parse(src)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    body, lines = classes[cls].body, []
    for i, st in enumerate(body):
        if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)) or st.target.id in skip:
            continue
        name = st.target.id
        nxt = body[i + 1] if i + 1 < len(body) else None
        doc = nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
            and isinstance(nxt.value.value, str) else ""
        nested = ast.get_source_segment(src, st.annotation)
        if nested in classes and nested != cls:
            lines += describe(module, nested, prefix=f"{prefix}{name}.")
            continue
        default = ast.get_source_segment(src, st.value) if st.value is not None else "(required)"
        factory = re.fullmatch(r"field\(default_factory=(\w+)\)", default)
        if factory:
            default = {"list": "[]", "dict": "{}"}.get(factory.group(1), f"{factory.group(1)}()")
        lines.append(f"{prefix}{name} = {default}" + (f": {' '.join(doc.split())}" if doc else ""))
    return lines


def epilog(module: str, cls: str, skip: tuple[str, ...]) -> str:
    return "Options for --config (YAML):\n\n" + "\n\n".join(describe(module, cls, skip))
