"""A vocabulary that can spell JSON, and a tiny random model that writes with it.

The shipped tiny model's character vocabulary (``DEFAULT_CHARS``) has no ``{``, ``}``,
``"``, ``[`` or ``]``: it cannot write JSON at all, so structured-output tests and notebooks
that ask for JSON use this model instead. Its weights are random, so what it writes
unconstrained is noise; constrained by a grammar, every output it writes is valid whatever
the weights, which is what those tests check.

``JSON_CHARS`` is the shipped alphabet plus upper case letters and ``{}[]"_\\``: every JSON
document over ASCII letters and digits, without control-character escapes, can be spelled.
"""

from __future__ import annotations

import string

from fleetlab.models import tiny
from fleetlab.models.tokenizer import DEFAULT_CHARS, CharTokenizer

JSON_CHARS = DEFAULT_CHARS + string.ascii_uppercase + '{}[]"_\\'


def json_tokenizer() -> CharTokenizer:
    """A :class:`CharTokenizer` over ``JSON_CHARS`` (ids 0-3 special, as every CharTokenizer)."""
    return CharTokenizer(JSON_CHARS)


def tiny_json(family: str = "llama", seed: int = 0, **overrides):
    """``(model, tokenizer)``: a tiny random ``family`` model (see ``fleetlab.models.tiny``) whose
    vocabulary is exactly :func:`json_tokenizer`'s (``vocab_size`` 88)."""
    tokenizer = json_tokenizer()
    return tiny(family, seed=seed, vocab_size=tokenizer.vocab_size, **overrides), tokenizer
