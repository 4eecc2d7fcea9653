"""The ``"draft"`` proposer: a small model, patched by fleetlab, drafts ``k`` tokens per step.

The draft model has its **own paged KV cache** (its own layers and heads) addressed by the
**same block ids** as the target's: the scheduler allocates a request's blocks once and
both caches use them, so a block shared through the prefix cache holds valid K/V in both.
Its per-request state lives in a :class:`~fleetlab.spec_decode.proposer_batch.ProposerInputBatch`:
fields it registers on the main ``InputBatch``, so they move with its rows (condense, reorder
decode-first).

Each step, after the target's step:

1. the draft's cache is valid up to the target's ``num_computed_tokens`` as the step began
   (it caught up in every earlier step; drafts the target rejected are overwritten now);
2. catch up, in one packed forward over every row: what the target computed this step,
   and for each row that gained tokens, up to its new last token (its logits give the
   first draft);
3. ``k - 1`` more forwards of one token per proposing row, each feeding the previous draft
   (kept on the device: the drafts come back to the host in one read at the end).

The draft writes K/V up to ``k - 1`` positions past a row's last token: the scheduler
reserves those slots (``num_lookahead_tokens = k``). Drafting is greedy (the argmax), so
the draft distribution is a point mass and rejection sampling stays exact.
"""

from __future__ import annotations

import numpy as np
import paddle

from fleetlab.attention.context import forward_context
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.device import check_model_dtype_runs, upload
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.patching import PatchHandle, patch_model
from fleetlab.spec_decode.config import check_draft_vocab
from fleetlab.spec_decode.proposer import Proposer
from fleetlab.spec_decode.proposer_batch import ProposerInputBatch, proposer_fields


class DraftModelProposer(Proposer):
    """Autoregressive drafting with a fleetlab-patched small model over its own paged cache."""

    name = "draft"

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        model = config.model
        self.handle = model if isinstance(model, PatchHandle) else patch_model(model, backend=context.backend)
        self._owns_patch = self.handle is not model
        try:
            check_model_dtype_runs(self.handle.dtype, "speculative_config model")
            check_draft_vocab(self.handle.vocab_size, context.vocab_size)
        except ValueError:
            self.close()
            raise
        self.kv_cache = PagedKVCache.for_handle(self.handle, context.num_blocks, context.block_size)
        self.fields = proposer_fields(self.num_speculative_tokens)  # registered on the main batch
        self.num_lookahead_tokens = self.num_speculative_tokens  # its drafts' K/V slots past a row's last token
        self.batch: ProposerInputBatch | None = None
        self._copies = None  # the step's CopyPlan, for its first forward

    def bind(self, batch) -> None:
        self.batch = ProposerInputBatch(batch)

    def set_copies(self, copies) -> None:
        """The step's partial prefix hits, copied in the draft's cache too (it shares the target's block
        ids) by the catch-up forward's layers, each after its write (a source the step fills is written then)."""
        self._copies = self.kv_cache.copy_plan(copies)

    def close(self) -> None:
        """Undo the patch this proposer applied to the draft model."""
        if self._owns_patch:
            self.handle.unpatch()

    def propose(self, batch, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        n, req_ids, reach = batch.num_reqs, batch.req_ids, self.batch.num_computed_tokens
        # What both models' caches hold: drafts past the target's count that it rejected are redone.
        start = np.minimum(self.batch.reach()[:n], batch.num_computed_tokens[:n]).astype(np.int64)
        num_tokens = batch.num_tokens[:n].astype(np.int64)
        gained = self.gained(batch, sampled)
        upto = np.where(gained > 0, num_tokens + gained,
                        np.minimum(start + batch.num_scheduled_tokens[:n], num_tokens))
        max_drafts = self.max_drafts(batch, gained)
        rows = np.flatnonzero(upto > start)
        if len(rows) == 0:
            return {}
        ids = np.concatenate([np.concatenate([batch.token_ids[r, start[r]: min(upto[r], num_tokens[r])],
                                              sampled.get(req_ids[r], [])]) for r in rows.tolist()])
        scored = np.flatnonzero(max_drafts[rows] > 0)  # catch-up rows that propose, in row order
        logits = self._forward(batch, rows, (upto - start)[rows], start[rows], upload(ids.reshape(1, -1), np.int64),
                               scored)
        reach[rows] = upto[rows]
        prop_rows = rows[scored]
        if len(prop_rows) == 0:  # the catch-up alone keeps the draft's cache in step
            return {}
        drafts = [paddle.argmax(logits, axis=-1)]
        for i in range(1, int(max_drafts[prop_rows].max())):
            keep = np.flatnonzero(max_drafts[prop_rows] > i)
            sub = prop_rows[keep]
            prev = paddle.gather(drafts[-1], upload(keep)) if len(keep) < len(prop_rows) else drafts[-1]
            logits = self._forward(batch, sub, np.ones(len(sub), np.int64), reach[sub], prev.reshape([1, -1]),
                                   np.arange(len(sub)))
            reach[sub] += 1  # the draft's cache now holds the token fed
            step = paddle.full([len(prop_rows)], -1, dtype="int64")
            drafts.append(paddle.scatter(step, upload(keep), paddle.argmax(logits, axis=-1)))
        host = paddle.stack(drafts, axis=1).numpy()  # [num proposing rows, max drafts]: one read
        out = {}
        for j, row in enumerate(prop_rows.tolist()):
            proposal = host[j, : max_drafts[row]].tolist()
            self.batch.set_drafts(row, proposal)
            out[req_ids[row]] = proposal
        return out

    def _forward(self, batch, rows: np.ndarray, query_lens: np.ndarray, num_computed: np.ndarray,
                 input_ids: paddle.Tensor, scored: np.ndarray) -> paddle.Tensor:
        """One packed draft forward over ``rows``; logits ``[len(scored), vocab]`` at the last
        token of the rows ``rows[scored]``."""
        device_tables = batch.dev("block_table") if len(rows) == batch.num_reqs else None  # all rows: the mirror
        md = AttentionMetadata.build(query_lens, num_computed, batch.block_table[rows], self.context.block_size,
                                     self.context.decode_threshold, block_tables_device=device_tables)
        md.kv_copies, self._copies = self._copies, None  # the catch-up applies the step's copies
        last = upload(md.cu_seqlens_q_host[1:][scored].astype(np.int64) - 1)
        with paddle.no_grad(), forward_context(md, self.kv_cache):
            return self.handle.compute_logits(input_ids.astype("int64"), md.positions.reshape([1, -1]), last)

