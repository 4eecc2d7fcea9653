"""Triton paged-attention kernels against a dense float64 reference.

On a GPU the kernels run compiled, across realistic shapes (block sizes 8-64, GQA groups
1-12 including 3, 5, 6 and 12, head dims 64/96/128/256, contexts up to 32k, bf16/fp16).
Without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``) on small CPU
shapes. Needs torch and triton; the module is skipped where either is missing (fleetlab's
CPU venv).

Every cache slot outside every row's visible context holds NaN (or inf): never-written
slots, the tail of each row's last block, and, with a sliding window, the positions no
query of the row can see (whose whole blocks may be gone from the table: -1). A kernel
that loads what it masks shows up as a non-finite output.

Set ``FLEETLAB_TRITON_ERRORS=path.json`` to record the worst error seen per kernel
and dtype (``path.json.gwN`` per worker under pytest-xdist; the H200 benchmark JSON
carries them, merged).
"""

from __future__ import annotations

import functools
import json
import math
import os

import pytest

torch = pytest.importorskip("torch", reason="the Triton kernel tests need torch (not in fleetlab's CPU venv)")
ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # must be set before the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton kernel tests need triton")

from fleetlab.attention import triton_kernels as tk

if not ON_GPU and type(tk._decode_kernel).__name__ != "InterpretedFunction":
    pytest.skip("no GPU, and the kernels were imported before TRITON_INTERPRET=1 was set",
                allow_module_level=True)

DEVICE = "cuda" if ON_GPU else "cpu"
# Relative error ||out - ref|| / ||ref|| and max abs error allowed per dtype.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 6e-2)}
WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _record_worst_errors():
    yield
    path = os.environ.get("FLEETLAB_TRITON_ERRORS")
    if path:
        worker = os.environ.get("PYTEST_XDIST_WORKER")  # one file per worker under pytest -n
        with open(f"{path}.{worker}" if worker else path, "w") as f:
            json.dump(WORST, f, indent=1, sort_keys=True)


def _check(name: str, out, ref, dtype, rows=None) -> None:
    """Compare with the float64 reference, keep the worst error, fail past tolerance.

    ``rows``: the packed tokens to compare (default all).
    """
    out = out.double().cpu()
    if rows is not None:
        out, ref = out[rows], ref[rows]
    if not torch.isfinite(out).all():
        raise AssertionError(f"{name}: non-finite output")
    err = (out - ref).abs().max().item()
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    key = f"{name}/{str(dtype).split('.')[-1]}"
    WORST[key] = max(WORST.get(key, 0.0), err)
    WORST[key + "/rel"] = max(WORST.get(key + "/rel", 0.0), rel)
    rel_tol, abs_tol = TOLERANCE[dtype]
    assert rel < rel_tol and err < abs_tol, f"{name}: rel {rel:.2e} max abs {err:.2e}"


# ---------------------------------------------------------------------------------
# A paged batch and the dense reference, written plainly
# ---------------------------------------------------------------------------------


def _first_visible(seq_len: int, query_len: int, window) -> int:
    """The earliest position any query of a row can see."""
    return 0 if window is None else max(0, seq_len - query_len + 1 - window)


def make_batch(query_lens, num_computed, *, block_size, num_heads, num_kv_heads, head_dim,
               dtype, seed=0, spare_blocks=3, window=None, poison=float("nan"), evict=True):
    """Random packed queries and a paged cache holding every row's visible context.

    Blocks are handed out in a shuffled order (a fragmented pool). Every slot outside
    every row's visible context holds ``poison``: slots no row owns, the tail of each
    row's last block, and (``window``) positions before the first one any query of the
    row sees; with ``evict`` the blocks wholly before it leave the table (-1), as an
    engine that frees them would. ``clean`` in the result is the same batch with
    zeros instead of ``poison``.
    """
    gen = torch.Generator().manual_seed(seed)
    query_lens = list(query_lens)
    seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
    blocks_per_row = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(blocks_per_row) + 1), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, poison, dtype=torch.float32)
    value_cache = torch.full(shape, poison, dtype=torch.float32)
    used = 0
    for row, (n, s, q) in enumerate(zip(blocks_per_row, seq_lens, query_lens)):
        ids = perm[used:used + n]
        used += n
        first = _first_visible(s, q, window)
        tables[row, :n] = ids.to(torch.int32)
        if evict:
            tables[row, :first // block_size] = -1
        pos = torch.arange(first, s)
        slots = ids[pos // block_size] * block_size + pos % block_size
        for cache in (key_cache, value_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(len(pos), num_kv_heads, head_dim, generator=gen)
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen)
    batch = {
        "query": query.to(DEVICE, dtype), "key_cache": key_cache.to(DEVICE, dtype),
        "value_cache": value_cache.to(DEVICE, dtype), "block_tables": tables.to(DEVICE),
        "seq_lens_kv": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), "cu_seqlens_q": cu.to(DEVICE),
        "window": window,
    }
    batch["clean"] = {k: (torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0) if k.endswith("cache") else v)
                      for k, v in batch.items()}
    return batch


