"""Reference paged attention equals plain dense causal attention on the unpaged sequences."""

import itertools

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetlab.attention import tiled
from fleetlab.attention.backend import get_attention_backend
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.attention.naive import naive_paged_attention
from fleetlab.attention.tiled import TiledBackend, TiledMetadata, paged_attention
from fleetlab.kv.paged_cache import PagedKVCache

HQ, D, SCALE = 8, 4, 0.37
FAST = settings(max_examples=12, deadline=None)


def dense_attention(q, k, v, positions, window=None, sinks=None):
    """Plain attention of queries ``q [n, Hq, D]`` at ``positions`` over a whole sequence ``k, v [L, Hkv, D]``."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1).astype(np.float64)
    scores = np.einsum("qhd,khd->hqk", q.astype(np.float64), k) * SCALE
    j, p = np.arange(k.shape[0])[None, :], np.asarray(positions)[:, None]
    visible = (j <= p) & ((j > p - window) if window else True)
    scores = np.where(visible[None], scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[:, None, None])
    e = np.exp(scores - top)
    denom = e.sum(-1, keepdims=True) + (np.exp(sinks[:, None, None] - top) if sinks is not None else 0)
    return np.einsum("hqk,khd->qhd", e / denom, v)


class World:
    """Requests with random full Q/K/V, their blocks scattered over a shuffled paged cache."""

    def __init__(self, lengths, num_kv_heads, block_size, seed=0, dtype="float32", attention=paged_attention,
                 poison=None):
        rng = np.random.default_rng(seed)
        self.attention = attention
        self.block_size = block_size
        need = [-(-n // block_size) for n in lengths]
        self.width = max(need)
        physical = rng.permutation(sum(need) + 3)  # a few spare blocks stay unused
        self.tables = np.full((len(lengths), self.width), -1, np.int32)
        start = 0
        for r, n in enumerate(need):
            self.tables[r, :n] = physical[start:start + n]
            start += n
        self.q = [rng.standard_normal((n, HQ, D)).astype("float32") for n in lengths]
        self.k = [rng.standard_normal((n, num_kv_heads, D)).astype("float32") for n in lengths]
        self.v = [rng.standard_normal((n, num_kv_heads, D)).astype("float32") for n in lengths]
        self.cache = PagedKVCache(1, len(physical), block_size, num_kv_heads, D, dtype=dtype)
        if poison is not None:  # every slot holds garbage until a step writes it
            for cache in (self.cache.key_cache(0), self.cache.value_cache(0)):
                cache.set_value(paddle.full_like(cache, poison))

    def step(self, rows, window=None, sinks=None):
        """Run rows ``[(request, num_computed, query_len)]`` as one packed step; return per-row outputs."""
        req = [r for r, _, _ in rows]
        computed = [c for _, c, _ in rows]
        qlens = [n for _, _, n in rows]
        md = AttentionMetadata.build(qlens, computed, self.tables[req], self.block_size)
        pick = [(r, slice(c, c + n)) for r, c, n in rows]
        k = np.concatenate([self.k[r][s] for r, s in pick])
        v = np.concatenate([self.v[r][s] for r, s in pick])
        q = np.concatenate([self.q[r][s] for r, s in pick])
        dtype = self.cache.dtype
        self.cache.write(0, paddle.to_tensor(k).astype(dtype), paddle.to_tensor(v).astype(dtype), md.slot_mapping)
        out = self.attention(paddle.to_tensor(q).astype(dtype), self.cache.key_cache(0),
                              self.cache.value_cache(0), md, scale=SCALE, sliding_window=window,
                              sinks=None if sinks is None else paddle.to_tensor(sinks))
        out = out.astype("float32").numpy()
        return np.split(out, np.cumsum(qlens)[:-1])

    def expected(self, r, start, n, window=None, sinks=None):
        return dense_attention(self.q[r][start:start + n], self.k[r], self.v[r],
                               np.arange(start, start + n), window, sinks)


def _prefill(world, rows):
    """Write the cached prefix ``[0, num_computed)`` of each row (its attention output is not checked)."""
    rows = [(r, 0, c) for r, c, _ in rows if c > 0]
    if rows:
        world.step(rows)


@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])  # GQA ratios 1, 2, 4, 8
@pytest.mark.parametrize("length", [3, 4, 5, 13])  # block_size - 1, block_size, block_size + 1, ...
def test_prefill_then_decode_match_dense(num_kv_heads, length):
    world = World([length, length + 1], num_kv_heads, block_size=4, seed=length)
    got = world.step([(0, 0, length), (1, 0, length)])  # whole prompts
    for r in range(2):
        np.testing.assert_allclose(got[r], world.expected(r, 0, length), atol=1e-5)
    got = world.step([(1, length, 1)])  # one decode with the prompt cached
    np.testing.assert_allclose(got[0], world.expected(1, length, 1), atol=1e-5)


@FAST
@given(data=st.data())
def test_chunked_prefill_matches_full_sequence(data):
    length = data.draw(st.integers(2, 23), label="length")
    cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=4), label="cuts"))
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]), label="block_size")
    window = data.draw(st.sampled_from([None, 1, 3, 30]), label="window")
    world = World([length], num_kv_heads=2, block_size=block_size, seed=length)
    bounds = [0, *cuts, length]
    outs = [world.step([(0, a, b - a)], window=window)[0] for a, b in itertools.pairwise(bounds)]
    np.testing.assert_allclose(np.concatenate(outs), world.expected(0, 0, length, window), atol=1e-5)


@FAST
@given(data=st.data())
def test_mixed_batch_in_any_row_order(data):
    num_reqs = data.draw(st.integers(1, 6), label="num_reqs")
    lengths = data.draw(st.lists(st.integers(1, 20), min_size=num_reqs, max_size=num_reqs), label="lengths")
    rows = []
    for r, n in enumerate(lengths):
        qlen = data.draw(st.one_of(st.just(1), st.integers(1, n)), label=f"qlen{r}")  # many decodes
        rows.append((r, n - qlen, qlen))
    rows = data.draw(st.permutations(rows), label="order")
    num_kv_heads = data.draw(st.sampled_from([1, 2, 4, 8]), label="num_kv_heads")
    window = data.draw(st.sampled_from([None, 1, 2, 5, np.int64(50)]), label="window")
    use_sinks = data.draw(st.booleans(), label="sinks")
    world = World(lengths, num_kv_heads, block_size=data.draw(st.sampled_from([2, 4]), label="bs"), seed=num_reqs)
    sinks = np.random.default_rng(1).standard_normal(HQ).astype("float32") * 2 if use_sinks else None
    _prefill(world, rows)
    got = world.step(rows, window, sinks)
    for (r, c, n), out in zip(rows, got):
        np.testing.assert_allclose(out, world.expected(r, c, n, window, sinks), atol=1e-5)


@FAST
@given(data=st.data())
def test_the_naive_attention_and_its_fast_sibling_agree(data):
    lengths = data.draw(st.lists(st.integers(1, 14), min_size=1, max_size=5), label="lengths")
    rows = [(r, n - q, q) for r, n in enumerate(lengths)
            for q in [data.draw(st.one_of(st.just(1), st.integers(1, n)), label=f"q{r}")]]
    window = data.draw(st.sampled_from([None, 2, 5]), label="window")
    sinks = np.linspace(-1, 2, HQ).astype("float32") if data.draw(st.booleans(), label="sinks") else None
    outs = []
    for attention in (paged_attention, naive_paged_attention):
        world = World(lengths, num_kv_heads=2, block_size=3, seed=len(lengths), attention=attention)
        _prefill(world, rows)
        outs.append(world.step(rows, window, sinks))
    for fast, naive, (r, c, n) in zip(*outs, rows):
        np.testing.assert_allclose(fast, naive, atol=1e-5)
        np.testing.assert_allclose(naive, world.expected(r, c, n, window, sinks), atol=1e-5)


@pytest.mark.parametrize("attention", [paged_attention, naive_paged_attention], ids=["tiled", "naive"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_garbage_outside_every_rows_context_changes_nothing(attention, poison):
    # Rows of different lengths share tiles: a short row reads the padding of its tile (stale
    # slots, and block 0 for its -1 table entries) -- all of it NaN or inf here.
    lengths = [9, 2, 17, 5]
    rows = [(0, 8, 1), (1, 0, 2), (2, 10, 7), (3, 4, 1)]
    for window, sinks in ((None, None), (3, np.linspace(-1, 1, HQ).astype("float32"))):
        clean = World(lengths, num_kv_heads=2, block_size=4, attention=attention)
        dirty = World(lengths, num_kv_heads=2, block_size=4, attention=attention, poison=poison)
        spare = sorted(set(range(1, dirty.cache.num_blocks)) - set(dirty.tables.ravel().tolist()))[0]
        dirty.tables[dirty.tables == 0] = spare  # block 0: never written, but read for -1 entries
        clean.tables[:] = dirty.tables
        for world in (clean, dirty):
            _prefill(world, rows)
        for got, want in zip(dirty.step(rows, window, sinks), clean.step(rows, window, sinks)):
            assert np.isfinite(got).all()
            np.testing.assert_array_equal(got, want)


def test_the_tiled_backend_plans_once_per_layer_shape():
    world = World([6, 3], num_kv_heads=2, block_size=4)
    md = TiledBackend().build_metadata(AttentionMetadata.build([6, 3], [0, 0], world.tables, 4))
    assert isinstance(md, TiledMetadata) and md.plans == {}
    q = paddle.zeros([9, HQ, D])
    for _ in range(3):  # three layers of one step
        paged_attention(q, world.cache.key_cache(0), world.cache.value_cache(0), md, scale=SCALE)
    paged_attention(q, world.cache.key_cache(0), world.cache.value_cache(0), md, scale=SCALE, sliding_window=2)
    assert len(md.plans) == 2


@pytest.mark.parametrize("window", [1, 3, 6, 100])  # shorter and longer than the context
def test_sliding_window_and_sinks_on_decodes(window):
    lengths = [9, 2, 17]
    world = World(lengths, num_kv_heads=2, block_size=4, seed=window)
    sinks = np.linspace(-2, 3, HQ).astype("float32")
    rows = [(r, n - 1, 1) for r, n in enumerate(lengths)]
    _prefill(world, rows)
    for s in (None, sinks):
        for (r, c, n), out in zip(rows, world.step(rows, window, s)):
            np.testing.assert_allclose(out, world.expected(r, c, n, window, s), atol=1e-5)


def test_sinks_shrink_the_weights():
    # A very large sink takes all the softmax mass: the output goes to zero.
    world = World([5], num_kv_heads=1, block_size=2)
    out = world.step([(0, 0, 5)], sinks=np.full(HQ, 50.0, "float32"))[0]
    assert np.abs(out).max() < 1e-10


@pytest.mark.parametrize("limits", [tiled.TileLimits(HQ * 12 * 2, 10**9, 3),
                                    tiled.TileLimits(10**9, 2 * D * 8, 10**9)])
def test_small_tiles_change_the_plan_but_not_results(monkeypatch, limits):
    lengths = [11, 7, 3, 9, 2]
    rows = [(0, 0, 11), (1, 6, 1), (2, 0, 3), (3, 8, 1), (4, 1, 1)]
    world = World(lengths, num_kv_heads=2, block_size=2)
    _prefill(world, rows)
    md = AttentionMetadata.build([n for *_, n in rows], [c for _, c, _ in rows], world.tables, 2)
    assert len(tiled.plan_tiles(md, HQ, 2 * D, None, limits)) > 3
    monkeypatch.setattr(tiled, "tile_limits", lambda: limits)
    for window in (None, 4):
        for (r, c, n), out in zip(rows, world.step(rows, window=window)):
            np.testing.assert_allclose(out, world.expected(r, c, n, window), atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_returns_query_dtype(dtype):
    world = World([6, 3], num_kv_heads=2, block_size=4, dtype=dtype)
    rows = [(0, 0, 6), (1, 0, 3)]
    md = AttentionMetadata.build([6, 3], [0, 0], world.tables, 4)
    q = paddle.zeros([9, HQ, D], dtype=dtype)
    out = paged_attention(q, world.cache.key_cache(0), world.cache.value_cache(0), md, scale=SCALE)
    assert out.dtype == getattr(paddle, dtype) and list(out.shape) == [9, HQ, D]
    for (r, c, n), got in zip(rows, world.step(rows)):
        np.testing.assert_allclose(got, world.expected(r, c, n), atol=5e-2)


def test_backend_is_registered_and_writes_then_attends():
    assert get_attention_backend("tiled") is TiledBackend
    assert TiledBackend.name == "tiled" and not TiledBackend.requires_reorder
    world = World([5, 3], num_kv_heads=4, block_size=2)
    md = AttentionMetadata.build([1, 3], [4, 0], world.tables, 2)
    _prefill(world, [(0, 4, 1)])
    q = np.concatenate([world.q[0][4:], world.q[1]])
    k = np.concatenate([world.k[0][4:], world.k[1]])
    v = np.concatenate([world.v[0][4:], world.v[1]])
    # Patched models hand over [heads, T, D] tensors transposed to [T, heads, D] (strided views).
    q, k, v = (paddle.to_tensor(x.transpose(1, 0, 2).copy()).transpose([1, 0, 2]) for x in (q, k, v))
    out = TiledBackend().forward(0, q, k, v, world.cache, md, scale=SCALE).numpy()
    np.testing.assert_allclose(out[:1], world.expected(0, 4, 1), atol=1e-5)
    np.testing.assert_allclose(out[1:], world.expected(1, 0, 3), atol=1e-5)


@pytest.mark.parametrize(
    "q_shape, heads, block_size, kwargs, match",
    [
        ([4, 6, D], 4, 2, {}, "multiple"),
        ([4, HQ, D], 2, 4, {}, "block_size"),
        ([5, HQ, D], 2, 2, {}, "tokens"),
        ([4, HQ, D + 1], 2, 2, {}, "head_dim"),
        ([4, HQ, D], 2, 2, {"sliding_window": 0}, "sliding_window"),
        ([4, HQ, D], 2, 2, {"sliding_window": 2.5}, "sliding_window"),
        ([4, HQ, D], 2, 2, {"sinks": paddle.zeros([2])}, "sinks"),
    ],
)
def test_bad_inputs_raise(q_shape, heads, block_size, kwargs, match):
    cache = PagedKVCache(1, 4, block_size, heads, D)
    md = AttentionMetadata.build([4], [0], [[0, 1, -1, -1]], 2)
    with pytest.raises(ValueError, match=match):
        paged_attention(paddle.zeros(q_shape), cache.key_cache(0), cache.value_cache(0), md, scale=1.0, **kwargs)


@pytest.mark.parametrize("tables,block_size,match", [
    (np.zeros((1, 0), np.int32), 2, "beyond its row's block table"),  # was an IndexError
    ([[0, 1]], 0, "block_size"),
])
def test_metadata_build_names_a_bad_table_or_block_size(tables, block_size, match):
    with pytest.raises(ValueError, match=match):
        AttentionMetadata.build([3], [0], tables, block_size)
