"""The checks every validated setting goes through: an int in bounds, a float in bounds, a
bool, a flat list of token ids.

Each takes ``where`` (the start of the message: ``"request 'a': sampling field"``,
``"engine config:"``, ``"speculative_config: field"``), the field's name and its value,
and returns the value as a plain Python ``int`` / ``float`` / ``bool`` / ``list[int]`` or
raises naming both. Nothing is coerced silently: numpy scalars and 0-d arrays count as
the numbers they hold, but a ``bool`` is not an int, a float is not an int, and a numeric
string is not a number.

A value of the wrong type raises :class:`FieldTypeError`, which is a ``TypeError`` and a
``ValueError`` at once (so code that catches the engine's ``ValueError`` s, such as the
OpenAI server's 400 answers, catches it too); a value out of range raises ``ValueError``.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence

import numpy as np

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


class FieldTypeError(TypeError, ValueError):
    """A setting of the wrong type (a ``TypeError`` that is also a ``ValueError``)."""


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _scalar(value):
    """A 0-d numpy array as the numpy scalar it holds; anything else unchanged."""
    return value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _interval(low, high, low_open: bool = False) -> str:
    if low is None and high is None:
        return ""
    if high is None:
        return f" {'>' if low_open else '>='} {_num(low)}"
    if low is None:
        return f" <= {_num(high)}"
    return f" in {'(' if low_open else '['}{_num(low)}, {_num(high)}]"


def int_field(where: str, name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as a Python int within ``[low, high]`` (None: unbounded on that side)."""
    value = _scalar(value)
    rule = "an int" + _interval(low, high)
    if isinstance(value, (bool, np.bool_)):
        raise FieldTypeError(f"{where} {name}={value!r} must be {rule} (a bool is not an int here)")
    try:
        number = operator.index(value)
    except TypeError:
        raise FieldTypeError(f"{where} {name}={_short(value)} must be {rule}, not "
                             f"{type(value).__name__}") from None
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{where} {name}={number} must be {rule}")
    return int(number)


def float_field(where: str, name: str, value, low: float, high: float, *, low_open: bool = False,
                note: str = "") -> float:
    """``value`` (an int or float, numpy's included) as a Python float in ``[low, high]``
    (``(low, high]`` with ``low_open``); NaN is always refused. ``note`` ends the message."""
    value = _scalar(value)
    rule = "a number" + _interval(low, high, low_open) + note
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise FieldTypeError(f"{where} {name}={_short(value)} must be {rule}, not {type(value).__name__}")
    number = float(value)
    if not (low < number if low_open else low <= number) or not number <= high:  # NaN fails both
        raise ValueError(f"{where} {name}={value!r} must be {rule}")
    return number


def bool_field(where: str, name: str, value) -> bool:
    """``value`` (``True``/``False`` or a numpy bool) as a Python bool; nothing else is truthy here."""
    value = _scalar(value)
    if not isinstance(value, (bool, np.bool_)):
        raise FieldTypeError(f"{where} {name}={_short(value)} must be True or False, not {type(value).__name__}")
    return bool(value)


def is_sequence(value) -> bool:
    """A list-like of items: a list, tuple, range or numpy array of >= 1 dimension (a str is
    text, a mapping is keyed, a 0-d array is a scalar)."""
    if isinstance(value, np.ndarray):
        return value.ndim > 0
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def token_ids_field(where: str, name: str, value, hint: str = "") -> list[int]:
    """A flat sequence of int token ids (a list, tuple, range or 1-D integer numpy array) as a
    list of Python ints (their range is the caller's to check). ``hint`` is added to the message for a nested list."""
    if isinstance(value, np.ndarray):
        if value.ndim == 1 and value.dtype.kind in "iu":
            return value.tolist()  # exact Python ints, whatever the integer dtype
        raise FieldTypeError(f"{where} {name} must be a flat sequence of int token ids; got a numpy array "
                             f"of shape {value.shape} and dtype {value.dtype}{hint}")
    if not is_sequence(value):
        raise FieldTypeError(f"{where} {name}={_short(value)} must be a sequence of int token ids (e.g. "
                             f"[5, 17]), not {type(value).__name__}")
    ids = []
    for i, t in enumerate(value):
        if type(t) is not int:  # the common case stays fast
            if is_sequence(t):
                raise FieldTypeError(f"{where} {name}[{i}]={_short(t)} is a {type(t).__name__}, but {name} is "
                                     f"a flat sequence of int token ids{hint}")
            t = int_field(where, f"{name}[{i}]", t)
        ids.append(t)
    return ids
