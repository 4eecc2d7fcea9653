"""``Sampler``: turns the logits of each row's last token into its next token.

A step scores one position per row whose chunk reached its last known token. Greedy rows
take the argmax. Sampled rows apply temperature, top-k and top-p, then draw by inverse CDF
with a uniform derived from the request's own seed and the index of the token being drawn,
so a seeded request gives the same tokens whatever else shares its batch. Logits processors
(logit bias and penalties among them) change the logits first. A row whose logits are not
finite gets no token (its request stops with an error). Rows that asked for log-probabilities
get them from the raw logits (:mod:`fleetlab.engine.logprobs`), and so do the prompt
positions of requests that asked for prompt log-probabilities (after a grammar's mask, as in
vLLM, but before any other processor). Every result comes back in one
device-to-host read. Speculative decoding verifies draft tokens with a subclass
(:class:`fleetlab.spec_decode.rejection.RejectionSampler`) that reuses these primitives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle

from fleetlab.device import upload
from fleetlab.engine import logprobs as lp
from fleetlab.engine.logits_processor import apply_processor


@dataclass(slots=True)
class SamplingTensors:
    """Per scored position sampling settings for one step.

    greedy: bool ``[P]`` host, positions of temperature-0 rows (decides the all-greedy path).
    temperature, top_p: float32, top_k: int (0 = off): device tensors, one entry per batch
      row (``pos_row`` picks each position's) or, with ``pos_row`` None, per position.
    seeds, draw_index: int64 ``[P]`` host arrays (draw_index = the request's output index of
      the token drawn here): the per-request random state, drawn on the host so it never
      depends on the batch.
    banned: per position, token ids that must not be drawn (EOS/stop before min_tokens).
    draft_token_ids: int64 ``[P]`` host, the draft each position verifies (-1: none).
    row_starts: int64 ``[R]`` host, each scored row's first position (a row verifying ``k``
      drafts owns ``k + 1`` positions); None: one position per row.
    pos_row: int64 ``[P]`` host, the batch row of each position.
    batch: the InputBatch the rows belong to (what logits processors read), or None.
    num_logprobs: int ``[P]`` host, top logprobs each position returns (-1: none); None: none.
    prompt_targets, prompt_num_logprobs: int64 ``[Q]`` host, or None: the logits handed to the
      sampler carry ``Q`` more rows after the ``P`` scored ones, at prompt positions whose
      next prompt token (the target) gets its logprob and the top ``prompt_num_logprobs``.
    row_errors: batch row -> why a logits processor stops that row's request (a grammar that
      allows no token): the runner reports it as the request's error and its token is dropped.
    """

    greedy: np.ndarray
    temperature: paddle.Tensor
    top_k: paddle.Tensor
    top_p: paddle.Tensor
    seeds: np.ndarray
    draw_index: np.ndarray
    banned: list[list[int]]
    draft_token_ids: np.ndarray | None = None
    row_starts: np.ndarray | None = None
    pos_row: np.ndarray | None = None
    batch: object = None
    num_logprobs: np.ndarray | None = None
    prompt_targets: np.ndarray | None = None
    prompt_num_logprobs: np.ndarray | None = None
    row_errors: dict = field(default_factory=dict)


@dataclass(slots=True)
class SampleResult:
    """Host arrays ``[P]``: the token each position draws and whether its logits were finite;
    ``draws``: the sampled positions' device results by name (``"token"``, and a subclass's own,
    such as the rejection sampler's ``"accepted"``), ``[num sampled positions]`` each, read in the
    same read; ``logprobs``: a ``TokenLogprobs`` per position (None where not asked for);
    ``prompt_logprobs``: one per prompt position of ``st.prompt_targets``."""

    tokens: np.ndarray
    finite: np.ndarray
    draws: dict
    logprobs: list | None = None
    prompt_logprobs: list | None = None


def request_rng(seed: int, draw_index: int) -> np.random.Generator:
    """The request's own random stream at its ``draw_index``-th token (Philox, keyed by its seed)."""
    return np.random.Generator(np.random.Philox(key=int(seed), counter=int(draw_index)))