def dense_reference(batch, *, scale, sliding_window=None, sinks=None):
    """Per row: gather the visible context through the block table, softmax(q k^T) v in float64."""
    q_all = batch["query"].double().cpu()
    kc, vc = batch["key_cache"].double().cpu(), batch["value_cache"].double().cpu()
    tables, cu = batch["block_tables"].long().cpu(), batch["cu_seqlens_q"].cpu().long()
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = q_all.shape[1] // num_kv_heads
    out = torch.zeros_like(q_all)
    for row, seq_len in enumerate(batch["seq_lens_kv"].cpu().tolist()):
        q = q_all[cu[row]:cu[row + 1]]  # [q_len, Hq, D]
        pos = torch.arange(_first_visible(seq_len, q.shape[0], sliding_window), seq_len)
        blocks = tables[row, pos // block_size]
        assert (blocks >= 0).all()
        k = kc[blocks, pos % block_size].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = vc[blocks, pos % block_size].repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q.shape[0], seq_len)
        seen = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            seen &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink_col = sinks.double().cpu()[:, None, None].expand(-1, q.shape[0], 1)
            probs = torch.softmax(torch.cat([scores, sink_col], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out[cu[row]:cu[row + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


# ---------------------------------------------------------------------------------
# Cases: realistic on the GPU, tiny under the CPU interpreter
# ---------------------------------------------------------------------------------

if ON_GPU:
    DTYPES = [torch.bfloat16, torch.float16]
    # (block_size, num_kv_heads, group, head_dim)
    SHAPES = [(16, 8, 1, 128), (16, 4, 2, 64), (16, 2, 3, 128), (16, 8, 4, 128), (16, 2, 8, 64),
              (32, 1, 5, 128), (64, 2, 8, 128), (8, 2, 6, 128), (16, 2, 12, 64), (16, 4, 4, 96),
              (16, 2, 4, 256), (16, 16, 1, 64), (16, 8, 5, 128), (16, 1, 32, 128)]
    # shapes held out of the tuning: 40/8 heads, MQA 32/1, 16/4 at head dim 256, pages of 64 and 128
    HELD_OUT = [(16, 8, 5, 128), (16, 1, 32, 128), (16, 4, 4, 256), (64, 8, 4, 128), (128, 2, 8, 64)]
    STEP_CONTEXTS = [0, 40, 999, 3000, 4099]
    DECODE_LENS = [1, 15, 16, 17, 33, 1000, 4099]
    LONG_DECODE_LENS = [32768, 20001, 2048, 1]
    PREFILL = ([15, 16, 17, 1, 300], [0, 16, 47, 5, 700])  # (query_lens, num_computed)
    # query lengths of multi-token decode rows (speculative verification: k + 1 tokens)
    MULTI = ([2, 1, 4, 8, 16, 3, 7], [40, 1, 999, 15, 3000, 0, 64])
    PREFILL_TILES = [None, (64, 32, 4, 2), (128, 128, 8, 2)]  # (block_m, block_n, warps, stages)
    WINDOWS = [None, 1, 5, 40, 700]
else:
    DTYPES = [torch.float32, torch.float16]
    SHAPES = [(4, 2, 1, 16), (16, 1, 3, 32), (4, 1, 4, 16), (8, 1, 6, 24)]
    DECODE_LENS = [1, 3, 4, 5, 16, 17, 41]
    LONG_DECODE_LENS = []
    PREFILL = ([3, 4, 5, 1, 9], [0, 4, 7, 5, 13])
    MULTI = ([2, 1, 4, 5, 3], [9, 1, 30, 0, 16])
    PREFILL_TILES = [None, (16, 16, 4, 1), (32, 16, 4, 1)]
    WINDOWS = [None, 1, 5, 12]
    HELD_OUT = [(4, 2, 5, 16), (4, 1, 8, 16), (16, 1, 2, 64)]
    STEP_CONTEXTS = [0, 5, 17, 30, 41]

SHAPE_IDS = [f"bs{b}-kv{k}-g{g}-d{d}" for b, k, g, d in SHAPES]
TILE_IDS = ["default" if t is None else "m{}-n{}-w{}-s{}".format(*t) for t in PREFILL_TILES]


def _batch_for(shape, dtype, query_lens, num_computed, seed=0, **kwargs):
    block_size, num_kv_heads, group, head_dim = shape
    return make_batch(query_lens, num_computed, block_size=block_size, num_heads=num_kv_heads * group,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed, **kwargs)


def _edge_lens(block_size):
    """Context lengths around block edges: bs - 1, bs, bs + 1, plus the shape list."""
    return sorted(set(DECODE_LENS + [block_size - 1, block_size, block_size + 1, 2 * block_size + 1]) - {0})


def _poisoned_out(batch):
    return torch.full_like(batch["query"], float("nan"))


def _sinks(num_heads, use):
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(3)).to(DEVICE) if use else None


def _tile_kwargs(tiles):
    return {} if tiles is None else dict(zip(("block_m", "block_n", "num_warps", "num_stages"), tiles))


def _paged(batch, *, num_decodes, scale, window=None, sinks=None, max_decode_query_len=None):
    """``paged_attention`` on ``batch`` with host bounds computed as the backend does."""
    cu = batch["cu_seqlens_q"].cpu().tolist()
    lens = batch["seq_lens_kv"].cpu().tolist()
    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    return tk.paged_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], batch["cu_seqlens_q"], num_decodes=num_decodes,
        num_decode_tokens=cu[num_decodes], max_query_len=max(q_lens[num_decodes:], default=0),
        max_decode_query_len=max(q_lens[:num_decodes], default=0) if max_decode_query_len is None
        else max_decode_query_len,
        max_decode_seq_len=max(lens[:num_decodes], default=0), scale=scale, sliding_window=window,
        sinks=sinks, out=_poisoned_out(batch))


# ---------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_store_kv_writes_slots_and_skips_minus_one(shape, dtype):
    block_size, num_kv_heads, _, head_dim = shape
    num_blocks, num_tokens = 6, 3 * block_size + 1
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    keep = slots >= 0
    want_k.view(-1, num_kv_heads, head_dim)[slots[keep]] = key[keep]
    want_v.view(-1, num_kv_heads, head_dim)[slots[keep]] = value[keep]

    dev = [t.to(DEVICE) for t in (key, value, key_cache, value_cache, slots)]
    tk.store_kv(*dev)
    assert torch.equal(dev[2].cpu(), want_k) and torch.equal(dev[3].cpu(), want_v)
    WORST[f"store_kv/{str(dtype).split('.')[-1]}"] = 0.0  # bit-exact, checked above


@pytest.mark.parametrize("latency_kernel", [None, True], ids=["default-kernel", "latency-kernel"])
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["one-split", "three-splits", "planned"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_dense(shape, dtype, num_splits, latency_kernel):
    lens = _edge_lens(shape[0])
    batch = _batch_for(shape, dtype, [1] * len(lens), [n - 1 for n in lens], seed=len(lens))
    scale = shape[3] ** -0.5
    out = tk.decode_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], max_seq_len=max(lens), scale=scale, num_splits=num_splits,
        latency_kernel=latency_kernel, out=_poisoned_out(batch))
    _check("decode", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.parametrize("heads_per_program", [1, 2, 4])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_several_kv_heads_per_program(heads_per_program, num_splits):
    """Block-diagonal queries over the K/V of adjacent kv heads give each head its own answer."""
    shape = (16, 16, 1, 64) if ON_GPU else (4, 4, 1, 16)
    dtype = DTYPES[0]
    lens = _edge_lens(shape[0])
    batch = _batch_for(shape, dtype, [1] * len(lens), [n - 1 for n in lens], seed=2)
    scale = shape[3] ** -0.5
    out = tk.decode_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], max_seq_len=max(lens), scale=scale, num_splits=num_splits,
        heads_per_program=heads_per_program, out=_poisoned_out(batch))
    _check("decode", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["one-split", "three-splits", "planned"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_multi_token_decode_matches_dense(shape, dtype, num_splits):
    """Decode rows of 1..R query tokens (speculative verification), causal among themselves."""
    query_lens, num_computed = MULTI
    if max(query_lens) * shape[2] > tk.MAX_DECODE_ROWS:
        query_lens = [min(q, tk.MAX_DECODE_ROWS // shape[2]) for q in query_lens]
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=13)
    scale = shape[3] ** -0.5
    seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
    out = tk.decode_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], max_seq_len=max(seq_lens), scale=scale, num_splits=num_splits,
        num_rows=len(query_lens), cu_seqlens_q=batch["cu_seqlens_q"], max_query_len=max(query_lens),
        out=_poisoned_out(batch))
    _check("multi_decode", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.parametrize("merge_in_launch", [True, False], ids=["last-split-merges", "second-launch"])
@pytest.mark.parametrize("merge_tile", [None, 1], ids=["one-load", "split-by-split"])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_many_splits_merge(monkeypatch, use_sinks, merge_tile, merge_in_launch):
    """Tens of splits per row, merged by the last one to finish or by a second launch, in
    chunks or one by one."""
    shape = SHAPES[2]
    if merge_tile is not None:
        monkeypatch.setattr(tk, "_MERGE_TILE", merge_tile)
    query_lens, num_computed = [1, 3, 2, 1], [0, 150, 298, 70]
    batch = _batch_for(shape, DTYPES[0], query_lens, num_computed, seed=31)
    sinks = _sinks(shape[1] * shape[2], use_sinks)
    scale = shape[3] ** -0.5
    out = tk.decode_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], max_seq_len=300, scale=scale, sinks=sinks, num_splits=19, block_n=16,
        num_rows=4, cu_seqlens_q=batch["cu_seqlens_q"], max_query_len=3, merge_in_launch=merge_in_launch,
        out=_poisoned_out(batch))
    _check("multi_decode", out, dense_reference(batch, scale=scale, sinks=sinks), DTYPES[0])


