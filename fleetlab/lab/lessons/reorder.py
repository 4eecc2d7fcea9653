"""Two alternatives to the runtime's two-pointer decode-first reorder, for comparison.

- :func:`stable_partition` / :func:`stable_reorder`: decodes first *and* each group in its
  old order. It keeps the order a reader expects, but moves every row after the first
  misplaced one, where the two-pointer scan moves only the misplaced rows.
- :func:`decode_first_order`: move nothing at all; gather the step's inputs through an
  index map, decodes first (the approach of vLLM's newer model runner).
"""

from __future__ import annotations

import numpy as np

from fleetlab.lab.lessons.row_moves import permute_rows


def stable_partition(is_decode: np.ndarray) -> np.ndarray:
    """``perm`` (``perm[new] = old``) putting decode rows first, keeping order within groups."""
    is_decode = np.asarray(is_decode, dtype=bool)
    return np.concatenate([np.flatnonzero(is_decode), np.flatnonzero(~is_decode)]).astype(np.int64)


def stable_reorder(batch, decode_threshold: int = 1) -> tuple[np.ndarray, int]:
    """Reorder a dense ``InputBatch`` with :func:`stable_partition`; returns ``(perm, num_decodes)``
    like ``InputBatch.reorder_split_prefill_and_decode``."""
    mask = batch.is_decode(decode_threshold)
    perm = stable_partition(mask)
    permute_rows(batch, perm)
    return perm, int(mask.sum())


def decode_first_order(batch, decode_threshold: int = 1) -> tuple[np.ndarray, int]:
    """The gather index map: live rows (holes skipped), decodes first, each group in row order.

    Returns ``(order, num_decodes)``. Nothing moves; the step's inputs are gathered as
    ``batch.block_table[order]`` etc.
    """
    live = np.flatnonzero(np.not_equal(batch.np("req_id"), None))
    mask = batch.is_decode(decode_threshold)[live]
    return np.concatenate([live[mask], live[~mask]]), int(mask.sum())
