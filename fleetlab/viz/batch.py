"""Drawings of the persistent batch: its rows, condense, the decode-first reorder, and the
gather-index alternative that moves no row at all.

Inputs are the ``RowRecord`` lists of :meth:`fleetlab.InputBatch.snapshot` (one per row:
request id, phase, token counts, block table). A row's box is coloured by its phase
(decode blue, prefill orange, empty grey) with a square of its request's colour on the left.

- :func:`draw_batch`: one snapshot.
- :func:`draw_reorder`: two snapshots side by side, with an arrow for every request that
  changed rows.
- :func:`reorder_frames` + :func:`draw_reorder_frame`: condense and the two-pointer reorder
  one swap at a time, for a slider (see :func:`fleetlab.viz.widgets.player`).
- :func:`draw_gather_map`: the rows stay put; the step reads them through an index map.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Rectangle

from fleetlab.viz._style import ALERT_COLOR, EDGE_COLOR, phase_color, request_color

_ROW_WIDTH = 10.0


def _row_text(rec) -> str:
    if rec.phase == "empty":
        return "(empty)"
    return (f"req {rec.req_id}  {rec.phase}  {rec.num_scheduled_tokens} tok this step  "
            f"({rec.num_computed_tokens}/{rec.num_tokens} in KV cache)")


def _draw_rows(ax, records, *, labels=None, highlight=(), num_decodes=None, gid_prefix="row") -> None:
    """Draw ``records`` top to bottom into ``ax``; ``labels`` replace the ``row i`` tick labels."""
    highlight = set(highlight)
    for y, rec in enumerate(records):
        moved = y in highlight
        ax.add_patch(Rectangle((0, -y), _ROW_WIDTH, 0.8, facecolor=phase_color(rec.phase),
                               edgecolor=ALERT_COLOR if moved else EDGE_COLOR, linewidth=2.5 if moved else 0.8,
                               alpha=0.9, gid=f"{gid_prefix}:{y}"))
        if rec.phase != "empty":
            ax.add_patch(Rectangle((0.15, -y + 0.15), 0.5, 0.5, facecolor=request_color(rec.req_id),
                                   edgecolor="white"))
        ax.text(0.9, -y + 0.4, _row_text(rec), va="center", fontsize=8)
    if num_decodes is not None and 0 < num_decodes < len(records):
        ax.axhline(-num_decodes + 0.9, color="#222222", linestyle="--", linewidth=1)
    ax.set_yticks([-y + 0.4 for y in range(len(records))],
                  labels if labels is not None else [f"row {rec.row}" for rec in records], fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(0, _ROW_WIDTH)
    ax.set_ylim(-max(len(records), 1) + 0.9, 0.9)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)


def _rows_figure(num_rows: int, ncols: int = 1) -> Figure:
    return Figure(figsize=(5.2 * ncols, 0.42 * max(num_rows, 1) + 0.9), layout="constrained")


def draw_batch(records: Sequence, *, ax=None, title: str | None = None, highlight: Sequence[int] = (),
               num_decodes: int | None = None):
    """Draw one batch snapshot, one box per row from row 0 at the top.

    Args:
      records: ``InputBatch.snapshot()`` rows (``RowRecord``).
      highlight: row indices outlined in red (e.g. the rows a swap just moved).
      num_decodes: draw a dashed line after the first ``num_decodes`` rows (decode | prefill).
    Returns the Figure; row boxes have gid ``"row:<index>"``.
    """
    if ax is None:
        fig = _rows_figure(len(records))
        ax = fig.add_subplot()
    _draw_rows(ax, records, highlight=highlight, num_decodes=num_decodes)
    ax.set_title(title or f"{sum(r.phase != 'empty' for r in records)} requests in {len(records)} rows", fontsize=9)
    return ax.figure


def _connect(fig, ax_left, ax_right, y_left: int, y_right: int, gid: str, color: str) -> None:
    arrow = ConnectionPatch((_ROW_WIDTH, -y_left + 0.4), (0, -y_right + 0.4), "data", "data", axesA=ax_left,
                            axesB=ax_right, arrowstyle="->", color=color, linewidth=1.5)
    arrow.set_gid(gid)
    fig.add_artist(arrow)


def draw_reorder(before: Sequence, after: Sequence, *, titles=("before", "after"), num_decodes: int | None = None):
    """Two snapshots side by side, an arrow for each request whose row changed.

    Args:
      before, after: ``RowRecord`` lists of the same batch at two moments.
      num_decodes: mark the decode | prefill boundary in ``after``.
    Returns the Figure; arrows are in ``fig.artists`` with gid ``"move:<request id>"``
    and moved rows of ``after`` are outlined in red.
    """
    fig = _rows_figure(max(len(before), len(after)), ncols=2)
    ax_left, ax_right = fig.subplots(1, 2)
    row_before = {r.req_id: y for y, r in enumerate(before) if r.phase != "empty"}
    moved = [y for y, r in enumerate(after) if r.phase != "empty" and row_before.get(r.req_id, y) != y]
    _draw_rows(ax_left, before)
    _draw_rows(ax_right, after, highlight=moved, num_decodes=num_decodes)
    ax_left.set_title(titles[0], fontsize=9)
    ax_right.set_title(f"{titles[1]}: {len(moved)} rows moved", fontsize=9)
    for y in moved:
        req_id = after[y].req_id
        _connect(fig, ax_left, ax_right, row_before[req_id], y, f"move:{req_id}", request_color(req_id))
    return fig


@dataclass(slots=True)
class ReorderFrame:
    """One moment of condense + reorder: the rows, what just changed and why.

    moved: row indices that received a different request in this frame.
    num_decodes: set once the batch is dense (the decode | prefill boundary to draw).
    """

    label: str
    records: list
    moved: tuple[int, ...]
    num_decodes: int | None


def reorder_frames(batch, decode_threshold: int = 1) -> list[ReorderFrame]:
    """Condense ``batch`` and reorder it decode-first one swap at a time, recording each frame.

    Frame 0 is the batch as given (holes included), frame 1 after ``condense()``, then one
    frame per swap of the two-pointer scan (:func:`fleetlab.engine.input_batch.two_pointer_swaps`),
    applied with ``batch.swap``: the same moves ``reorder_split_prefill_and_decode`` makes
    in one go. The batch is left condensed and reordered, as the runner leaves it.
    """
    from fleetlab.engine.input_batch import two_pointer_swaps

    frames = [ReorderFrame("as the step begins (finished requests left holes)", batch.snapshot(decode_threshold),
                           (), None)]
    live = batch.condense()
    mask = batch.is_decode(decode_threshold)
    num_decodes = int(mask.sum())
    moved = tuple(int(new) for new, old in enumerate(live) if new != old)
    frames.append(ReorderFrame(f"condense: {len(moved)} rows slide up into the holes",
                               batch.snapshot(decode_threshold), moved, num_decodes))
    lefts, rights = two_pointer_swaps(mask)
    for k, (left, right) in enumerate(zip(lefts.tolist(), rights.tolist()), start=1):
        batch.swap(left, right)
        frames.append(ReorderFrame(f"swap {k}/{len(lefts)}: prefill row {left} <-> decode row {right}",
                                   batch.snapshot(decode_threshold), (left, right), num_decodes))
    if len(lefts) == 0:
        frames.append(ReorderFrame("already decode-first: no swap needed", batch.snapshot(decode_threshold), (),
                                   num_decodes))
    return frames


def draw_reorder_frame(frames: Sequence[ReorderFrame], index: int):
    """Frame ``index`` of :func:`reorder_frames` next to frame 0, with the frame's moves in red.

    Left: the batch as the step began; right: the batch at this frame. Returns the Figure.
    """
    if not 0 <= index < len(frames):
        raise ValueError(f"frame index {index} out of range [0, {len(frames)})")
    frame = frames[index]
    fig = _rows_figure(max(len(frames[0].records), len(frame.records)), ncols=2)
    ax_left, ax_right = fig.subplots(1, 2)
    _draw_rows(ax_left, frames[0].records)
    _draw_rows(ax_right, frame.records, highlight=frame.moved, num_decodes=frame.num_decodes)
    ax_left.set_title("as the step began", fontsize=9)
    ax_right.set_title(f"frame {index}: {frame.label}", fontsize=9)
    return fig


def draw_gather_map(records: Sequence, order: Sequence[int], num_decodes: int):
    """The reorder that moves no row: rows stay put and the step gathers them by index.

    Args:
      records: the batch's rows (``InputBatch.snapshot()``), holes allowed.
      order: ``fleetlab.lessons.reorder.decode_first_order``'s index map: step slot ``k`` reads row ``order[k]``.
      num_decodes: slots ``[0, num_decodes)`` are decodes.
    Left: the rows as stored; right: the step's view. An arrow (gid ``"gather:<k>"``) joins
    row ``order[k]`` to slot ``k`` whenever they differ. Returns the Figure.
    """
    order = [int(i) for i in np.asarray(order).reshape(-1)]
    gathered = [records[i] for i in order]
    fig = _rows_figure(max(len(records), len(order)), ncols=2)
    ax_left, ax_right = fig.subplots(1, 2)
    _draw_rows(ax_left, records)
    _draw_rows(ax_right, gathered, labels=[f"slot {k} <- row {i}" for k, i in enumerate(order)],
               num_decodes=num_decodes, gid_prefix="slot")
    ax_left.set_title("batch rows (never move)", fontsize=9)
    ax_right.set_title(f"step view: gather index map {order}", fontsize=9)
    for k, i in enumerate(order):
        if k != i:
            _connect(fig, ax_left, ax_right, i, k, f"gather:{k}", request_color(records[i].req_id))
    return fig