@pytest.mark.parametrize("merge_slice", [0, 1, 2], ids=["all-rows", "row-by-row", "two-rows"])
@pytest.mark.parametrize("window", [None, 5], ids=["no-window", "window"])
@pytest.mark.parametrize("multi", [False, True], ids=["one-token", "multi-token"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_splits_merged_in_a_second_launch(shape, multi, window, merge_slice):
    """``merge_in_launch=False``: the splits write partials, ``_decode_merge_kernel`` merges
    them, all of a (row, kv head group)'s tile rows per program or a slice of them (on a
    Hopper GPU as a programmatic dependent launch, off / let in at once / after the K/V)."""
    dtype = DTYPES[0]
    if multi:
        query_lens, num_computed = MULTI
        query_lens = [min(q, tk.MAX_DECODE_ROWS // shape[2]) for q in query_lens]
    else:
        num_computed = [n - 1 for n in _edge_lens(shape[0])]
        query_lens = [1] * len(num_computed)
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=37, window=window)
    sinks = _sinks(shape[1] * shape[2], window is not None)
    scale = shape[3] ** -0.5
    seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
    for num_splits in (3, None):
        out = tk.decode_attention(
            batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
            batch["seq_lens_kv"], max_seq_len=max(seq_lens), scale=scale, sliding_window=window, sinks=sinks,
            num_splits=num_splits, num_rows=len(query_lens), cu_seqlens_q=batch["cu_seqlens_q"] if multi else None,
            max_query_len=max(query_lens), merge_in_launch=False, merge_slice=merge_slice, pdl=merge_slice,
            out=_poisoned_out(batch))
        ref = dense_reference(batch, scale=scale, sliding_window=window, sinks=sinks)
        _check("multi_decode" if multi else "decode", out, ref, dtype)


@pytest.mark.parametrize("tiles", PREFILL_TILES, ids=TILE_IDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_prefill_chunks_match_dense(shape, dtype, tiles):
    if tiles is not None and 4 * tiles[1] * shape[3] * tiles[3] > 200 * 1024:
        pytest.skip("K/V stages exceed an H200's shared memory at this head_dim")
    query_lens, num_computed = PREFILL
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=7)
    scale = shape[3] ** -0.5
    out = tk.prefill_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], batch["cu_seqlens_q"], first_row=0, num_rows=len(query_lens),
        max_query_len=max(query_lens), scale=scale, out=_poisoned_out(batch), **_tile_kwargs(tiles))
    _check("prefill", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("tiles", PREFILL_TILES[1:], ids=TILE_IDS[1:])
def test_prefill_tile_boundaries(tiles, window):
    """Contexts at every offset from a K/V tile edge, chunks at every offset from a query tile
    edge: the unmasked and masked key ranges must meet exactly."""
    block_m, block_n = tiles[:2]
    shape = (16, 2, 3, 64) if ON_GPU else (4, 1, 3, 16)
    tokens = block_m // shape[2]
    num_computed = list(range(block_n + 1))
    query_lens = [1 + (7 * i) % (2 * tokens + 2) for i in num_computed]
    dtype = DTYPES[0]
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=29, window=window)
    scale = shape[3] ** -0.5
    out = tk.prefill_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], batch["cu_seqlens_q"], first_row=0, num_rows=len(query_lens),
        max_query_len=max(query_lens), scale=scale, sliding_window=window, out=_poisoned_out(batch),
        **_tile_kwargs(tiles))
    _check("prefill", out, dense_reference(batch, scale=scale, sliding_window=window), dtype)