class Sampler:
    """``sample(logits [P, vocab], st)`` -> a :class:`SampleResult`; ``sample_rows`` groups its tokens by row.

    ``processors``: :class:`~fleetlab.engine.logits_processor.LogitsProcessor` s applied, in
    order, to the logits of every step before anything is picked.
    """

    def __init__(self, processors=()):
        self.processors = list(processors)

    def sample_rows(self, logits: paddle.Tensor, st: SamplingTensors) -> tuple[list[list[int] | None], SampleResult]:
        """The tokens each scored row gains (None where its logits were not finite), and the
        whole :class:`SampleResult` (logprobs included)."""
        res = self.sample(logits, st)
        return [[t] if ok else None for t, ok in zip(res.tokens.tolist(), res.finite.tolist())], res

    def sample(self, logits: paddle.Tensor, st: SamplingTensors) -> SampleResult:
        """Draw every position; one device-to-host read in all."""
        logits = logits if logits.dtype == paddle.float32 else logits.astype("float32")
        num, none = len(st.greedy), np.zeros(0, np.int64)
        blocks = []
        if st.prompt_targets is not None:  # rows past the scored ones: prompt positions
            blocks.append(lp.gather(paddle.nn.functional.log_softmax(logits[num:], -1),
                                    upload(st.prompt_targets, np.int64), int(st.prompt_num_logprobs.max())))
        if num == 0:  # only prompt positions this step (a chunk short of its prompt's end)
            return self._read([], {}, blocks, st, none, none)
        scored = logits if num == logits.shape[0] else logits[:num]
        ok = paddle.isfinite(scored)
        lp_rows = np.flatnonzero(st.num_logprobs >= 0) if st.num_logprobs is not None else none
        logits, raw = self._process(scored, st, lp_rows)
        chosen = paddle.argmax(logits, axis=-1)
        head = [chosen, ok.all(axis=-1).astype("int64")]  # a row not finite finishes with an error
        rows, draws = np.flatnonzero(~st.greedy), {}
        if len(rows):
            clean = paddle.where(ok, logits, paddle.zeros_like(logits))  # keeps the sampled rows defined
            index = upload(rows if st.pos_row is None else st.pos_row[rows])  # the settings' rows
            probs = self.probs(paddle.gather(clean, upload(rows), axis=0), paddle.gather(st.temperature, index),
                               paddle.gather(st.top_k, index), paddle.gather(st.top_p, index))
            draws = self.draw(probs, st, rows)
            if raw is not None:  # the logprobs of the token each row takes
                chosen = paddle.scatter(chosen, upload(rows), self.taken(draws, st, rows))
        if raw is not None:  # before the prompt block: _read unpacks in this order
            lp_index = upload(lp_rows)
            blocks.insert(0, lp.gather(raw, paddle.gather(chosen, lp_index), int(st.num_logprobs[lp_rows].max())))
        return self._read(head, draws, blocks, st, rows, lp_rows)

    def _process(self, logits: paddle.Tensor, st: SamplingTensors, lp_rows: np.ndarray) -> tuple:
        """The logits after every processor and ban, and the raw logprobs of rows ``lp_rows``
        (None if none): a grammar's mask comes first (-inf is masked, not broken, and no logprob
        ranks it), then the logprobs are taken, then the other processors run."""
        masks = [p for p in self.processors if getattr(p, "masks_tokens", False)]
        for processor in masks:
            logits = apply_processor(processor, logits, st)
        raw = self._raw_logprobs(paddle.gather(logits, upload(lp_rows), axis=0)) if len(lp_rows) else None
        for processor in self.processors:
            if processor not in masks:
                logits = apply_processor(processor, logits, st)
        if any(st.banned):  # EOS and stop ids before min_tokens can never be drawn
            mask = np.zeros(logits.shape, dtype=bool)
            for row, ids in enumerate(st.banned):
                mask[row, ids] = True
            logits = paddle.where(upload(mask), paddle.full_like(logits, float("-inf")), logits)
        return logits, raw

    @staticmethod
    def _raw_logprobs(logits: paddle.Tensor) -> paddle.Tensor:
        """Log-softmax, keeping ``-inf`` (a masked token) at ``-inf``: Paddle's CPU kernel gives it
        about ``-64`` below the row's largest logit instead."""
        return paddle.where(paddle.isinf(logits), logits, paddle.nn.functional.log_softmax(logits, -1))

    @staticmethod
    def _read(head: list, draws: dict, blocks: list, st: SamplingTensors, rows: np.ndarray,
              lp_rows: np.ndarray) -> SampleResult:
        """The step's one device-to-host read: the int64 argmax and finite flags of every position
        and the named ``draws`` of the sampled ones (as float64, exact for token ids, when logprob
        ``blocks`` ride along), unpacked into a :class:`SampleResult`."""
        num, k, parts = len(st.greedy), len(rows), head + list(draws.values())
        host = paddle.concat([p.astype("float64") for p in parts] + blocks if blocks else parts).numpy()
        tokens, finite = host[:num].astype(np.int64), host[num: 2 * num].astype(bool)
        named = {name: host[2 * num + i * k: 2 * num + (i + 1) * k].astype(np.int64) for i, name in enumerate(draws)}
        if k:
            tokens[rows] = named["token"]
        res = SampleResult(tokens, finite, named)
        rest = host[2 * num + len(draws) * k:]
        if len(lp_rows):
            items, rest = lp.unpack(rest, tokens[lp_rows], st.num_logprobs[lp_rows])
            res.logprobs = [None] * num
            for r, item in zip(lp_rows.tolist(), items):
                res.logprobs[r] = item
        if st.prompt_targets is not None:
            res.prompt_logprobs, _ = lp.unpack(rest, st.prompt_targets, st.prompt_num_logprobs)
        return res

    def taken(self, draws: dict, st: SamplingTensors, rows: np.ndarray) -> paddle.Tensor:
        """The token each sampled position ``rows`` takes (its logprob is returned): the drawn one."""
        return draws["token"]

    def draw(self, probs: paddle.Tensor, st: SamplingTensors, rows: np.ndarray) -> dict:
        """``{"token": drawn ids}`` (int64 device ``[len(rows)]``) for the sampled positions ``rows``, each
        drawn with the first uniform in [0, 1) of its request's own stream at its token's index."""
        u = upload([request_rng(st.seeds[r], st.draw_index[r]).random() for r in rows.tolist()], np.float32)
        return {"token": self.inverse_cdf(probs, u)}

    @staticmethod
    def inverse_cdf(probs: paddle.Tensor, u: paddle.Tensor) -> paddle.Tensor:
        """The token whose CDF interval holds ``u * total`` in each row of (unnormalized) ``probs``."""
        cdf = paddle.cumsum(probs, axis=-1)
        drawn = paddle.sum((cdf <= u.unsqueeze(-1) * cdf[:, -1:]).astype("int64"), axis=-1)
        # A float32 u can round up to 1.0 (threshold == cdf[-1]): every entry then counts and the
        # draw runs off the end. Clamp to the last drawable token, never a masked or banned one.
        drawable_ids = (probs > 0).astype("int64") * paddle.arange(probs.shape[-1], dtype="int64")
        return paddle.minimum(drawn, paddle.max(drawable_ids, axis=-1))

    @staticmethod
    def probs(logits, temperature, top_k, top_p) -> paddle.Tensor:
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
