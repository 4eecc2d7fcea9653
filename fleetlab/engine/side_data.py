"""Per-request side data: embeddings that replace some prompt tokens' own embeddings.

A vision-language request carries image features bound to prompt positions (the image's
placeholder tokens). The engine keeps them with the request and in its InputBatch row (an
object field, moved by every condense and reorder like any other field), slices them to
each prefill chunk, and, after a preemption, recomputes with them again. Blocks from the
first replaced position on are never shared through the prefix cache: their K/V depend on
more than the token ids the cache keys on.
"""

from __future__ import annotations

import numpy as np


def normalize_prompt_embeds(request_id: str, prompt_embeds, num_prompt_tokens: int, hidden_size: int):
    """``(positions int64 [m], embeddings float32 [m, hidden_size])`` from what a user passes.

    Accepts ``{prompt position: vector [hidden_size]}`` or an array ``[num_prompt_tokens,
    hidden_size]`` (every position replaced). Raises ``ValueError`` naming the request and
    ``prompt_embeds`` for a position outside the prompt, a wrong width, or a non-finite value.
    """
    def bad(why):
        raise ValueError(f"request {request_id!r}: prompt_embeds {why}")

    if isinstance(prompt_embeds, dict):
        if not prompt_embeds:
            bad("is an empty dict")
        items = sorted(prompt_embeds.items())
        try:
            positions = np.array([int(p) for p, _ in items], dtype=np.int64)
            values = np.stack([np.asarray(v, dtype=np.float32) for _, v in items])
        except (TypeError, ValueError) as exc:
            bad(f"must map int positions to vectors of {hidden_size} floats ({exc})")
    else:
        values = np.asarray(prompt_embeds, dtype=np.float32)
        if values.ndim != 2 or values.shape[0] != num_prompt_tokens:
            bad(f"as an array must be [num_prompt_tokens={num_prompt_tokens}, {hidden_size}]; "
                f"got {list(values.shape)}")
        positions = np.arange(num_prompt_tokens, dtype=np.int64)
    if values.ndim != 2 or values.shape[1] != hidden_size:
        bad(f"vectors must have the model's hidden size {hidden_size}; got shape {list(values.shape)}")
    if positions.min() < 0 or positions.max() >= num_prompt_tokens:
        bad(f"positions {positions.tolist()[:5]} must lie in the prompt [0, {num_prompt_tokens})")
    if not np.isfinite(values).all():
        bad("holds non-finite values")
    return positions, values


def chunk_embeds(prompt_embeds, row_start: int, num_computed: int, num_scheduled: int):
    """The replacements that fall in one prefill chunk: ``(packed token indices, vectors)``.

    ``row_start``: the row's first token in the packed step; the chunk covers positions
    ``[num_computed, num_computed + num_scheduled)``.
    """
    positions, values = prompt_embeds
    inside = (positions >= num_computed) & (positions < num_computed + num_scheduled)
    return row_start + positions[inside] - num_computed, values[inside]
