"""Drawing runs measured on the spot: :class:`RunRecord` / :func:`run_record` summarize a
run from its ``RequestOutput`` s, and :func:`draw_run_comparison` draws several runs side by
side: output tokens per second, engine steps, and requests completed over time. Repeated
runs of one configuration share its name: each is then drawn at its fastest run, with the
range over the runs, so a difference smaller than the wobble is seen as such.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure

from fleetlab.lab.viz._style import PALETTE, integer_steps, labelled_bars


@dataclass(slots=True)
class RunRecord:
    """A measured run: name, wall seconds, output tokens, each request's completion time
    (seconds after the run started, sorted) and, if known, the engine steps it took and the
    CPU seconds this process spent on it (``time.process_time``: unlike wall time, it does
    not grow while other programs hold the CPU)."""

    name: str
    wall_s: float
    num_output_tokens: int
    finish_times: list[float]
    num_steps: int | None = None
    cpu_s: float | None = None

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per wall-clock second (nan for a zero-length run)."""
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def mean_latency_s(self) -> float:
        """Mean time from the run's start to each request's completion."""
        return float(np.mean(self.finish_times)) if self.finish_times else float("nan")


def run_record(name: str, outputs: Sequence, start: float, end: float, num_steps: int | None = None,
               cpu_s: float | None = None) -> RunRecord:
    """Summarize a run from its ``RequestOutput`` s and its ``time.perf_counter`` start and end.

    Completion times come from each output's ``metrics["finish_time"]`` (perf_counter seconds).
    ``num_steps``: the engine steps the run took (e.g. ``llm.stats()["num_steps"]``);
    ``cpu_s``: the ``time.process_time()`` difference over the run.
    """
    if end < start:
        raise ValueError(f"run {name!r}: end ({end}) before start ({start})")
    finish = sorted(float(o.metrics["finish_time"]) - start for o in outputs if o.metrics.get("finish_time"))
    tokens = sum(len(o.token_ids) for o in outputs)
    return RunRecord(name, end - start, tokens, finish, num_steps, cpu_s)


def fastest_runs(runs: Sequence[RunRecord]) -> dict[str, RunRecord]:
    """``{name: its run with the highest tokens per second}``, names in first-seen order."""
    best: dict[str, RunRecord] = {}
    for run in runs:
        if run.name not in best or run.tokens_per_s > best[run.name].tokens_per_s:
            best[run.name] = run
    return best


def draw_run_comparison(runs: Sequence[RunRecord]):
    """Runs side by side: output tokens per wall-clock second (bars, gid ``"throughput:<name>"``),
    CPU seconds when every run has them (bars, gid ``"cpu:<name>"``), engine steps when every
    run knows them (bars, gid ``"steps:<name>"``), and requests completed over time (one step
    line per name, gid ``"completed:<name>"``).

    Runs sharing a name are repeats: the throughput bar and the line show the fastest of
    them, the CPU bar the least CPU time, and whiskers (gid ``"range:<panel>:<name>"``) span
    the runs. Returns the Figure."""
    if not runs:
        raise ValueError("draw_run_comparison: no runs to draw")
    best = fastest_runs(runs)
    names = list(best)
    with_steps = all(r.num_steps is not None for r in runs)
    with_cpu = all(r.cpu_s is not None for r in runs)
    panels = 2 + with_steps + with_cpu
    fig = Figure(figsize=(4.0 * panels, 3.3), layout="constrained")
    axes = list(fig.subplots(1, panels))
    ax_tp, ax_done = axes[0], axes[-1]
    repeats = max(sum(r.name == n for r in runs) for n in names)
    _range_bars(ax_tp, runs, names, lambda r: r.tokens_per_s, max, "throughput", "{:.0f}")
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_title("throughput, wall clock (higher is better)"
                    + (f"\nfastest of {repeats} runs; whisker: the others" if repeats > 1 else ""), fontsize=9)
    if with_cpu:
        ax_cpu = axes[1]
        _range_bars(ax_cpu, runs, names, lambda r: r.cpu_s, min, "cpu", "{:.2f}")
        ax_cpu.set_ylabel("CPU seconds of this process")
        ax_cpu.set_title("CPU time for the same work (lower is better)"
                         + ("\nleast of the runs; whisker: the others" if repeats > 1 else ""), fontsize=9)
    if with_steps:
        ax_steps = axes[1 + with_cpu]
        labelled_bars(ax_steps, names, [best[n].num_steps for n in names], "steps", "{:d}")
        ax_steps.set_ylabel("engine steps")
        ax_steps.set_title("steps for the same work (fewer is better)", fontsize=9)
    for i, name in enumerate(names):
        times = [0.0, *best[name].finish_times]
        ax_done.step(times, range(len(times)), where="post", color=PALETTE[i % len(PALETTE)], label=name,
                     gid=f"completed:{name}")
    ax_done.set_xlabel("seconds since start")
    ax_done.set_ylabel("requests finished")
    integer_steps(ax_done, "y")
    ax_done.set_title("completions over time, fastest run\n(left is better)", fontsize=9)
    ax_done.legend(fontsize=8, frameon=False)
    return fig


def _range_bars(ax, runs, names, value, pick, gid: str, fmt: str) -> None:
    """One bar per name at ``pick`` (max or min) of ``value(run)`` over its runs, whiskered to the
    rest, labelled above the whisker."""
    for x, name in enumerate(names):
        v = [value(r) for r in runs if r.name == name]
        top = pick(v)
        ax.bar(x, top, color=PALETTE[x % len(PALETTE)])[0].set_gid(f"{gid}:{name}")
        if len(v) > 1:
            low, high = (top - min(v), 0) if pick is max else (0, max(v) - top)
            ax.errorbar([x], [top], yerr=[[low], [high]], color="black", capsize=3, linewidth=0.8,
                        gid=f"range:{gid}:{name}")
        ax.text(x, max(v) if pick is min else top, fmt.format(top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names, fontsize=8)
