"""Drawing runs measured on the spot: :class:`RunRecord` / :func:`run_record` summarize a
run from its ``RequestOutput`` s, and :func:`draw_run_comparison` draws several runs side by
side: output tokens per second, engine steps, and requests completed over time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from fleetlab.viz._style import PALETTE, integer_steps, labelled_bars


@dataclass(slots=True)
class RunRecord:
    """A measured run: name, wall seconds, output tokens, each request's completion time
    (seconds after the run started, sorted) and, if known, the engine steps it took."""

    name: str
    wall_s: float
    num_output_tokens: int
    finish_times: list[float]
    num_steps: int | None = None

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per wall-clock second (nan for a zero-length run)."""
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def mean_latency_s(self) -> float:
        """Mean time from the run's start to each request's completion."""
        return float(np.mean(self.finish_times)) if self.finish_times else float("nan")


def run_record(name: str, outputs: Sequence, start: float, end: float, num_steps: int | None = None) -> RunRecord:
    """Summarize a run from its ``RequestOutput`` s and its ``time.perf_counter`` start and end.

    Completion times come from each output's ``metrics["finish_time"]`` (perf_counter seconds).
    ``num_steps``: the engine steps the run took (e.g. ``llm.stats()["num_steps"]``).
    """
    if end < start:
        raise ValueError(f"run {name!r}: end ({end}) before start ({start})")
    finish = sorted(float(o.metrics["finish_time"]) - start for o in outputs if o.metrics.get("finish_time"))
    tokens = sum(len(o.token_ids) for o in outputs)
    return RunRecord(name, end - start, tokens, finish, num_steps)


def draw_run_comparison(runs: Sequence[RunRecord]):
    """Runs side by side: output tokens per second (bars, gid ``"throughput:<name>"``), engine
    steps when every run knows them (bars, gid ``"steps:<name>"``), and requests completed
    over time (one step line per run, gid ``"completed:<name>"``). Returns the Figure."""
    if not runs:
        raise ValueError("draw_run_comparison: no runs to draw")
    with_steps = all(r.num_steps is not None for r in runs)
    fig = Figure(figsize=(12.0 if with_steps else 9.0, 3.2), layout="constrained")
    axes = fig.subplots(1, 3 if with_steps else 2)
    ax_tp, ax_done = axes[0], axes[-1]
    labelled_bars(ax_tp, [r.name for r in runs], [r.tokens_per_s for r in runs], "throughput", "{:.0f}")
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_title("throughput (higher is better)", fontsize=9)
    if with_steps:
        labelled_bars(axes[1], [r.name for r in runs], [r.num_steps for r in runs], "steps", "{:d}")
        axes[1].set_ylabel("engine steps")
        axes[1].set_title("steps for the same work (fewer is better)", fontsize=9)
    for i, run in enumerate(runs):
        times = [0.0, *run.finish_times]
        ax_done.step(times, range(len(times)), where="post", color=PALETTE[i % len(PALETTE)], label=run.name,
                     gid=f"completed:{run.name}")
    ax_done.set_xlabel("seconds since start")
    ax_done.set_ylabel("requests finished")
    integer_steps(ax_done, "y")
    ax_done.set_title("completions over time (left is better)", fontsize=9)
    ax_done.legend(fontsize=8, frameon=False)
    return fig
