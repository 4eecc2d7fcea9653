"""Example constraints for tests, benchmarks and notebooks.

Every schema here is *bounded*: strings have a ``maxLength`` or a pattern, numbers a range,
arrays ``maxItems``, objects no extra properties. So every output has a bounded length, and
greedy decoding of any model (a random one included) ends with EOS within ``MAX_JSON_CHARS``
characters when JSON is compact (``disable_any_whitespace=True``); with whitespace allowed, a
random model may write whitespace for ever.
"""

from __future__ import annotations

MAX_JSON_CHARS = 64
"""The longest compact output of any schema in ``SCHEMAS``, rounded up."""

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "scores": {"type": "array", "maxItems": 4, "items": {"type": "integer", "minimum": 0, "maximum": 99}},
    "flags": {"type": "object", "additionalProperties": False, "required": ["color", "ok"],
              "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["id", "tags", "owner"],
               "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                              "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
                              "owner": {"type": "object", "additionalProperties": False, "required": ["name"],
                                        "properties": {"name": {"type": "string", "maxLength": 5}}}}},
    "code": {"type": "object", "additionalProperties": False, "required": ["code", "value"],
             "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                {"type": "boolean"}, {"type": "null"}]}}},
}
"""Name -> JSON schema (see the module docstring)."""
