"""``Ahead``: what planning a step ahead of the one in flight advanced, and taking it back.

The scheduler plans step N+1 before step N is committed. For that plan to be right, each
request scheduled in step N must look as if step N had run: its ``num_computed_tokens``
past step N's tokens, and one placeholder for the token step N samples
(``Request.num_placeholders``). :meth:`Ahead.take` makes that advance right after planning;
:meth:`Ahead.settle` takes it back just before the scheduler commits step N, so that
``Scheduler.update`` advances every request exactly as in the synchronous loop (the scheduler
alone advances a request, one step behind what the model computed). A request that is no
longer running as planned (finished by step N-1, aborted, stopped by a stop string, or
preempted while step N+1 was planned) is left out of the commit: its slot was wasted, its
token is dropped, and it never gains a token from a step it was scheduled in after it finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fleetlab.engine.messages import ModelRunnerOutput, SchedulerOutput
from fleetlab.engine.request import Request, RequestStatus


@dataclass(slots=True)
class _Advance:
    request: Request
    num_tokens: int  # scheduled in the step
    samples: bool  # the step samples a token for it (its chunk reaches its last token)
    num_preemptions: int  # as planned: a preemption since makes the plan stale


@dataclass(slots=True)
class Ahead:
    """One planned step's advances (request id -> what it added) and its admissions."""

    advances: dict[str, _Advance] = field(default_factory=dict)
    admitted: list[Request] = field(default_factory=list)
    undone: bool = False  # the advance was taken back (settled, or rolled back): never twice

    @classmethod
    def take(cls, scheduler, sched: SchedulerOutput) -> Ahead:
        """Advance every request ``sched`` schedules as if the step had run, and open the KV
        manager's log of the next step (this one stays open until it is committed)."""
        ahead = cls(admitted=list(scheduler.admitted))  # what a rollback of this plan sends back
        for rid, n in sched.num_scheduled_tokens.items():
            req = scheduler.requests[rid]
            samples = req.num_computed_tokens + n >= req.num_tokens + req.num_placeholders
            ahead.advances[rid] = _Advance(req, n, samples, req.num_preemptions)
            req.num_computed_tokens += n
            req.num_placeholders += samples
        scheduler.kv.open_step()
        return ahead

    def is_live(self, scheduler, rid: str) -> bool:
        """The request still runs as this step planned it."""
        a = self.advances[rid]
        return (scheduler.requests.get(rid) is a.request and a.request.status is RequestStatus.RUNNING
                and a.request.num_preemptions == a.num_preemptions)

    def undo(self, scheduler) -> None:
        """Take back the advance of every request still running as planned."""
        if self.undone:
            return
        self.undone = True
        for rid, a in self.advances.items():
            if self.is_live(scheduler, rid):
                a.request.num_computed_tokens -= a.num_tokens
                a.request.num_placeholders -= a.samples
            elif a.request.status is not RequestStatus.RUNNING:
                a.request.num_placeholders = 0  # preempted (recomputed from its known tokens) or finished

    def settle(self, scheduler, sched: SchedulerOutput,
               result: ModelRunnerOutput) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Undo the advance and return the step's messages with only its live requests: what
        ``Scheduler.update`` commits."""
        self.undo(scheduler)
        live = {rid for rid in self.advances if self.is_live(scheduler, rid)}
        if len(live) == len(sched.num_scheduled_tokens):
            return sched, result
        keep = lambda d: {k: v for k, v in d.items() if k in live}  # noqa: E731
        sched = replace(sched, num_scheduled_tokens=keep(sched.num_scheduled_tokens),
                        scheduled_spec_decode_tokens=keep(sched.scheduled_spec_decode_tokens))
        result = replace(result, sampled_token_ids=keep(result.sampled_token_ids), logprobs=keep(result.logprobs),
                         prompt_logprobs=keep(result.prompt_logprobs), errors=keep(result.errors),
                         spec_token_ids=keep(result.spec_token_ids))
        return sched, result
