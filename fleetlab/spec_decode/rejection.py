"""``RejectionSampler``: verify draft tokens so the output is distributed as the target's own.

A row verifying ``k`` drafts scores ``k + 1`` positions: the logits after its last known
token and after each draft. Position ``i`` accepts draft ``d_i`` when greedy and ``d_i``
is the argmax, or, when sampling, with probability ``min(1, p(d_i) / q(d_i))``. fleetlab's
proposers draft greedily, so ``q`` is a point mass on ``d_i`` and that is ``p(d_i)``; on
rejection the position draws from the residual ``max(0, p - q)`` renormalized, i.e. ``p``
without ``d_i``. Leviathan et al. (2023) and Chen et al. (2023) show the accepted-or-redrawn
token is then distributed exactly as ``p``. The row keeps its accepted prefix and one more
token: the redrawn one at the first rejection, or the bonus token after a fully accepted run.
"""

from __future__ import annotations

import numpy as np
import paddle

from fleetlab.device import upload
from fleetlab.engine.sampler import Sampler, SamplingTensors, request_rng


class RejectionSampler(Sampler):
    """A :class:`Sampler` whose rows may carry drafts (``st.draft_token_ids``, ``st.row_starts``)."""

    def sample_rows(self, logits: paddle.Tensor, st: SamplingTensors) -> tuple[list[list[int] | None], object]:
        """Per scored row: its accepted drafts and one token of its own (None if not finite);
        and the whole ``SampleResult``."""
        res = self.sample(logits, st)
        drafts = st.draft_token_ids
        accepted = (drafts >= 0) & (drafts == res.tokens)  # greedy positions: the draft is the argmax
        sampled = np.flatnonzero(~st.greedy)
        accepted[sampled] = res.draws["accepted"].astype(bool) if len(sampled) else accepted[sampled]
        if res.logprobs is not None:  # label an accepted draft's position with the draft (see taken)
            for p in np.flatnonzero(accepted & (drafts >= 0)).tolist():
                if res.logprobs[p] is not None:
                    res.logprobs[p].token_id = int(drafts[p])
        ends = np.append(st.row_starts[1:], len(drafts))
        rows = []
        for start, end in zip(st.row_starts.tolist(), ends.tolist()):
            if not res.finite[start:end].all():
                rows.append(None)
                continue
            # The first position not accepted: a rejected draft, or the last one (it verifies none), so m drafts kept.
            m = int(np.argmin(accepted[start:end]))
            rows.append(drafts[start : start + m].tolist() + [int(res.tokens[start + m])])
        return rows, res

    def taken(self, draws: dict, st: SamplingTensors, rows: np.ndarray) -> paddle.Tensor:
        """A sampled position takes its draft when it accepts it, else the token drawn in its place."""
        return paddle.where(draws["accepted"] == 1, upload(st.draft_token_ids[rows]), draws["token"])

    def draw(self, probs: paddle.Tensor, st: SamplingTensors, rows: np.ndarray) -> dict:
        """``{"token": drawn, "accepted": 0/1}`` for the sampled positions ``rows``: a draft is accepted with
        probability ``p(draft)``; the drawn token comes from ``p`` without the draft."""
        # Two uniforms of the request's own stream: the first, the sampler's, draws a token; the second accepts.
        u = upload([request_rng(st.seeds[r], st.draw_index[r]).random(2) for r in rows.tolist()], np.float32)
        draft_ids = upload(st.draft_token_ids[rows])
        has_draft = draft_ids >= 0
        draft_col = draft_ids.clip(min=0).unsqueeze(-1)
        p_draft = paddle.take_along_axis(probs, draft_col, axis=-1).squeeze(-1)
        accepted = paddle.logical_and(has_draft, self.accept(p_draft, u[:, 1]))
        is_draft = paddle.logical_and(paddle.arange(probs.shape[-1], dtype="int64").unsqueeze(0) == draft_col,
                                      has_draft.unsqueeze(-1))
        drawn = self.inverse_cdf(self.residual(probs, is_draft), u[:, 0])
        return {"token": drawn, "accepted": accepted.astype("int64")}

    @staticmethod
    def accept(p_draft: paddle.Tensor, u: paddle.Tensor) -> paddle.Tensor:
        """Accept a point-mass draft with probability ``min(1, p / q) = p(draft)``."""
        return u < p_draft

    @staticmethod
    def residual(probs: paddle.Tensor, is_draft: paddle.Tensor) -> paddle.Tensor:
        """``max(0, p - q)`` (unnormalized) with ``q`` a point mass on the draft: ``p`` without it."""
        return paddle.where(is_draft, paddle.zeros_like(probs), probs)
