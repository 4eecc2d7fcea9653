"""The errors the edge raises, in one place that imports nothing of the engine: parameter
dataclasses (``SamplingParams``, ``StructuredOutputsParams``) and the checks (``fleetlab.fields``,
``fleetlab.edge``) all raise these, so importing a params dataclass loads no Paddle and no import cycle."""

from __future__ import annotations

import operator


class FieldTypeError(TypeError, ValueError):
    """A setting of the wrong type (a ``TypeError`` that is also a ``ValueError``)."""


def short(value, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages that quote what a user sent."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def type_error(where: str, name: str, value, rule: str) -> FieldTypeError:
    """The refusal of a value of the wrong kind: the field, the value as sent, its type."""
    return FieldTypeError(f"{where} {name}={short(value)} must be {rule}, not {type(value).__name__}")


def refuse(checks, error: type = ValueError, prefix: str = "") -> None:
    """Raise ``error(prefix + why)`` for the first ``(is it broken, why)`` of ``checks`` that is
    broken: a piece's checks read as one table, each condition beside what it says. ``why`` may
    be a function returning the message (a check on a hot path formats nothing until it fails)."""
    why = next((what for broken, what in checks if broken), None)
    if why:
        raise error(prefix + (why() if callable(why) else why))


class ExtensionError(RuntimeError):
    """An extension (a KV connector, a prefix cache, a step observer) raised, or returned what the
    engine cannot use. The message names the extension and its method; the extension's own
    exception, if any, is ``__cause__``. The step it happened in was rolled back (see
    ``EngineCore.step``), except for an observer's: see :class:`ObserverError`."""


class ObserverError(ExtensionError):
    """A step observer's ``on_step`` raised. The step itself was committed: ``outputs`` and
    ``runner_output`` are what it produced (``LLM.step`` returns them with its next call)."""

    def __init__(self, message: str, outputs=(), runner_output=None):
        super().__init__(message)
        self.outputs, self.runner_output = list(outputs), runner_output


def extension_name(kind: str, extension) -> str:
    """``KV connector 'offload' (OffloadConnector)``: how an error names an extension."""
    name = getattr(extension, "name", "")
    return f"{kind} {name!r} ({type(extension).__name__})" if name else f"{kind} {type(extension).__name__}"


def call_extension(kind: str, extension, method: str, *args, **kwargs):
    """``extension.method(*args, **kwargs)``; an ``Exception`` it raises comes out as
    :class:`ExtensionError` naming it and the method (a ``KeyboardInterrupt`` passes through as is)."""
    try:
        return getattr(extension, method)(*args, **kwargs)
    except ExtensionError:
        raise
    except Exception as exc:
        raise ExtensionError(f"{extension_name(kind, extension)}.{method} raised "
                             f"{type(exc).__name__}: {exc}") from exc


def bad_return(kind: str, extension, method: str, value, rule: str) -> ExtensionError:
    """The refusal of what an extension's method returned: it, the method, the value, the rule."""
    return ExtensionError(f"{extension_name(kind, extension)}.{method} returned {short(value)} "
                          f"({type(value).__name__}); {rule}")


def int_in(value, low: int, high: int) -> int | None:
    """``value`` as an int if it is one (not a bool) in ``[low, high]``, else None: the shape of most
    counts an extension returns (the caller raises :func:`bad_return` on None)."""
    if isinstance(value, bool):
        return None
    try:
        n = operator.index(value)
    except TypeError:
        return None
    return n if low <= n <= high else None
