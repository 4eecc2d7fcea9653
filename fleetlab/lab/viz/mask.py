"""The attention mask of one packed step: which keys each packed query token may see.

A step packs every row's query tokens into one sequence (``cu_seqlens_q``), but no token may
attend across rows: the mask over the step is block-diagonal, one block per row. Inside a
row's block, a query sees the row's cached prefix (K/V written by earlier steps) in full and
this step's own keys causally (``key position <= query position``). A decode row is one
query seeing its whole context; a prefill chunk is a lower triangle after its prefix. No
kernel builds this matrix (they loop over rows or tiles and skip what is hidden); it is the
picture of what they compute, read from the step's real :class:`~fleetlab.AttentionMetadata`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from matplotlib.colors import to_rgb
from matplotlib.patches import Patch

from fleetlab.lab.viz._style import new_axes, request_color


@dataclass(slots=True)
class PackedMask:
    """The mask of one step over ``T`` packed queries and ``K`` keys (every row's whole context,
    row after row).

    visible: bool ``[T, K]``; query_row / query_pos: ``[T]`` row and position of each packed
    query; key_row / key_pos / key_slot: ``[K]`` row, position and cache slot of each key;
    key_cached: ``[K]`` True for a key written by an earlier step (the row's cached prefix);
    row_labels: one label per row.
    """

    visible: np.ndarray
    query_row: np.ndarray
    query_pos: np.ndarray
    key_row: np.ndarray
    key_pos: np.ndarray
    key_slot: np.ndarray
    key_cached: np.ndarray
    row_labels: list[str]

    def block(self, row: int) -> np.ndarray:
        """The ``[Q, L]`` part of :attr:`visible` of row ``row``: its queries against its context."""
        return self.visible[np.ix_(self.query_row == row, self.key_row == row)]


def packed_mask(metadata, row_labels: Sequence[str] | None = None, sliding_window: int | None = None) -> PackedMask:
    """The :class:`PackedMask` of the step ``metadata`` describes (its host ``cu_seqlens_q`` and
    ``seq_lens_kv``, and its block tables for the slots). With ``sliding_window``, a query
    also sees only the last ``sliding_window`` positions, as a windowed layer does."""
    cu = np.asarray(metadata.cu_seqlens_q_host, dtype=np.int64)
    seq_lens = np.asarray(metadata.seq_lens_kv_host, dtype=np.int64)
    query_lens = np.diff(cu)
    rows = np.arange(len(seq_lens))
    query_row = np.repeat(rows, query_lens)
    query_pos = np.concatenate([np.arange(s - q, s) for s, q in zip(seq_lens, query_lens)] or [np.zeros(0, int)])
    key_row = np.repeat(rows, seq_lens)
    key_pos = np.concatenate([np.arange(s) for s in seq_lens] or [np.zeros(0, int)])
    key_cached = key_pos < (seq_lens - query_lens)[key_row]
    tables = np.asarray(metadata.block_tables.numpy(), dtype=np.int64)
    bs = metadata.block_size
    key_slot = tables[key_row, key_pos // bs] * bs + key_pos % bs
    visible = (query_row[:, None] == key_row[None, :]) & (key_pos[None, :] <= query_pos[:, None])
    if sliding_window is not None:
        visible &= key_pos[None, :] > query_pos[:, None] - sliding_window
    labels = [str(x) for x in row_labels] if row_labels is not None else [f"row {r}" for r in rows]
    return PackedMask(visible, query_row, query_pos, key_row, key_pos, key_slot, key_cached, labels)


def _name(label: str) -> str:
    return f"req {label}" if label.isdigit() else label


def _lighter(color: str, amount: float = 0.6) -> np.ndarray:
    return 1 - (1 - np.array(to_rgb(color))) * (1 - amount)


def draw_packed_mask(mask: PackedMask, *, ax=None, title: str | None = None):
    """The mask as a grid: packed queries down, keys across, grouped by row.

    A visible key is drawn in its row's request colour, pale when it comes from the row's
    cached prefix, full when this step wrote it; a hidden one is white. Rows are separated by
    lines; a key's column is labelled with its position (and the row's group with its label
    and slots). Returns the Figure; the image has gid ``"mask"``, separators ``"row-edge:<r>"``.
    """
    num_q, num_k = mask.visible.shape
    fig, ax = new_axes(ax, figsize=(max(6.0, 0.2 * num_k + 2.5), max(2.5, 0.24 * num_q + 1.6)))
    image = np.ones((num_q, num_k, 3))
    for r, label in enumerate(mask.row_labels):
        full = np.array(to_rgb(request_color(label)))
        cols = mask.key_row == r
        for cached, rgb in ((True, _lighter(request_color(label))), (False, full)):
            where = mask.visible & (cols & (mask.key_cached == cached))[None, :]
            image[where] = rgb
    ax.imshow(image, aspect="auto", interpolation="nearest", gid="mask")
    ax.set_xticks(range(num_k), [str(p) for p in mask.key_pos], fontsize=5.5)
    ax.set_yticks(range(num_q), [f"{_name(mask.row_labels[r])} @{p}" for r, p in zip(mask.query_row, mask.query_pos)],
                  fontsize=6.5)
    for r, label in enumerate(mask.row_labels):
        keys = np.flatnonzero(mask.key_row == r)
        queries = np.flatnonzero(mask.query_row == r)
        if len(keys):
            ax.axvline(keys[-1] + 0.5, color="#444444", linewidth=0.8, gid=f"row-edge:{r}")
            cached = int(mask.key_cached[keys].sum())
            ax.text(keys.mean(), -0.8, f"{_name(label)}: {cached} cached + {len(keys) - cached} new", ha="center",
                    va="bottom", fontsize=7, color=request_color(label))
        if len(queries):
            ax.axhline(queries[-1] + 0.5, color="#444444", linewidth=0.8)
    ax.set_xlabel("keys: each row's context, by position (pale: the cached prefix; full: written this step)",
                  fontsize=8)
    ax.set_ylabel("packed query tokens (request @ position)", fontsize=8)
    ax.tick_params(length=0)
    ax.legend(handles=[Patch(facecolor=_lighter("#777777"), label="visible, from the cache"),
                       Patch(facecolor="#777777", label="visible, written this step"),
                       Patch(facecolor="white", edgecolor="#999999", label="hidden")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(title or "the packed step's attention mask", fontsize=9, pad=22)
    return fig
