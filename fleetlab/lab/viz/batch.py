"""Drawings of the persistent batch: its rows, condense, the decode-first reorder, and the
gather-index alternative that moves no row at all.

Inputs are the ``RowRecord`` lists of :func:`fleetlab.inspect.batch.batch_snapshot` (one per row:
request id, phase, token counts, block table). A row's box is coloured by its phase
(decode blue, prefill orange, empty grey) with a square of its request's colour on the left.

- :func:`draw_batch`: one snapshot.
- :func:`draw_reorder`: two snapshots side by side, with an arrow for every request that
  changed rows.
- :func:`reorder_frames` + :func:`draw_reorder_frame`: condense and the two-pointer reorder
  one swap at a time, for a slider (see :func:`fleetlab.lab.viz.widgets.player`);
  :func:`draw_reorder_strip`: the same frames side by side, small, for a static page.
- :func:`draw_gather_map`: the rows stay put; the step reads them through an index map.
- :func:`token_split` / :func:`draw_token_axis`: the step's packed token axis, and which
  part of it a decode kernel and a prefill kernel would each take, before and after the
  reorder: the reason the reorder exists.

In two-panel drawings the right panel's row labels stand on its right, so the arrows
between the panels never cross a label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Patch, Rectangle

from fleetlab.inspect.batch import batch_snapshot
from fleetlab.lab.lessons.row_moves import swap_rows
from fleetlab.lab.viz._style import ALERT_COLOR, EDGE_COLOR, integer_steps, phase_color, request_color

_ROW_WIDTH = 10.0


def _row_text(rec) -> str:
    if rec.phase == "empty":
        return "(empty)"
    return (f"req {rec.req_id}  {rec.phase}  {rec.num_scheduled_tokens} tok this step  "
            f"({rec.num_computed_tokens}/{rec.num_tokens} in KV cache)")


def _draw_rows(ax, records, *, labels=None, highlight=(), num_decodes=None, gid_prefix="row",
               labels_right: bool = False) -> None:
    """Draw ``records`` top to bottom into ``ax``; ``labels`` replace the ``row i`` tick labels
    (drawn on the right with ``labels_right``)."""
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
    if labels_right:
        ax.yaxis.tick_right()
    for side in ("top", "bottom", "left" if labels_right else "right"):
        ax.spines[side].set_visible(False)


def _rows_figure(num_rows: int, ncols: int = 1) -> Figure:
    fig = Figure(figsize=(5.6 * ncols, 0.42 * max(num_rows, 1) + 0.9), layout="constrained")
    if ncols > 1:
        fig.get_layout_engine().set(wspace=0.12)  # room for the arrows between the panels
    return fig


def draw_batch(records: Sequence, *, ax=None, title: str | None = None, highlight: Sequence[int] = (),
               num_decodes: int | None = None):
    """Draw one batch snapshot, one box per row from row 0 at the top.

    Args:
      records: ``fleetlab.inspect.batch.batch_snapshot`` rows (``RowRecord``).
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
    _draw_rows(ax_right, after, highlight=moved, num_decodes=num_decodes, labels_right=True)
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

    frames = [ReorderFrame("as the step begins (finished requests left holes)", batch_snapshot(batch, decode_threshold),
                           (), None)]
    live = batch.condense()
    mask = batch.is_decode(decode_threshold)
    num_decodes = int(mask.sum())
    moved = tuple(int(new) for new, old in enumerate(live) if new != old)
    frames.append(ReorderFrame(f"condense: {len(moved)} rows slide up into the holes",
                               batch_snapshot(batch, decode_threshold), moved, num_decodes))
    lefts, rights = two_pointer_swaps(mask)
    for k, (left, right) in enumerate(zip(lefts.tolist(), rights.tolist()), start=1):
        swap_rows(batch, left, right)
        frames.append(ReorderFrame(f"swap {k}/{len(lefts)}: prefill row {left} <-> decode row {right}",
                                   batch_snapshot(batch, decode_threshold), (left, right), num_decodes))
    if len(lefts) == 0:
        frames.append(ReorderFrame("already decode-first: no swap needed", batch_snapshot(batch, decode_threshold), (),
                                   num_decodes))
    return frames


def draw_reorder_frame(frames: Sequence[ReorderFrame], index: int):
    """Frame ``index`` of :func:`reorder_frames` next to frame 0, with the frame's moves in red.

    Left: the batch as the step began; right: the batch at this frame. Drawn without a layout
    engine, so a player can show it quickly. Returns the Figure.
    """
    if not 0 <= index < len(frames):
        raise ValueError(f"frame index {index} out of range [0, {len(frames)})")
    frame = frames[index]
    num_rows = max(len(frames[0].records), len(frame.records))
    # A fixed layout: a player draws many frames, and a layout engine would draw each twice.
    fig = Figure(figsize=(11.2, 0.42 * max(num_rows, 1) + 0.9))
    ax_left, ax_right = fig.subplots(1, 2)
    fig.subplots_adjust(left=0.06, right=0.94, wspace=0.08, top=1 - 0.45 / fig.get_figheight(),
                        bottom=0.1 / fig.get_figheight())
    _draw_rows(ax_left, frames[0].records)
    _draw_rows(ax_right, frame.records, highlight=frame.moved, num_decodes=frame.num_decodes, labels_right=True)
    ax_left.set_title("as the step began", fontsize=9)
    ax_right.set_title(f"frame {index}: {frame.label}", fontsize=9)
    return fig


