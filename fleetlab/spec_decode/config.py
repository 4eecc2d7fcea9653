"""``SpeculativeConfig``: which proposer drafts how many tokens (FastDeploy / vLLM naming)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    name (checked by ``fleetlab.validation.check_speculative_config``). A refusal is a
    ``ValueError`` (a wrong type: a ``TypeError`` that is also one) starting
    ``speculative_config:`` and naming the field.
    """

    method: str
    num_speculative_tokens: int
    model: object = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    options: dict = field(default_factory=dict)
