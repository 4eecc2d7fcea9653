"""``OverlapEngineCore``: the host plans and prepares step N+1 while the model runs step N.

The synchronous core (:class:`~fleetlab.engine.core.EngineCore`) leaves the model idle while
the host schedules, prepares the batch and commits. Here a model thread runs each step's
forward and sampling (:meth:`ModelRunner.run`; Paddle's kernels release the GIL) while the
host thread does the rest for the next step. One call of :meth:`OverlapEngineCore.step` is
still the three moves, one step apart::

    host:   schedule N+1 | prepare N+1, queue it | wait ...............| update N
    model:  ........ run N (forward, sample) ..........| fill N+1 | run N+1 ........

- **schedule** plans step N+1 as if step N had run (:class:`~fleetlab.overlap.ahead.Ahead`:
  ``num_computed_tokens`` past N's tokens, a placeholder for the token N samples);
- **execute** prepares step N+1 on the host (``ModelRunner.prepare``, then
  :func:`~fleetlab.overlap.frozen.freeze` so N+1's run never reads the live batch) and queues
  it on the model thread, which fills its placeholders with step N's tokens
  (:func:`~fleetlab.overlap.placeholders.fill`) as soon as N is done and runs it, without a
  round trip through the host; the host waits for step N, and for step N+1's forward to be
  under way (so that the two threads do not both wake as step N ends);
- **update** commits step N (``Scheduler.update``, after :meth:`Ahead.settle` took the advance
  back and left out requests that stopped running since they were planned).

So outputs come one call late (the first call returns none), and a request that finishes in
step N has one wasted slot in N+1, never an extra token. If anything fails (planning N+1,
preparing or running either step, committing N), both steps in flight are rolled back (the KV
manager keeps an undo log per open step; the advances are taken back) and the runner reset.
Observers see step N once it is committed, as in the synchronous loop.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from fleetlab.engine.core import EngineCore
from fleetlab.engine.hooks import StepHooks, notify_observers
from fleetlab.engine.messages import ModelRunnerOutput, SchedulerOutput
from fleetlab.engine.outputs import RequestOutput
from fleetlab.engine.request import RequestStatus
from fleetlab.overlap.ahead import Ahead
from fleetlab.overlap.frozen import freeze
from fleetlab.overlap.gate import OverlapGate
from fleetlab.overlap.placeholders import fill

logger = logging.getLogger(__name__)
_ADMITTED = (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)  # still as admitted (not preempted since)


@dataclass(slots=True)
class _Step:
    """A step between its plan and its commit: the plan, its advance, its run (None: empty)."""

    sched: SchedulerOutput
    ahead: Ahead
    future: Future | None = None
    started: threading.Event = field(default_factory=threading.Event)  # its placeholders are filled, its forward on


class OverlapEngineCore(EngineCore):
    """Runs steps of ``scheduler`` on ``runner`` with step N+1's host work overlapped with step
    N's forward (see the module docstring); ``LLM(async_scheduling=True)`` builds it."""

    def __init__(self, scheduler, runner, hooks: StepHooks, gate: OverlapGate | None = None):
        super().__init__(scheduler, runner, hooks)
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="fleetlab-model")
        self._in_flight: _Step | None = None  # the step the model thread runs (or has run)
        self.gate = gate if gate is not None else OverlapGate()
        hooks.attach(self.gate)  # it times the commits

    def step(self) -> tuple[list[RequestOutput], ModelRunnerOutput]:
        """Plan step N+1, start it once step N is done, commit step N: the outputs of step N's
        requests that gained tokens or finished (none on the first call), and step N's message.
        When the gate finds overlapping slower (:mod:`fleetlab.overlap.gate`), a step runs in line."""
        if not self.gate.overlap():
            return self._step_in_line()
        try:
            with self.hooks.phase("schedule"):
                sched = self.scheduler.schedule()
        except BaseException:
            self._rollback(None, partial=self.scheduler.planned)
            raise
        planned = _Step(sched, Ahead.take(self.scheduler, sched))
        done, result = self._execute_ahead(planned)
        if done is None:
            return [], ModelRunnerOutput()
        committed = []  # what the observers see, once every commit of this call is done
        outputs, result = self._update(done, result, committed)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            # Nothing runs any more: what is in flight holds wasted slots only. Finish it now,
            # so no forward outlives the loop's last request (another engine may run next).
            last, self._in_flight = self._in_flight, None
            more, _ = self._update(last, self._result(last, planned=None), committed)
            outputs += more
        notify_observers(self.hooks, committed)
        return outputs, result

    def _step_in_line(self) -> tuple[list[RequestOutput], ModelRunnerOutput]:
        """One step as the synchronous loop runs it; the first call after overlapped steps only
        commits the step in flight (and plans none)."""
        if self._in_flight is None:
            return EngineCore.step(self)
        last, self._in_flight = self._in_flight, None
        committed = []
        outputs, result = self._update(last, self._result(last, planned=None), committed)
        notify_observers(self.hooks, committed)
        return outputs, result

    def _update(self, done: _Step, result: ModelRunnerOutput,
                committed: list) -> tuple[list[RequestOutput], ModelRunnerOutput]:
        """Commit ``done`` (its live requests only) and add ``(scheduler output, runner output,
        outputs)`` to ``committed``. If the commit fails, ``done`` and the step in flight are rolled back."""
        try:
            with self.hooks.phase("update"):
                sched, result = done.ahead.settle(self.scheduler, done.sched, result)
                outputs = self.scheduler.update(sched, result)
        except BaseException:
            self._rollback(None, done=done)
            raise
        committed.append((sched, result, outputs))
        return outputs, result

    def _result(self, step: _Step, planned: _Step | None) -> ModelRunnerOutput:
        """Wait for ``step``'s run; if it failed, roll it back (and ``planned``) and re-raise."""
        try:
            with self.hooks.phase("wait"):
                return step.future.result() if step.future is not None else ModelRunnerOutput()
        except BaseException:
            self._in_flight = step
            self._rollback(planned)
            raise

    def _execute_ahead(self, planned: _Step) -> tuple[_Step | None, ModelRunnerOutput]:
        """Prepare ``planned`` and queue it behind the step in flight, then wait for that one;
        returns it with its result. On any exception both steps are rolled back."""
        done = self._in_flight
        try:
            prepared = self._prepare(planned.sched)
            if prepared is not None:
                before = done.future if done is not None else None
                planned.future = self._model_thread.submit(self._run_after, before, prepared, planned.started)
            with self.hooks.phase("wait"):
                result = done.future.result() if done is not None and done.future else ModelRunnerOutput()
                if planned.future is not None:
                    planned.started.wait()  # commit step N once N+1's forward is under way, not in its way
        except BaseException:
            self._rollback(planned)
            raise
        self._in_flight = planned
        return done, result

    def _run_after(self, before: Future | None, prepared, started: threading.Event) -> ModelRunnerOutput:
        """On the model thread, right after the step before (the thread runs its queue in order):
        fill ``prepared``'s placeholders with that step's tokens, tell the host (``started``),
        then run it. If the step before failed, this one fails with it (and both are rolled back)."""
        try:
            result = before.result() if before is not None else ModelRunnerOutput()
            with self.hooks.phase("fill"):
                fill(prepared, result)
        finally:
            started.set()  # the host wakes now, not as step N ends: both would want the GIL at once
        return self.runner.run(prepared)

    def _prepare(self, sched: SchedulerOutput):
        if not sched.num_scheduled_tokens:
            return None
        prepared = self.runner.prepare(sched)
        with self.hooks.phase("freeze"):
            freeze(prepared, self.runner.batch)
        return prepared

    def _rollback(self, planned: _Step | None, partial: SchedulerOutput | None = None,
                  done: _Step | None = None) -> None:
        """Undo ``done`` (a step whose commit failed), the step in flight, ``planned`` and
        ``partial`` (a plan that failed half way: no advance taken), newest last in the list and
        undone first: the scheduler's plans, the advances, the KV manager's open logs; reset the
        runner (it resends every row)."""
        steps = [s for s in (done, self._in_flight, planned) if s is not None]
        self._in_flight = None
        for s in steps:
            self.drain(s)
        for s in steps:
            s.ahead.undo(self.scheduler)  # (a step already settled is not undone twice)
        # Only admissions still running go back to the queue (one preempted since is there already).
        admitted = [[r for r in s.ahead.admitted if r.status in _ADMITTED] for s in steps]
        plans = [s.sched for s in steps]
        if partial is not None:
            plans.append(partial)
            admitted.append(list(self.scheduler.admitted))
        self.roll_back(plans, admitted)

    @staticmethod
    def drain(step: _Step | None) -> None:
        """Wait until ``step``'s run is over (whatever its outcome)."""
        if step is not None and step.future is not None:
            step.future.exception()

    def close(self) -> None:
        """Wait for the step in flight and stop the model thread."""
        self.drain(self._in_flight)
        self._model_thread.shutdown(wait=True)
