"""Watching the engine step by step, without a branch in the step: observers and traces.

``LLM.step`` hands every step's messages to its observers (``on_step(scheduler_output,
runner_output, outputs)``). :class:`StepRecorder` is the one behind ``record_traces=True``: it
times the step's parts by wrapping them (nothing is timed when no recorder is attached) and
keeps a :class:`StepTrace` of every step for drawings and tests.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from fleetlab.engine.messages import ModelRunnerOutput, SchedulerOutput
from fleetlab.engine.outputs import RequestOutput


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


@dataclass(slots=True)
class StepTrace:
    """Everything one engine step did, for drawing and for tests.

    rows: the batch rows in the order the model ran them; order_before / order_after:
    request ids by batch row before and after the decode-first reorder (equal when the step
    did not reorder); tokens: request id -> the tokens it kept this step; timings: seconds
    spent in each of ``STEP_TIMING_PARTS``, and in ``"record"`` the recorder's own (building
    this trace: what the step would not spend without a recorder).
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


# The parts of a step that StepTrace.timings times, in the order they run: (owner, method).
STEP_TIMING_PARTS = {"schedule": ("scheduler", "schedule"), "batch_update": ("runner", "update_batch"),
                     "metadata": ("runner", "prepare_inputs"), "forward": ("runner", "forward"),
                     "sample": ("runner", "sample"), "propose": ("proposer", "propose"),
                     "update": ("scheduler", "update")}


class StepRecorder:
    """Keeps a :class:`StepTrace` of every step of ``llm`` in ``self.traces``, with the time
    each part of the step took (the parts are wrapped once, on this recorder's creation)."""

    def __init__(self, llm):
        self.llm = llm
        self.traces: list[StepTrace] = []
        self._timings: dict[str, float] = {}
        runner = getattr(llm.runner, "runner", llm.runner)  # the model runner, also inside a tensor-parallel wrapper
        owners = {"scheduler": llm.scheduler, "runner": runner, "proposer": llm.proposer}
        for part, (owner, method) in STEP_TIMING_PARTS.items():
            if owners[owner] is not None:
                self._time(owners[owner], method, part)

    def _time(self, obj, method: str, part: str) -> None:
        fn = getattr(obj, method)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._timings[part] = self._timings.get(part, 0.0) + time.perf_counter() - start

        setattr(obj, method, timed)

    def on_step(self, so: SchedulerOutput, result: ModelRunnerOutput, outputs: list[RequestOutput]) -> None:
        start = time.perf_counter()
        pool, batch = self.llm.pool, self.llm.runner.batch
        kept = {o.request_id: o.new_token_ids for o in outputs if o.new_token_ids}
        rows = []
        if so.num_scheduled_tokens:  # the runner's rows still hold the step's inputs
            for rec in batch.snapshot():
                rid = rec.req_id
                drafts = list(so.scheduled_spec_decode_tokens.get(rid, ()))
                gained = result.sampled_token_ids.get(rid, [])
                # A decode runs the last sampled token (and the drafts after it); anything else fills the
                # cache with the prompt (one token after a prefix-cache hit, too) or recomputes.
                computed = rec.num_computed_tokens
                decode = computed == rec.num_tokens - 1 and computed >= rec.num_prompt_tokens
                rows.append(RowTrace(rid, "decode" if decode else "prefill", rec.num_scheduled_tokens,
                                     computed, rec.num_prompt_tokens, rec.block_table, drafts,
                                     max(0, len(gained) - 1) if drafts else 0, list(kept.get(rid, []))))
        self.traces.append(StepTrace(
            step=so.step, rows=rows, order_before=result.order_before, order_after=result.order_after,
            num_decodes=result.num_decodes, reordered=result.reordered, tokens=kept,
            preempted=list(so.preempted_req_ids), finished=[o.request_id for o in outputs if o.finished],
            num_free_blocks=pool.num_free_blocks, num_blocks=pool.num_blocks,
            num_batched_tokens=so.total_num_scheduled_tokens, timings=self._timings))
        self._timings = {}
        self.traces[-1].timings["record"] = time.perf_counter() - start
