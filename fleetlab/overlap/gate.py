"""``OverlapGate``: whether the overlapped loop should overlap its next step, measured as it runs.

Overlapping pays where the host's work on step N+1 runs while the device computes step N: a
GPU, whose kernels run without the interpreter. On a CPU running a small model in Paddle's eager
mode the model thread holds the GIL for most of its forward, so the two threads take turns
instead of running together, and the hand-overs cost more than the overlap hides (measured:
0.85-0.93x the synchronous loop's output tokens per second at batch 64). So the loop measures
instead of assuming. It probes: a few steps overlapped, a few in line (the synchronous loop's
three moves, one step at a time), and compares their median *cadence* (wall time between two
commits of decode steps, per row). The faster way then runs until the next probe. A probe's first
steps after each switch are not counted (the pipeline fills or drains there). Nothing is
hidden: ``history`` keeps every probe's two medians and the choice made from them.

The gate sees commits as an observer of the engine's ``on_step`` point
(:class:`~fleetlab.engine.hooks.StepHooks`); :class:`~fleetlab.overlap.core.OverlapEngineCore`
asks :meth:`OverlapGate.overlap` before each step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class Probe:
    """One probe's outcome: the median seconds per decode row between two commits, overlapped and
    in line, and whether the steps after it overlap; ``step``: the commit count when it was decided."""

    step: int
    overlapped: float
    in_line: float
    overlap: bool


@dataclass
class OverlapGate:
    """Decides, step by step, whether :class:`~fleetlab.overlap.core.OverlapEngineCore` overlaps.

    probe_steps: cadences measured per mode in a probe (after ``settle_steps`` uncounted ones);
    run_steps: steps run the chosen way between two probes; margin: how much faster (a share of
    the in-line cadence) overlapping must measure to be chosen: a probe's few steps are noisy on
    a shared machine, and wrongly overlapping costs more there than wrongly not. ``always``: overlap every step (no
    probe; what a lesson that draws the overlap itself wants). ``clock``: seconds now (a test's
    own clock; default ``time.perf_counter``).
    """

    probe_steps: int = 8
    settle_steps: int = 2
    margin: float = 0.03
    run_steps: int = 96
    always: bool = False
    clock: Callable[[], float] = time.perf_counter
    history: list[Probe] = field(default_factory=list)
    _queue: list[bool] = field(default_factory=list)  # the modes of the coming steps
    _samples: dict = field(default_factory=lambda: {True: [], False: []})
    _mode: bool = True  # the mode of the step being run
    _counted: bool = False  # whether its cadence is a sample
    _last_commit: float | None = None
    _num_commits: int = 0
    _first_overlapped: bool = True  # which mode a probe starts with (alternates, so neither always goes first)

    def overlap(self) -> bool:
        """Whether the coming step overlaps (called once per engine step, before it runs)."""
        if self.always:
            return True
        if not self._queue:
            self._plan()
        self._mode, self._counted = self._queue.pop(0)
        return self._mode

    def on_step(self, scheduler_output, runner_output, outputs) -> None:
        """A step was committed: its cadence (since the commit before) per scheduled row is a sample
        of the mode that ran it, if counted and if every row was a decode (a prompt's chunk costs
        more per row, and a probe that caught one would compare unlike steps)."""
        now, last = self.clock(), self._last_commit
        self._last_commit, self._num_commits = now, self._num_commits + 1
        counts = scheduler_output.num_scheduled_tokens.values()
        if self._counted and last is not None and counts and max(counts) == 1:
            self._samples[self._mode].append((now - last) / len(counts))

    @property
    def overlapping(self) -> bool:
        """The mode of the step now running (or last run)."""
        return self.always or self._mode

    def _plan(self) -> None:
        """Queue the next probe, or the run decided by the probe just over."""
        over, inline = self._samples[True], self._samples[False]
        if over and inline:  # a probe just ended: decide, then run
            over_s, inline_s = statistics.median(over), statistics.median(inline)
            decision = Probe(self._num_commits, over_s, inline_s, over_s < (1 - self.margin) * inline_s)
            self.history.append(decision)
            over.clear()
            inline.clear()
            self._queue = [(decision.overlap, False)] * self.run_steps
            return
        first = self._first_overlapped
        self._first_overlapped = not first
        for mode in (first, not first):
            self._queue += [(mode, False)] * self.settle_steps + [(mode, True)] * self.probe_steps
