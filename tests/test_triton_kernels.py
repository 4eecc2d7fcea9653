"""Triton paged-attention kernels against a dense torch reference.

On a GPU the kernels run compiled, across realistic shapes (block size 16, GQA 1-8,
head dims 64/128, contexts up to 32k, bf16/fp16). Without a GPU they run under
Triton's interpreter (``TRITON_INTERPRET=1``) on small CPU shapes. Needs torch and
triton; the module is skipped where either is missing (fleetlab's CPU venv).

Set ``FLEETLAB_TRITON_ERRORS=path.json`` to record the worst error seen per kernel
and dtype (the H200 benchmark JSON carries them).
"""

from __future__ import annotations

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
        with open(path, "w") as f:
            json.dump(WORST, f, indent=1, sort_keys=True)


def _check(name: str, out, ref, dtype) -> None:
    """Compare with the float64 reference, keep the worst error, fail past tolerance."""
    out = out.double().cpu()
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


def make_batch(query_lens, num_computed, *, block_size, num_heads, num_kv_heads, head_dim,
               dtype, seed=0, spare_blocks=3):
    """Random packed queries and a paged cache holding every row's full context.

    Blocks are handed out in a shuffled order (a fragmented pool); every slot no row
    owns is NaN, so a kernel reading outside a context shows up as NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    query_lens = list(query_lens)
    seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
    blocks_per_row = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_row) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(seq_lens), max(blocks_per_row) + 1), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    value_cache = torch.full(shape, float("nan"), dtype=torch.float32)
    used = 0
    for row, (n, s) in enumerate(zip(blocks_per_row, seq_lens)):
        ids = perm[used:used + n]
        used += n
        tables[row, :n] = ids.to(torch.int32)
        pos = torch.arange(s)
        slots = ids[pos // block_size] * block_size + pos % block_size
        key_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(s, num_kv_heads, head_dim, generator=gen)
        value_cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(s, num_kv_heads, head_dim, generator=gen)
    cu = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    query = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen)
    return {
        "query": query.to(DEVICE, dtype), "key_cache": key_cache.to(DEVICE, dtype),
        "value_cache": value_cache.to(DEVICE, dtype), "block_tables": tables.to(DEVICE),
        "seq_lens_kv": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), "cu_seqlens_q": cu.to(DEVICE),
    }


def dense_reference(batch, *, scale, sliding_window=None, sinks=None):
    """Per row: gather the context through the block table, softmax(q k^T) v in float64."""
    q_all = batch["query"].double()
    kc, vc = batch["key_cache"].double(), batch["value_cache"].double()
    tables, cu = batch["block_tables"].long(), batch["cu_seqlens_q"].cpu().long()
    block_size, num_kv_heads = kc.shape[1], kc.shape[2]
    group = q_all.shape[1] // num_kv_heads
    out = torch.zeros_like(q_all)
    for row, seq_len in enumerate(batch["seq_lens_kv"].cpu().tolist()):
        pos = torch.arange(seq_len, device=q_all.device)
        blocks = tables[row, pos // block_size]
        k = kc[blocks, pos % block_size].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = vc[blocks, pos % block_size].repeat_interleave(group, dim=1)
        q = q_all[cu[row]:cu[row + 1]]  # [q_len, Hq, D]
        q_pos = torch.arange(seq_len - q.shape[0], seq_len, device=q_all.device)
        seen = pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            seen &= pos[None, :] > q_pos[:, None] - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        scores = scores.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            sink_col = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
            probs = torch.softmax(torch.cat([scores, sink_col], -1), -1)[..., :-1]
        else:
            probs = torch.softmax(scores, -1)
        out[cu[row]:cu[row + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.cpu()


# ---------------------------------------------------------------------------------
# Cases: realistic on the GPU, tiny under the CPU interpreter
# ---------------------------------------------------------------------------------

if ON_GPU:
    DTYPES = [torch.bfloat16, torch.float16]
    # (block_size, num_kv_heads, group, head_dim)
    SHAPES = [(16, 8, 1, 128), (16, 4, 2, 64), (16, 2, 3, 128), (16, 8, 4, 128), (16, 2, 8, 64),
              (32, 1, 5, 128), (64, 2, 8, 128)]
    DECODE_LENS = [1, 15, 16, 17, 33, 1000, 4099]
    LONG_DECODE_LENS = [32768, 20001, 2048, 1]
    PREFILL = ([15, 16, 17, 1, 300], [0, 16, 47, 5, 700])  # (query_lens, num_computed)
else:
    DTYPES = [torch.float32, torch.float16]
    SHAPES = [(4, 2, 1, 16), (16, 1, 3, 32), (4, 1, 4, 16)]
    DECODE_LENS = [1, 3, 4, 5, 16, 17, 41]
    LONG_DECODE_LENS = []
    PREFILL = ([3, 4, 5, 1, 9], [0, 4, 7, 5, 13])

SHAPE_IDS = [f"bs{b}-kv{k}-g{g}-d{d}" for b, k, g, d in SHAPES]


def _batch_for(shape, dtype, query_lens, num_computed, seed=0):
    block_size, num_kv_heads, group, head_dim = shape
    return make_batch(query_lens, num_computed, block_size=block_size, num_heads=num_kv_heads * group,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=seed)


def _edge_lens(block_size):
    """Context lengths around block edges: bs - 1, bs, bs + 1, plus the shape list."""
    return sorted(set(DECODE_LENS + [block_size - 1, block_size, block_size + 1, 2 * block_size + 1]) - {0})


def _poisoned_out(batch):
    return torch.full_like(batch["query"], float("nan"))


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


@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["one-split", "three-splits", "planned"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_decode_matches_dense(shape, dtype, num_splits):
    lens = _edge_lens(shape[0])
    batch = _batch_for(shape, dtype, [1] * len(lens), [n - 1 for n in lens], seed=len(lens))
    scale = shape[3] ** -0.5
    out = tk.decode_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], max_seq_len=max(lens), scale=scale, num_splits=num_splits,
        out=_poisoned_out(batch))
    _check("decode", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_prefill_chunks_match_dense(shape, dtype):
    query_lens, num_computed = PREFILL
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=7)
    scale = shape[3] ** -0.5
    out = tk.prefill_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], batch["cu_seqlens_q"], first_row=0, num_rows=len(query_lens),
        max_query_len=max(query_lens), scale=scale, out=_poisoned_out(batch))
    _check("prefill", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.parametrize("window", [None, 1, 5, 40])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch_with_window_and_sinks(dtype, use_sinks, window):
    """Decode rows first, then prefill chunks, through the one ``paged_attention`` entry."""
    shape = SHAPES[2]
    query_lens = [1, 1, 1] + PREFILL[0]
    num_computed = [0, shape[0], 3 * shape[0] + 2] + PREFILL[1]
    batch = _batch_for(shape, dtype, query_lens, num_computed, seed=11)
    num_heads = shape[1] * shape[2]
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(3)).to(DEVICE) if use_sinks else None
    scale = shape[3] ** -0.5
    seq_lens = [c + q for c, q in zip(num_computed, query_lens)]
    out = tk.paged_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], batch["cu_seqlens_q"], num_decodes=3, max_query_len=max(query_lens),
        max_decode_seq_len=max(seq_lens[:3]), scale=scale, sliding_window=window, sinks=sinks,
        out=_poisoned_out(batch))
    ref = dense_reference(batch, scale=scale, sliding_window=window, sinks=sinks)
    _check("mixed", out, ref, dtype)


@pytest.mark.skipif(not LONG_DECODE_LENS, reason="long contexts only on a GPU (the interpreter is slow)")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 8, 4, 128), (16, 8, 8, 64), (16, 8, 1, 128)], ids=str)
def test_long_context_decode(shape, dtype):
    lens = LONG_DECODE_LENS
    batch = _batch_for(shape, dtype, [1] * len(lens), [n - 1 for n in lens], seed=5)
    scale = shape[3] ** -0.5
    out = tk.decode_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], max_seq_len=max(lens), scale=scale, out=_poisoned_out(batch))
    _check("decode", out, dense_reference(batch, scale=scale), dtype)


@pytest.mark.skipif(not ON_GPU, reason="long chunks only on a GPU (the interpreter is slow)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_prefill_chunk_over_long_context(dtype):
    shape = (16, 8, 4, 128)
    batch = _batch_for(shape, dtype, [512, 777, 64], [3584, 0, 9000], seed=9)
    scale = shape[3] ** -0.5
    out = tk.prefill_attention(
        batch["query"], batch["key_cache"], batch["value_cache"], batch["block_tables"],
        batch["seq_lens_kv"], batch["cu_seqlens_q"], first_row=0, num_rows=3, max_query_len=777,
        scale=scale, out=_poisoned_out(batch))
    _check("prefill", out, dense_reference(batch, scale=scale), dtype)


def test_plan_decode_splits_fills_the_gpu_and_covers_the_context():
    splits, split_len = tk.plan_decode_splits(1, 8, 32768, block_n=64, num_sms=132)
    assert splits > 1 and split_len % 64 == 0 and splits * split_len >= 32768
    assert tk.plan_decode_splits(256, 8, 4096, block_n=64, num_sms=132) == (1, 4096)
    assert tk.plan_decode_splits(17, 8, 4096, block_n=64, num_sms=132) == (1, 4096)  # >= one program/SM
    splits, split_len = tk.plan_decode_splits(16, 8, 8192, block_n=64, num_sms=132)
    assert 1 < splits <= 8192 // 64 and split_len * (splits - 1) < 8192 <= split_len * splits
    splits, split_len = tk.plan_decode_splits(4, 8, 100, block_n=64, num_sms=132)
    assert splits == 2 and split_len == 64  # never a split shorter than one tile


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
    with pytest.raises(ValueError, match="key_cache"):
        tk.store_kv(batch["query"], batch["query"], batch["key_cache"][0], batch["value_cache"][0],
                    torch.zeros(2, dtype=torch.int64, device=DEVICE))
