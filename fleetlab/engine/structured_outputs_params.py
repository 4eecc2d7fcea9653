"""``StructuredOutputsParams``: which constraint one request's output must follow.

The field names are vLLM's (``vllm.sampling_params.StructuredOutputsParams``): exactly one of
``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (the backend's own grammar
syntax: llguidance's Lark dialect, or GBNF) and ``json_object`` (any JSON object) is set.
Two options shape JSON output: ``disable_any_whitespace`` (compact JSON only) and
``whitespace_pattern`` (a regex for the whitespace allowed between JSON tokens).

:meth:`StructuredOutputsParams.validate` checks what needs no grammar library: one constraint
set, the types, a schema that is JSON. Whether a regex or a schema *compiles* is the grammar
backend's check (``GrammarBackend.validate``), also run when the request arrives.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, fields, replace

from fleetlab.errors import FieldTypeError, type_error
from fleetlab.errors import short as _short

KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The constraint fields; exactly one is set."""


@dataclass(slots=True)
class StructuredOutputsParams:
    """The constraint of one request (vLLM's names; exactly one of the first five is set).

    json: a JSON schema, as a dict (or ``True``, JSON Schema's boolean schema for any value;
      ``False``, the one no value satisfies, is refused) or as the text of one.
    regex: a regular expression the whole output must match (Rust ``regex`` syntax, which is
      Python's for everything but look-around and back-references).
    choice: a non-empty list of strings; the output is exactly one of them.
    grammar: a context-free grammar in the backend's syntax (llguidance: Lark, or GBNF).
    json_object: ``True``: any JSON object.
    disable_any_whitespace: JSON only: no whitespace between tokens (``{"a":1}``).
    whitespace_pattern: JSON only: a regex for the whitespace allowed between tokens.
    """

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    @property
    def kind(self) -> str:
        """The name of the constraint field that is set (``"json"``, ``"regex"``, ...)."""
        for name in KINDS:
            if getattr(self, name) is not None:
                return name
        raise ValueError("structured_outputs: no constraint is set; set one of " + ", ".join(KINDS))

    @classmethod
    def coerce(cls, value, request_id: str = "?") -> StructuredOutputsParams:
        """``value`` as a params object: one already, or a dict of its fields (a server's JSON
        body). An unknown key raises ``ValueError`` naming it: nothing is silently dropped."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise FieldTypeError(f"request {request_id!r}: structured_outputs={_short(value)} must be a "
                                 f"StructuredOutputsParams or a dict of its fields, not {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(value) - known))  # keys of any type: sorted as text
        if unknown:
            raise ValueError(f"request {request_id!r}: structured_outputs has unknown fields {unknown}; "
                             f"fleetlab supports {sorted(known)}")
        return cls(**value)

    def validate(self, request_id: str = "?") -> StructuredOutputsParams:
        """Raise ``ValueError`` naming the request and the field if the constraint is malformed;
        return a checked copy in which ``json`` is a parsed schema (a dict or a bool) and
        ``choice`` a list of str. ``self`` is left as it is."""
        where = f"request {request_id!r}: structured_outputs field"
        set_fields = [name for name in KINDS if getattr(self, name) is not None]
        if len(set_fields) != 1:
            raise ValueError(f"request {request_id!r}: structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {set_fields or 'none'}")
        checked = replace(self)
        kind = set_fields[0]
        if kind == "json":
            checked.json = _schema(where, self.json)
        elif kind == "choice":
            checked.choice = _choices(where, self.choice)
        elif kind == "json_object":
            if self.json_object is not True:
                raise FieldTypeError(f"{where} json_object={_short(self.json_object)} must be True (or unset)")
        else:
            _text(where, kind, getattr(self, kind))
        for name in ("disable_any_whitespace",):
            if not isinstance(getattr(self, name), bool):
                raise FieldTypeError(f"{where} {name}={_short(getattr(self, name))} must be True or False")
        if self.whitespace_pattern is not None:
            _text(where, "whitespace_pattern", self.whitespace_pattern)
        json_options = self.disable_any_whitespace or self.whitespace_pattern is not None
        if json_options and kind not in ("json", "json_object"):
            raise ValueError(f"{where} disable_any_whitespace / whitespace_pattern apply to json and "
                             f"json_object only, not to {kind}")
        if self.disable_any_whitespace and self.whitespace_pattern is not None:
            raise ValueError(f"{where} disable_any_whitespace and whitespace_pattern contradict each other; "
                             "set one")
        return checked

    def cache_key(self) -> tuple:
        """A canonical, hashable key of the constraint: the same schema written with its keys in
        another order, or as text rather than a dict, gives the same key. Call on a validated copy."""
        kind = self.kind
        spec = getattr(self, kind)
        if kind == "json":
            spec = _json.dumps(spec, sort_keys=True, separators=(",", ":"))
        elif kind == "choice":
            spec = tuple(spec)
        return kind, spec, self.disable_any_whitespace, self.whitespace_pattern


def _text(where: str, name: str, value) -> str:
    if not isinstance(value, str):
        raise type_error(where, name, value, "a str")
    if not value:
        raise ValueError(f"{where} {name} is empty")
    return value


def _schema(where: str, value) -> dict | bool:
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except _json.JSONDecodeError as exc:
            raise ValueError(f"{where} json is not valid JSON text: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise type_error(where, "json", value, "a JSON schema: a dict (or its JSON text)")
    if value is False:
        raise ValueError(f"{where} json=False is the schema no value satisfies: nothing could be generated")
    try:  # strict JSON: Python writes NaN and infinities as tokens no grammar library parses
        # sorted, as cache_key writes it: keys of mixed kinds ("" and 0) are refused here
        _json.dumps(value, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where} json cannot be written as JSON: {exc}") from None
    return value


def _choices(where: str, value) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise type_error(where, "choice", value, "a list of strings")
    if not value:
        raise ValueError(f"{where} choice is an empty list: nothing could be generated")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise type_error(where, f"choice[{i}]", item, "a str")
        if not item:
            raise ValueError(f"{where} choice[{i}] is an empty string")
    return list(value)