def draw_reorder_strip(frames: Sequence[ReorderFrame], indices: Sequence[int] | None = None):
    """Frames of :func:`reorder_frames` side by side, small: what the player shows, on one page.

    Each frame is a column of rows, each row a cell naming its request and what it runs this
    step (``d1``: a one-token decode, ``p9``: a 9-token prefill chunk), coloured by phase; the
    rows the frame moved are outlined in red; a dashed line closes the decode rows. Cells have
    gid ``"strip:<frame>:<row>"``. ``indices``: the frames to draw (default: all). Returns the Figure.
    """
    indices = list(range(len(frames))) if indices is None else [int(i) for i in indices]
    if not indices or not all(0 <= i < len(frames) for i in indices):
        raise ValueError(f"draw_reorder_strip: frame indices {indices} outside [0, {len(frames)})")
    num_rows = max(len(frames[i].records) for i in indices)
    fig = Figure(figsize=(1.55 * len(indices) + 0.6, 0.3 * num_rows + 1.3), layout="constrained")
    axes = fig.subplots(1, len(indices), squeeze=False)[0]
    for ax, index in zip(axes, indices):
        frame = frames[index]
        moved = set(frame.moved)
        for y, rec in enumerate(frame.records):
            edge = ALERT_COLOR if y in moved else EDGE_COLOR
            ax.add_patch(Rectangle((0, -y), 1.0, 0.82, facecolor=phase_color(rec.phase), edgecolor=edge,
                                   linewidth=2.2 if y in moved else 0.6, gid=f"strip:{index}:{y}"))
            if rec.phase != "empty":
                ax.add_patch(Rectangle((0.06, -y + 0.16), 0.16, 0.5, facecolor=request_color(rec.req_id),
                                       edgecolor="none"))
                ax.text(0.6, -y + 0.41, f"{rec.req_id} {rec.phase[0]}{rec.num_scheduled_tokens}", ha="center",
                        va="center", fontsize=7.5)
        if frame.num_decodes is not None and 0 < frame.num_decodes < len(frame.records):
            ax.axhline(-frame.num_decodes + 0.91, color="#222222", linestyle="--", linewidth=1)
        ax.set_xlim(-0.05, 1.05)
        ax.set_ylim(-num_rows + 0.85, 0.9)
        ax.axis("off")
        ax.set_title(f"{index}: " + _short_label(frame.label), fontsize=7)
    return fig


def _short_label(label: str) -> str:
    """A frame's label for a narrow panel: ``"swap 2/3: prefill row 4 <-> decode row 7"`` -> ``"swap 2/3\n4 <-> 7"``."""
    if label.startswith("swap"):
        head, rest = label.split(": ", 1)
        left, right = rest.split(" <-> ")
        return f"{head}\nrows {left.split()[-1]} <-> {right.split()[-1]}"
    if label.startswith("condense"):
        return "condense\n" + label.split(": ", 1)[1].replace(" slide up into the holes", " slide up")
    return "as the step\nbegins" if label.startswith("as the step") else label


