"""Who waited in the queue, when, and what kept them out.

A step's trace lists the requests that ran; a request that waits appears in none. The
caller knows when each request arrived (it called ``add_request`` before that step), and the
traces say when it first ran, when it was preempted and when it ran again: between those, it
waited. Why it waited is read from the trace of each step it waited through, in the order the
scheduler stops admitting (``Scheduler._schedule_waiting``):

- ``"preemption"``: the step preempted a running request (the pool ran dry for the requests
  already running), and a step that preempts admits nobody new;
- ``"rows"``: ``max_num_seqs`` requests ran in the step: no row was free;
- ``"budget"``: the step's tokens filled ``max_num_batched_tokens``;
- ``"pool"``: none of those: the next request's first chunk needed more KV blocks than the
  pool had free (with ``enable_chunked_prefill=False``: or its whole prompt did not fit the
  budget left, reported as ``"pool or budget"``).

Under first-come-first-served the queue's head blocks everyone behind it: a request waits for
the step's reason even when it would have fitted itself (head-of-line blocking).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Why nobody (more) was admitted in a step, as the legend and the prose say it.
WAIT_REASONS = {
    "rows": "all rows taken (max_num_seqs)",
    "budget": "token budget spent (max_num_batched_tokens)",
    "pool": "KV pool full: no blocks for the next prompt",
    "pool or budget": "the next prompt needs more blocks than are free or more tokens than are left",
    "preemption": "the pool ran dry for running requests: one was preempted, nobody admitted",
}


@dataclass(slots=True)
class Wait:
    """One stay in the waiting queue: steps ``start .. end - 1`` (``end``: the step it ran in;
    None if the traces end first; ``start == end`` when it ran in the step it arrived).

    after_preemption: the stay began with a preemption (``start`` is the step after it).
    reasons: ``{step: reason}`` for every step waited through (keys of ``WAIT_REASONS``).
    """

    request_id: str
    start: int
    end: int | None
    after_preemption: bool
    reasons: dict[int, str] = field(default_factory=dict)

    @property
    def steps(self) -> list[int]:
        """The steps it waited through."""
        return sorted(self.reasons)

    def describe(self) -> str:
        """One sentence: when it queued, how long, and what blocked each step of it."""
        came = "was preempted" if self.after_preemption else "arrived"
        when = f"step {self.start - 1}" if self.after_preemption else f"step {self.start}"
        if not self.reasons:
            return f"req {self.request_id} {came} in {when} and ran at once"
        by_reason: dict[str, list[int]] = {}
        for step, reason in sorted(self.reasons.items()):
            by_reason.setdefault(reason, []).append(step)
        why = "; ".join(f"{WAIT_REASONS[r]}: step{'s' if len(s) > 1 else ''} {_ranges(s)}"
                        for r, s in by_reason.items())
        ran = f"ran in step {self.end}" if self.end is not None else "still waiting when the traces end"
        return f"req {self.request_id} {came} in {when}, waited {len(self.reasons)} step(s) ({why}), {ran}"


def _ranges(steps: Sequence[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    out, first, prev = [], steps[0], steps[0]
    for s in [*steps[1:], None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(f"{first}-{prev}" if prev > first else f"{first}")
        if s is not None:
            first = prev = s
    return ", ".join(out)


def blocked_by(trace, config) -> str:
    """Why the scheduler admitted nobody (more) in the step of ``trace`` (see the module doc).

    ``config``: anything with ``max_num_seqs``, ``max_num_batched_tokens`` and
    ``enable_chunked_prefill`` (an ``EngineConfig``, ``llm.config``)."""
    if trace.preempted:
        return "preemption"
    if len(trace.rows) >= config.max_num_seqs:
        return "rows"
    if trace.num_batched_tokens >= config.max_num_batched_tokens:
        return "budget"
    return "pool" if config.enable_chunked_prefill else "pool or budget"


def queue_waits(traces: Sequence, arrival_steps: Mapping[str, int], config) -> list[Wait]:
    """Every stay in the waiting queue, in order of its start (see :class:`Wait`).

    ``arrival_steps``: ``{request id: step}`` of each request added before that step ran;
    ``config``: the engine's settings (``llm.config``). Requests absent from
    ``arrival_steps`` are counted from their first step (they never waited before it).
    """
    runs: dict[str, list[int]] = {}
    preempted: dict[str, list[int]] = {}
    for t in traces:
        for row in t.rows:
            runs.setdefault(row.request_id, []).append(t.step)
        for rid in t.preempted:
            preempted.setdefault(rid, []).append(t.step)
    by_step = {t.step: t for t in traces}
    last = traces[-1].step if traces else -1
    starts = [(str(rid), int(step), False) for rid, step in arrival_steps.items()]
    starts += [(rid, p + 1, True) for rid, steps in preempted.items() for p in steps]
    waits = []
    for rid, start, after_preemption in starts:
        end = next((s for s in runs.get(rid, []) if s >= start), None)
        stop = last + 1 if end is None else end
        reasons = {s: blocked_by(by_step[s], config) for s in range(start, stop) if s in by_step}
        waits.append(Wait(rid, start, end, after_preemption, reasons))
    return sorted(waits, key=lambda w: (w.start, not w.after_preemption, _id_key(w.request_id)))


def _id_key(request_id: str):
    return (0, int(request_id), "") if request_id.isdigit() else (1, 0, request_id)


def queue_before(waits: Sequence[Wait], step: int) -> list[str]:
    """The requests in the waiting queue as ``step`` begins (the step may admit them)."""
    return [w.request_id for w in waits if w.start <= step and (w.end is None or step <= w.end)]
