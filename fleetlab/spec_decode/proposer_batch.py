"""``ProposerInputBatch``: a draft model's per-request state, row for row beside the InputBatch.

A production engine's MTP/draft proposer keeps its own batch of per-request buffers (the
drafts it proposed, how far its own cache reaches...). When the main batch condenses or
reorders decode-first, those rows must move the same way, or the draft model reads another
request's state. Here the proposer batch *follows* the main batch: it is
attached with ``InputBatch.add_follower`` and every row move, clear and add of the main
batch is replayed on it, through its own field registry. Lockstep holds by construction
(``check_lockstep`` verifies it; the tests fingerprint it under random operations).
"""

from __future__ import annotations

import numpy as np

from fleetlab.engine.batch_fields import Field, FieldRegistry

PROPOSER_FIELDS = FieldRegistry([
    Field("req_id", (), "object", "host", None, "request id, mirrors the main batch's row"),
    Field("num_computed_tokens", (), "int32", "host", 0,
          "how far the draft's own cache reaches after its last forward (past the target's, by the "
          "drafts it wrote); a record for drawing: positions come from the main batch"),
    Field("draft_token_ids", ("num_speculative_tokens",), "int64", "host", -1,
          "the drafts proposed in the last step, -1 unused"),
    Field("num_draft_tokens", (), "int32", "host", 0, "valid entries of draft_token_ids"),
])


class ProposerInputBatch:
    """Per-request buffers ``[max_num_seqs, ...]`` of a proposer, moved with the main batch.

    Args:
      max_num_seqs: rows, as the main batch.
      num_speculative_tokens: ``k`` (width of ``draft_token_ids``).
      fields: the registry (default ``PROPOSER_FIELDS``); extra fields move like the rest.
    """

    def __init__(self, max_num_seqs: int, num_speculative_tokens: int, fields: FieldRegistry | None = None):
        self.max_num_seqs = max_num_seqs
        self._fields = (fields or PROPOSER_FIELDS).copy()
        sizes = {"num_speculative_tokens": num_speculative_tokens}
        self._np = {f.name: np.full((max_num_seqs, *f.resolve_shape(sizes)), f.fill, dtype=f.dtype)
                    for f in self._fields}

    def np(self, name: str) -> np.ndarray:
        """The whole numpy buffer of field ``name`` (rows are the main batch's rows)."""
        return self._np[self._fields[name].name]

    @property
    def num_computed_tokens(self) -> np.ndarray:
        return self._np["num_computed_tokens"]

    # The three hooks the main batch calls (see InputBatch.add_follower).
    def move_rows(self, dst: np.ndarray, src: np.ndarray) -> None:
        for buf in self._np.values():
            buf[dst] = buf[src]

    def clear_rows(self, rows: np.ndarray) -> None:
        for f in self._fields:
            self._np[f.name][rows] = f.fill

    def on_add(self, batch, row: int, req_id) -> None:
        """A request joined the main batch in ``row`` (its prefix-cache hits hold both models' K/V)."""
        self._np["req_id"][row] = req_id
        self._np["num_computed_tokens"][row] = batch.num_computed_tokens[row]

    def set_drafts(self, row: int, drafts) -> None:
        drafts = list(drafts)
        self._np["draft_token_ids"][row] = -1
        self._np["draft_token_ids"][row, : len(drafts)] = drafts
        self._np["num_draft_tokens"][row] = len(drafts)

    def reset(self) -> None:
        self.clear_rows(np.arange(self.max_num_seqs))

    def check_lockstep(self, batch) -> None:
        """Raise RuntimeError unless every row holds the same request as the main batch's."""
        mine = self._np["req_id"]
        theirs = batch.buffer("req_id")
        bad = [r for r in range(self.max_num_seqs) if mine[r] != theirs[r]]
        if bad:
            raise RuntimeError(f"proposer batch out of step with the main batch at rows {bad}: "
                               f"{[mine[r] for r in bad]} vs {[theirs[r] for r in bad]}")
