"""Log-probabilities: how likely the model found each token, returned beside the tokens.

**Which logits.** fleetlab returns the log-softmax of the model's *raw* logits, before logit
bias, penalties, temperature, top-k and top-p: vLLM's default ``logprobs_mode="raw_logprobs"``.
So a request's logprobs do not change with its sampling settings, and they equal what the
unpatched model's own forward gives (``log_softmax(full_forward_logits(...))``, the oracle of
``tests/test_sampling_parity.py``). A structured output's grammar mask comes first, as vLLM
applies its bitmask before its sampler: the distribution is over the tokens the grammar allows.

**What a position gets.** A :class:`TokenLogprobs`: the token taken there, its logprob and rank,
and the ``k`` most likely tokens with theirs (OpenAI's ``logprobs``/``top_logprobs``). Sampled
tokens get one per output token (``SamplingParams.logprobs = k``); prompt tokens get one per
token after the first (``prompt_logprobs = k``: the logits at position ``j`` score token
``j + 1``).

**One device read.** :func:`gather` packs ``R`` positions into a float64 block ``[R, 2 + 2k]``
(the token's logprob, its rank, the top ``k`` ids, their logprobs) that the sampler appends to
the step's one device-to-host read; :func:`unpack` reads it back on the host.
:class:`fleetlab.output.logprobs.LogprobsCollector` (the output processor's) keeps each request's
lists as steps add to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import paddle


@dataclass(slots=True)
class TokenLogprobs:
    """One position: the token taken, its logprob and rank (1 = the most likely), and the
    ``top`` most likely tokens as ``(token id, logprob)``, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


def gather(logprobs: paddle.Tensor, token_ids: paddle.Tensor, k: int) -> paddle.Tensor:
    """Flat float64 ``[R * (2 + 2k)]``: per row of ``logprobs [R, vocab]`` the logprob of
    ``token_ids [R]`` (int64, on the device), its rank, then the top ``k`` ids and logprobs."""
    chosen = paddle.take_along_axis(logprobs, token_ids.reshape([-1, 1]), axis=-1)
    rank = paddle.sum((logprobs > chosen).astype("int64"), axis=-1, keepdim=True) + 1
    cols = [chosen.astype("float64"), rank.astype("float64")]
    if k:
        values, ids = paddle.topk(logprobs, k, axis=-1)
        cols += [ids.astype("float64"), values.astype("float64")]
    return paddle.concat(cols, axis=-1).reshape([-1])


def unpack(host: np.ndarray, token_ids, ks) -> tuple[list[TokenLogprobs], np.ndarray]:
    """The host side of :func:`gather`: the ``R = len(ks)`` positions of the block ``[R * (2 + 2k)]``
    (``k = max(ks)``) at the front of ``host``, row ``r`` keeping its own ``ks[r]`` top entries; and
    the rest of ``host`` (the next block of the step's read)."""
    ks = [int(x) for x in ks]
    k = max(ks, default=0)
    rows = host[: len(ks) * (2 + 2 * k)].reshape(len(ks), 2 + 2 * k)  # logprob, rank, top ids, top logprobs
    items = [TokenLogprobs(int(token), float(row[0]), int(row[1]),
                           [(int(i), float(v)) for i, v in zip(row[2: 2 + kr], row[2 + k: 2 + k + kr])])
             for row, token, kr in zip(rows, token_ids, ks)]
    return items, host[rows.size:]
