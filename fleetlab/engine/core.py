"""``EngineCore``: one engine step is three moves, and nothing else.

The scheduler plans (``SchedulerOutput``), the model runner executes (``ModelRunnerOutput``),
the scheduler commits and returns each request's progress (``RequestOutput`` s, token ids
only). The whole step is one transaction: if anything raises while it is planned, run or
committed (the scheduler, a policy, the prefix cache, the KV connector, the runner), the
scheduler rolls the plan back (:meth:`Scheduler.rollback`: counters, blocks, prefix-cache
entries, the connector's own bookkeeping through its ``rollback``) and the runner is reset, so
the step never happened and the same requests run again from where they were. Observers see a
step once it is committed; one that raises cannot take the step back: the other observers
still run, then :class:`~fleetlab.errors.ObserverError` names it and carries the step's outputs
(``LLM.step`` returns them with its next call, so none is lost). What users get back (logprobs
attached, parallel samples fanned in, stop strings applied, text) is the output processor's work, after the step
(:mod:`fleetlab.output`); ``LLM`` is the front door over both.

``step`` is the synchronous loop's step. An engine that overlaps the next step's scheduling
with this one's forward (vLLM's batch queue) is another ``EngineCore`` with its own
``step``: :class:`fleetlab.overlap.OverlapEngineCore` (``LLM(async_scheduling=True)``); the
front door calls whichever it holds (``LLM.core``).
"""

from __future__ import annotations

import logging

from fleetlab.engine.hooks import StepHooks, notify_observers
from fleetlab.engine.messages import ModelRunnerOutput, SchedulerOutput
from fleetlab.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


class EngineCore:
    """Runs steps of ``scheduler`` on ``runner``; ``hooks``: where observers see them."""

    def __init__(self, scheduler, runner, hooks: StepHooks):
        self.scheduler, self.runner, self.hooks = scheduler, runner, hooks

    def step(self) -> tuple[list[RequestOutput], ModelRunnerOutput]:
        """Plan, run, commit: the outputs of the requests that gained tokens or finished, and
        the runner's message (the output processor reads its logprobs)."""
        try:
            with self.hooks.phase("schedule"):
                sched = self.scheduler.schedule()
            result = self._execute(sched)
            with self.hooks.phase("update"):
                outputs = self.scheduler.update(sched, result)
        except BaseException:  # anywhere in the step: it never happened
            self.roll_back([self.scheduler.planned])
            raise
        notify_observers(self.hooks, [(sched, result, outputs)])  # each observer.on_step(sched, result, outputs)
        return outputs, result

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the plan (an empty one runs nothing)."""
        return self.runner.execute(sched) if sched.num_scheduled_tokens else ModelRunnerOutput()

    def roll_back(self, plans: list[SchedulerOutput], admitted: list | None = None) -> None:
        """Undo ``plans`` (oldest first; undone newest first) and reset the runner (it is sent every
        row again). ``admitted``: each plan's admissions still to send back (default: the scheduler's)."""
        logger.debug("steps %s failed: rolling them back", [p.step for p in plans])
        self.runner.reset()  # first: a rollback that fails (a connector's own) still leaves no stale row
        for i in reversed(range(len(plans))):
            self.scheduler.rollback(plans[i], None if admitted is None else admitted[i])
