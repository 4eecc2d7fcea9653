"""``Sampler``: turns scored positions' logits into tokens, and verifies draft tokens.

A step scores ``P`` positions: one per row whose chunk reached its last known token, and
``k + 1`` per row verifying ``k`` drafts. Greedy positions take the argmax. Sampled
positions apply temperature, top-k and top-p, then draw by inverse CDF with a uniform
derived from the request's own seed and the index of the token being drawn, so a seeded
request gives the same tokens whatever else shares its batch.

Draft verification (speculative decoding): a position that proposes draft ``d`` accepts it
when greedy and ``d`` is the argmax, or, when sampling, with probability ``p(d)`` (the
proposers draft greedily, so their distribution ``q`` is a point mass on ``d`` and
``min(1, p(d) / q(d)) = p(d)``); on rejection it draws from the residual ``max(0, p - q)``
renormalized, i.e. ``p`` without ``d``. Leviathan et al. (2023) and Chen et al. (2023)
show the accepted-or-resampled token is then distributed exactly as ``p``: the output
distribution is the target model's own. Every result comes back in one device-to-host read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from fleetlab.device import upload


@dataclass(slots=True)
class SamplingTensors:
    """Per scored position sampling settings for one step.

    greedy: bool ``[P]`` host, positions of temperature-0 rows (decides the all-greedy path).
    temperature, top_p: float32 ``[P]``, top_k: int ``[P]`` (0 = off): device tensors.
    seeds, draw_index: int64 ``[P]`` host arrays (draw_index = the request's output index of
      the token drawn here): the per-request random state, drawn on the host so it never
      depends on the batch.
    banned: per position, token ids that must not be drawn (EOS/stop before min_tokens).
    draft_token_ids: int64 ``[P]`` host, the draft each position verifies (-1: none).
    """

    greedy: np.ndarray
    temperature: paddle.Tensor
    top_k: paddle.Tensor
    top_p: paddle.Tensor
    seeds: np.ndarray
    draw_index: np.ndarray
    banned: list[list[int]]
    draft_token_ids: np.ndarray | None = None

    @classmethod
    def from_host(cls, temperature, top_k, top_p, seeds, draw_index, banned=None,
                  draft_token_ids=None) -> SamplingTensors:
        """Build from host arrays (uploads the settings the sampler reads on the device)."""
        temperature = np.asarray(temperature, dtype=np.float32)
        return cls(temperature == 0, upload(temperature), upload(top_k),
                   upload(top_p, np.float32), np.asarray(seeds),
                   np.asarray(draw_index), banned or [[] for _ in temperature],
                   None if draft_token_ids is None else np.asarray(draft_token_ids, dtype=np.int64))


@dataclass(slots=True)
class SampleResult:
    """Host arrays ``[P]``: the token each position draws (the correction or bonus token
    where a draft is rejected or absent), whether its draft was accepted, and whether its
    logits were finite."""

    tokens: np.ndarray
    accepted: np.ndarray
    finite: np.ndarray


def uniform_for(seed: int, draw_index: int) -> float:
    """The request's uniform for drawing its ``draw_index``-th token, in [0, 1)."""
    return float(_philox(seed, draw_index).random())


def accept_uniform_for(seed: int, draw_index: int) -> float:
    """An independent uniform for accepting a draft as the ``draw_index``-th token."""
    return float(_philox(seed, draw_index).random(2)[1])


def _philox(seed: int, draw_index: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=int(seed), counter=int(draw_index)))