@pytest.mark.parametrize("tiles", PREFILL_TILES, ids=TILE_IDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("use_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_with_window_and_sinks(dtype, use_sinks, window, tiles):
    """Single- and multi-token decode rows first, then prefill chunks, through ``paged_attention``."""
    shape = SHAPES[2]
    query_lens = [1, 3, 1, 2] + PREFILL[0]
    num_computed = [0, shape[0], 3 * shape[0] + 2, 5] + PREFILL[1]
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=11, window=window)
    sinks = _sinks(shape[1] * shape[2], use_sinks)
    scale = shape[3] ** -0.5
    if tiles is None:
        out = _paged(batch, num_decodes=4, scale=scale, window=window, sinks=sinks)
    else:  # the same batch, the prefill rows with explicit tiles
        out = _paged(batch, num_decodes=4, scale=scale, window=window, sinks=sinks)
        tk.prefill_attention(
            batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
            batch["seq_lens_kv"], batch["cu_seqlens_q"], first_row=4, num_rows=len(query_lens) - 4,
            max_query_len=max(query_lens), scale=scale, sliding_window=window, sinks=sinks, out=out,
            **_tile_kwargs(tiles))
    ref = dense_reference(batch, scale=scale, sliding_window=window, sinks=sinks)
    _check("mixed", out, ref, dtype)


@pytest.mark.parametrize("part", ["decode-only", "multi-decode-only", "prefill-only"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_with_an_empty_part(dtype, part):
    shape = SHAPES[1]
    if part == "prefill-only":
        query_lens, num_computed, num_decodes = PREFILL[0], PREFILL[1], 0
    elif part == "decode-only":
        query_lens, num_computed = [1] * 4, [0, 7, shape[0], 33]
        num_decodes = 4
    else:
        query_lens, num_computed = MULTI
        num_decodes = len(query_lens)
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=17)
    scale = shape[3] ** -0.5
    out = _paged(batch, num_decodes=num_decodes, scale=scale)
    _check("mixed", out, dense_reference(batch, scale=scale), dtype)


# ---------------------------------------------------------------------------------
# Plans: made once per step, run by every layer (the backend's path)
# ---------------------------------------------------------------------------------


def _slot_mapping(batch):
    """int64 ``[T]``: the cache slot of each packed query token."""
    cu, lens = batch["cu_seqlens_q"].cpu().tolist(), batch["seq_lens_kv"].cpu().tolist()
    tables, block_size = batch["block_tables"].cpu().long(), batch["key_cache"].shape[1]
    pos = torch.cat([torch.arange(n - (b - a), n) for a, b, n in zip(cu, cu[1:], lens)])
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor([b - a for a, b in zip(cu, cu[1:])]))
    return (tables[rows, pos // block_size] * block_size + pos % block_size).to(DEVICE)


def _layers(batch, num_layers, seed):
    """``num_layers`` layers of one step: the same rows and block tables, each layer its own
    queries and cache contents (poison wherever the first layer's cache holds it)."""
    gen = torch.Generator().manual_seed(seed)
    layers = [batch]
    for _ in range(num_layers - 1):
        layer = dict(batch)
        for name in ("query", "key_cache", "value_cache"):
            t = batch[name]
            layer[name] = torch.where(torch.isfinite(t), torch.randn(t.shape, generator=gen).to(DEVICE, t.dtype), t)
        layers.append(layer)
    return layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", HELD_OUT, ids=[f"bs{b}-kv{k}-g{g}-d{d}" for b, k, g, d in HELD_OUT])
def test_step_plans_serve_every_layer(shape, dtype):
    """One ``StepPlans`` per step: every layer stores the step's K/V through its plan (their
    slots hold NaN before) and runs it, single- and multi-token decode rows and prefill rows
    at contexts off the block edges; each layer gets its own dense answer, layers of one
    geometry share one plan, and the next step plans that geometry up front."""
    group = shape[2]
    decode_lens = [1, 1, 2, 3, 1] if 3 * group <= tk.MAX_DECODE_ROWS else [1] * 5
    query_lens = decode_lens + PREFILL[0]
    batch = _batch_for(shape, dtype, query_lens, STEP_CONTEXTS + PREFILL[1], seed=43)
    slots = _slot_mapping(batch)
    paged = tk.PagedBatch.from_host(
        batch["block_tables"], batch["seq_lens_kv"], batch["cu_seqlens_q"], slots, block_size=shape[0],
        num_decodes=5, cu_seqlens_q_host=batch["cu_seqlens_q"].cpu().numpy(),
        seq_lens_kv_host=batch["seq_lens_kv"].cpu().numpy())
    known = {}
    plans = tk.StepPlans(paged, like=batch["query"], known=known)
    scale = shape[3] ** -0.5
    for layer in _layers(batch, 3, seed=44):
        ref = dense_reference(layer, scale=scale)
        caches = [c.view(-1, shape[1], shape[3]) for c in (layer["key_cache"], layer["value_cache"])]
        key, value = (c[slots].clone() for c in caches)
        for c in caches:
            c[slots] = float("nan")
        plan = plans.for_layer(layer["query"], layer["key_cache"])
        plan.store_kv(key, value, layer["key_cache"], layer["value_cache"])
        out = plan.run(layer["query"], layer["key_cache"], layer["value_cache"], scale=scale,
                       out=_poisoned_out(layer))
        _check("step_plans", out, ref, dtype)
    assert plans.for_layer(batch["query"], batch["key_cache"]) is plan and len(known) == 1
    # a layer keeps its key whatever the step's token count: the next step finds its geometry
    assert tk.layer_key(batch["query"][:3], batch["key_cache"]) == tk.layer_key(batch["query"], batch["key_cache"])
    assert plans.for_layer(batch["query"], batch["key_cache"], sliding_window=7) is not plan and len(known) == 2
    assert len(tk.StepPlans(paged, like=batch["query"], known=known).known) == 2


def test_a_plan_takes_tensors_off_a_16_byte_boundary():
    """A plan compiled on aligned tensors runs a layer whose query and output start 2 bytes
    past a boundary (back through Triton's JIT for that call), then aligned ones again."""
    shape, dtype = SHAPES[0], DTYPES[0]
    lens = _edge_lens(shape[0])
    batch = _batch_for(shape, dtype, [1] * len(lens), [n - 1 for n in lens], seed=47)
    g = tk.LayerGeometry.of(batch["query"], batch["key_cache"])
    scale = shape[3] ** -0.5
    ref = dense_reference(batch, scale=scale)
    for num_splits in (1, 3):
        plan = tk.plan_decode(g, batch["block_tables"], batch["seq_lens_kv"], num_tokens=len(lens),
                              max_seq_len=max(lens), num_splits=num_splits)
        q = batch["query"]
        shifted = torch.empty(q.numel() + 1, dtype=dtype, device=DEVICE)[1:].view(q.shape)
        shifted.copy_(q)
        out_shifted = torch.full_like(shifted, float("nan"))
        for query, out in ((q, _poisoned_out(batch)), (shifted, out_shifted), (q, _poisoned_out(batch))):
            plan.run(query, batch["key_cache"], batch["value_cache"], scale=scale, out=out)
            _check("decode", out, ref, dtype)


def test_a_plan_refuses_a_call_it_was_not_made_for():
    batch = _batch_for(SHAPES[0], DTYPES[0], [1, 1], [3, 4])
    g = tk.LayerGeometry.of(batch["query"], batch["key_cache"])
    plan = tk.plan_decode(g, batch["block_tables"], batch["seq_lens_kv"], num_tokens=2, max_seq_len=5)
    args = (batch["key_cache"], batch["value_cache"])
    with pytest.raises(ValueError, match="tokens"):
        plan.run(batch["query"][:1], *args, scale=1.0)
    with pytest.raises(ValueError, match="sinks"):
        plan.run(batch["query"], *args, scale=1.0, sinks=torch.zeros(batch["query"].shape[1], device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        plan.run(batch["query"], *args, scale=1.0, out=torch.empty_like(batch["query"]).transpose(0, 1))
    with pytest.raises(ValueError, match="slot_mapping"):
        plan.store_kv(batch["query"], batch["query"], *args)
    with pytest.raises(TypeError, match="unknown decode knobs"):
        tk.plan_decode(g, batch["block_tables"], batch["seq_lens_kv"], num_tokens=2, max_seq_len=5, bogus=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_decode_rows_fall_back_to_the_prefill_kernel(dtype):
    """Decode rows with more query tokens x heads than a decode program holds still come out right."""
    shape = (16, 2, 12, 64) if ON_GPU else (8, 1, 12, 16)
    query_lens = [tk.MAX_DECODE_ROWS // shape[2] + 1, 2, 1]
    batch = _batch_for(shape, dtype, query_lens, [5, 40, 17], seed=19)
    scale = shape[3] ** -0.5
    out = _paged(batch, num_decodes=3, scale=scale)
    _check("multi_decode", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("window", [None, 3, 21])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[0]], ids=[SHAPE_IDS[1], SHAPE_IDS[0]])
def test_masked_slots_never_reach_the_output(shape, use_sinks, window, poison):
    """Issue #14: a cache holding NaN/inf everywhere outside every row's visible context
    (slots never written, the last block's tail, positions before the window, evicted
    blocks as -1 table entries) gives the same finite output as a clean cache, for
    decode, multi-token decode and prefill rows, with windows and sinks."""
    dtype = DTYPES[1]
    query_lens = [1, 1, 3, 2, 1] + PREFILL[0]
    num_computed = [0, 2 * shape[0] + 3, 4 * shape[0] + 1, 7, 30] + PREFILL[1]
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=23, window=window,
                       poison=float(poison), evict=True)
    sinks = _sinks(shape[1] * shape[2], use_sinks)
    scale = shape[3] ** -0.5
    outs = []
    for b in (batch, batch["clean"]):
        for num_splits, merge_in_launch in ((1, True), (3, True), (3, False)):
            out = _paged(b, num_decodes=0, scale=scale, window=window, sinks=sinks)  # all rows on the prefill kernel
            tk.decode_attention(  # then the five decode rows on the decode kernel
                b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens_kv"],
                max_seq_len=int(b["seq_lens_kv"][:5].max()), scale=scale, sliding_window=window, sinks=sinks,
                num_splits=num_splits, num_rows=5, cu_seqlens_q=b["cu_seqlens_q"], max_query_len=3,
                merge_in_launch=merge_in_launch, out=out)
            outs.append(out)
    ref = dense_reference(batch, scale=scale, sliding_window=window, sinks=sinks)
    for i in range(3):
        _check("poisoned_cache", outs[i], ref, dtype)
        assert torch.equal(outs[i], outs[i + 3])  # same bits as a clean cache


@pytest.mark.parametrize("poison", ["nan", "inf"])
@pytest.mark.parametrize("window", [None, 3, 21])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[0]], ids=[SHAPE_IDS[1], SHAPE_IDS[0]])
def test_latency_kernel_windows_sinks_and_masked_slots(shape, use_sinks, window, poison):
    """The latency path (single-token rows, merged by ``_decode_reduce_kernel``): windows,
    sinks, splits past a row's context, many splits, and a cache holding NaN/inf outside
    every visible context give the clean cache's bits and the dense answer."""
    dtype = DTYPES[1]
    num_computed = [0, 2 * shape[0] + 3, 4 * shape[0] + 1, 7, 30, 3 * shape[0] - 1]
    batch = _batch_for(shape, dtype, [1] * len(num_computed), num_computed, seed=41, window=window,
                       poison=float(poison), evict=True)
    sinks = _sinks(shape[1] * shape[2], use_sinks)
    scale = shape[3] ** -0.5
    outs = []
    for b in (batch, batch["clean"]):
        for num_splits, block_n, pdl in ((1, 64, 0), (3, 16, 1), (None, 16, 0), (19, 16, 1)):
            outs.append(tk.decode_attention(
                b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens_kv"],
                max_seq_len=int(b["seq_lens_kv"].max()), scale=scale, sliding_window=window, sinks=sinks,
                num_splits=num_splits, block_n=block_n, latency_kernel=True, pdl=pdl, out=_poisoned_out(b)))
    ref = dense_reference(batch, scale=scale, sliding_window=window, sinks=sinks)
    for i in range(4):
        _check("poisoned_cache", outs[i], ref, dtype)
        assert torch.equal(outs[i], outs[i + 4])  # same bits as a clean cache


def test_decode_config_picks_the_measured_path():
    """The H200 table: small single-token batches take the latency path, a batch that fills
    the multiprocessors once is not split, larger split batches run one kv head per program
    and merge in a second launch, a tile row per program; multi-token rows and large
    batches keep their knobs."""
    cfg = functools.partial(tk.decode_config, 128, 4, 8, 2, num_sms=132)
    deeper = tk.LATENCY_CONFIG._replace(num_stages=5)  # contexts of 8k and more
    for rows, span, want in ((1, 512, tk.LATENCY_CONFIG), (1, 2048, tk.LATENCY_CONFIG), (1, 8192, deeper),
                             (2, 8192, deeper)):
        assert cfg(num_rows=rows, max_span=span) == want
    assert tk.decode_config(128, 8, 4, 2, num_rows=1, max_span=32768, num_sms=132) == deeper
    assert tk.decode_config(128, 8, 4, 2, num_rows=16, max_span=2048, num_sms=132) == tk.LATENCY_CONFIG
    assert not cfg(num_rows=1, max_span=8192, latency_path=False).latency_kernel
    for span, block_n in ((512, 64), (2048, 128), (8192, 128)):  # one wave nearly full: no split
        one_wave = cfg(num_rows=16, max_span=span)
        assert not one_wave.may_split and not one_wave.latency_kernel and one_wave.block_n == block_n
    big = cfg(num_rows=1, max_span=32768)
    assert not big.latency_kernel and not big.merge_in_launch and big.may_split
    assert (big.block_n, big.num_stages, big.programs_per_sm, big.merge_slice, big.pdl) == (128, 5, 1, 1, 2)
    mha = tk.decode_config(64, 1, 16, 2, num_rows=1, max_span=32768, num_sms=132)
    # split: one kv head, two programs per multiprocessor, the merge let in at the start
    assert (mha.heads_per_program, mha.programs_per_sm, mha.pdl) == (1, 2, 1)
    assert tk.decode_config(64, 1, 16, 2, num_rows=16, max_span=2048, num_sms=132).heads_per_program == 2
    multi = cfg(max_query_len=4, num_rows=8, max_span=8192)
    assert multi.merge_in_launch and not multi.latency_kernel
    assert cfg(num_rows=1, max_span=512, max_query_len=2) == cfg(num_rows=1, max_span=512, max_query_len=2,
                                                                   latency_path=False)
    assert cfg(num_rows=64, max_span=512) == tk.DecodeConfig(64, 4, 3, 2, 1)  # large batch: as before
    assert not tk.decode_config(256, 4, 8, 2, num_rows=1, max_span=512, num_sms=132).latency_kernel
    wide = tk.decode_config(256, 4, 4, 2, num_rows=32, max_span=4096, num_sms=132)  # head dim 256, one wave
    assert (wide.block_n, wide.num_warps, wide.may_split) == (64, 8, False)


@pytest.mark.skipif(not LONG_DECODE_LENS, reason="long contexts only on a GPU (the interpreter is slow)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 8, 4, 128), (16, 8, 8, 64), (16, 8, 1, 128), (16, 16, 1, 64),
                                   (16, 8, 5, 128), (16, 1, 32, 128), (16, 4, 4, 256)], ids=str)
def test_long_context_decode(shape, dtype):
    lens = LONG_DECODE_LENS
    batch = _batch_for(shape, dtype, [1] * len(lens), [n - 1 for n in lens], seed=5)
    scale = shape[3] ** -0.5
    out = tk.decode_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], max_seq_len=max(lens), scale=scale, out=_poisoned_out(batch))
    _check("decode", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.skipif(not ON_GPU, reason="long chunks only on a GPU (the interpreter is slow)")
@pytest.mark.parametrize("window", [None, 1000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefill_chunk_over_long_context(dtype, window):
    shape = (16, 8, 4, 128)
    query_lens, num_computed = [512, 777, 64, 2048], [3584, 0, 9000, 0]
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=9, window=window)
    scale = shape[3] ** -0.5
    out = tk.prefill_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], batch["cu_seqlens_q"], first_row=0, num_rows=4, max_query_len=2048,
        scale=scale, sliding_window=window, out=_poisoned_out(batch))
    _check("prefill", out, dense_reference(batch, scale=scale, sliding_window=window), dtype)


