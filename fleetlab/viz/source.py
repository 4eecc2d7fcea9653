"""Show the engine's own code in a notebook, read from the package at run time (never pasted).

    viz.show_source(fleetlab.engine.scheduler.Scheduler.schedule)

renders the function as it is in the installed package, with its file and line numbers, so a
figure of what the scheduler did can sit beside the code that did it, and both stay true when
the code changes. ``lines=`` keeps part of a long function (its own line numbers, as printed).
"""

from __future__ import annotations

import html
import inspect
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class Source:
    """A piece of fleetlab's source: where it lives and its lines (numbered as in the file)."""

    name: str
    path: str
    first_line: int
    lines: list[str]

    def __str__(self) -> str:
        width = len(str(self.first_line + len(self.lines)))
        body = "\n".join(f"{self.first_line + i:>{width}}  {line}" for i, line in enumerate(self.lines))
        return f"# {self.name}  ({self.path}:{self.first_line})\n{body}"

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight  # Jupyter brings pygments; plain text without it
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:
            return f"<pre>{html.escape(str(self))}</pre>"
        formatter = HtmlFormatter(linenos="inline", linenostart=self.first_line, noclasses=True, nobackground=True)
        code = highlight("\n".join(self.lines), PythonLexer(), formatter)
        return (f"<div style='font-size:12px'><b><code>{html.escape(self.name)}</code></b> "
                f"<span style='color:#777'>{html.escape(self.path)}:{self.first_line}</span>{code}</div>")

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))


def show_source(obj, lines: tuple[int, int] | None = None) -> Source:
    """The source of ``obj`` (a function, method or class of the package) for display.

    ``lines``: ``(first, last)`` line numbers of the file (inclusive) to keep; default all.
    """
    obj = inspect.unwrap(getattr(obj, "__func__", obj))
    source_lines, first = inspect.getsourcelines(obj)
    text = [line.rstrip("\n") for line in source_lines]
    if lines is not None:
        lo, hi = lines
        if not first <= lo <= hi < first + len(text):
            raise ValueError(f"lines={lines} is outside {obj.__qualname__} ({first}..{first + len(text) - 1})")
        text, first = text[lo - first: hi - first + 1], lo
    path = Path(inspect.getsourcefile(obj)).resolve()
    package = next((p for p in path.parents if p.name == "fleetlab"), path.parent)
    return Source(obj.__qualname__, str(path.relative_to(package.parent)), first, text)
