"""``Sampler``: turns each row's logits into its next token.

Greedy rows take the argmax. Sampled rows apply temperature, top-k and top-p, then
draw by inverse CDF with a uniform number derived from the request's own seed and the
index of the token being drawn, so a seeded request gives the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling settings for one step, rows in batch order.

    greedy: bool ``[B]`` host, rows with temperature 0 (decides the fast all-greedy path).
    temperature, top_p: float32 ``[B]``, top_k: int ``[B]`` (0 = off): device tensors,
      the InputBatch's device mirrors in the engine.
    seeds, draw_index: int64 ``[B]`` host arrays (draw_index = outputs so far): the
      per-request random state, drawn on the host so it never depends on the batch.
    banned: per row, token ids that must not be drawn (EOS/stop before min_tokens).
    """

    greedy: np.ndarray
    temperature: paddle.Tensor
    top_k: paddle.Tensor
    top_p: paddle.Tensor
    seeds: np.ndarray
    draw_index: np.ndarray
    banned: list[list[int]]

    @classmethod
    def from_host(cls, temperature, top_k, top_p, seeds, draw_index, banned=None) -> SamplingTensors:
        """Build from host arrays (uploads the settings the sampler reads on the device)."""
        temperature = np.asarray(temperature, dtype=np.float32)
        return cls(temperature == 0, paddle.to_tensor(temperature), paddle.to_tensor(np.asarray(top_k)),
                   paddle.to_tensor(np.asarray(top_p, dtype=np.float32)), np.asarray(seeds),
                   np.asarray(draw_index), banned or [[] for _ in temperature])


def uniform_for(seed: int, draw_index: int) -> float:
    """The request's uniform draw for its ``draw_index``-th token, in [0, 1)."""
    return float(np.random.Generator(np.random.Philox(key=int(seed), counter=int(draw_index))).random())


class Sampler:
    """Samples one token per row from logits ``[B, vocab]``; returns int64 numpy ``[B]``."""

    def __call__(self, logits: paddle.Tensor, st: SamplingTensors) -> np.ndarray:
        if logits.dtype != paddle.float32:
            logits = logits.astype("float32")
        if any(st.banned):
            logits = self._ban(logits, st.banned)
        tokens = paddle.argmax(logits, axis=-1).numpy().astype(np.int64)
        if st.greedy.all():
            return tokens
        rows = np.nonzero(~st.greedy)[0]
        index = paddle.to_tensor(rows)
        probs = self._probs(paddle.gather(logits, index, axis=0), paddle.gather(st.temperature, index),
                            paddle.gather(st.top_k, index), paddle.gather(st.top_p, index))
        u = np.array([uniform_for(st.seeds[r], st.draw_index[r]) for r in rows], dtype=np.float32)
        cdf = paddle.cumsum(probs, axis=-1)
        u_t = paddle.to_tensor(u).unsqueeze(-1) * cdf[:, -1:]
        drawn = paddle.sum((cdf <= u_t).astype("int64"), axis=-1).numpy()
        # A float32 u can round up to 1.0 (u_t == cdf[-1]): every entry then counts and the
        # draw runs off the end. Clamp to the last drawable token, never a masked or banned one.
        drawable_ids = (probs > 0).astype("int64") * paddle.arange(probs.shape[-1], dtype="int64")
        last = paddle.max(drawable_ids, axis=-1).numpy()
        tokens[rows] = np.minimum(drawn, last)
        return tokens

    @staticmethod
    def _ban(logits: paddle.Tensor, banned: list[list[int]]) -> paddle.Tensor:
        mask = np.zeros(logits.shape, dtype=bool)
        for row, ids in enumerate(banned):
            mask[row, ids] = True
        return paddle.where(paddle.to_tensor(mask), paddle.full_like(logits, float("-inf")), logits)

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
