"""What ``/metrics`` reads of the engine beyond ``LLM.stats()``, gathered on the engine thread.

``AsyncLLM`` keeps a snapshot of the engine's figures, taken by the engine thread after each
loop turn, so that a scrape on the asyncio side never reads a half-updated count. Besides
``LLM.stats()`` the snapshot holds (:func:`snapshot`):

- ``iteration_tokens``: a histogram of the tokens each engine step ran (prompt and output
  tokens together, drafts included: vLLM's ``iteration_tokens_total``), counted by
  :class:`IterationTokens`, an engine observer (``LLM.observers``);
- with speculative decoding, ``spec_num_drafts`` (verify rows) and
  ``spec_accepted_per_position`` (how many drafts were accepted at each position), read from
  the engine's ``SpecDecodingStats``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


def iteration_buckets(max_num_batched_tokens: int) -> list[int]:
    """1, 8, 16, 32... (vLLM's bounds) up to the largest step the engine can run."""
    bounds, b = [1], 8
    while b < max_num_batched_tokens:
        bounds.append(b)
        b *= 2
    return bounds + [max_num_batched_tokens] if max_num_batched_tokens > 1 else bounds


@dataclass(slots=True)
class IterationTokens:
    """An engine observer: a histogram of ``SchedulerOutput.total_num_scheduled_tokens`` per step.

    ``bounds``: the buckets' upper bounds; ``counts[i]``: steps with at most ``bounds[i]`` tokens
    and more than ``bounds[i - 1]`` (the last entry: more than every bound).
    """

    bounds: list[int]
    counts: list[int] = field(default_factory=list)
    total: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def on_step(self, scheduler_output, runner_output, outputs) -> None:
        tokens = scheduler_output.total_num_scheduled_tokens
        if tokens:  # a step that ran nothing (all waiting on a grammar) is no iteration
            self.counts[bisect.bisect_left(self.bounds, tokens)] += 1
            self.total += tokens

    def snapshot(self) -> dict:
        """``{"bounds", "counts", "sum"}``, copies."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}


def snapshot(llm, iteration_tokens: IterationTokens) -> dict:
    """``llm.stats()`` and the counts of the module docstring (call it on the engine thread)."""
    stats = llm.stats()
    stats["iteration_tokens"] = iteration_tokens.snapshot()
    spec = getattr(llm, "spec_stats", None)
    if spec is not None:
        stats["spec_num_drafts"] = spec.num_drafts
        stats["spec_accepted_per_position"] = list(spec.accepted_per_position)
    return stats