ON_HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0)
# (block_size, num_kv_heads, group, head_dim): MHA, GQA 7:1 / 4:1 / 6:1, pages 8-128, d64 / d256
GLUON_SHAPES = [(16, 8, 1, 128), (64, 4, 7, 128), (128, 8, 4, 128), (16, 16, 1, 64), (16, 4, 4, 256),
                (8, 2, 6, 128), (128, 2, 8, 64)]


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon prefill kernel is for sm_90 GPUs")
@pytest.mark.parametrize("ring", ["default", "deep"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", GLUON_SHAPES, ids=[f"bs{b}-kv{k}-g{g}-d{d}" for b, k, g, d in GLUON_SHAPES])
def test_gluon_prefill_matches_dense_across_tile_edges(shape, dtype, ring, monkeypatch):
    """The Hopper plan takes the warp-specialised Gluon kernel; chunks at every offset from a K/V
    tile edge and from a query tile edge, after contexts of 0 to 300 tokens, match dense, with
    the default ring and with a deeper ring of smaller tiles and two Q buffers (every buffer
    reused many times, items of the persistent walk with and without keys)."""
    from fleetlab.attention import gluon_ws_prefill as gp

    if ring == "deep":
        default = gp.kernel_config
        monkeypatch.setattr(gp, "kernel_config", lambda head_dim, max_query_len: default(head_dim, max_query_len) | {
            "BLOCK_N": 64 if head_dim <= 128 else 32, "STAGES": 3, "Q_SLOTS": 2})
    monkeypatch.setenv("FLEETLAB_GLUON_PREFILL", "1")
    g = tk.LayerGeometry.of(*(lambda b: (b["query"], b["key_cache"], b["value_cache"]))(
        _batch_for(shape, dtype, [1], [0])))
    assert tk._gluon_prefill_usable(g)
    num_computed = [0, 1, 63, 64, 127, 128, 129, 300, 0, 5]
    query_lens = [1, 130, 65, 128, 2, 255, 17, 500, 1000, 129]
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=31)
    scale = shape[3] ** -0.5
    plan = tk.plan_prefill(g, batch["block_tables"], batch["seq_lens_kv"], batch["cu_seqlens_q"],
                           num_tokens=batch["query"].shape[0], first_row=0, num_rows=len(query_lens),
                           max_query_len=max(query_lens))
    assert [launch.config.get("kernel") for launch in plan.launches] == ["gluon_ws"]
    out = plan.run(batch["query"], batch["key_cache"], batch["value_cache"], scale=scale, out=_poisoned_out(batch))
    _check("gluon_prefill", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon prefill kernel is for sm_90 GPUs")
def test_gluon_prefill_is_not_planned_for_windows_sinks_or_forced_knobs(monkeypatch):
    monkeypatch.setenv("FLEETLAB_GLUON_PREFILL", "1")
    batch = _batch_for((16, 2, 4, 128), torch.bfloat16, [64], [0])
    q, kc, vc = batch["query"], batch["key_cache"], batch["value_cache"]
    assert tk._gluon_prefill_usable(tk.LayerGeometry.of(q, kc, vc))
    assert not tk._gluon_prefill_usable(tk.LayerGeometry.of(q, kc, vc, sliding_window=32))
    assert not tk._gluon_prefill_usable(tk.LayerGeometry.of(q, kc, vc, sinks=_sinks(8, True)))
    forced = tk.plan_prefill(tk.LayerGeometry.of(q, kc, vc), batch["block_tables"], batch["seq_lens_kv"],
                             batch["cu_seqlens_q"], num_tokens=64, first_row=0, num_rows=1, max_query_len=64,
                             block_n=32)
    assert forced.launches[0].kernel is tk._prefill_kernel


@pytest.mark.skipif(not ON_HOPPER, reason="the Gluon prefill kernel is for sm_90 GPUs")
def test_gluon_prefill_plan_runs_tensors_off_a_16_byte_boundary_through_its_fallback(monkeypatch):
    """The Gluon kernel copies 16 bytes at a time; a query one element off a 16-byte boundary
    runs the plan's portable fallback, and still matches dense."""
    monkeypatch.setenv("FLEETLAB_GLUON_PREFILL", "1")
    batch = _batch_for((16, 2, 4, 128), torch.bfloat16, [100, 37], [0, 50], seed=5)
    q = batch["query"]
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16 != 0
    g = tk.LayerGeometry.of(shifted, batch["key_cache"], batch["value_cache"])
    plan = tk.plan_prefill(g, batch["block_tables"], batch["seq_lens_kv"], batch["cu_seqlens_q"], num_tokens=137,
                           first_row=0, num_rows=2, max_query_len=100)
    launch = plan.launches[0]
    assert launch.config["kernel"] == "gluon_ws" and launch.fallback.kernel is tk._prefill_kernel
    out = plan.run(shifted, batch["key_cache"], batch["value_cache"], scale=128 ** -0.5, out=_poisoned_out(batch))
    _check("gluon_prefill_fallback", out, dense_reference(batch, scale=128 ** -0.5), torch.bfloat16)


def test_plan_decode_splits_fills_the_gpu_and_covers_the_context():
    splits, split_len = tk.plan_decode_splits(1, 8, 32768, block_n=64, num_sms=132)
    assert splits > 1 and split_len % 64 == 0 and splits * split_len >= 32768
    assert tk.plan_decode_splits(256, 8, 4096, block_n=64, num_sms=132) == (1, 4096)
    assert tk.plan_decode_splits(33, 8, 4096, block_n=64, num_sms=132) == (1, 4096)  # >= two programs/SM
    assert tk.plan_decode_splits(17, 8, 4096, block_n=64, num_sms=132, programs_per_sm=1) == (1, 4096)
    splits, split_len = tk.plan_decode_splits(16, 8, 8192, block_n=64, num_sms=132)
    assert 1 < splits <= 8192 // 64 and split_len * (splits - 1) < 8192 <= split_len * splits
    # one wave: 16 splits x 8 heads = 128 programs <= 132 slots, not 17 x 8 = 136
    assert tk.plan_decode_splits(1, 8, 32768, block_n=64, num_sms=132, programs_per_sm=1) == (16, 2048)
    splits, split_len = tk.plan_decode_splits(4, 8, 100, block_n=64, num_sms=132)
    assert splits == 2 and split_len == 64  # never a split shorter than one tile
    # the latency path's rule: splits rounded up, no split from one program per multiprocessor on
    assert tk.plan_decode_splits(16, 4, 2048, block_n=64, num_sms=132, whole_waves=False) == (5, 448)
    assert tk.plan_decode_splits(1, 4, 32768, block_n=64, num_sms=132, whole_waves=False) == (64, 512)
    assert tk.plan_decode_splits(1, 8, 2048, block_n=64, num_sms=132, whole_waves=False) == (32, 64)
    assert tk.plan_decode_splits(17, 8, 512, block_n=64, num_sms=132, whole_waves=False) == (1, 512)


def test_split_counters_are_left_at_zero():
    """The merging program of each split decode resets its counter for the next launch."""
    shape = SHAPES[0]
    lens = [5, 40, 17]
    batch = _batch_for(shape, DTYPES[0], [1] * len(lens), [n - 1 for n in lens])
    for _ in range(2):
        tk.decode_attention(
            batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
            batch["seq_lens_kv"], max_seq_len=max(lens), scale=1.0, num_splits=4)
    counters = tk._split_counters(batch["query"], len(lens) * shape[1])
    assert int(counters.abs().sum()) == 0


def test_bad_inputs_raise_named_errors():
    batch = _batch_for(SHAPES[0], DTYPES[0], [1, 1], [3, 4])
    args = (batch["key_cache"], batch["value_cache"], batch["block_tables"], batch["seq_lens_kv"])
    odd_heads = torch.zeros(2, batch["key_cache"].shape[2] * 2 + 1, batch["query"].shape[2],
                            dtype=batch["query"].dtype, device=DEVICE)
    with pytest.raises(ValueError, match="num_kv_heads"):
        tk.decode_attention(odd_heads, *args, max_seq_len=5, scale=1.0)
    with pytest.raises(TypeError, match="dtype"):
        tk.decode_attention(batch["query"].double(), *args, max_seq_len=5, scale=1.0)
    with pytest.raises(ValueError, match="sinks"):
        tk.decode_attention(batch["query"], *args, max_seq_len=5, scale=1.0,
                            sinks=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="sliding_window"):
        tk.decode_attention(batch["query"], *args, max_seq_len=5, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="max_query_len"):
        tk.decode_attention(batch["query"], *args, max_seq_len=5, scale=1.0,
                            cu_seqlens_q=batch["cu_seqlens_q"], max_query_len=tk.MAX_DECODE_ROWS + 1)
    with pytest.raises(ValueError, match="heads_per_program"):
        tk.decode_attention(batch["query"], *args, max_seq_len=5, scale=1.0, heads_per_program=3)
    with pytest.raises(ValueError, match="latency kernel"):
        tk.decode_attention(batch["query"], *args, max_seq_len=5, scale=1.0, latency_kernel=True,
                            cu_seqlens_q=batch["cu_seqlens_q"], max_query_len=2)
    with pytest.raises(ValueError, match="key_cache"):
        tk.store_kv(batch["query"], batch["query"], batch["key_cache"][0], batch["value_cache"][0],
                    torch.zeros(2, dtype=torch.int64, device=DEVICE))
