"""Tiled paged attention in plain Paddle ops, and the ``"tiled"`` backend (the default).

One packed step mixes decode rows (one query token) and prefill chunks (many). Every
query token at position ``p`` of its request attends to that request's cached keys at
positions ``j <= p`` (and ``j > p - w`` with a sliding window ``w``), read from the paged
cache through the row's block table.

How it is vectorized: the host copies in the metadata give every row's query length and
context length, so the work is planned on the host, without a device sync. Rows are
grouped into *tiles* (decode rows together, prefill rows together, each sorted by context
length and padded to the longest) and a tile is a handful of batched ops: gather its rows'
keys/values through the block tables straight into ``[B, Hkv, L, D]``, one batched matmul
for the scores ``[B, Hkv, Q*G, L]`` (``G = Hq / Hkv`` query heads share a KV head), a mask
from positions, a float32 softmax, a second matmul. :class:`TileLimits` caps a tile's size:
on a CPU small tiles stay in cache and let a long prompt's early queries skip later keys;
the count of tiles grows with the batch's size in tokens, never with its count of requests.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import paddle

from fleetlab.attention.backend import AttentionBackend, current_device_kind
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.device import Packer
from fleetlab.errors import refuse
from fleetlab.kv.paged_cache import gather_rows


@dataclass(slots=True, frozen=True)
class TileLimits:
    """How big one tile may grow (float32 elements), so its temporaries stay bounded.

    score_elements: ``B * Hq * Q * L`` scores; kv_elements: ``B * L * Hkv * D`` gathered keys
    (and as many values); query_slots: ``Q``, so a long prompt's early queries skip the keys
    after them. Small tiles keep a CPU's caches warm; a GPU wants few, large ones.
    """

    score_elements: int
    kv_elements: int
    query_slots: int


CPU_TILE_LIMITS = TileLimits(score_elements=1 << 22, kv_elements=1 << 20, query_slots=128)
GPU_TILE_LIMITS = TileLimits(score_elements=1 << 26, kv_elements=1 << 26, query_slots=1024)


def tile_limits() -> TileLimits:
    """The limits for Paddle's current device."""
    return CPU_TILE_LIMITS if current_device_kind() == "cpu" else GPU_TILE_LIMITS


class _Tile(NamedTuple):
    """Geometry of one batched piece of work on the host: ``B`` rows, ``Q`` query slots and
    ``L`` keys (whole blocks) each; int64 arrays but ``live``.

    tokens: ``[B * Q]`` packed token index of each query slot (a valid token for padding too);
    cells: ``[B * L / block_size]`` block-table cells read (``row * width + column``);
    key_start: ``[B, 1]`` position of each row's first key read; qpos: ``[B, Q]`` logical
    position of each query; live: bool ``[B, 1, L, 1]``, keys inside the row's context (the
    rest are stale slots or padding, whatever they hold); valid: the real query slots (indices
    into ``tokens``), None when every slot is real.
    """

    tokens: np.ndarray
    cells: np.ndarray
    key_start: np.ndarray
    qpos: np.ndarray
    live: np.ndarray
    valid: np.ndarray | None


class _Plan(NamedTuple):
    """What one tile's kernels read, every layer of the step alike: built on the host from a
    :class:`_Tile` (:func:`_index_tile`), uploaded once per step.

    tokens, live, valid: the tile's (tokens None: the tile is every token of the step, in
    order); kv_index: int64 rows of the cache (seen as
    ``[num_blocks * block_size * Hkv, D]``; whole blocks when ``Hkv == 1``) that gather into
    ``[B, Hkv, L, D]``; visible: bool ``[B, 1, Q, 1, L]`` (its shape gives the tile's ``B``,
    ``Q`` and padded key length ``L``).
    """

    tokens: np.ndarray
    kv_index: np.ndarray
    live: np.ndarray
    visible: np.ndarray
    valid: np.ndarray | None


