"""``Scheduler``: continuous batching under a token budget.

Each step it fills ``max_num_batched_tokens`` and at most ``max_num_seqs`` rows:
running requests first (their decodes, or the next chunk of a long prompt), then
waiting requests in the policy's order. Prefills and decodes share a step. When the
block pool runs dry it preempts a running request (the policy picks: by default the
most recently admitted), frees its blocks and puts it back in the waiting queue to be
recomputed later. The engine rejects any request the whole pool could not hold, so the
request the policy never preempts (the oldest, under the default first-come-first-served
policy) can always finish: the loop cannot deadlock. Other policies bound waiting by
their own rules (see ``PriorityPolicy``'s aging).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fleetlab.kv.manager import KVCacheManager
from fleetlab.engine.policies import SchedulingPolicy, make_policy
from fleetlab.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan: which requests run and how many tokens each.

    scheduled: requests in the order they were scheduled (running first, then new).
    num_scheduled_tokens: request id -> tokens to run this step.
    preempted: requests preempted while making room in this step.
    """

    step: int
    scheduled: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens the step runs in all (the packed batch length ``T``)."""
        return sum(self.num_scheduled_tokens.values())


class Scheduler:
    """Chooses, every step, which requests run and how many tokens each.

    Args:
      kv_manager: the request-level view of the block pool.
      max_num_batched_tokens, max_num_seqs, max_model_len: the step's budget and caps.
      enable_chunked_prefill: let a prompt take several steps; without it a prompt is
        admitted only when it fits whole in the step's remaining budget.
      enable_prefix_caching: look up cached blocks when admitting a request.
      policy: a :class:`SchedulingPolicy` or its registered name.
    """

    def __init__(self, kv_manager: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, policy: SchedulingPolicy | str = "fcfs"):
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.enable_prefix_caching = enable_prefix_caching
        self.policy = make_policy(policy)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.step_count = 0
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        """Queue a new request (validated by the engine) at the back of the waiting list."""
        request.status = RequestStatus.WAITING
        request.enqueue_step = self.step_count
        self.waiting.append(request)

    def abort(self, request_ids) -> list[Request]:
        """Finish the named waiting or running requests with reason ``"abort"`` and free
        their blocks at once; ids of finished or unknown requests are skipped. Returns the
        aborted requests."""
        wanted = set(request_ids)
        aborted = [r for r in self.running + self.waiting if r.request_id in wanted]
        for req in aborted:
            (self.running if req in self.running else self.waiting).remove(req)
            self.kv.free(req)
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
        return aborted

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (preempting on a dry pool), then admissions."""
        out = SchedulerOutput(step=self.step_count)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # after a preemption the pool is tight: admit nobody new
            self._schedule_waiting(out, budget)
        self.step_count += 1
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Give each running request its next tokens; returns the budget left.

        On a dry pool the policy's victim is preempted (its tokens, if already scheduled
        this step, go back to the budget) until ``req`` fits or is itself the victim.
        A scheduled victim stands before ``req`` in ``running``, so removing it shifts ``req``
        down one row: hence ``i -= 1``.
        """
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.policy.pick_victim(self.running)
                budget += out.num_scheduled_tokens.pop(victim.request_id, 0)
                if victim in out.scheduled:
                    out.scheduled.remove(victim)
                    i -= 1
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.scheduled.append(req)
                out.num_scheduled_tokens[req.request_id] = n
                budget -= n
                i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = min(self.waiting, key=lambda r: self.policy.admission_key(r, self.step_count))
            hits = self.kv.get_computed_blocks(req) if self.enable_prefix_caching else []
            remaining = req.num_tokens - len(hits) * self.kv.block_size
            if remaining > budget and not self.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            if self.enable_prefix_caching:  # counted once per admission, not once per retry
                self.kv.pool.record_lookup(req.num_tokens, len(hits))
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(req)
            out.num_scheduled_tokens[req.request_id] = n
            budget -= n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        logger.debug("step %d: preempting %s", self.step_count, req.request_id)
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
        out.preempted.append(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int], errors: dict[str, str],
               now: float) -> list[Request]:
        """Advance every scheduled request by its tokens and the token it sampled.

        ``sampled`` holds a token only for rows whose chunk reached the end of their
        known tokens (a mid-prompt chunk samples nothing). ``errors`` maps request ids
        to an error found while running them; those finish with reason ``"error"``.
        Returns the requests that finished in this step (their blocks are freed).
        """
        finished = []
        for req in out.scheduled:
            req.num_computed_tokens += out.num_scheduled_tokens[req.request_id]
            self.kv.cache_full_blocks(req)
            if req.request_id in errors:
                req.error = errors[req.request_id]
                self._finish(req, "error", now, finished)
            elif req.request_id in sampled:
                req.output_token_ids.append(sampled[req.request_id])
                req.token_times.append(now)
                if req.first_token_time is None:
                    req.first_token_time = now
                reason = self._stop_reason(req)
                if reason:
                    self._finish(req, reason, now, finished)
        return finished

    def _stop_reason(self, req: Request) -> str | None:
        sp = req.sampling_params
        token = req.output_token_ids[-1]
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if token in sp.stop_token_ids:
                return "stop"
            if not sp.ignore_eos and req.eos_token_id is not None and token == req.eos_token_id:
                return "stop"
        if n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, now: float, finished: list[Request]) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = now
        self.running.remove(req)
        self.kv.free(req)
        finished.append(req)
