"""``scheduling_policy="lpm"``: admit the waiting request with the longest cached prefix first.

SGLang's longest-prefix-match: when many requests wait, running first those whose prompt the
prefix cache already holds most of computes fewer prompt tokens, and keeps a shared prefix in
use (so it is not evicted) while the requests sharing it run back to back. Left alone it
starves a request nothing shares with; the guard is aging: a request that has waited
``max_wait_steps`` steps is admitted before any cache-favoured one, oldest first.
"""

from __future__ import annotations

from fleetlab.engine.policies import SchedulingPolicy


class LongestPrefixMatch(SchedulingPolicy):
    """Longest cached prefix first (ties: arrival order); a request that waited
    ``max_wait_steps`` steps goes first, oldest first. Preempts the newest admission."""

    name = "lpm"

    def __init__(self, max_wait_steps: int = 64):
        if not isinstance(max_wait_steps, int) or max_wait_steps < 1:
            raise ValueError(f"LongestPrefixMatch: max_wait_steps={max_wait_steps!r} must be an int >= 1")
        self.max_wait_steps = max_wait_steps
        self.kv = None

    def attach(self, kv_manager) -> None:
        self.kv = kv_manager

    def admission_key(self, request, step: int):
        if step - request.enqueue_step >= self.max_wait_steps:
            return (0, 0, request.arrival_order)
        _, num_cached_tokens = self.kv.get_computed_blocks(request)
        return (1, -num_cached_tokens, request.arrival_order)