def paged_attention(query: paddle.Tensor, key_cache: paddle.Tensor, value_cache: paddle.Tensor,
                    metadata: AttentionMetadata, *, scale: float, sliding_window: int | None = None,
                    sinks: paddle.Tensor | None = None) -> paddle.Tensor:
    """Attention of a packed batch of queries over the paged KV cache.

    Args:
      query: ``[T, Hq, D]`` the step's packed queries (RoPE applied).
      key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` one layer's cache, already
        holding this step's keys/values. ``Hq`` must be a multiple of ``Hkv`` (GQA).
      metadata: the step's :class:`AttentionMetadata`; rows may come in any order.
      scale: multiplies ``q . k`` (usually ``D ** -0.5``).
      sliding_window: ``w``: a query at position ``p`` sees keys in ``(p - w, p]``; None = all.
      sinks: ``[Hq]`` per-head logits added to the softmax denominator only (GPT-OSS).

    Returns ``[T, Hq, D]`` in ``query``'s dtype; the softmax runs in float32.
    """
    num_tokens, num_heads, head_dim = _check_inputs(query, key_cache, value_cache, metadata, sinks, sliding_window)
    sliding_window = None if sliding_window is None else operator.index(sliding_window)
    if num_tokens == 0:
        return paddle.zeros_like(query)
    num_kv_heads = key_cache.shape[2]
    tiles, order = _step_plan(metadata, (num_heads, num_kv_heads, head_dim, sliding_window))
    q32 = query.astype("float32") * scale
    group = num_heads // num_kv_heads
    sink_logits = None if sinks is None else sinks.astype("float32").reshape([1, num_kv_heads, 1, group, 1])
    outs = [_attend_tile(q32, key_cache, value_cache, plan, sink_logits) for plan in tiles]
    out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
    if order is not None:
        out = paddle.gather(out, order)  # put the tiles' tokens back in packed order
    return out.astype(query.dtype)


@dataclass(slots=True)
class TiledMetadata(AttentionMetadata):
    """The tiled backend's per-step metadata: the common fields plus its tile plans,
    one per layer shape (heads, window), built by the first layer of that shape and reused
    by the others."""

    plans: dict = field(default_factory=dict)


def _step_plan(metadata, shape: tuple) -> tuple:
    """The plan for this step and layer ``shape`` ``(Hq, Hkv, D, sliding_window)``: ``(plans, order)``,
    every tile's :class:`_Plan` and the gather that restores packed order (None: already in order).
    Memoized in a ``TiledMetadata``; planned afresh for plain ``AttentionMetadata``. It is numpy
    on the host from the metadata's host copies (no device op), and however many tiles, it goes
    to Paddle's current device in two copies (one per dtype)."""
    limits = tile_limits()
    key = (*shape, limits)
    plans = metadata.plans if isinstance(metadata, TiledMetadata) else {}
    if key not in plans:
        num_heads, num_kv_heads, head_dim, sliding_window = shape
        tiles = plan_tiles(metadata, num_heads, num_kv_heads * head_dim, sliding_window, limits)
        table = metadata.block_tables_host
        table = (metadata.block_tables.numpy() if table is None else table).astype(np.int64).reshape(-1)
        hosts = [_index_tile(t, table, metadata.block_size, num_kv_heads, sliding_window) for t in tiles]
        dest = np.concatenate([t.tokens if t.valid is None else t.tokens[t.valid] for t in tiles])
        in_order = np.array_equal(dest, np.arange(len(dest)))
        if in_order and len(hosts) == 1 and hosts[0].valid is None:  # one tile of every token in order
            hosts[0] = hosts[0]._replace(tokens=None)  # its queries are the step's: no gather
        packer = Packer()
        staged = [[None if a is None else packer.add(a) for a in h] for h in hosts]
        order = None if in_order else packer.add(np.argsort(dest))
        packer.upload()
        plans[key] = ([_Plan(*[None if h is None else packer.get(h) for h in handles]) for handles in staged],
                      None if order is None else packer.get(order))
    return plans[key]


def _index_tile(tile: _Tile, table: np.ndarray, block_size: int, num_kv_heads: int, sliding_window) -> _Plan:
    """A tile's :class:`_Plan` on the host: its cache rows through the flat block ``table`` (int64,
    ``-1`` read as block 0, whose keys ``live`` hides) and its mask."""
    num_rows, q_len = tile.qpos.shape
    seq_len = tile.live.shape[2]
    blocks = np.maximum(table[tile.cells], 0)
    if num_kv_heads == 1:  # whole blocks already lie [L, 1, D]: gather them
        kv_index = blocks
    else:  # rows (slot * Hkv + head) that gather into [B, Hkv, L, D]
        slots = (blocks.reshape(num_rows, -1, 1) * block_size + np.arange(block_size)).reshape(num_rows, 1, -1)
        kv_index = (slots * num_kv_heads + np.arange(num_kv_heads).reshape(1, -1, 1)).reshape(-1)
    key_pos = (np.arange(seq_len) + tile.key_start)[:, None, :]  # [B, 1, L]
    query_pos = tile.qpos[:, :, None]  # [B, Q, 1]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    return _Plan(tile.tokens, kv_index, tile.live, visible.reshape(num_rows, 1, q_len, 1, seq_len), tile.valid)


