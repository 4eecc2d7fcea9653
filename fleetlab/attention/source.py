"""Read fleetlab's kernels as text, on any machine.

The Triton kernels import Triton, which CPU installs lack; notebooks still want to show
them. ``kernel_source`` reads a function's source straight from the module file.
"""

from __future__ import annotations

import ast
import importlib.util


def kernel_source(name: str, module: str = "fleetlab.attention.triton_kernels") -> str:
    """The source text of function ``name`` in ``module`` (decorators included), without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"module {module!r} not found")
    with open(spec.origin, encoding="utf-8") as f:
        text = f.read()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            return "\n".join(text.splitlines()[start - 1: node.end_lineno])
    raise ValueError(f"no function {name!r} in {module}")
