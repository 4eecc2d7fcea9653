"""``SamplingParams``: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings.

    max_tokens: the most new tokens to generate (>= 1).
    temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    top_k: keep the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = all).
    seed: per-request seed; the same seed gives the same tokens whatever else shares the
      batch (each draw uses the seed and the token's index, not a shared generator).
    stop_token_ids: generation stops after emitting one of these (it stays in token_ids).
    ignore_eos: keep going past the model's EOS token.
    min_tokens: EOS and stop tokens are masked out until this many tokens exist.

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

    def validate(self, request_id: str = "?") -> None:
        """Raise ``ValueError`` naming the request and the field if a setting is invalid."""

        def bad(field_name, value, rule):
            raise ValueError(f"request {request_id!r}: sampling field {field_name}={value!r} {rule}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", self.max_tokens, "must be an int >= 1")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            bad("temperature", self.temperature, "must be >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", self.top_k, "must be an int >= 0 (0 disables it)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", self.top_p, "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", self.seed, "must be an int in [0, 2**63) or None")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", self.min_tokens, f"must be an int in [0, max_tokens={self.max_tokens}]")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                bad("stop_token_ids", tuple(self.stop_token_ids), "must hold non-negative ints")
