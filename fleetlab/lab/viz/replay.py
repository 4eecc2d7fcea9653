"""The block pool step by step: one light frame per step for a player, and the key steps
side by side as a static strip (what a page without widgets shows).

Inputs: the run's traces, one :class:`fleetlab.lab.viz.PoolFrame` per step (``viz.pool_frame(llm)``
after every ``llm.step()``), and optionally the waits of :func:`fleetlab.lab.viz.queue_waits`.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from matplotlib.figure import Figure

from fleetlab.lab.viz.blocks import draw_block_pool, pool_legend
from fleetlab.lab.viz.timeline import admissions, describe_pool_change, describe_step
from fleetlab.lab.viz.waiting import WAIT_REASONS


def step_story(traces: Sequence, step: int, *, block_size: int | None = None, waits: Sequence = ()) -> list[str]:
    """What happened in ``step``, one line each: who ran (:func:`describe_step`), who waited
    and why, and what the pool gained from the prefix cache or lost to a preemption."""
    trace = next((t for t in traces if t.step == step), None)
    if trace is None:
        raise ValueError(f"no trace for step {step}")
    lines = [describe_step(trace)]
    waiting = [w for w in waits if step in w.reasons]
    if waiting:
        lines.append(f"waiting: {', '.join(w.request_id for w in waiting)} "
                     f"({WAIT_REASONS[waiting[0].reasons[step]]})")
    change = describe_pool_change(traces, step, block_size)
    if change:
        lines.append(change)
    return lines


def _frame(pool_frames: Sequence, step: int):
    frame = next((f for f in pool_frames if f.step == step), None)
    if frame is None:
        raise ValueError(f"no pool frame for step {step}")
    return frame


def _revived(traces: Sequence, step: int, block_size: int) -> list[int]:
    return [b for a in admissions([t for t in traces if t.step <= step], block_size) if a.step == step
            for b in a.cached_block_ids]


def draw_pool_step(traces: Sequence, step: int, pool_frames: Sequence, *, waits: Sequence = (), ncols: int = 14):
    """The block pool after ``step``, titled with the step's story (:func:`step_story`).

    Blocks a request took from the prefix cache in this step are outlined in green. Light
    enough for a play control: one grid of squares, a few lines of text, and a fixed layout
    (a layout engine would draw every frame twice). Returns the Figure.
    """
    frame = _frame(pool_frames, step)
    rows = -(-len(frame.blocks) // ncols)
    width, grid_h, head_h, legend_h = 0.55 * ncols + 0.4, 0.55 * rows, 0.9, 0.6
    height = head_h + grid_h + legend_h
    fig = Figure(figsize=(width, height))
    ax = fig.add_axes((0.2 / width, legend_h / height, 0.55 * ncols / width, grid_h / height))
    in_use = sum(i.ref_count > 0 for i in frame.blocks)
    revived = _revived(traces, step, frame.block_size)
    draw_block_pool(frame, ncols=ncols, ax=ax, revived=revived, legend=False,
                    title=f"block pool after step {step}: {in_use}/{len(frame.blocks)} blocks in use")
    fig.legend(handles=pool_legend(frame.block_tables, shared=any(i.ref_count > 1 for i in frame.blocks),
                                   revived=bool(revived)),
               loc="lower left", bbox_to_anchor=(0.2 / width, 0.0), ncols=4, fontsize=7, frameon=False)
    fig.text(0.2 / width, 1 - 0.08 / height, "\n".join(step_story(traces, step, block_size=frame.block_size,
                                                                    waits=waits)),
             fontsize=8.5, ha="left", va="top")
    return fig


def draw_pool_strip(traces: Sequence, steps: Sequence[int], pool_frames: Sequence, *, waits: Sequence = (),
                    ncols: int = 7, per_row: int = 3):
    """The block pool after each of ``steps``, small, ``per_row`` panels a row, one legend.

    Each panel is titled with its step's story in short: who waited, who was preempted, who
    took which blocks back from the prefix cache, who finished. Panels' axes have gid
    ``"pool-step:<step>"``.
    Returns the Figure.
    """
    if not steps:
        raise ValueError("draw_pool_strip: no steps to draw")
    frames = [_frame(pool_frames, s) for s in steps]
    grid_rows = -(-len(frames[0].blocks) // ncols)
    nrows = -(-len(steps) // per_row)
    fig = Figure(figsize=(4.2 * per_row + 1.6, (0.5 * grid_rows + 1.3) * nrows), layout="constrained")
    axes = fig.subplots(nrows, per_row, squeeze=False).ravel()
    owners: dict[str, None] = {}
    for ax, step, frame in zip(axes, steps, frames):
        lines = step_story(traces, step, block_size=frame.block_size, waits=waits)[1:]  # the rows are in the timeline
        finished = next(t.finished for t in traces if t.step == step)
        if finished:
            lines.append(f"finished {', '.join(finished)}: blocks freed (full ones stay cached)")
        wrapped = [part for line in lines for part in textwrap.wrap(line, 60)]
        draw_block_pool(frame, ncols=ncols, ax=ax, revived=_revived(traces, step, frame.block_size), legend=False,
                        title="\n".join([f"after step {step}", *wrapped]))
        ax.title.set_fontsize(7)
        ax.set_gid(f"pool-step:{step}")
        owners.update(dict.fromkeys(frame.block_tables))
    for ax in axes[len(steps):]:
        ax.set_visible(False)
    fig.legend(handles=pool_legend(sorted(owners, key=lambda r: (len(r), r))), loc="outside right upper",
               fontsize=7, frameon=False)
    return fig
