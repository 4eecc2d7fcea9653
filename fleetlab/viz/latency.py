"""Latency percentiles of several runs side by side (e.g. one per scheduling policy).

Input: ``{name: LatencyStats}`` from :func:`fleetlab.bench.latency.latency_stats`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from matplotlib.figure import Figure

from fleetlab.bench.latency import PERCENTILES
from fleetlab.viz._style import PALETTE

# (LatencyStats field, panel title, scale to the shown unit)
_PANELS = (
    ("ttft_steps", "time to first token (steps)", 1.0),
    ("tpot_steps", "time per output token (steps)", 1.0),
    ("ttft_s", "time to first token (ms)", 1e3),
    ("tpot_s", "time per output token (ms)", 1e3),
)


def draw_latency(stats_by_policy: Mapping, *, steps: bool | None = None, ms: bool = True):
    """Grouped bars of p50 / p90 / p99 TTFT and TPOT, one colour per run.

    Args:
      stats_by_policy: ``{name: LatencyStats}`` in the order to draw.
      steps: draw the step-based panels; None = when every run has them.
      ms: draw the wall-clock panels (milliseconds).
    Bars have gid ``"<field>:<name>:p<percentile>"`` (field ``ttft_steps``, ``tpot_s``...)
    and height the value in the panel's unit. Returns the Figure.
    """
    if not stats_by_policy:
        raise ValueError("draw_latency needs at least one run")
    runs = list(stats_by_policy.items())
    if steps is None:
        steps = all(s.ttft_steps is not None for _, s in runs)
    elif steps and any(s.ttft_steps is None for _, s in runs):
        missing = [n for n, s in runs if s.ttft_steps is None]
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
    return fig


def _panel(ax, runs, field: str, scale: float) -> None:
    """One panel: for each percentile, a bar per run."""
    width = 0.8 / len(runs)
    top = 0.0
    for i, (name, stats) in enumerate(runs):
        p = getattr(stats, field)
        values = [getattr(p, f"p{q}") * scale for q in PERCENTILES]
        for j, (q, value) in enumerate(zip(PERCENTILES, values)):
            x = j + (i - (len(runs) - 1) / 2) * width
            shown = 0.0 if math.isnan(value) else value
            bar = ax.bar(x, shown, width=width * 0.92, color=PALETTE[i % len(PALETTE)],
                         label=name if j == 0 else None)[0]
            bar.set_gid(f"{field}:{name}:p{q}")
            ax.text(x, shown, "n/a" if math.isnan(value) else f"{value:.3g}", ha="center", va="bottom", fontsize=6)
            top = max(top, shown)
    ax.set_xticks(range(len(PERCENTILES)), [f"p{q}" for q in PERCENTILES], fontsize=8)
    ax.set_ylim(0, top * 1.18 if top > 0 else 1.0)
    ax.tick_params(axis="y", labelsize=7)
