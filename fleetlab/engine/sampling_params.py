"""``SamplingParams``: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from fleetlab.engine.checks import FLOAT32_MAX, INT64_MAX, bool_field, float_field, int_field, token_ids_field

MIN_TEMPERATURE = 1e-5
"""Temperatures in ``(0, MIN_TEMPERATURE)`` are greedy: ``logits / T`` would overflow float32."""


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings.

    max_tokens: the most new tokens to generate (an int >= 1). The engine clamps it to what
      the request can hold, ``max_model_len - len(prompt)`` (a larger value means "until
      the model's length"), so it always fits the batch's int32 buffer.
    temperature: 0 means greedy; otherwise logits are divided by it before sampling. A
      number in ``[0, float32 max]`` (inf and NaN are refused). Temperatures below
      ``MIN_TEMPERATURE`` (1e-5) are greedy, the limit of sampling as T goes to 0: dividing
      float32 logits by a smaller T overflows them to inf and makes the draw meaningless.
    top_k: keep the k most likely tokens (0 = no limit); an int >= 0, clamped by the engine
      to the vocabulary size (a k beyond it keeps every token, as 0 does).
    top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = all); a
      number in ``(0, 1]``, and > 0 still once rounded to float32.
    seed: None or an int in ``[0, 2**63)`` (the batch's int64 buffer); the same seed gives
      the same tokens whatever else shares the batch (each draw uses the seed and the
      token's index, not a shared generator).
    stop_token_ids: token ids (a sequence of ints >= 0, inside the vocabulary; at most the
      batch's ``max_stop_ids``): generation stops after emitting one (it stays in token_ids).
    ignore_eos: keep going past the model's EOS token (True or False).
    min_tokens: EOS and stop tokens are masked out until this many tokens exist; an int in
      ``[0, max_tokens]`` (clamped with ``max_tokens``).

    numpy scalars count as the numbers they hold (``temperature=np.float32(0.7)``); a
    ``bool`` is not an int, and nothing else is converted: a wrong type raises
    ``TypeError`` (``fleetlab.engine.checks.FieldTypeError``, also a ``ValueError``).

    fleetlab defaults to greedy decoding (temperature 0) so that every output can be
    checked against the model's own forward pass.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, request_id: str = "?") -> SamplingParams:
        """Raise ``ValueError`` (``TypeError`` for a wrong type) naming the request and the
        field if a setting is invalid; return a checked copy holding plain Python values
        (ints, floats, a tuple of stop ids, a temperature below ``MIN_TEMPERATURE`` as 0).
        ``self`` is left as it is."""
        where = f"request {request_id!r}: sampling field"
        max_tokens = int_field(where, "max_tokens", self.max_tokens, 1)
        temperature = float_field(where, "temperature", self.temperature, 0.0, FLOAT32_MAX,
                                  note=f" (0 = greedy; below {MIN_TEMPERATURE:g} counts as greedy)")
        top_p = float_field(where, "top_p", self.top_p, 0.0, 1.0, low_open=True)
        if np.float32(top_p) == 0:  # the sampler's float32 buffer would hold 0: nothing kept
            raise ValueError(f"{where} top_p={top_p!r} must be in (0, 1] and stay > 0 as a float32 (>= 1e-45)")
        return replace(
            self, max_tokens=max_tokens,
            temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
            top_k=int_field(where, "top_k", self.top_k, 0), top_p=top_p,
            seed=None if self.seed is None else int_field(where, "seed", self.seed, 0, INT64_MAX),
            stop_token_ids=tuple(self._stop_token_ids(where)),
            ignore_eos=bool_field(where, "ignore_eos", self.ignore_eos),
            min_tokens=int_field(where, "min_tokens", self.min_tokens, 0, max_tokens))

    def _stop_token_ids(self, where: str) -> list[int]:
        ids = token_ids_field(where, "stop_token_ids", self.stop_token_ids)
        bad = [t for t in ids if t < 0]
        if bad:
            raise ValueError(f"{where} stop_token_ids holds {bad[:5]}: token ids are >= 0")
        return ids

