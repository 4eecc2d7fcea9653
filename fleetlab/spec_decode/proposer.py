"""The ``Proposer`` interface, its registry, and how many drafts a row may take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from fleetlab.registry import Registry


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may need from the engine to build itself.

    backend: the target's attention backend instance; num_blocks / block_size: the paged
    pool the draft cache mirrors (same block ids); max_model_len; vocab_size: the target's;
    decode_threshold: the most query tokens a decode row carries.
    """

    backend: object
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    decode_threshold: int


class Proposer:
    """Drafts tokens for the rows of an ``InputBatch``, right after the target's step.

    Class attribute ``name`` is the registry name. ``num_lookahead_tokens``: slots the
    scheduler must reserve past a row's last token when it samples (a draft model writes
    its proposals' K/V there; a model-free proposer needs none).
    """

    name: ClassVar[str] = "base"
    fields: tuple = ()  # batch fields of its per-request state, registered on the runner's InputBatch
    num_lookahead_tokens: int = 0

    def __init__(self, config, context: ProposerContext) -> None:
        self.config = config
        self.context = context  # what the engine told it (max_model_len; a draft model's pool, its backend)
        self.num_speculative_tokens = config.num_speculative_tokens

    def bind(self, batch) -> None:
        """Called once with the runner's (empty) ``InputBatch``."""

    def propose(self, batch, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """Drafts per request id, after a step in which the rows of ``batch`` gained
        ``sampled[request id]`` (rows absent from it gained nothing; the batch itself still
        holds the step's inputs: its ``num_computed_tokens`` and ``num_tokens`` as the step began)."""
        raise NotImplementedError(f"proposer {self.name!r} ({type(self).__name__}) must implement propose()")

    @staticmethod
    def gained(batch, sampled: dict[str, list[int]]) -> np.ndarray:
        """Tokens each row ``[num_reqs]`` gained this step (``sampled``, as :meth:`propose` gets it)."""
        return np.array([len(sampled.get(rid, ())) for rid in batch.req_ids], dtype=np.int64)

    def max_drafts(self, batch, gained: np.ndarray) -> np.ndarray:
        """Drafts each row ``[num_reqs]`` may take once it holds the tokens it ``gained``: none for a
        row that gained none; else at most ``k``, and room for them plus the bonus token before
        ``max_tokens`` and the model's length."""
        n = batch.num_reqs
        num_tokens = batch.num_tokens[:n] + gained
        room = np.minimum(self.context.max_model_len - num_tokens,
                          batch.max_tokens[:n] - (num_tokens - batch.num_prompt_tokens[:n]) - 1)
        return np.where(gained > 0, np.clip(room, 0, self.num_speculative_tokens), 0)

    def set_copies(self, copies) -> None:
        """The step's :class:`~fleetlab.kv.copies.BlockCopy` s (partial prefix-cache hits), given just
        before :meth:`propose`: a proposer with a paged cache of its own applies them in its next
        forward, each layer after its write (the draft model's catch-up); default: it has none."""

    def reset(self) -> None:
        """Forget per-request state (the runner was reset after a failed step)."""

    def close(self) -> None:
        """Release what the proposer holds (a draft model's patch)."""


PROPOSERS = Registry("proposer", Proposer, {
    "ngram": "fleetlab.spec_decode.ngram:NgramProposer",
    "draft": "fleetlab.spec_decode.draft:DraftModelProposer",
})
register_proposer = PROPOSERS.register
