"""``SpeculativeConfig``: which proposer drafts how many tokens (FastDeploy / vLLM naming)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields

from fleetlab.errors import FieldTypeError, refuse
from fleetlab.fields import int_field
from fleetlab.spec_decode.proposer import PROPOSERS


@dataclass(slots=True)
class SpeculativeConfig:
    """Settings of speculative decoding (``LLM(..., speculative_config={...})``).

    method: a registered proposer: ``"ngram"`` (prompt lookup) or ``"draft"`` (a draft model),
      or a ``Proposer`` subclass or instance.
    num_speculative_tokens: ``k``, drafts proposed per step (each verify row then carries
      ``k + 1`` query tokens).
    model: the draft model for ``"draft"`` (a PaddleFormers causal LM or Fleet-style model
      sharing the target's vocabulary); fleetlab patches it and gives it its own paged cache.
    prompt_lookup_min / prompt_lookup_max: ``"ngram"``: the shortest and longest suffix
      looked up earlier in the request's own tokens (the longest match wins).
    options: a proposer's own settings (keyword-only arguments of its ``__init__``), from the
      keys of the dict that are none of these fields.

    Bounds: ``num_speculative_tokens`` an int in ``[1, 16]``, the lookup lengths ints in
    ``[1, 64]`` with min <= max (numpy ints count, bools do not); ``method`` a registered
    name (checked by :func:`check_speculative_config`). A refusal is a
    ``ValueError`` (a wrong type: a ``TypeError`` that is also one) starting
    ``speculative_config:`` and naming the field.
    """

    method: str
    num_speculative_tokens: int
    model: object = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    options: dict = field(default_factory=dict)


def check_speculative_config(config):
    """A checked ``SpeculativeConfig`` from a dict (or one passed through); see its docstring.

    ``method`` is a registered name, a ``Proposer`` subclass or an instance (as everywhere a
    registry's kind is taken). Keys that are not ``SpeculativeConfig`` fields are the
    proposer's own options: accepted when its class takes them as keyword arguments of its
    ``__init__`` (kept in ``options``), refused by name otherwise."""
    if not isinstance(config, SpeculativeConfig):
        if not isinstance(config, dict):
            raise FieldTypeError(f"speculative_config must be a dict; got {type(config).__name__}")
        missing = [name for name in ("method", "num_speculative_tokens") if name not in config]
        if missing:
            raise ValueError(f"speculative_config: field {missing[0]!r} is required")
        known = {f.name for f in fields(SpeculativeConfig)} - {"options"}
        options = {k: v for k, v in config.items() if k not in known}
        config = SpeculativeConfig(**{k: v for k, v in config.items() if k in known}, options=options)
    try:  # the registry refuses with a FieldTypeError (a TypeError), an unknown name included
        cls = PROPOSERS.resolve(config.method)
    except TypeError:
        raise FieldTypeError(f"speculative_config: method={config.method!r:.60} must be a registered proposer "
                             f"({PROPOSERS.names()}), a Proposer subclass or an instance of one") from None
    # Its own options: the keyword-only parameters of its __init__.
    own = {p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY}
    unknown, known = sorted(set(config.options) - own), sorted(f.name for f in fields(SpeculativeConfig))
    refuse([(unknown, f"unknown field(s) {unknown}; known: {[n for n in known if n != 'options']} and "
                      f"{cls.__name__}'s own options {sorted(own)}"),
            (isinstance(config.method, PROPOSERS.base) and config.options, f"options {sorted(config.options)} "
             "cannot reach a proposer instance (it is built already): pass its class, or build it with them")],
           prefix="speculative_config: ")
    for name, high in (("num_speculative_tokens", 16), ("prompt_lookup_min", 64), ("prompt_lookup_max", 64)):
        setattr(config, name, int_field("speculative_config: field", name, getattr(config, name), 1, high))
    k = getattr(config.method, "num_speculative_tokens", config.num_speculative_tokens)
    refuse([(config.prompt_lookup_min > config.prompt_lookup_max, f"prompt_lookup_min={config.prompt_lookup_min} "
             f"exceeds prompt_lookup_max={config.prompt_lookup_max}"),
            (config.method == "draft" and config.model is None,
             "method='draft' needs field 'model' (e.g. fleetlab.models.load_tiny_draft()[0])"),
            (k != config.num_speculative_tokens, f"num_speculative_tokens={config.num_speculative_tokens}, but the "
             f"proposer instance drafts {k!r}")], prefix="speculative_config: ")
    return config


def check_draft_vocab(draft_vocab_size: int, target_vocab_size: int) -> None:
    """A draft model must share the target's tokenizer: the same vocabulary."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config: field 'model' has vocabulary {draft_vocab_size}, the target "
                         f"{target_vocab_size}: a draft must share the target's tokenizer")
