"""``Request``: the scheduler's record of one request across its whole life."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from fleetlab.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    """Where a request is in its life: queued, in the running batch, requeued, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its blocks freed; it will be recomputed
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # admitted, its blocks held, its K/V still arriving
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One request: its tokens, how far its KV cache is computed, its drafts.

    ``num_computed_tokens`` counts the tokens whose K/V are in the paged cache; the
    tokens still to run are ``all_token_ids[num_computed_tokens:]`` plus the drafts in
    ``spec_token_ids``. Preemption frees the blocks (the ``KVCacheManager`` holds them)
    and resets it to 0 (the request is recomputed from its prompt and outputs).
    Under the overlapped loop (:mod:`fleetlab.overlap`) the next step is planned while one is
    in flight: ``num_computed_tokens`` then already counts the tokens in flight and
    ``num_placeholders`` the tokens that step will sample (scheduled as placeholders, not yet
    in ``output_token_ids``); both are taken back when the scheduler commits the step.
    A request with ``waiting_on`` set (a future: its grammar's compile) waits until that is
    done, while the requests behind it are admitted; one ``WAITING_FOR_REMOTE_KVS`` (a KV
    connector's future: its K/V arriving) is held out of the running batch until then.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    arrival_order: int
    eos_token_id: int | None = None
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    num_placeholders: int = 0  # tokens a step in flight will sample, already scheduled past (overlapped loop)
    extra: dict = field(default_factory=dict)  # values of its own InputBatch fields, e.g. prompt_embeds
    waiting_on: Future | None = None  # not admitted / not scheduled before this is done (a compile, a transfer)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    enqueue_step: int = 0  # scheduler step at which the request first joined the queue
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_cacheable_tokens(self) -> int:
        """Leading tokens whose K/V depend on token ids alone, so the prefix cache may share
        them: all of them, or those before the first position with a replaced embedding."""
        side = self.extra.get("prompt_embeds")  # (positions int64 [m], embeddings [m, hidden])
        return self.num_tokens if side is None else int(side[0].min())

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """A request that wants prompt logprobs computes every prompt position: a prefix-cache
        hit would skip the positions it covers (vLLM's ``skip_reading_prefix_cache``)."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_ready(self) -> bool:
        """Whatever it waits on is done: the scheduler may admit it."""
        return self.waiting_on is None or self.waiting_on.done()
