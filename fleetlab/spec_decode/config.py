"""``SpeculativeConfig``: which proposer drafts how many tokens (FastDeploy / vLLM naming)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from fleetlab.engine.checks import FieldTypeError, int_field


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

    Bounds: ``num_speculative_tokens`` an int in ``[1, 16]``, the lookup lengths ints in
    ``[1, 64]`` with min <= max (numpy ints count, bools do not); ``method`` a registered
    name. A refusal is a ``ValueError`` (a wrong type: a ``TypeError`` that is also one)
    starting ``speculative_config:`` and naming the field.
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
            raise FieldTypeError(f"speculative_config must be a dict; got {type(config).__name__}")
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
        from fleetlab.spec_decode.proposer import list_proposers

        if not isinstance(self.method, str) or self.method not in list_proposers():
            raise ValueError(f"speculative_config: method={self.method!r} is not a registered proposer; "
                             f"known: {list_proposers()}")
        where = "speculative_config: field"
        self.num_speculative_tokens = int_field(where, "num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        self.prompt_lookup_min = int_field(where, "prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        self.prompt_lookup_max = int_field(where, "prompt_lookup_max", self.prompt_lookup_max, 1, 64)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.method == "draft" and self.model is None:
            raise ValueError("speculative_config: method='draft' needs field 'model' (e.g. "
                             "fleetlab.models.load_tiny_draft()[0])")

