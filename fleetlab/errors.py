"""The errors the edge raises, in one place that imports nothing of the engine: parameter
dataclasses (``SamplingParams``, ``StructuredOutputsParams``) and the checks (``fleetlab.fields``,
``fleetlab.edge``) all raise these, so importing a params dataclass loads no Paddle and no import cycle."""

from __future__ import annotations


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
