"""The host's and the model's timelines, synchronous and overlapped, from the engine's own timestamps.

Input: the spans of :class:`fleetlab.overlap.Timeline` (an observer of the engine's phases:
name, start, end, thread). :func:`draw_overlap` puts each loop on two lanes, the host thread
and the thread that ran the forward (the host itself in the synchronous loop, the model thread
when overlapped), over the same few steps, so the idle model between forwards in one and the
host's work under the forward in the other are seen side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.patches import Patch

from fleetlab.lab.viz._style import EDGE_COLOR, new_axes

# Host phases warm, the model's cool; waiting on the model is drawn as a hatch, not a colour.
OVERLAP_PHASE_COLORS = {
    "schedule": "#f28e2b", "batch_update": "#edc948", "metadata": "#b07aa1", "freeze": "#d37295",
    "fill": "#e15759", "update": "#9c755f", "forward": "#4e79a7", "sample": "#76b7b2", "wait": "#ffffff",
}


def window(spans: Sequence, first_forward: int, num_steps: int) -> list:
    """The spans from the ``first_forward``-th forward's start through ``num_steps`` forwards
    (and the host phases around them), with times in milliseconds from that start."""
    forwards = [s for s in spans if s.name == "forward"]
    start = forwards[first_forward].start
    last = forwards[min(first_forward + num_steps, len(forwards)) - 1]
    end = min((s.end for s in spans if s.name == "sample" and s.start >= last.start), default=last.end)
    return [(s.name, 1e3 * (max(s.start, start) - start), 1e3 * (min(s.end, end) - start), s.thread)
            for s in spans if s.end > start and s.start < end]  # cut at the window's edges


def draw_overlap(timelines: Mapping[str, Sequence], first_forward: int = 4, num_steps: int = 3, ax=None):
    """Lanes ``host`` and ``model`` for each loop of ``timelines`` (name -> Timeline spans),
    ``num_steps`` forwards from the ``first_forward``-th on; forwards are numbered N, N+1, ...
    The model's lane is its thread's spans when it has one (the overlapped loop: there the
    ``fill`` of placeholders runs too), else the forward and sample spans."""
    fig, ax = new_axes(ax, figsize=(9.0, 1.1 + 1.1 * len(timelines)))
    labels, y = [], 0
    for loop, spans in timelines.items():
        spans = list(getattr(spans, "spans", spans))
        model_thread = next((s.thread for s in spans if s.name == "forward"), None)
        shown = window(spans, first_forward, num_steps)
        own_thread = any(s.thread != model_thread for s in spans)  # overlapped: the model has a thread of its own
        on_model = [(s[3] == model_thread) if own_thread else s[0] in ("forward", "sample", "propose") for s in shown]
        lanes = (("model", [s for s, m in zip(shown, on_model) if m]),
                 ("host", [s for s, m in zip(shown, on_model) if not m]))
        for lane, items in lanes:
            for name, x0, x1, _ in items:
                ax.barh(y, x1 - x0, left=x0, height=0.7, color=OVERLAP_PHASE_COLORS.get(name, "#cccccc"),
                        edgecolor=EDGE_COLOR, linewidth=0.4, hatch="//" if name == "wait" else None)
            if lane == "model":
                for i, (_, x0, x1, _) in enumerate(s for s in items if s[0] == "forward"):
                    ax.text((x0 + x1) / 2, y, "N" if i == 0 else f"N+{i}", ha="center", va="center",
                            fontsize=8, color="white")
            labels.append(f"{loop}: {lane}")
            y += 1
        y += 0.4
    ax.set_yticks([i + 0.4 * (i // 2) for i in range(len(labels))], labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms from step N's forward")
    names = [n for n in OVERLAP_PHASE_COLORS if any(n == s.name for t in timelines.values()
                                                    for s in getattr(t, "spans", t))]
    ax.legend(handles=[Patch(facecolor=OVERLAP_PHASE_COLORS[n], edgecolor=EDGE_COLOR, hatch="//" if n == "wait"
                             else None, label=n) for n in names],
              loc="upper center", bbox_to_anchor=(0.5, -0.22 if len(timelines) > 1 else -0.4), ncol=len(names),
              fontsize=7, frameon=False)
    return fig
