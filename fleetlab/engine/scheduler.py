"""``Scheduler``: continuous batching under a token budget, the only owner of request progress.

Each step it fills ``max_num_batched_tokens`` and at most ``max_num_seqs`` rows: running
requests first (a decode, the drafts it verifies, or the next chunk of a long prompt),
then waiting requests in the policy's order. Prefills and decodes share a step. When the
block pool runs dry it preempts a running request (the policy picks: by default the most
recently admitted), frees its blocks and puts it back in the waiting queue to be
recomputed later. A request whose K/V a KV connector loads between steps (``load_kv_async``)
is admitted ``WAITING_FOR_REMOTE_KVS``: its blocks allocated, skipped each step while the
others run, until the connector's future says the K/V arrived (it joins) or failed (it is
recomputed); a dry pool may preempt it like any running request. The engine rejects any
request the whole pool could not hold, so the request the policy never preempts (the
oldest, under the default first-come-first-served policy) can always finish: the loop
cannot deadlock.

The step is a transaction: :meth:`Scheduler.schedule` plans it and sends the runner a
:class:`~fleetlab.engine.messages.SchedulerOutput`; :meth:`Scheduler.update` commits the
runner's :class:`~fleetlab.engine.messages.ModelRunnerOutput` and returns the step's
:class:`~fleetlab.engine.outputs.RequestOutput` s (a request's tokens advance here and
nowhere else; drafts the target rejected roll ``num_computed_tokens`` back); if the runner
fails instead, :meth:`Scheduler.rollback` undoes what planning changed.

Speculative decoding needs no branch here: a request's drafts (``spec_token_ids``, empty
without speculation) are scheduled after its known tokens, and the slots a draft model
writes past a request's end are reserved by ``num_lookahead_tokens`` (0 without it).
"""

from __future__ import annotations

import logging
import time

from fleetlab.engine.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from fleetlab.engine.outputs import RequestOutput
from fleetlab.engine.policies import POLICIES, SchedulingPolicy, check_victim
from fleetlab.engine.request import Request, RequestStatus
from fleetlab.kv.manager import KVCacheManager
from fleetlab.kv_transfer.base import (
    NULL_CONNECTOR,
    KVConnector,
    checked_arrival,
    checked_holds,
    checked_num_matched,
    connector_call,
    requests_to_recompute,
)

logger = logging.getLogger(__name__)


