"""Applying a step's token bitmasks to the logits, on the device, and finding dead rows.

A bitmask row is int32 ``[W]`` with ``W * 32 >= V``: bit ``t % 32`` of word ``t // 32`` is 1
when token ``t`` is allowed (the layout of llguidance and xgrammar, and vLLM's). Bits past the
logits' ``V`` columns are ignored (a backend's stand-ins for characters the vocabulary lacks).

The sampler masks before temperature, top-k and top-p, so greedy and sampled rows alike can
only pick allowed tokens. Rows without a constraint pay nothing: the caller passes only the
constrained rows' logits (or their row indices into the whole batch's).
"""

from __future__ import annotations

import numpy as np
import paddle

_BITS = 32


def _constants(place) -> tuple[paddle.Tensor, paddle.Tensor]:
    # [1, 1, 32] int32: 1 << b for b in 0..31 (1 << 31 is INT32_MIN, the sign bit: fine for &); and -inf
    bits = np.left_shift(np.ones(_BITS, dtype=np.uint32), np.arange(_BITS, dtype=np.uint32)).view(np.int32)
    return (paddle.to_tensor(bits.reshape(1, 1, _BITS), place=place),
            paddle.to_tensor(np.array([-np.inf], dtype=np.float32), place=place))


_CONSTANTS: dict[str, tuple[paddle.Tensor, paddle.Tensor]] = {}  # per device, made once


def _on(place) -> tuple[paddle.Tensor, paddle.Tensor]:
    key = str(place)
    if key not in _CONSTANTS:
        _CONSTANTS[key] = _constants(place)
    return _CONSTANTS[key]


def unpack_bitmask(bitmask: paddle.Tensor, vocab_size: int) -> paddle.Tensor:
    """bool ``[P, vocab_size]``: which tokens each row allows (``bitmask``: int32 ``[P, W]``)."""
    rows, words = bitmask.shape
    shape = [rows, words, _BITS]
    bits, _ = _on(bitmask.place)
    # Both operands expanded first: Paddle's CPU AND was 3x slower broadcasting them itself (measured).
    allowed = paddle.bitwise_and(bitmask.unsqueeze(-1).expand(shape), bits.expand(shape)) != 0
    return allowed.reshape([rows, words * _BITS])[:, :vocab_size]


def apply_token_bitmask(logits: paddle.Tensor, bitmask: paddle.Tensor, rows: paddle.Tensor | None = None
                        ) -> paddle.Tensor:
    """``logits`` with every token its row's bitmask disallows set to ``-inf``; a new tensor.

    logits: float ``[N, V]``; bitmask: int32 ``[P, W]`` on the same device, ``W * 32 >= V``.
    rows: ``None`` (then ``P == N``: every row is masked) or int64 ``[P]``, the rows of
    ``logits`` that ``bitmask``'s rows belong to (the others are left as they are, at no cost
    beyond the gather and the scatter of the ``P`` constrained rows).
    """
    num_rows, vocab_size = logits.shape
    if bitmask.dtype != paddle.int32 or bitmask.ndim != 2 or bitmask.shape[1] * _BITS < vocab_size:
        raise ValueError(f"bitmask must be int32 [rows, >= {-(-vocab_size // _BITS)}] for {vocab_size} logits; "
                         f"got {bitmask.dtype} {list(bitmask.shape)}")
    expected = num_rows if rows is None else rows.shape[0]
    if bitmask.shape[0] != expected:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {expected} constrained logits rows")
    if expected == 0:
        return logits
    sub = logits if rows is None else paddle.gather(logits, rows)
    minus_inf = _on(bitmask.place)[1].astype(sub.dtype)
    masked = paddle.where(unpack_bitmask(bitmask, vocab_size), sub, minus_inf)
    return masked if rows is None else paddle.scatter(logits, rows, masked, overwrite=True)


def dead_rows(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool ``[P]``: rows (host int32 ``[P, W]``) that allow none of the ``vocab_size`` model
    tokens. Such a request cannot continue its grammar: the engine finishes it with an error
    rather than sample from all ``-inf``."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")
    return ~bits[:, :vocab_size].any(axis=1)
