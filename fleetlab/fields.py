"""Scalar field checks: one value a user (or a config) sent, as the Python value it holds, or a refusal
naming where it came from and the field.

A refusal is a ``ValueError``; a value of the wrong type raises :class:`~fleetlab.errors.FieldTypeError`,
which is a ``TypeError`` and a ``ValueError`` at once. Nothing is coerced silently: numpy scalars and
0-d arrays count as the numbers they hold, but a ``bool`` is not an int, a float is not an int, and a
numeric string is not a number. A bottom-level module (numpy and the errors only): the request edge,
the config dataclasses and the KV connectors all check their fields with it.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence

import numpy as np

from fleetlab.errors import FieldTypeError, short, type_error

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


def _scalar(value):
    """A 0-d numpy array as the numpy scalar it holds; anything else unchanged."""
    return value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value


def _interval(low, high, low_open: bool = False) -> str:
    def num(x):
        return f"{x:g}" if isinstance(x, float) else str(x)

    if high is None:  # (every bounded caller gives a low bound)
        return "" if low is None else f" {'>' if low_open else '>='} {num(low)}"
    return f" in {'(' if low_open else '['}{num(low)}, {num(high)}]"


def int_field(where: str, name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as a Python int within ``[low, high]`` (None: unbounded on that side)."""
    value = _scalar(value)
    rule = "an int" + _interval(low, high)
    if isinstance(value, (bool, np.bool_)):
        raise FieldTypeError(f"{where} {name}={value!r} must be {rule} (a bool is not an int here)")
    try:
        number = operator.index(value)
    except TypeError:
        raise type_error(where, name, value, rule) from None
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
        raise type_error(where, name, value, rule)
    number = float(value)
    if not (low < number if low_open else low <= number) or not number <= high:  # NaN fails both
        raise ValueError(f"{where} {name}={value!r} must be {rule}")
    return number


def optional(check, where: str, name: str, value, *args, **kwargs):
    """None (the setting is unset) as it is; any other value checked by ``check(where, name, value, ...)``."""
    return None if value is None else check(where, name, value, *args, **kwargs)


def bool_field(where: str, name: str, value) -> bool:
    """``value`` (``True``/``False`` or a numpy bool) as a Python bool; nothing else is truthy here."""
    value = _scalar(value)
    if not isinstance(value, (bool, np.bool_)):
        raise type_error(where, name, value, "True or False")
    return bool(value)


def stop_strings_field(where: str, value) -> tuple[str, ...]:
    """``SamplingParams.stop`` as a tuple of non-empty strings (None: none; a str: that one)."""
    items = () if value is None else (value,) if isinstance(value, str) else value
    if not is_sequence(items) or not all(isinstance(s, str) for s in items):
        raise FieldTypeError(f"{where} stop={short(value)} must be a string or a list of strings")
    if not all(items):
        raise ValueError(f"{where} stop={short(value)}: a stop string cannot be empty")
    return tuple(items)


def is_sequence(value) -> bool:
    """A list-like of items: a list, tuple, range or numpy array of >= 1 dimension (a str is
    text, a mapping is keyed, a 0-d array is a scalar)."""
    if isinstance(value, np.ndarray):
        return value.ndim > 0
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def token_ids_field(where: str, name: str, value, hint: str = "") -> list[int]:
    """A flat sequence of int token ids (a list, tuple, range or 1-D integer numpy array) as a
    list of Python ints (their range is the caller's to check); ``hint`` ends the message
    for a nested list."""
    if isinstance(value, np.ndarray):
        if value.ndim == 1 and value.dtype.kind in "iu":
            return value.tolist()  # exact Python ints, whatever the integer dtype
        raise FieldTypeError(f"{where} {name} must be a flat sequence of int token ids; got a numpy array "
                             f"of shape {value.shape} and dtype {value.dtype}{hint}")
    if not is_sequence(value):
        raise type_error(where, name, value, "a sequence of int token ids (e.g. [5, 17])")
    ids = []
    for i, t in enumerate(value):
        if type(t) is not int:  # the common case stays fast
            if is_sequence(t):
                raise FieldTypeError(f"{where} {name}[{i}]={short(t)} is a {type(t).__name__}, but {name} is "
                                     f"a flat sequence of int token ids{hint}")
            t = int_field(where, f"{name}[{i}]", t)
        ids.append(t)
    return ids
