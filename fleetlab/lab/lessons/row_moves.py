"""An ``InputBatch``'s rows moved by hand: a step taken apart, one move at a time.

The engine moves rows in ``condense`` and ``reorder_split_prefill_and_decode`` and appends in
``update_requests``; a lesson does the same moves one at a time with these:

- :func:`swap_rows`, :func:`permute_rows`, :func:`append_tokens`, :func:`append_block_ids`;
- :func:`by_request`, :func:`unpermute`: per-row values back to request ids or to the row
  order before a reorder.
"""

from __future__ import annotations

import numpy as np


def swap_rows(batch, i: int, j: int) -> None:
    """Exchange rows ``i`` and ``j`` (either may be a hole) in every field."""
    for row in (i, j):
        if not 0 <= row < batch.num_rows:
            raise ValueError(f"swap: row {row} is outside the rows in use [0, {batch.num_rows})")
    if i != j:
        batch.move_rows(np.array([i, j]), np.array([j, i]))


def permute_rows(batch, perm) -> None:
    """Reorder the rows of a dense batch: new row ``i`` takes old row ``perm[i]``."""
    perm = np.asarray(perm, dtype=np.int64)
    if batch.has_holes or sorted(perm.tolist()) != list(range(batch.num_rows)):
        raise ValueError(f"perm must be a permutation of the rows [0, {batch.num_rows}) of a dense batch (call "
                         f"condense() first); got {perm.tolist()}")
    moved = np.flatnonzero(perm != np.arange(batch.num_rows))
    batch.move_rows(moved, perm[moved])


def _live_req(batch, row: int):
    if not 0 <= row < batch.num_rows or batch.buffer("req_id")[row] is None:
        raise ValueError(f"row {row} holds no request (num_rows={batch.num_rows})")
    return batch.buffer("req_id")[row]


def append_tokens(batch, row: int, tokens) -> None:
    """Append output tokens to the row's ``token_ids`` (its drafts are dropped)."""
    req_id, tokens, size = _live_req(batch, row), list(tokens), batch.sizes["max_model_len"]
    if int(batch.buffer("num_tokens")[row]) + len(tokens) > size:
        raise ValueError(f"request {req_id!r}: field 'token_ids' is full (max_model_len={size})")
    batch.append(np.array([row]), [tokens])


def append_block_ids(batch, row: int, block_ids) -> None:
    """Append newly allocated block ids to the row's ``block_table``."""
    req_id, ids, size = _live_req(batch, row), list(block_ids), batch.sizes["max_blocks_per_seq"]
    start = int(batch.buffer("num_blocks")[row])
    if start + len(ids) > size:
        raise ValueError(f"request {req_id!r}: {start} + {len(ids)} block ids exceed field 'block_table' "
                         f"(max_blocks_per_seq={size})")
    num_spec = batch.buffer("num_spec_tokens")[row]
    batch.append(np.array([row]), [[]], [ids])
    batch.buffer("num_spec_tokens")[row] = num_spec  # blocks alone leave the drafts


def by_request(batch, values) -> dict:
    """``{req_id: values[row]}`` for the live rows; ``values`` is indexed by row."""
    return {req_id: values[row] for req_id, row in batch.req_id_to_row.items()}


def invert_permutation(perm) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] = i``: for ``perm[new_row] = old_row``, ``inv[old_row] = new_row``."""
    perm = np.asarray(perm, dtype=np.int64)
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm), dtype=np.int64)
    return inv


def unpermute(values_new, perm) -> np.ndarray:
    """Put per-row ``values_new`` (new row order) back into the order before ``perm``.

    ``perm[new_row] = old_row`` as returned by ``reorder_split_prefill_and_decode``.
    """
    return np.asarray(values_new)[invert_permutation(perm)]
