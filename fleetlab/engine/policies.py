"""Scheduling policies: who is admitted next, and who is preempted when blocks run out.

A policy is a small object with two methods, chosen in the engine config by name
(``scheduling_policy="fcfs"``), class or instance. Register your own with
:func:`register_policy` to choose it by name.
"""

from __future__ import annotations

from fleetlab.engine.request import Request
from fleetlab.errors import FieldTypeError, short
from fleetlab.registry import Registry


class SchedulingPolicy:
    """First come, first served: admit in arrival order, preempt the newest admission.

    ``admission_key(request, step)``: the waiting request with the smallest key is
    admitted next (a preempted request keeps its arrival order, so it goes back to the
    front). ``pick_victim(running)``: the running request to preempt when the pool is
    dry; ``running`` is in admission order.
    """

    name = "fcfs"

    def attach(self, kv_manager) -> None:
        """Called once by the scheduler with its KV manager (a cache-aware policy asks it)."""

    def admission_key(self, request: Request, step: int):
        return request.arrival_order

    def pick_victim(self, running: list[Request]) -> Request:
        return running[-1]


class ShortestPromptFirst(SchedulingPolicy):
    """Admit the shortest waiting prompt first: lower time to first token on average,
    but a long prompt can wait as long as shorter ones keep arriving."""

    name = "spf"

    def admission_key(self, request: Request, step: int):
        return (request.num_prompt_tokens, request.arrival_order)


class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` runs first, with aging so nobody starves.

    Every ``aging_steps`` steps a request has waited lowers its effective priority by
    one, so a request waits at most ``(priority - best_priority + 1) * aging_steps``
    steps behind requests that arrived after it. Preemption takes the running request
    with the worst priority (the newest among equals).
    """

    name = "priority"

    def __init__(self, aging_steps: int = 32):
        if aging_steps < 1:
            raise ValueError(f"PriorityPolicy: aging_steps={aging_steps} must be >= 1")
        self.aging_steps = aging_steps

    def admission_key(self, request: Request, step: int):
        waited = step - request.enqueue_step
        return (request.priority - waited // self.aging_steps, request.arrival_order)

    def pick_victim(self, running: list[Request]) -> Request:
        return max(reversed(running), key=lambda r: r.priority)


POLICIES = Registry("scheduling_policy", SchedulingPolicy, {
    "fcfs": "fleetlab.engine.policies:SchedulingPolicy",
    "spf": "fleetlab.engine.policies:ShortestPromptFirst",
    "priority": "fleetlab.engine.policies:PriorityPolicy",
    "lpm": "fleetlab.engine.longest_prefix_match:LongestPrefixMatch",
})
register_policy = POLICIES.register


def check_victim(policy, victim, running: list):
    """What ``policy.pick_victim(running)`` returned, checked where the scheduler receives it:
    one of the ``running`` requests themselves (not an id, a copy or None), else a
    ``TypeError`` / ``ValueError`` naming the policy (raised before anything is preempted)."""
    if any(victim is r for r in running):
        return victim
    name = f"scheduling policy {getattr(policy, 'name', '?')!r} ({type(policy).__name__})"
    if not isinstance(victim, Request):
        raise FieldTypeError(f"{name}: pick_victim returned {short(victim)} ({type(victim).__name__}); it must "
                             "return one of the Request objects in the list it is given")
    raise ValueError(f"{name}: pick_victim returned request {victim.request_id!r}, which is not running; it must "
                     "return one of the requests in the list it is given")
