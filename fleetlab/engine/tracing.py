"""Building a ``StepTrace`` from one step's messages (only when a trace is asked for)."""

from __future__ import annotations

from fleetlab.engine.outputs import RowTrace, StepTrace
from fleetlab.engine.runner_output import ModelRunnerOutput
from fleetlab.engine.scheduler_output import SchedulerOutput


def rows_before(so: SchedulerOutput, scheduler) -> dict[str, tuple[int, int, int, list[int]]]:
    """``{request id: (num_computed_tokens, num_tokens, num_prompt_tokens, block ids)}`` as
    the step starts (copied: the step changes them)."""
    out = {}
    for rid in so.num_scheduled_tokens:
        req = scheduler.requests[rid]
        out[rid] = (req.num_computed_tokens, req.num_tokens, req.num_prompt_tokens, scheduler.kv.get_block_ids(rid))
    return out


def build_step_trace(so: SchedulerOutput, result: ModelRunnerOutput, before: dict, kept: dict[str, list[int]],
                     finished: list[str], num_free_blocks: int, num_blocks: int, timings: dict) -> StepTrace:
    """The trace of one step. ``kept``: tokens each request kept (after stop truncation)."""
    rows = []
    for rid in result.order_after:
        computed, num_tokens, num_prompt, blocks = before[rid]
        # A decode runs the last sampled token (and verifies drafts after it); anything else fills
        # the cache with the prompt (even one token after a prefix-cache hit) or recomputes after
        # a preemption.
        decode = computed == num_tokens - 1 and computed >= num_prompt
        drafts = list(so.scheduled_spec_decode_tokens.get(rid, ()))
        gained = result.sampled_token_ids.get(rid, [])
        rows.append(RowTrace(
            rid, "decode" if decode else "prefill", so.num_scheduled_tokens[rid], computed, num_prompt, blocks,
            draft_token_ids=drafts, num_accepted_tokens=max(0, len(gained) - 1) if drafts else 0,
            token_ids=list(kept.get(rid, []))))
    return StepTrace(
        step=so.step, rows=rows, order_before=result.order_before, order_after=result.order_after,
        num_decodes=result.num_decodes, reordered=result.reordered, tokens=kept,
        preempted=list(so.preempted_req_ids), finished=finished, num_free_blocks=num_free_blocks,
        num_blocks=num_blocks, num_batched_tokens=so.total_num_scheduled_tokens, timings=timings)