def draw_gather_map(records: Sequence, order: Sequence[int], num_decodes: int):
    """The reorder that moves no row: rows stay put and the step gathers them by index.

    Args:
      records: the batch's rows (``fleetlab.inspect.batch.batch_snapshot``), holes allowed.
      order: ``fleetlab.lab.lessons.reorder.decode_first_order``'s index map: step slot ``k`` reads row ``order[k]``.
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
               num_decodes=num_decodes, gid_prefix="slot", labels_right=True)
    ax_left.set_title("batch rows (never move)", fontsize=9)
    ax_right.set_title(f"step view: gather index map {order}", fontsize=9)
    for k, i in enumerate(order):
        if k != i:
            _connect(fig, ax_left, ax_right, i, k, f"gather:{k}", request_color(records[i].req_id))
    return fig


# ---------------------------------------------------------------- the packed token axis
@dataclass(slots=True)
class TokenSplit:
    """One step's packed token axis, row after row, and how two attention kernels split it.

    segments: ``(request id, phase, first token, num tokens)`` per row, in row order.
    num_decodes / num_decode_tokens: the leading run of decode rows and their tokens, which
      is all a decode kernel can take (``AttentionMetadata.num_decodes`` counts the same run);
      every token after it goes to the prefill kernel.
    stranded: request ids of decode rows that fall after that run, so into the prefill
      kernel's range (none once the batch is reordered decode-first).
    """

    segments: list[tuple[object, str, int, int]]
    num_decodes: int
    num_decode_tokens: int
    stranded: list

    @property
    def num_tokens(self) -> int:
        return sum(n for *_, n in self.segments)


def token_split(records: Sequence, decode_threshold: int = 1) -> TokenSplit:
    """The :class:`TokenSplit` of rows ``records`` (``fleetlab.inspect.batch.batch_snapshot`` rows, or anything
    with ``req_id``/``request_id`` and ``num_scheduled_tokens``); empty rows are skipped.

    A row is a decode when it runs ``1..decode_threshold`` tokens, as the metadata counts it.
    """
    segments, start = [], 0
    for rec in records:
        n = int(rec.num_scheduled_tokens)
        if getattr(rec, "phase", None) == "empty" or n == 0:
            continue
        req_id = getattr(rec, "req_id", None)
        req_id = rec.request_id if req_id is None else req_id
        phase = "decode" if n <= decode_threshold else "prefill"
        segments.append((req_id, phase, start, n))
        start += n
    num_decodes = next((i for i, seg in enumerate(segments) if seg[1] != "decode"), len(segments))
    num_decode_tokens = sum(n for *_, n in segments[:num_decodes])
    stranded = [seg[0] for seg in segments[num_decodes:] if seg[1] == "decode"]
    return TokenSplit(segments, num_decodes, num_decode_tokens, stranded)


def _draw_token_strip(ax, split: TokenSplit, y: float, label: str) -> None:
    """One packed step at height ``y``: a box per row (width = its tokens), the kernels' ranges below."""
    stranded = set(split.stranded)
    for req_id, phase, start, n in split.segments:
        lost = phase == "decode" and req_id in stranded
        ax.add_patch(Rectangle((start, y), n, 0.8, facecolor=phase_color(phase), edgecolor=request_color(req_id),
                               linewidth=1.6, hatch="xx" if lost else None, gid=f"token:{label}:{req_id}"))
        ax.text(start + n / 2, y + 0.4, str(req_id), ha="center", va="center", fontsize=8)
    total = split.num_tokens
    ranges = [("decode kernel", 0, split.num_decode_tokens, "#2b6cb0"),
              ("prefill kernel", split.num_decode_tokens, total, "#c05621")]
    for name, lo, hi, color in ranges:
        if hi <= lo:
            if name == "decode kernel":
                ax.text(lo, y - 0.55, "decode kernel: nothing (no one-token row leads)", ha="left", va="top",
                        fontsize=8, color=color, gid=f"range:{label}:decode")
            continue
        ax.annotate("", xy=(lo, y - 0.25), xytext=(hi, y - 0.25),
                    arrowprops={"arrowstyle": "|-|", "color": color, "linewidth": 1.5, "shrinkA": 0, "shrinkB": 0})
        span = f"token {lo}" if hi - lo == 1 else f"tokens {lo}-{hi - 1}"
        narrow = (hi - lo) < 0.3 * max(total, 1)
        ax.text(lo if narrow else (lo + hi) / 2, y - 0.55, f"{name}: {span}", ha="left" if narrow else "center",
                va="top", fontsize=8, color=color, gid=f"range:{label}:{name.split()[0]}")


def draw_token_axis(before: Sequence, after: Sequence, *, decode_threshold: int = 1,
                    titles=("before the reorder", "after the decode-first reorder")):
    """The step's packed tokens before and after the reorder, and what each kernel gets.

    Each row of the batch is one box on the token axis, as wide as the tokens it runs this
    step (blue decode, orange prefill, outlined in the request's colour). Under each strip,
    the ranges a two-kernel backend hands out: ``[0, num_decode_tokens)`` to the decode
    kernel, the rest to the prefill kernel. Before the reorder, decode rows that come after
    a prefill row are hatched: they land in the prefill kernel's range. ``before`` and
    ``after``: rows (see :func:`token_split`). Boxes have gid ``"token:<before|after>:<req>"``.
    Returns the Figure.
    """
    splits = {"before": token_split(before, decode_threshold), "after": token_split(after, decode_threshold)}
    total = max(s.num_tokens for s in splits.values())
    fig = Figure(figsize=(min(14.0, max(8.0, 0.3 * total + 2.0)), 3.6), layout="constrained")
    ax = fig.add_subplot()
    for (label, split), y, title in zip(splits.items(), (2.2, 0.0), titles):
        _draw_token_strip(ax, split, y, label)
        count = len(split.stranded)
        note = (f"{count} decode row{'s' if count > 1 else ''} stranded in the prefill range" if count
                else "every decode in the decode range")
        ax.text(0, y + 0.95, f"{title}: {note}", fontsize=9, va="bottom")
    ax.set_xlim(-0.5, total + 0.5)
    ax.set_ylim(-1.2, 3.6)
    ax.set_yticks([])
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    ax.set_xlabel("packed token index in the step's [1, T] input")
    integer_steps(ax)
    ax.legend(handles=[Patch(color=phase_color("decode"), label="decode row (1 token)"),
                       Patch(color=phase_color("prefill"), label="prefill row (a chunk)"),
                       Patch(facecolor=phase_color("decode"), hatch="xx", edgecolor=EDGE_COLOR,
                             label="decode in the prefill range")],
              fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 1.12), ncols=3, frameon=False)
    return fig
