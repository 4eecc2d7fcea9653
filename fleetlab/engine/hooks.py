"""``StepHooks``: the named points where an observer sees an engine step, without a branch in it.

Three points, each a list of listeners (:meth:`StepHooks.attach` puts an observer on every
point it has a method for):

- ``on_step(scheduler_output, runner_output, outputs)``: the step's three messages, once the
  scheduler has committed it (``LLM.observers`` is this list). An observer that raises takes
  nothing back: every other observer still sees the step, then
  :class:`~fleetlab.errors.ObserverError` names it and carries the step's outputs;
- ``on_phase(name, seconds)``: each part of the step (``with hooks.phase(name):`` in the
  engine core and the model runner; the names are ``PHASES``: ``STEP_PHASES`` in either loop,
  ``OVERLAP_PHASES`` in the overlapped one only), timed only while someone listens;
- ``on_batch_order(req_ids)``: the runner's rows, condensed, before the decode-first reorder.

``fleetlab.inspect`` holds the observers (the ``StepRecorder`` of ``record_traces=True``, the
speculative-decoding counts); a profiler range or a metrics exporter plugs in the same way.
"""

from __future__ import annotations

import contextlib
import time

from fleetlab.errors import ObserverError, extension_name

# The parts of a step of the synchronous loop, in the order they run (what a ``StepTrace`` times).
STEP_PHASES = ("schedule", "batch_update", "metadata", "forward", "sample", "propose", "update")
# Those the overlapped loop (``fleetlab.overlap``) adds: ``freeze`` (copy step N+1's inputs away
# from the batch the host changes next), ``fill`` (put step N's sampled tokens in N+1's
# placeholders, on the model thread) and ``wait`` (the host waiting for step N's forward).
OVERLAP_PHASES = ("freeze", "fill", "wait")
# Every name ``on_phase`` is called with: either loop's parts.
PHASES = STEP_PHASES + OVERLAP_PHASES
_UNTIMED = contextlib.nullcontext()


class _Timed:
    __slots__ = ("listeners", "name", "start")

    def __init__(self, listeners: list, name: str):
        self.listeners, self.name = listeners, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self.start
        for listener in self.listeners:
            listener.on_phase(self.name, seconds)


class StepHooks:
    """The listeners of one engine's steps (see the module docstring)."""

    POINTS = ("on_step", "on_phase", "on_batch_order")

    def __init__(self):
        self.listeners: dict[str, list] = {point: [] for point in self.POINTS}
        self.observers = self.listeners["on_step"]

    def attach(self, observer) -> None:
        """Let ``observer`` see every point it has a method for."""
        for point, listeners in self.listeners.items():
            if hasattr(observer, point):
                listeners.append(observer)

    def detach(self, observer) -> None:
        """Stop showing ``observer`` the step (undoes :meth:`attach`)."""
        for listeners in self.listeners.values():
            if observer in listeners:
                listeners.remove(observer)

    def phase(self, name: str):
        """A context manager around the step's part ``name`` (it costs nothing while no one times)."""
        listeners = self.listeners["on_phase"]
        return _Timed(listeners, name) if listeners else _UNTIMED

    def batch_order(self, req_ids) -> None:
        for listener in self.listeners["on_batch_order"]:
            listener.on_batch_order(list(req_ids))


def notify_observers(hooks: StepHooks, steps: list) -> None:
    """Show every observer each committed ``(scheduler_output, runner_output, outputs)``; if any
    raised, raise :class:`ObserverError` naming the first, once all have seen every step (it
    carries the steps' outputs: they are committed, and must still reach the user)."""
    failed = None
    for step in steps:
        for observer in list(hooks.observers):
            try:
                observer.on_step(*step)
            except Exception as exc:
                failed = failed or (observer, exc)
    if failed is not None:
        observer, exc = failed
        outputs = [o for _, _, outs in steps for o in outs]
        raise ObserverError(f"{extension_name('step observer', observer)}.on_step raised {type(exc).__name__}: "
                            f"{exc} (the step is committed: its outputs come with the next step)",
                            outputs, steps[-1][1]) from exc
