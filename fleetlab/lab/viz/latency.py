"""Latency percentiles of several configurations side by side (e.g. one per scheduling policy).

Input: ``{name: LatencyStats}`` from :func:`fleetlab.inspect.latency.latency_stats`, or
``{name: [LatencyStats, ...]}``, one per repeated run: then each bar is the median over the
runs and a whisker spans the fastest to the slowest run, so a difference smaller than the
spread is seen to be noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from fleetlab.inspect.latency import PERCENTILES
from fleetlab.lab.viz._style import PALETTE

# (LatencyStats field, panel title, scale to the shown unit)
_PANELS = (
    ("ttft_steps", "time to first token (steps)", 1.0),
    ("tpot_steps", "time per output token (steps)", 1.0),
    ("ttft_s", "time to first token (ms)", 1e3),
    ("tpot_s", "time per output token (ms)", 1e3),
)


def draw_latency(stats_by_policy: Mapping, *, steps: bool | None = None, ms: bool = True):
    """Grouped bars of p50 / p90 / p99 TTFT and TPOT, one colour per configuration.

    Args:
      stats_by_policy: ``{name: LatencyStats}`` or ``{name: [LatencyStats, ...]}`` (repeated
        runs), in the order to draw.
      steps: draw the step-based panels; None = when every run has them.
      ms: draw the wall-clock panels (milliseconds).
    Bars have gid ``"<field>:<name>:p<percentile>"`` (field ``ttft_steps``, ``tpot_s``...)
    and height the value in the panel's unit (the median over repeated runs, whose range is
    an error bar with gid ``"spread:<field>:<name>:p<percentile>"``). Returns the Figure.
    """
    if not stats_by_policy:
        raise ValueError("draw_latency needs at least one run")
    runs = [(name, [s] if not isinstance(s, Sequence) else list(s)) for name, s in stats_by_policy.items()]
    if any(not repeats for _, repeats in runs):
        raise ValueError("draw_latency: a configuration with no runs")
    if steps is None:
        steps = all(s.ttft_steps is not None for _, repeats in runs for s in repeats)
    elif steps and any(s.ttft_steps is None for _, repeats in runs for s in repeats):
        missing = [n for n, repeats in runs if any(s.ttft_steps is None for s in repeats)]
        raise ValueError(f"draw_latency: runs {missing} have no step figures (latency_stats got no traces)")
    panels = [p for p in _PANELS if (p[0].endswith("steps") and steps) or (p[0].endswith("_s") and ms)]
    if not panels:
        raise ValueError("draw_latency: nothing to draw (steps=False and ms=False)")
    num_rows = -(-len(panels) // 2)
    fig = Figure(figsize=(7.5, 2.5 * num_rows + 0.4), layout="constrained")
    axes = fig.subplots(num_rows, 2, squeeze=False).ravel()
    for ax, (field, title, scale) in zip(axes, panels):
        _panel(ax, runs, field, scale)
        ax.set_title(title, fontsize=9)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7, loc="upper left", frameon=False)
    counts = sorted({len(repeats) for _, repeats in runs})
    if counts[-1] > 1:
        fig.suptitle(f"bars: median of {'/'.join(map(str, counts))} runs each; whiskers: fastest to slowest run",
                     fontsize=8)
    return fig


def _panel(ax, runs, field: str, scale: float) -> None:
    """One panel: for each percentile, a bar per configuration (median of its runs, with their range)."""
    width = 0.8 / len(runs)
    top = 0.0
    for i, (name, repeats) in enumerate(runs):
        for j, q in enumerate(PERCENTILES):
            values = np.array([getattr(getattr(s, field), f"p{q}") * scale for s in repeats], dtype=float)
            x = j + (i - (len(runs) - 1) / 2) * width
            known = values[~np.isnan(values)]
            value = float(np.median(known)) if known.size else float("nan")
            shown = 0.0 if math.isnan(value) else value
            bar = ax.bar(x, shown, width=width * 0.92, color=PALETTE[i % len(PALETTE)],
                         label=name if j == 0 else None)[0]
            bar.set_gid(f"{field}:{name}:p{q}")
            high = shown
            if known.size > 1 and known.max() > known.min():  # equal runs (steps): nothing to whisker
                low, high = float(known.min()), float(known.max())
                ax.errorbar([x], [shown], yerr=[[shown - low], [high - shown]], color="black", capsize=2,
                            linewidth=0.8, gid=f"spread:{field}:{name}:p{q}")
            ax.text(x, high, "n/a" if math.isnan(value) else f"{value:.3g}", ha="center", va="bottom", fontsize=6)
            top = max(top, high)
    ax.set_xticks(range(len(PERCENTILES)), [f"p{q}" for q in PERCENTILES], fontsize=8)
    ax.set_ylim(0, top * 1.18 if top > 0 else 1.0)
    ax.tick_params(axis="y", labelsize=7)
