"""The paged attention to read first: one row at a time, every step spelled out.

:func:`naive_paged_attention` does what every paged-attention kernel does, slowly: for each
batch row it turns positions into cache slots through the block table, gathers the keys
and values, applies the causal (and sliding-window) mask and a softmax, and mixes the
values. ``fleetlab.attention.tiled.paged_attention`` is its fast sibling (rows batched
into tiles); the tests hold the two to the same numbers. ``backend="naive"`` runs it.
"""

from __future__ import annotations

import paddle

from fleetlab.attention.backend import AttentionBackend


def naive_paged_attention(query, key_cache, value_cache, metadata, *, scale, sliding_window=None, sinks=None):
    """``query [T, Hq, D]`` over caches ``[num_blocks, block_size, Hkv, D]`` -> ``[T, Hq, D]``."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, bs = key_cache.shape[2], metadata.block_size
    keys = key_cache.reshape([-1, num_kv_heads, head_dim])  # one row per cache slot
    values = value_cache.reshape([-1, num_kv_heads, head_dim])
    cu, seq_lens = metadata.cu_seqlens_q_host, metadata.seq_lens_kv_host
    outputs = []
    for row in range(len(seq_lens)):
        q = query[int(cu[row]) : int(cu[row + 1])].astype("float32")  # [Q, Hq, D]
        num_q, seq_len = q.shape[0], int(seq_lens[row])
        pos = paddle.arange(seq_len, dtype="int64")  # every position of the row's context
        slots = metadata.block_tables[row].astype("int64")[pos // bs] * bs + pos % bs
        k = paddle.gather(keys, slots).astype("float32")  # [L, Hkv, D]
        v = paddle.gather(values, slots).astype("float32")
        k = paddle.repeat_interleave(k, num_heads // num_kv_heads, axis=1)  # GQA: share KV heads
        v = paddle.repeat_interleave(v, num_heads // num_kv_heads, axis=1)
        scores = paddle.einsum("qhd,lhd->hql", q, k) * scale  # [Hq, Q, L]
        q_pos = paddle.arange(seq_len - num_q, seq_len, dtype="int64").unsqueeze(1)  # the new tokens
        visible = pos.unsqueeze(0) <= q_pos  # causal
        if sliding_window is not None:
            visible = paddle.logical_and(visible, pos.unsqueeze(0) > q_pos - sliding_window)
        scores = paddle.where(visible.unsqueeze(0), scores, paddle.full([], float("-inf")))
        if sinks is not None:  # a per-head logit in the softmax's denominator only
            sink = sinks.astype("float32").reshape([num_heads, 1, 1]).expand([num_heads, num_q, 1])
            scores = paddle.concat([scores, sink], axis=-1)
        weights = paddle.nn.functional.softmax(scores, axis=-1)[:, :, :seq_len]
        outputs.append(paddle.einsum("hql,lhd->qhd", weights, v))
    return paddle.concat(outputs).astype(query.dtype) if outputs else paddle.zeros_like(query)


class NaiveBackend(AttentionBackend):
    """:func:`naive_paged_attention` as a backend: any device, any row order, windows and sinks."""

    name = "naive"

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None,
               sinks=None):
        return naive_paged_attention(query, key_cache, value_cache, metadata, scale=scale,
                                     sliding_window=sliding_window, sinks=sinks)
