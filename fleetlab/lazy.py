"""Names a package exports lazily (PEP 562): each is imported the first time it is asked for, so
importing the package stays cheap (no Paddle until a name that needs it is used)."""

from __future__ import annotations

import importlib
import sys


def lazy_getattr(module_name: str, table: dict[str, str]):
    """A module ``__getattr__`` for ``module_name``: ``name`` in ``table`` is imported from the module
    ``table[name]`` when first asked for, then kept in the package's namespace."""
    namespace = sys.modules[module_name].__dict__

    def __getattr__(name: str):
        if name not in table:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(table[name]), name)
        return value

    return __getattr__
