"""``ProposerInputBatch``: a draft model's per-request state, a field group of the main InputBatch.

A production engine's MTP/draft proposer keeps per-request buffers of its own (the drafts it
proposed, how far its own cache reaches...). When the main batch condenses or reorders
decode-first, those rows must move the same way, or the draft model reads another request's
state. Here they cannot fall behind: the proposer registers its buffers as fields of the main
batch (:func:`proposer_fields`, as a logits processor registers its own), so the batch's one
row move (``InputBatch.move_rows``) carries them with every other field, and a removed row is
cleared with the rest. The ``ProposerInputBatch`` is the proposer's view of that group, under
its own names; its rows are the main batch's rows by construction.
"""

from __future__ import annotations

import numpy as np

from fleetlab.engine.batch_fields import Field

# The view's names -> the main batch's fields (``req_id`` is the main batch's own).
NAMES = {"req_id": "req_id", "num_computed_tokens": "draft_num_computed_tokens",
         "draft_token_ids": "draft_token_ids", "num_draft_tokens": "num_draft_tokens"}


def proposer_fields(num_speculative_tokens: int) -> list[Field]:
    """The fields a draft proposer registers on the main batch (``k`` = the width of its drafts)."""
    return [
        Field("draft_num_computed_tokens", (), "int32", "host", -1,
              "how far the draft model's own cache reaches after its last forward (past the target's, by "
              "the drafts it wrote); -1: it has not run on the row yet (the prefix-cache hits hold both "
              "models' K/V, so it starts where the target stands)"),
        Field("draft_token_ids", (num_speculative_tokens,), "int64", "host", -1,
              "the drafts proposed in the last step, -1 unused"),
        Field("num_draft_tokens", (), "int32", "host", 0, "valid entries of draft_token_ids"),
    ]


class ProposerInputBatch:
    """The proposer's rows of ``batch`` (an InputBatch whose registry holds :func:`proposer_fields`)."""

    def __init__(self, batch) -> None:
        missing = [name for name in NAMES.values() if name not in batch.fields]
        if missing:
            raise ValueError(f"ProposerInputBatch: register proposer_fields(k) in the batch's field registry first "
                             f"(missing {missing})")
        self.main = batch

    def np(self, name: str) -> np.ndarray:
        """The whole numpy buffer of field ``name`` (``req_id``, ``num_computed_tokens``,
        ``draft_token_ids``, ``num_draft_tokens``); rows are the main batch's rows."""
        return self.main.buffer(NAMES[name])

    @property
    def num_computed_tokens(self) -> np.ndarray:
        """The draft's own record per row (writable; -1 where it has not run yet)."""
        return self.np("num_computed_tokens")

    def reach(self) -> np.ndarray:
        """How far the draft model's cache reaches per row: its own record, or, on a row it has
        not run on yet, the target's (the prefix-cache hits hold both models' K/V)."""
        own = self.np("num_computed_tokens")
        return np.where(own >= 0, own, self.main.buffer("num_computed_tokens"))

    def set_drafts(self, row: int, drafts) -> None:
        drafts = list(drafts)
        self.np("draft_token_ids")[row] = -1
        self.np("draft_token_ids")[row, : len(drafts)] = drafts
        self.np("num_draft_tokens")[row] = len(drafts)
