"""The two messages of an engine step: ``SchedulerOutput`` out, ``ModelRunnerOutput`` back.

``SchedulerOutput`` carries only what the runner cannot know: a request's full data the
first time the runner sees it (:class:`NewRequestData`), and for requests it already holds
only what changed since their last step (:class:`CachedRequestData`). The runner rebuilds
its ``InputBatch`` from this message alone; no scheduler ``Request`` object crosses it.
``ModelRunnerOutput`` carries what the step computed, keyed by request id; the scheduler
alone turns it into progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetlab.engine.sampling_params import SamplingParams  # pure data: no cycle, no Paddle


@dataclass(slots=True)
class NewRequestData:
    """Everything about a request the runner does not hold yet.

    Sent on admission, after a preemption (``num_computed_tokens`` restarts from the
    prefix-cache hits), and when a running request was left out of the previous step.
    ``sampling_params``: the request's settings as the edge resolved them (``max_tokens``
    clamped, ``top_k`` >= 0); ``seed``: its own (the edge draws one for requests that set none);
    ``eos_token_id``: None when the model has no EOS token.
    ``extra``: values of the request's own batch fields by name (side data such as
    ``prompt_embeds``, or a prototype's field like a LoRA id), set on its row.
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    eos_token_id: int | None
    block_ids: list[int]
    num_computed_tokens: int
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class CachedRequestData:
    """The diff of requests the runner already holds, one entry per request (columns).

    new_token_ids: output tokens accepted since the runner last heard of the request.
    new_block_ids: blocks appended to its block table, after the table is cut to
      ``num_blocks - len(new_block_ids)`` entries (blocks past rejected drafts are freed,
      so a table can shrink before it grows again).
    num_blocks: the length of its block table after this diff.
    num_computed_tokens: tokens whose K/V are in the cache before this step (the
      scheduler's count: it rolls back past rejected drafts).
    """

    req_ids: list[str] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_blocks: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def add(self, req_id: str, new_token_ids: list[int], new_block_ids: list[int], num_blocks: int,
            num_computed: int) -> None:
        self.req_ids.append(req_id)
        self.new_token_ids.append(new_token_ids)
        self.new_block_ids.append(new_block_ids)
        self.num_blocks.append(num_blocks)
        self.num_computed_tokens.append(num_computed)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan.

    num_scheduled_tokens: request id -> query tokens this step (its known tokens still to
      compute, plus the drafts it verifies), in scheduling order: running, then admitted.
    scheduled_spec_decode_tokens: request id -> draft tokens to verify (they are the last
      ``len(drafts)`` of its scheduled tokens).
    finished_req_ids: requests that finished or were aborted since the last step.
    preempted_req_ids: requests preempted while this step was planned.
    kv_copies: :class:`~fleetlab.kv.copies.BlockCopy` s the runner applies to the paged cache before
      the forward (the head of a cached block into a request's own block: a prefix-cache match that
      ends inside a block), in order.
    kv_connector_metadata: the KV connector's plan of the step's loads and saves (None without one).
    """

    step: int
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: list[str] = field(default_factory=list)
    kv_copies: list = field(default_factory=list)
    kv_connector_metadata: object = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens the step runs in all (the packed batch length ``T``)."""
        return sum(self.num_scheduled_tokens.values())


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step computed, keyed by request id (the row order never leaks out).

    sampled_token_ids: request id -> the tokens it gained: the drafts the target accepted,
      then one token of its own (sampled, or the bonus after a fully accepted run); absent
      for rows whose chunk stopped short of their last known token (a mid-prompt chunk).
    logprobs: request id -> one :class:`~fleetlab.engine.logprobs.TokenLogprobs` per gained
      token (requests that asked for ``logprobs``).
    prompt_logprobs: request id -> ``(first prompt position scored, [TokenLogprobs])``: the
      prompt tokens this step's chunk predicts (requests that asked for ``prompt_logprobs``).
    spec_token_ids: request id -> drafts proposed for the next step.
    errors: request id -> message (e.g. non-finite logits); those requests stop.
    finished_sending / kv_load_failed_block_ids: the KV connector's report (``get_finished``).
    """

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)
    kv_load_failed_block_ids: set[int] = field(default_factory=set)
