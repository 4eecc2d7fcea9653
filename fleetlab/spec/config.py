"""``SpeculativeConfig``: which proposer drafts how many tokens (FastDeploy / vLLM naming)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields


@dataclass(slots=True)
class SpeculativeConfig:
    """Settings of speculative decoding (``LLM(..., speculative_config={...})``).

    method: a registered proposer: ``"ngram"`` (prompt lookup) or ``"draft"`` (a draft model).
    num_speculative_tokens: ``k``, drafts proposed per step (each verify row then carries
      ``k + 1`` query tokens).
    model: the draft model for ``"draft"`` (a PaddleFormers causal LM or Fleet-style model
      sharing the target's vocabulary); fleetlab patches it and gives it its own paged cache.
    prompt_lookup_min / prompt_lookup_max: ``"ngram"``: the shortest and longest suffix
      looked up earlier in the request's own tokens (the longest match wins).
    """

    method: str
    num_speculative_tokens: int
    model: object = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    @classmethod
    def from_dict(cls, config) -> SpeculativeConfig:
        """Validate a dict (or pass a ``SpeculativeConfig`` through); ValueError names the field."""
        if isinstance(config, SpeculativeConfig):
            config.validate()
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict; got {type(config).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {sorted(known)}")
        for name in ("method", "num_speculative_tokens"):
            if name not in config:
                raise ValueError(f"speculative_config: field {name!r} is required")
        spec = cls(**config)
        spec.validate()
        return spec

    def validate(self) -> None:
        from fleetlab.spec.proposer import list_proposers

        if self.method not in list_proposers():
            raise ValueError(f"speculative_config: method={self.method!r} is not a registered proposer; "
                             f"known: {list_proposers()}")
        self.num_speculative_tokens = _int_field("num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        self.prompt_lookup_min = _int_field("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        self.prompt_lookup_max = _int_field("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft" and self.model is None:
            raise ValueError("speculative_config: method='draft' needs field 'model' (e.g. "
                             "fleetlab.models.load_tiny_draft()[0])")


def _int_field(name: str, value, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"speculative_config: field {name}={value!r} must be an int in [{low}, {high}]")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"speculative_config: field {name}={value!r} must be an int in [{low}, {high}]") from None
    if not low <= value <= high:
        raise ValueError(f"speculative_config: field {name}={value} must be in [{low}, {high}]")
    return int(value)