class Scheduler:
    """Chooses, every step, which requests run and how many tokens each.

    Args:
      kv_manager: the request-level view of the block pool (the scheduler's only way to it).
      max_num_batched_tokens, max_num_seqs, max_model_len: the step's budget and caps.
      enable_chunked_prefill: let a prompt take several steps; without it a prompt is
        admitted only when it fits whole in the step's remaining budget.
      policy: a :class:`SchedulingPolicy` instance or class, or its registered name.
      num_lookahead_tokens: slots reserved past a request's last token when it samples
        (a draft model writes its proposals there).
      kv_connector: a :class:`~fleetlab.kv_transfer.KVConnector` (tokens loadable from outside
        at admission, blocks kept until a save is done); default: the null connector.
    """

    def __init__(self, kv_manager: KVCacheManager, *, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 policy: SchedulingPolicy | str = "fcfs", num_lookahead_tokens: int = 0,
                 kv_connector: KVConnector = NULL_CONNECTOR):
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.num_lookahead_tokens = num_lookahead_tokens
        self.policy = POLICIES.make(policy)
        self.policy.attach(kv_manager)
        self.connector = kv_connector
        self._held: dict[str, Request] = {}  # retired, blocks kept until the connector's save is done
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_count = 0
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        # What the runner holds of each request: (tokens, blocks) as of the last message.
        self._sent: dict[str, tuple[int, int]] = {}
        self._finished_ids: set[str] = set()
        self.admitted: list[Request] = []  # the last plan's admissions, which rollback sends back
        self.planned: SchedulerOutput | None = None  # the last plan, whole or (if planning failed) partial

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queue a new request (validated by the engine; ``WAITING``, as built) at the back of the
        waiting list."""
        request.enqueue_step = self.step_count
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def abort(self, request_ids) -> list[Request]:
        """Finish the named waiting or running requests with reason ``"abort"`` (their
        ``finish_time`` now) and free their blocks at once; ids of finished or unknown requests
        are skipped. If the KV connector's ``request_finished`` raises, nothing is aborted."""
        aborted = [self.requests[rid] for rid in dict.fromkeys(request_ids) if rid in self.requests]
        holds = [self._connector_holds(req) for req in aborted]  # may raise: before anything changes
        now = time.perf_counter()
        for req, hold in zip(aborted, holds):
            self._finish(req, "abort", now, hold)
        return aborted

    # ------------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        """Plan one step: running requests first (preempting on a dry pool), then admissions.

        If anything raises while planning (a policy, the prefix cache, the KV connector), the
        partial plan is ``self.planned``: the engine core hands it to :meth:`rollback`."""
        out = self.planned = SchedulerOutput(step=self.step_count)
        self.step_count += 1  # now, so that rolling back a partial plan takes it back
        self.admitted = []
        self._take_remote_kvs(out)
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted_req_ids:  # after a preemption the pool is tight: admit nobody new
            self._schedule_waiting(out, budget)
        self._fill_request_data(out)
        out.kv_copies = self.kv.take_copies(out.num_scheduled_tokens)  # partial prefix hits, copied first
        out.finished_req_ids, self._finished_ids = self._finished_ids, set()
        out.kv_connector_metadata = connector_call(self.connector, "build_connector_meta", out, self)
        return out

    def _take_remote_kvs(self, out: SchedulerOutput) -> None:
        """Requests whose remote K/V arrived join the batch; a failed transfer (False, or an
        exception out of the future) is recomputed."""
        for req in [r for r in self.running if r.status is RequestStatus.WAITING_FOR_REMOTE_KVS and r.is_ready]:
            if req.waiting_on.exception() is not None:
                logger.warning("KV connector %s: the transfer of request %s failed (%r); it will be recomputed",
                               self.connector.name, req.request_id, req.waiting_on.exception())
            arrived = req.waiting_on.exception() is None and req.waiting_on.result() is True
            req.waiting_on, req.status = None, RequestStatus.RUNNING
            if not arrived:
                self._preempt(req, out)

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Known tokens still to compute plus the drafts (or the placeholders of tokens a step in
        flight will sample), within the budget and the model's length."""
        n = req.num_tokens + req.num_placeholders + len(req.spec_token_ids) - req.num_computed_tokens
        return min(n, budget, self.max_model_len - req.num_computed_tokens)

    def _lookahead(self, req: Request, num_new_tokens: int) -> int:
        """Lookahead slots only for a row that will sample (its chunk reaches its last token)."""
        return self.num_lookahead_tokens if req.num_computed_tokens + num_new_tokens >= req.num_tokens else 0

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
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:  # blocks held, nothing to run yet
                i += 1
                continue
            n = self._num_new_tokens(req, budget)
            while self.kv.allocate_slots(req, n, self._lookahead(req, n), max_num_tokens=self.max_model_len) is None:
                victim = check_victim(self.policy, self.policy.pick_victim(self.running), self.running)
                budget += out.num_scheduled_tokens.pop(victim.request_id, 0)
                out.scheduled_spec_decode_tokens.pop(victim.request_id, None)
                if self.running.index(victim) < i:
                    i -= 1
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                budget -= self._schedule(req, n, out)
                i += 1
        return budget

    def _schedule(self, req: Request, n: int, out: SchedulerOutput) -> int:
        """Put ``n`` of the request's tokens in the plan (the last ones past its known tokens are
        drafts to verify); returns ``n``, what the step's budget gives up."""
        out.num_scheduled_tokens[req.request_id] = n
        num_drafts = req.num_computed_tokens + n - req.num_tokens
        if num_drafts > 0:
            out.scheduled_spec_decode_tokens[req.request_id] = req.spec_token_ids[:num_drafts]
        return n

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:  # held ones count
            ready = [r for r in self.waiting if r.is_ready]  # a request whose grammar compiles waits
            if not ready:
                break
            req = min(ready, key=lambda r: self.policy.admission_key(r, out.step))
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            num_external = checked_num_matched(self.connector, connector_call(  # loaded, not computed
                self.connector, "get_num_new_matched_tokens", req, num_hit_tokens), req, num_hit_tokens)
            remaining = req.num_tokens - num_hit_tokens - num_external
            if remaining > budget and not self.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            wait = num_external > 0 and self.connector.load_kv_async  # its K/V arrive between steps
            if wait:  # it holds its slots as lookahead: no block enters the prefix cache before its K/V is there
                new, ahead = 0, num_external + remaining + self.num_lookahead_tokens
            else:
                new, ahead = num_external + n, self._lookahead(req, n + num_hit_tokens + num_external)
            try:
                if self.kv.allocate_slots(req, new, ahead, hits, max_num_tokens=self.max_model_len) is None:
                    break
            except BaseException:  # (the prefix cache failed) not admitted: it holds no block
                self.kv.free(req)
                raise
            if self.kv.prefix_cache is not None:  # counted once per admission, not once per retry
                self.kv.record_lookup(req, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens + num_external
            self.waiting.remove(req)  # admitted now: a rollback from here on sends it back with its blocks
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS if wait else RequestStatus.RUNNING
            self.running.append(req)
            self.admitted.append(req)
            arrival = checked_arrival(self.connector, connector_call(
                self.connector, "update_state_after_alloc", req, self.kv.get_block_ids(req.request_id),
                num_hit_tokens, num_external), wait)
            req.first_scheduled_time = req.first_scheduled_time or time.perf_counter()
            req.waiting_on = arrival if wait else req.waiting_on
            if not wait:
                budget -= self._schedule(req, n, out)

    def _fill_request_data(self, out: SchedulerOutput) -> None:
        """Full data for requests the runner lacks; the diff for those it holds."""
        sent = {}
        for rid in out.num_scheduled_tokens:
            req = self.requests[rid]
            blocks = self.kv.get_block_ids(rid)
            if rid in self._sent:
                num_tokens, num_blocks = self._sent[rid]
                new_tokens = req.output_token_ids[num_tokens - req.num_prompt_tokens:]  # it has the prompt
                out.scheduled_cached_reqs.add(rid, new_tokens, blocks[num_blocks:], len(blocks),
                                              req.num_computed_tokens)
            else:
                out.scheduled_new_reqs.append(NewRequestData(
                    rid, list(req.prompt_token_ids), list(req.output_token_ids), req.sampling_params, req.seed,
                    req.eos_token_id, blocks, req.num_computed_tokens, req.extra))
            sent[rid] = (req.num_tokens, len(blocks))
        self._sent = sent  # the runner drops every row this step does not schedule

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        logger.debug("step %d: preempting %s", self.step_count, req.request_id)
        self.running.remove(req)
        self.kv.free(req)
        self._sent.pop(req.request_id, None)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.waiting_on = None  # a transfer still arriving is discarded (the connector reads preempted_req_ids)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(req)
        out.preempted_req_ids.append(req.request_id)

    # ------------------------------------------------------------------ committing
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput, now: float | None = None) -> list[RequestOutput]:
        """Commit the step: advance every scheduled request by what the runner computed, and
        return a ``RequestOutput`` for each request that gained tokens or finished.

        A row verifying ``k`` drafts computed ``k + 1`` positions and gained the accepted
        drafts plus one token: ``num_computed_tokens`` moves back over the rejected ones
        (their K/V are dropped: later tokens overwrite their slots, and blocks past the new
        end are freed). Tokens are appended one at a time, so a stop token, EOS,
        ``max_tokens`` or the model's length inside an accepted run ends the request exactly
        where plain decoding would. Finished requests free their blocks.

        Two phases: first what the step does to each request is worked out and the KV connector
        is told which requests retire (``request_finished``, the one extension called here);
        only then is anything changed. So if the connector raises, nothing is committed and the
        engine core rolls the whole step back (held blocks whose save is done are freed first,
        whatever happens: that news comes once).
        """
        now = time.perf_counter() if now is None else now
        for rid in result.finished_sending & self._held.keys():  # the connector's save is done: free what it kept
            self.kv.free(self._held.pop(rid))
        redo = requests_to_recompute(self.kv, out.num_scheduled_tokens, result.kv_load_failed_block_ids)
        plan = [(self.requests[rid], n, *self._outcome(self.requests[rid], out, result, rid))
                for rid, n in out.num_scheduled_tokens.items() if rid not in redo]
        holds = {req.request_id: self._connector_holds(req) for req, _, _, reason, _ in plan if reason}
        for rid in redo:  # a KV load failed: recompute, as after a preemption (before commit drops its cache entries)
            self._preempt(self.requests[rid], out)
        self.kv.commit_step()
        outputs = [self._commit(req, n, tokens, reason, num_rejected, result, holds.get(req.request_id), now)
                   for req, n, tokens, reason, num_rejected in plan]
        return [o for o in outputs if o is not None]

    def _outcome(self, req: Request, out: SchedulerOutput, result: ModelRunnerOutput, rid: str):
        """What the step does to a request, changing nothing: ``(tokens it keeps or None, why it
        finishes or None, drafts rejected)``."""
        if rid in result.errors:
            return None, "error", 0
        tokens = result.sampled_token_ids.get(rid)
        if tokens is None:
            return None, None, 0  # a prefill chunk that did not reach the prompt's end
        num_rejected = len(out.scheduled_spec_decode_tokens.get(rid, ())) + 1 - len(tokens)
        n_out, num_tokens = len(req.output_token_ids), req.num_tokens
        for i, token in enumerate(tokens):  # one at a time: a stop inside an accepted run ends it there
            if reason := self._stop_reason(req.sampling_params, req.eos_token_id, token, n_out + i + 1,
                                           num_tokens + i + 1):
                return tokens[: i + 1], reason, num_rejected
        return tokens, None, num_rejected

    def _commit(self, req: Request, n: int, tokens, reason, num_rejected: int, result: ModelRunnerOutput,
                hold, now: float) -> RequestOutput | None:
        """Advance one request as :meth:`_outcome` worked out (nothing here calls an extension); its
        output, or None for a prefill chunk short of the prompt's end."""
        rid = req.request_id
        req.num_computed_tokens += n - num_rejected
        if rid in result.errors:
            req.error = result.errors[rid]
        if tokens is not None:
            req.first_token_time = req.first_token_time or now
            req.output_token_ids.extend(tokens)
            self.num_generated_tokens += len(tokens)
        if reason is not None:
            self._finish(req, reason, now, hold)
        elif tokens is not None:
            req.spec_token_ids = result.spec_token_ids.get(rid, [])
            if num_rejected:
                self._free_rejected_slots(req)
        return None if tokens is None and reason is None else RequestOutput.from_request(req, tokens or [])

    def _free_rejected_slots(self, req: Request) -> None:
        """Give back the blocks past the request's new end (and its lookahead), and tell the
        runner its table is cut back (the next diff's ``num_blocks``)."""
        rid = req.request_id
        if self.kv.free_blocks_beyond(req, min(req.num_tokens + self.num_lookahead_tokens, self.max_model_len)):
            self._sent[rid] = (self._sent[rid][0], len(self.kv.get_block_ids(rid)))

    def _stop_reason(self, sp, eos_token_id, token: int, n_out: int, num_tokens: int) -> str | None:
        """Why a request ends at ``token``, its ``n_out``-th output and ``num_tokens``-th token:
        ``"stop"`` (a stop token or EOS, once ``min_tokens`` are out), ``"length"`` (``max_tokens``
        or the model's length), or None."""
        at_stop = token in sp.stop_token_ids or (not sp.ignore_eos and token == eos_token_id)  # EOS unless ignored
        if n_out >= sp.min_tokens and at_stop:
            return "stop"
        if n_out >= sp.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def _connector_holds(self, req: Request) -> bool:
        """Tell the KV connector the request retires; True: it keeps the blocks until its save is done."""
        return checked_holds(self.connector, connector_call(
            self.connector, "request_finished", req, self.kv.get_block_ids(req.request_id)))

    def _finish(self, req: Request, reason: str, now: float, hold: bool) -> None:
        """End a running request (or a waiting one, aborted): free its blocks (or hold them, if
        the connector asked, ``hold``) and forget it (the engine keeps no history)."""
        req.finish_time = now
        if req in self.running:
            self.running.remove(req)
        else:  # aborted while waiting
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.spec_token_ids = []
        if hold:
            self._held[req.request_id] = req  # freed once get_finished names it
        else:
            self.kv.free(req)
        self.requests.pop(req.request_id, None)
        self._sent.pop(req.request_id, None)
        self._finished_ids.add(req.request_id)

    def rollback(self, out: SchedulerOutput, admitted: list[Request] | None = None) -> None:
        """The runner failed on ``out``: undo what planning changed, so the step never happened.
        ``admitted``: the requests ``out`` admitted (default: the last plan's, ``self.admitted``).

        Prefix-cache entries registered for the step are dropped (their K/V may be unwritten),
        requests admitted in it go back to the waiting queue with their blocks freed, and the
        runner (reset by the engine) is sent every request's full data again. Running
        requests keep the blocks planning gave them (they will need them); preemptions stand.
        """
        self.kv.rollback_step()
        for req in reversed(self.admitted if admitted is None else admitted):
            self.running.remove(req)
            self.kv.free(req)
            req.num_computed_tokens, req.waiting_on = 0, None  # (a transfer it awaited is dropped)
            req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
            self.waiting.insert(0, req)
        self.admitted = []
        self._sent.clear()
        self._finished_ids |= set(out.finished_req_ids)
        self.step_count -= 1
        connector_call(self.connector, "rollback", out)
