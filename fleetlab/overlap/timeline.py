"""``Timeline``: when each phase of each step ran, and on which thread.

An observer of the engine's ``on_phase`` point (:class:`~fleetlab.engine.hooks.StepHooks`):
a listener is called as a phase ends, so the end is the time of the call and the start is
the end less the phase's duration. The thread is the one that called (the host, or the
overlapped loop's model thread), which is what a timeline of the overlap draws
(:func:`fleetlab.lab.viz.overlap.draw_overlap`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Span:
    """One phase: its name, ``start`` and ``end`` (``time.perf_counter`` seconds), its thread."""

    name: str
    start: float
    end: float
    thread: str

    @property
    def on_model_thread(self) -> bool:
        return self.thread.startswith("fleetlab-model")


@dataclass
class Timeline:
    """``llm.hooks.attach(timeline)``: every phase after that becomes a :class:`Span` in ``spans``."""

    spans: list[Span] = field(default_factory=list)

    def on_phase(self, name: str, seconds: float) -> None:
        end = time.perf_counter()
        self.spans.append(Span(name, end - seconds, end, threading.current_thread().name))

    def clear(self) -> None:
        self.spans.clear()

    def busy(self, model_thread: bool) -> float:
        """Seconds the host (or the model thread) spent in phases (waits left out)."""
        return sum(s.end - s.start for s in self.spans if s.on_model_thread == model_thread and s.name != "wait")
