"""``StepRecorder``: a :class:`StepTrace` of every engine step, for drawings and tests.

The observer behind ``record_traces=True``. It sees a step only at the engine's named hooks
(:class:`~fleetlab.engine.hooks.StepHooks`): the time of each part (``on_phase``), the
runner's rows before the decode-first reorder (``on_batch_order``), and the step's messages
(``on_step``), after which it reads the rows the runner left. It holds the engine's pool and
batch, never the ``LLM``: a dropped ``LLM`` is collected with its recorder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fleetlab.engine.hooks import STEP_PHASES
from fleetlab.engine.messages import ModelRunnerOutput, SchedulerOutput
from fleetlab.engine.outputs import RequestOutput
from fleetlab.inspect.batch import batch_snapshot


@dataclass(slots=True)
class RowTrace:
    """One batch row in one step: who it was and what it did.

    draft_token_ids: the drafts it verified (empty without speculation); of those, the
    first ``num_accepted_tokens`` were accepted, the rest rejected. token_ids: the tokens
    the request kept from this step (accepted drafts, then the bonus/sampled token; cut
    at a stop).
    """

    request_id: str
    phase: str  # "decode" or "prefill": the request's phase, not the kernels' decode row (see _row)
    num_scheduled_tokens: int
    num_computed_tokens: int  # before this step
    num_prompt_tokens: int
    block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)
    num_accepted_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepTrace:
    """Everything one engine step did, for drawing and for tests.

    rows: the batch rows in the order the model ran them; order_before / order_after:
    request ids by batch row before and after the decode-first reorder (equal when the step
    did not reorder); reordered: the reorder moved rows this step; reorder: it is on for this
    engine (a step may still find every decode first already); tokens: request id -> the
    tokens it kept this step; timings: seconds spent in each of the step's ``STEP_PHASES``
    (:mod:`fleetlab.engine.hooks`), and in ``"record"`` the recorder's own (building this
    trace: what the step would not spend without a recorder).
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
    reorder: bool = False


class StepRecorder:
    """Keeps a :class:`StepTrace` of every step of ``llm`` in ``self.traces``, with the time
    each part of the step took, once attached: ``llm.hooks.attach(recorder)``."""

    def __init__(self, llm):
        self.traces: list[StepTrace] = []
        self.pool, self.batch = llm.pool, llm.runner.batch
        self.reorder, self.decode_threshold = llm.runner.reorder, llm.runner.decode_threshold
        self._timings: dict[str, float] = {}
        self._order_before: list[str] = []

    def on_phase(self, name: str, seconds: float) -> None:
        if name == STEP_PHASES[0]:  # a new step begins: drop what a step that raised left behind
            self._timings = {}
        self._timings[name] = self._timings.get(name, 0.0) + seconds

    def on_batch_order(self, req_ids: list[str]) -> None:
        self._order_before = req_ids

    def on_step(self, so: SchedulerOutput, result: ModelRunnerOutput, outputs: list[RequestOutput]) -> None:
        start = time.perf_counter()
        kept = {o.request_id: o.new_token_ids for o in outputs if o.new_token_ids}
        rows, order_after, num_decodes = [], [], 0
        if so.num_scheduled_tokens:  # the runner's rows still hold the step's inputs, in the order they ran
            rows = [self._row(rec, so, result, kept) for rec in batch_snapshot(self.batch)]
            order_after = [r.request_id for r in rows]
            num_decodes = int(self.batch.is_decode(self.decode_threshold).sum()) if self.reorder else 0
        self.traces.append(StepTrace(
            step=so.step, rows=rows, order_before=self._order_before if rows else [], order_after=order_after,
            num_decodes=num_decodes, reordered=self._order_before != order_after if rows else False, tokens=kept,
            preempted=list(so.preempted_req_ids), finished=[o.request_id for o in outputs if o.finished],
            num_free_blocks=self.pool.num_free_blocks, num_blocks=self.pool.num_blocks,
            num_batched_tokens=so.total_num_scheduled_tokens, timings=self._timings, reorder=self.reorder))
        self._timings, self._order_before = {}, []
        self.traces[-1].timings["record"] = time.perf_counter() - start

    @staticmethod
    def _row(rec, so: SchedulerOutput, result: ModelRunnerOutput, kept: dict) -> RowTrace:
        rid = rec.req_id
        drafts = list(so.scheduled_spec_decode_tokens.get(rid, ()))
        gained = result.sampled_token_ids.get(rid, [])
        # The request's phase: a decode runs the last sampled token (and the drafts after it); anything
        # else fills the cache with the prompt (one token after a prefix-cache hit, too) or recomputes.
        # The kernels' decode row is another thing (metadata.is_decode_row, by query length): a 1-token
        # prefill chunk is a prefill here and a decode row there (notebook 04 shows one).
        computed = rec.num_computed_tokens
        decode = computed == rec.num_tokens - 1 and computed >= rec.num_prompt_tokens
        return RowTrace(rid, "decode" if decode else "prefill", rec.num_scheduled_tokens, computed,
                        rec.num_prompt_tokens, rec.block_table, drafts, max(0, len(gained) - 1) if drafts else 0,
                        list(kept.get(rid, [])))
