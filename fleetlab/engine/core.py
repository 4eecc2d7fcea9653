"""``EngineCore``: one engine step is three moves, and nothing else.

The scheduler plans (``SchedulerOutput``), the model runner executes (``ModelRunnerOutput``),
the scheduler commits and returns each request's progress (``RequestOutput`` s, token ids
only). A step applies entirely or not at all: if the runner raises, the scheduler rolls the
plan back and the runner is reset. What users get back (logprobs attached, parallel samples
fanned in, stop strings applied, text) is the output processor's work, after the step
(:mod:`fleetlab.output`); ``LLM`` is the front door over both.

``step`` is the synchronous loop's step. An engine that overlaps the next step's scheduling
with this one's forward (vLLM's batch queue) is another ``EngineCore`` with its own
``step``: :class:`fleetlab.overlap.OverlapEngineCore` (``LLM(async_scheduling=True)``); the
front door calls whichever it holds (``LLM.core``).
"""

from __future__ import annotations

import logging

from fleetlab.engine.hooks import StepHooks
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
        with self.hooks.phase("schedule"):
            sched = self.scheduler.schedule()
        result = self._execute(sched)
        with self.hooks.phase("update"):
            outputs = self.scheduler.update(sched, result)
        for observer in self.hooks.observers:  # on_step(scheduler_output, runner_output, outputs)
            observer.on_step(sched, result, outputs)
        return outputs, result

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the plan; on any exception undo it (scheduler rollback, runner reset) and re-raise."""
        if not sched.num_scheduled_tokens:
            return ModelRunnerOutput()
        try:
            return self.runner.execute(sched)
        except BaseException:
            logger.debug("step %d failed: rolling it back", sched.step)
            self.scheduler.rollback(sched)
            self.runner.reset()
            raise