def plan_tiles(metadata: AttentionMetadata, num_heads: int, kv_token_elements: int,
               sliding_window: int | None, limits: TileLimits) -> list[_Tile]:
    """Split the batch into tiles: rows of one query token, then rows of more (each group padded
    alike; not the engine's decode split, which counts draft-verifying rows as decodes), each cut
    to fit ``limits``.

    ``kv_token_elements`` is ``Hkv * D``, the size of one token's keys.
    """
    cu = metadata.cu_seqlens_q_host.astype(np.int64)
    query_lens, seq_lens = np.diff(cu), metadata.seq_lens_kv_host.astype(np.int64)
    width = metadata.block_tables.shape[1]
    tiles = []
    for rows in (np.flatnonzero(query_lens == 1), np.flatnonzero(query_lens > 1)):
        if len(rows) == 0:
            continue
        max_q = int(query_lens[rows].max())
        max_kv = int(seq_lens[rows].max())
        if sliding_window is not None:
            max_kv = min(max_kv, sliding_window + max_q - 1 + metadata.block_size)
        q_step = max(1, min(max_q, limits.query_slots, limits.score_elements // (num_heads * max_kv)))
        row_step = max(1, min(limits.score_elements // (num_heads * max_kv * q_step),
                              limits.kv_elements // (kv_token_elements * max_kv)))
        if row_step < len(rows):  # cut into several tiles: neighbours pad to similar lengths
            rows = rows[np.argsort(seq_lens[rows], kind="stable")]
        for r0 in range(0, len(rows), row_step):
            for q0 in range(0, max_q, q_step):
                tile = _make_tile(cu, query_lens, seq_lens, metadata.block_size, width, rows[r0:r0 + row_step],
                                  q0, q_step, sliding_window)
                if tile is not None:
                    tiles.append(tile)
    return tiles


def _make_tile(cu, query_lens, seq_lens, bs, width, rows, q0, q_len, sliding_window) -> _Tile | None:
    """Plan query slots ``[q0, q0 + q_len)`` of each row in ``rows`` (None if all are padding);
    ``cu``, ``query_lens``, ``seq_lens``: the step's int64 host arrays; ``bs``: the block size;
    ``width``: the block tables' columns."""
    rows = rows[query_lens[rows] > q0]
    if len(rows) == 0:
        return None
    query_lens, seq_lens = query_lens[rows], seq_lens[rows]
    q_len = int(min(q_len, query_lens.max() - q0))
    slot = q0 + np.arange(q_len)[None, :]
    valid = (slot < query_lens[:, None]).reshape(-1)
    slot = np.minimum(slot, query_lens[:, None] - 1)  # padding repeats the row's last real query
    tokens = cu[rows][:, None] + slot
    qpos = (seq_lens - query_lens)[:, None] + slot
    end_block = (qpos.max(axis=1) + bs) // bs  # one past the block holding the last visible key
    first_block = (np.zeros_like(end_block) if sliding_window is None
                   else np.maximum(qpos.min(axis=1) - sliding_window + 1, 0) // bs)
    cols = first_block[:, None] + np.arange((end_block - first_block).max())  # [B, N] block-table columns read
    key_pos = first_block[:, None] * bs + np.arange(cols.shape[1] * bs)  # [B, L]
    live = key_pos <= qpos.max(axis=1, keepdims=True)
    cells = rows[:, None] * width + np.minimum(cols, width - 1)
    return _Tile(tokens.reshape(-1), cells.reshape(-1), key_pos[:, :1], qpos, live[:, None, :, None],
                 None if valid.all() else np.flatnonzero(valid))


def _attend_tile(q32, key_cache, value_cache, tile: _Plan, sink_logits):
    """Compute one tile (its uploaded :class:`_Plan`); returns ``[num valid query slots, Hq, D]``
    float32 in row-major slot order."""
    num_rows, _, q_len, _, seq_len = tile.visible.shape
    visible = tile.visible
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_heads = q32.shape[1]
    group = num_heads // num_kv_heads

    # Queries [B, Q, Hq, D] -> [B, Hkv, Q*G, D]: each KV head's G query heads share one matmul.
    q = q32 if tile.tokens is None else paddle.gather(q32, tile.tokens)
    q = q.reshape([num_rows, q_len, num_kv_heads, group, head_dim]).transpose([0, 2, 1, 3, 4])
    q = q.reshape([num_rows, num_kv_heads, q_len * group, head_dim])
    k = _gather_kv(key_cache, tile.kv_index, num_rows, seq_len)
    # Masked keys get weight 0, but 0 x NaN is NaN: a stale slot of a reused block (or block 0,
    # read for a -1 table entry) may hold anything, so values outside the context become 0.
    # Their scores are replaced by -inf below, whatever the keys hold.
    v = _gather_kv(value_cache, tile.kv_index, num_rows, seq_len)
    v = paddle.where(tile.live, v, paddle.zeros([], "float32"))

    scores = paddle.matmul(q, k, transpose_y=True)  # [B, Hkv, Q*G, L]
    scores = scores.reshape([num_rows, num_kv_heads, q_len, group, seq_len])
    scores = paddle.where(visible, scores, paddle.full([], float("-inf"), "float32"))
    scores = scores.reshape([num_rows, num_kv_heads, q_len * group, seq_len])
    out = paddle.matmul(paddle.nn.functional.softmax(scores, axis=-1), v)  # [B, Hkv, Q*G, D]
    if sink_logits is not None:
        # A sink adds exp(sink) to the denominator Z = sum(exp(scores)), which rescales every
        # weight by Z / (Z + exp(sink)) = sigmoid(logsumexp(scores) - sink): apply it to the output.
        lse = paddle.logsumexp(scores, axis=-1, keepdim=True)  # [B, Hkv, Q*G, 1]
        lse = lse.reshape([num_rows, num_kv_heads, q_len, group, 1])
        out = out.reshape(lse.shape[:-1] + [head_dim]) * paddle.nn.functional.sigmoid(lse - sink_logits)
    out = out.reshape([num_rows, num_kv_heads, q_len, group, head_dim])
    out = out.transpose([0, 2, 1, 3, 4])  # [B, Q, Hkv, G, D]
    out = out.reshape([num_rows * q_len, num_heads, head_dim])
    if tile.valid is not None:
        out = paddle.gather(out, tile.valid)
    return out


def _gather_kv(cache, kv_index, num_rows, seq_len):
    """One layer's keys (or values) of the tile's rows as float32 ``[B, Hkv, L, D]``.

    ``kv_index``: whole blocks when ``Hkv == 1``, else rows of ``[num_slots * Hkv, D]``
    (see :class:`_Plan`)."""
    _, _, num_kv_heads, head_dim = cache.shape
    x = gather_rows(cache if num_kv_heads == 1 else cache.reshape([-1, head_dim]), kv_index)
    return x.astype("float32").reshape([num_rows, num_kv_heads, seq_len, head_dim])


def _check_inputs(query, key_cache, value_cache, metadata, sinks, sliding_window):
    """The shapes agree and the window is a positive int (numpy ints welcome) or None (learners
    call ``paged_attention`` directly); returns ``(T, Hq, D)``."""
    q, kv, v = list(query.shape), list(key_cache.shape), list(value_cache.shape)
    refuse([(len(q) != 3, lambda: f"query must be [T, Hq, D]; got {q}"),
            (len(kv) != 4 or v != kv, lambda: f"key_cache {kv} and value_cache {v} must both be [num_blocks, "
             "block_size, Hkv, D]")], prefix="paged_attention: ")
    (num_tokens, num_heads, head_dim), (_, block_size, num_kv_heads, cache_dim) = q, kv
    refuse([(cache_dim != head_dim, lambda: f"query head_dim {head_dim} != cache head_dim {cache_dim}"),
            (num_heads % num_kv_heads, lambda: f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads"),
            (block_size != metadata.block_size,
             lambda: f"cache block_size {block_size} != metadata.block_size {metadata.block_size}"),
            (num_tokens != metadata.num_tokens,
             lambda: f"query has {num_tokens} tokens, metadata {metadata.num_tokens}"),
            (sinks is not None and list(sinks.shape) != [num_heads],
             lambda: f"sinks must be [{num_heads}]; got {list(sinks.shape)}"),
            (sliding_window is not None and not (hasattr(sliding_window, "__index__")
                                                 and operator.index(sliding_window) >= 1),
             lambda: f"sliding_window must be a positive int or None; got {sliding_window!r}")],
           prefix="paged_attention: ")
    return num_tokens, num_heads, head_dim


class TiledBackend(AttentionBackend):
    """Paged attention in plain Paddle ops: any device, any row order, windows and sinks."""

    name = "tiled"  # any row order: it needs no decode-first reorder (the base's requires_reorder=False)

    def __init__(self) -> None:
        super().__init__()
        self.layer_shapes: frozenset = frozenset()  # (Hq, Hkv, D, window) of every layer attended so far

    def build_metadata(self, common: AttentionMetadata) -> TiledMetadata:
        """The step's metadata with the plan of every layer shape seen so far (the first step's
        layers plan their own): built where the step is prepared, which is the host thread in
        the overlapped loop, not the model's."""
        md = common.extend(TiledMetadata)
        if common.num_tokens:
            for shape in self.layer_shapes:
                _step_plan(md, shape)
        return md

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None,
               sinks=None):
        """See :func:`paged_attention`."""
        out = paged_attention(query, key_cache, value_cache, metadata, scale=scale, sliding_window=sliding_window,
                              sinks=sinks)
        shape = (query.shape[1], key_cache.shape[2], query.shape[2],
                 None if sliding_window is None else operator.index(sliding_window))
        if shape not in self.layer_shapes:  # a new set, not a change to one build_metadata may be reading
            self.layer_shapes = self.layer_shapes | {shape}
        return out

