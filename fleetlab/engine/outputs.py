"""What the engine hands back: one ``RequestOutput`` per request, and per-step traces."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """The result of one request.

    token_ids: the generated ids (a final EOS or stop token is included).
    text: ``token_ids`` decoded without special tokens, when the engine has a tokenizer.
    finish_reason: ``"stop"`` (EOS or a stop token), ``"length"`` (max_tokens or the
      model's maximum length), ``"abort"`` (``LLM.abort``), ``"error"`` (see ``error``),
      or None while unfinished.
    metrics: arrival / first-token / finish times and each output token's time
      (``token_times``; ``time.perf_counter`` seconds), and ``num_preemptions``.
    new_token_ids: the ids this step added (what a stream sends); all of ``token_ids``
      in the outputs ``generate`` returns.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    new_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RowTrace:
    """One batch row in one step: who it was and what it did.

    draft_token_ids: the drafts it verified (empty without speculation); of those, the
    first ``num_accepted_tokens`` were accepted, the rest rejected. token_ids: the tokens
    the request kept from this step (accepted drafts, then the bonus/sampled token; cut
    at a stop).
    """

    request_id: str
    phase: str  # "decode" or "prefill"
    num_scheduled_tokens: int
    num_computed_tokens: int  # before this step
    num_prompt_tokens: int
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)
    num_accepted_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)

    @property
    def num_rejected_tokens(self) -> int:
        return len(self.draft_token_ids) - self.num_accepted_tokens


# The parts of a step that StepTrace.timings times, in the order they run.
STEP_TIMING_PARTS = ("schedule", "batch_update", "metadata", "forward", "sample", "propose", "update")


@dataclass(slots=True)
class StepTrace:
    """Everything one engine step did, for drawing and for tests.

    order_before / order_after: request ids by batch row before and after the
    decode-first reorder (equal when the step did not reorder).
    tokens: request id -> the tokens it kept this step (one per step without speculation).
    timings: seconds spent in each of ``STEP_TIMING_PARTS``.
    """

    step: int
    rows: list[RowTrace]
    order_before: list[str]
    order_after: list[str]
    num_decodes: int
    reordered: bool
    tokens: dict[str, list[int]]
    preempted: list[str]
    finished: list[str]
    num_free_blocks: int
    num_blocks: int
    num_batched_tokens: int
    timings: dict[str, float] = field(default_factory=dict)
