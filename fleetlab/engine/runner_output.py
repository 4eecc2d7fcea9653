"""``ModelRunnerOutput``: the message the model runner sends back after a step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced, keyed by request id (the row order never leaks out).

    sampled_token_ids: request id -> the tokens it gained: accepted drafts then one
      sampled (bonus) token; absent for rows whose chunk stopped short of their last
      known token (a mid-prompt prefill chunk samples nothing).
    spec_token_ids: request id -> draft tokens proposed for the next step.
    errors: request id -> message (e.g. non-finite logits); those requests stop.
    order_before / order_after: request ids by batch row before and after the reorder;
    num_decodes: leading rows the attention backend treats as decodes;
    timings: seconds of the runner's parts (batch_update, metadata, forward, sample, propose).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    order_before: list[str] = field(default_factory=list)
    order_after: list[str] = field(default_factory=list)
    num_decodes: int = 0
    reordered: bool = False
    timings: dict[str, float] = field(default_factory=dict)
