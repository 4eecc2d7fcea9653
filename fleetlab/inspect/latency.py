"""Request latency: time to first token (TTFT) and time per output token (TPOT), with percentiles.

Two clocks, both useful:

- **seconds**, from each ``RequestOutput.metrics`` (``arrival_time``, ``first_token_time``,
  ``finish_time``; ``time.perf_counter`` values). What a user feels, but noisy on a busy
  machine, and a step's cost depends on what it batched (a long prefill makes a slow step).
- **engine steps**, from ``LLM.traces`` (``record_traces=True``): ``StepTrace.tokens`` says
  which request got a token in which step. Steps do not depend on machine load, so they
  isolate what a scheduling decision changed.

For a request with ``n`` output tokens:

- ``TTFT = first_token - arrival``; in steps, the steps from the one it arrived before up to
  and including the one that produced its first token (a prompt served at once: 1 step).
- ``TPOT = (finish - first_token) / (n - 1)``, defined for ``n > 1`` only; in steps,
  ``(last token's step - first token's step) / (n - 1)`` (1.0 when it decoded every step).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True, frozen=True)
class Percentiles:
    """p50 / p90 / p99 and mean of one latency over the requests that have it (NaN if none).

    count: how many requests had a value (TPOT needs two tokens, TTFT one).
    """

    p50: float
    p90: float
    p99: float
    mean: float
    count: int

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Percentiles:
        """Percentiles (linear interpolation) of ``values``, skipping None and NaN."""
        kept = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=np.float64)
        if kept.size == 0:
            nan = float("nan")
            return cls(nan, nan, nan, nan, 0)
        p50, p90, p99 = (float(x) for x in np.percentile(kept, PERCENTILES))
        return cls(p50, p90, p99, float(kept.mean()), int(kept.size))


@dataclass(slots=True, frozen=True)
class RequestLatency:
    """One request's latencies. None where undefined: no token yet, a single token (TPOT),
    or no traces given (the step-based ones)."""

    request_id: str
    num_output_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    ttft_steps: int | None = None
    tpot_steps: float | None = None


@dataclass(slots=True, frozen=True)
class LatencyStats:
    """Per-request latencies and their percentiles over a run.

    ``ttft_s`` / ``tpot_s`` are in seconds; ``ttft_steps`` / ``tpot_steps`` in engine steps,
    None when :func:`latency_stats` got no traces.
    """

    requests: tuple[RequestLatency, ...]
    ttft_s: Percentiles
    tpot_s: Percentiles
    ttft_steps: Percentiles | None = None
    tpot_steps: Percentiles | None = None

    @property
    def has_steps(self) -> bool:
        return self.ttft_steps is not None


def token_steps(traces: Sequence) -> dict[str, list[int]]:
    """``{request id: [step of each output token]}`` from engine traces (``StepTrace.tokens``)."""
    steps: dict[str, list[int]] = {}
    for trace in traces:
        for request_id, tokens in trace.tokens.items():
            steps.setdefault(request_id, []).extend([trace.step] * len(tokens))
    return steps


def latency_stats(outputs: Sequence, traces: Sequence | None = None,
                  arrival_steps: Mapping[str, int] | None = None) -> LatencyStats:
    """TTFT and TPOT of every request in ``outputs`` (``RequestOutput`` s), with percentiles.

    Args:
      outputs: the run's ``RequestOutput`` s; each ``metrics`` needs ``arrival_time``,
        ``first_token_time`` and ``finish_time`` (None while unknown).
      traces: the run's ``LLM.traces`` (every step, from the first), for the step-based
        figures; None computes seconds only.
      arrival_steps: ``{request id: scheduler step count when it was added}`` (e.g.
        ``llm.stats()["num_steps"]`` just before ``add_request``). Missing ids arrived
        before the first traced step, as with ``LLM.generate``.
    Raises ``ValueError`` when the traces disagree with an output (a request whose tokens
    the traces do not all show, or one that ran before its arrival step).
    """
    by_request = token_steps(traces) if traces is not None else None
    first_step = traces[0].step if traces else 0
    arrivals = dict(arrival_steps or {})
    rows = []
    for out in outputs:
        rid = out.request_id
        ttft_s, tpot_s = _seconds(out)
        ttft_steps = tpot_steps = None
        if by_request is not None:
            ttft_steps, tpot_steps = _steps(rid, len(out.token_ids), by_request.get(rid, []),
                                            arrivals.get(rid, first_step))
        rows.append(RequestLatency(rid, len(out.token_ids), ttft_s, tpot_s, ttft_steps, tpot_steps))
    with_steps = by_request is not None
    return LatencyStats(
        requests=tuple(rows),
        ttft_s=Percentiles.of(r.ttft_s for r in rows),
        tpot_s=Percentiles.of(r.tpot_s for r in rows),
        ttft_steps=Percentiles.of(r.ttft_steps for r in rows) if with_steps else None,
        tpot_steps=Percentiles.of(r.tpot_steps for r in rows) if with_steps else None,
    )


def _seconds(out) -> tuple[float | None, float | None]:
    """Wall-clock ``(TTFT, TPOT)`` of one output, None where undefined."""
    m = out.metrics
    arrival, first, finish = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
    if arrival is None or first is None:
        return None, None
    ttft = float(first - arrival)
    n = len(out.token_ids)
    tpot = float(finish - first) / (n - 1) if finish is not None and n > 1 else None
    return ttft, tpot


def _steps(rid: str, num_tokens: int, steps: list[int], arrival: int) -> tuple[int | None, float | None]:
    """Step-based ``(TTFT, TPOT)`` of one request from the steps its tokens came in."""
    if len(steps) != num_tokens:
        raise ValueError(f"request {rid!r}: the traces show {len(steps)} output tokens but the output has "
                         f"{num_tokens}; record every step (LLM(record_traces=True)) from the first")
    if not steps:
        return None, None
    if steps[0] < arrival:
        raise ValueError(f"request {rid!r}: first token in step {steps[0]}, before its arrival step {arrival}")
    ttft = steps[0] - arrival + 1  # the arrival step itself counts: served at once = 1 step
    tpot = (steps[-1] - steps[0]) / (num_tokens - 1) if num_tokens > 1 else None
    return ttft, tpot


def latency_table(stats_by_name: Mapping[str, LatencyStats]) -> str:
    """A text table, one line per run: TTFT and TPOT p50/p90/p99 in steps (if known) and ms."""
    columns = [("ttft_steps", 1.0, "TTFT steps"), ("tpot_steps", 1.0, "TPOT steps"),
               ("ttft_s", 1e3, "TTFT ms"), ("tpot_s", 1e3, "TPOT ms")]
    columns = [c for c in columns if all(getattr(s, c[0]) is not None for s in stats_by_name.values())]
    width = max([len(n) for n in stats_by_name] + [6])
    head = " " * width + "".join(f" | {label:^22}" for _, _, label in columns)
    sub = " " * width + " | " + " | ".join(f"{'p50':>6} {'p90':>7} {'p99':>7}" for _ in columns)
    lines = [head, sub]
    for name, stats in stats_by_name.items():
        cells = []
        for field, scale, _ in columns:
            p = getattr(stats, field)
            cells.append(f"{p.p50 * scale:6.1f} {p.p90 * scale:7.1f} {p.p99 * scale:7.1f}")
        lines.append(f"{name:<{width}} | " + " | ".join(cells))
    return "\n".join(lines)
