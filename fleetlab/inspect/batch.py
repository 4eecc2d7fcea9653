"""An ``InputBatch`` seen from outside: its rows drawn and its bookkeeping checked (the engine's
own step needs neither).

- :func:`batch_snapshot`: one :class:`RowRecord` per row, for drawing;
- :func:`check_batch`: the id <-> row map, ``num_rows`` and empty rows agree (tests, debugging).

The row moves a lesson makes by hand (``swap_rows``, ``permute_rows``, ``append_tokens``...)
are :mod:`fleetlab.lab.lessons.row_moves`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleetlab.errors import refuse


@dataclass(slots=True)
class RowRecord:
    """One row of :func:`batch_snapshot`, for drawing the batch.

    ``phase`` is ``"decode"``, ``"prefill"`` or ``"empty"``; ``block_table`` lists the
    row's allocated block ids (no -1 padding).
    """

    row: int
    req_id: object
    phase: str
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: list[int]


def batch_snapshot(batch, decode_threshold: int = 1, *, include_free: bool = False) -> list[RowRecord]:
    """One :class:`RowRecord` per row ``[0, num_rows)`` (all rows with ``include_free``)."""
    decode = batch.is_decode(decode_threshold)
    records = []
    for row in range(batch.max_num_seqs if include_free else batch.num_rows):
        req_id = batch.buffer("req_id")[row]
        phase = "empty" if req_id is None else ("decode" if decode[row] else "prefill")
        blocks = batch.buffer("block_table")[row]
        counts = [int(batch.buffer(name)[row]) for name in
                  ("num_prompt_tokens", "num_tokens", "num_computed_tokens", "num_scheduled_tokens")]
        records.append(RowRecord(row, req_id, phase, *counts, blocks[blocks >= 0].tolist()))
    return records


def check_batch(batch) -> None:
    """Raise RuntimeError if the id <-> row map, ``num_rows`` or empty rows disagree."""
    req_ids = batch.buffer("req_id")
    derived = {req_ids[r]: r for r in range(batch.max_num_seqs) if req_ids[r] is not None}
    empty = np.flatnonzero(np.equal(req_ids, None))
    dirty = [f.name for f in batch.fields if len(empty) and not _all_fill(batch.buffer(f.name)[empty], f.fill)]
    mapped = dict(batch.req_id_to_row)
    refuse([(derived != mapped, f"req_id_to_row {mapped} != rows' req_id {derived}"),
            (derived and max(derived.values()) + 1 != batch.num_rows,
             f"num_rows={batch.num_rows} but last live row is {max(derived.values(), default=None)}"),
            (dirty, f"fields {dirty} hold data in an empty row")], RuntimeError)


def _all_fill(rows: np.ndarray, fill) -> bool:
    """Every entry equals ``fill`` (NaN fills compare equal to NaN; objects by identity or ==)."""
    if rows.dtype == object:
        return all(x is fill or x == fill for x in rows.reshape(-1))
    return np.array_equal(rows, np.full_like(rows, fill), equal_nan=True)
