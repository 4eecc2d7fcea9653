"""fleetlab's own source, read at run time, to show beside a picture of what it does.

:func:`source_excerpt` reads a function (or a stretch of it) straight from its module's file,
without importing the module, so a CPU machine can show a Triton kernel too;
:func:`show_source` does the same for a function or method you hold
(``viz.show_source(fleetlab.Scheduler.schedule)``). An excerpt knows its file and line
numbers: printed (or shown in a notebook, highlighted), it is numbered as in the file, so a
reader can open the file at that line and read on. Nothing is ever pasted: when the code
changes, what the notebook shows changes with it.
"""

from __future__ import annotations

import ast
import html
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class SourceExcerpt:
    """Lines ``first_line ..`` of ``path`` (a path from the package's parent folder, e.g.
    ``fleetlab/attention/naive.py``), from function ``name``."""

    path: str
    name: str
    first_line: int
    lines: list[str]

    @property
    def last_line(self) -> int:
        return self.first_line + len(self.lines) - 1

    def __str__(self) -> str:
        width = len(str(self.last_line))
        head = f"# {self.path}, lines {self.first_line}-{self.last_line} (in {self.name})"
        return "\n".join([head, *(f"{self.first_line + i:>{width}}  {line}" for i, line in enumerate(self.lines))])

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight  # Jupyter brings pygments: plain text without it
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:
            return f"<pre>{html.escape(str(self))}</pre>"
        formatter = HtmlFormatter(linenos="inline", linenostart=self.first_line, noclasses=True, nobackground=True)
        code = highlight("\n".join(self.lines), PythonLexer(), formatter)
        return (f"<div style='font-size:12px'><code>{html.escape(self.path)}</code>, lines {self.first_line}-"
                f"{self.last_line} (in <code>{html.escape(self.name)}</code>){code}</div>")

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))


def source_excerpt(name: str, module: str, *, start: str | None = None, stop: str | None = None,
                   body_only: bool = False) -> SourceExcerpt:
    """Function ``name`` of ``module`` (a dotted name), as in its file; ``"Class.method"`` for a
    method.

    start / stop: cut the excerpt from the first line containing ``start`` to the first line
    after it containing ``stop`` (both included); a missing text raises ``ValueError`` (the
    code changed: the excerpt must follow). body_only: leave out the decorators, signature
    and docstring. The module is read, not imported.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"source_excerpt: module {module!r} not found")
    text = Path(spec.origin).read_text(encoding="utf-8")
    node = ast.parse(text)
    for part in name.split("."):  # a class, then its method
        node = next((n for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                 ast.ClassDef)) and n.name == part), None)
        if node is None:
            raise ValueError(f"source_excerpt: no function {name!r} in {module}")
    first = min([d.lineno for d in node.decorator_list] + [node.lineno])
    if body_only:
        body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
        first = body[0].lineno
    lines = text.splitlines()[first - 1: node.end_lineno]
    lo = _find(lines, start, 0, name) if start else 0
    hi = _find(lines, stop, lo, name) if stop else len(lines) - 1
    package_root = Path(importlib.util.find_spec(module.split(".")[0]).origin).parent.parent
    path = Path(spec.origin).resolve().relative_to(package_root.resolve()).as_posix()
    return SourceExcerpt(path, name, first + lo, lines[lo: hi + 1])


def _find(lines: list[str], text: str, after: int, name: str) -> int:
    for i in range(after, len(lines)):
        if text in lines[i]:
            return i
    raise ValueError(f"source_excerpt: {text!r} not found in {name} (the code changed; update the excerpt)")


def show_source(obj, *, start: str | None = None, stop: str | None = None, body_only: bool = False) -> SourceExcerpt:
    """The source of a function, method or class of the package you hold, as :func:`source_excerpt`
    reads it (``start`` / ``stop`` / ``body_only`` as there)."""
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    return source_excerpt(obj.__qualname__.replace(".<locals>", ""), obj.__module__, start=start, stop=stop,
                          body_only=body_only)