class Sampler:
    """``sampler(logits [P, vocab], st)`` -> int64 numpy ``[P]`` tokens; ``sample`` also verifies drafts."""

    def __call__(self, logits: paddle.Tensor, st: SamplingTensors) -> np.ndarray:
        return self.sample(logits, st).tokens

    def sample(self, logits: paddle.Tensor, st: SamplingTensors) -> SampleResult:
        """Draw every position and verify its draft; one device-to-host read in all."""
        if logits.dtype != paddle.float32:
            logits = logits.astype("float32")
        num_pos = logits.shape[0]
        drafts = st.draft_token_ids if st.draft_token_ids is not None else np.full(num_pos, -1, np.int64)
        finite = paddle.isfinite(logits).all(axis=-1)
        # A non-finite row finishes its request with an error; zero it so the rest stays defined.
        logits = paddle.where(paddle.isfinite(logits), logits, paddle.zeros_like(logits))
        if any(st.banned):
            logits = self._ban(logits, st.banned)
        argmax = paddle.argmax(logits, axis=-1)
        if st.greedy.all():
            host = paddle.stack([argmax, finite.astype("int64")]).numpy()
            tokens = host[0].astype(np.int64)
            return SampleResult(tokens, (drafts >= 0) & (drafts == tokens), host[1].astype(bool))
        rows = np.flatnonzero(~st.greedy)
        drawn, accepted = self._sample_rows(logits, st, rows, drafts[rows])
        host = paddle.concat([argmax, finite.astype("int64"), drawn, accepted.astype("int64")]).numpy()
        tokens = host[:num_pos].astype(np.int64)
        greedy_accept = (drafts >= 0) & (drafts == tokens)
        tokens[rows] = host[2 * num_pos : 2 * num_pos + len(rows)]
        accepted_all = greedy_accept.copy()
        accepted_all[rows] = host[2 * num_pos + len(rows) :].astype(bool)
        return SampleResult(tokens, accepted_all, host[num_pos : 2 * num_pos].astype(bool))

    def _sample_rows(self, logits, st: SamplingTensors, rows: np.ndarray, drafts: np.ndarray):
        """Rejection-sample the non-greedy positions ``rows``; returns device ``(drawn, accepted)``."""
        index = upload(rows)
        probs = self._probs(paddle.gather(logits, index, axis=0), paddle.gather(st.temperature, index),
                            paddle.gather(st.top_k, index), paddle.gather(st.top_p, index))
        # The acceptance uniform is drawn only where there is a draft to accept.
        u = upload(np.array([[uniform_for(st.seeds[r], st.draw_index[r]),
                              accept_uniform_for(st.seeds[r], st.draw_index[r]) if d >= 0 else 1.0]
                             for r, d in zip(rows.tolist(), drafts.tolist())], dtype=np.float32))
        draft_ids = upload(drafts)
        has_draft = draft_ids >= 0
        draft_col = draft_ids.clip(min=0).unsqueeze(-1)
        p_draft = paddle.take_along_axis(probs, draft_col, axis=-1).squeeze(-1)
        accepted = paddle.logical_and(has_draft, self.accept(p_draft, u[:, 1]))
        is_draft = paddle.logical_and(paddle.arange(probs.shape[-1], dtype="int64").unsqueeze(0) == draft_col,
                                      has_draft.unsqueeze(-1))
        residual = self.residual(probs, is_draft)
        cdf = paddle.cumsum(residual, axis=-1)
        threshold = u[:, :1] * cdf[:, -1:]
        drawn = paddle.sum((cdf <= threshold).astype("int64"), axis=-1)
        # A float32 u can round up to 1.0 (threshold == cdf[-1]): every entry then counts and the
        # draw runs off the end. Clamp to the last drawable token, never a masked or banned one.
        drawable_ids = (residual > 0).astype("int64") * paddle.arange(residual.shape[-1], dtype="int64")
        return paddle.minimum(drawn, paddle.max(drawable_ids, axis=-1)), accepted

    @staticmethod
    def accept(p_draft: paddle.Tensor, u: paddle.Tensor) -> paddle.Tensor:
        """Accept a point-mass draft with probability ``min(1, p / q) = p(draft)``."""
        return u < p_draft

    @staticmethod
    def residual(probs: paddle.Tensor, is_draft: paddle.Tensor) -> paddle.Tensor:
        """``max(0, p - q)`` (unnormalized) with ``q`` a point mass on the draft: ``p`` without it."""
        return paddle.where(is_draft, paddle.zeros_like(probs), probs)

    @staticmethod
    def _ban(logits: paddle.Tensor, banned: list[list[int]]) -> paddle.Tensor:
        mask = np.zeros(logits.shape, dtype=bool)
        for row, ids in enumerate(banned):
            mask[row, ids] = True
        return paddle.where(upload(mask), paddle.full_like(logits, float("-inf")), logits)

    @staticmethod
    def _probs(logits, temperature, top_k, top_p) -> paddle.Tensor:
        """Probabilities after temperature, top-k and top-p (masked tokens get 0)."""
        vocab = logits.shape[-1]
        logits = logits / temperature.astype("float32").unsqueeze(-1)
        sorted_logits = paddle.sort(logits, axis=-1, descending=True)
        top_k = top_k.astype("int64")
        k = paddle.where(top_k > 0, paddle.clip(top_k, max=vocab), paddle.full_like(top_k, vocab)) - 1
        kth = paddle.take_along_axis(sorted_logits, k.unsqueeze(-1), axis=-1)
        sorted_probs = paddle.nn.functional.softmax(sorted_logits, axis=-1)
        # Keep a token while the mass strictly before it is below top_p (the top token always stays).
        mass_before = paddle.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = mass_before < top_p.astype("float32").unsqueeze(-1)
        n_keep = paddle.sum(keep_sorted.astype("int64"), axis=-1, keepdim=True) - 1
        pth = paddle.take_along_axis(sorted_logits, n_keep, axis=-1)
        threshold = paddle.maximum(kth, pth)
        keep = (logits >= threshold) & (logits > float("-inf"))  # banned tokens are -inf already
        probs = paddle.nn.functional.softmax(paddle.where(keep, logits, paddle.full_like(logits, float("-inf"))), -1)
        # Paddle's CPU softmax gives -inf a tiny mass (~1e-28), not 0: zero it so a masked token
        # can never be drawn.
        return paddle.where(keep, probs, paddle.zeros_like(probs))
