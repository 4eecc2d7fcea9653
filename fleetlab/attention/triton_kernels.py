"""Triton kernels for paged attention: store K/V, decode (split-K), packed prefill.

This module imports with Triton alone: no Paddle, and no torch at import time. The
host wrappers only use what torch and Paddle tensors both offer (``.shape``,
``.stride()``, ``.dtype``, ``.new_empty``), so the same kernels run on torch tensors
(tests, benchmarks) and on Paddle tensors under ``paddle.compat.enable_torch_proxy``
(``fleetlab.attention.triton_backend``).

Layouts (DESIGN.md):
  key_cache / value_cache  ``[num_blocks, block_size, num_kv_heads, head_dim]``
  block_tables             int32 ``[B, max_blocks]`` (-1 unused)
  slot_mapping             int64 ``[T]``, slot = block * block_size + p % block_size, -1 = skip
  query / out              ``[T, num_heads, head_dim]`` packed, row ``i`` owns tokens
                           ``[cu_seqlens_q[i], cu_seqlens_q[i+1])``
  seq_lens_kv              int32 ``[B]`` context length after this step's writes
Decode rows come first: rows ``[0, num_decodes)`` have one query token each, so decode
token ``i`` is row ``i``.

Numerics: scores and softmax in fp32 (base-2 exponent, ``scale * log2(e)`` folded
into the scores), the probabilities are cast to the cache dtype for the ``P @ V``
product (as flash attention does), accumulation in fp32.

Sliding window ``w``: a query at position ``p`` sees keys at ``(p - w, p]``.
Sinks: one logit per query head, added to the softmax denominator only.
"""

from __future__ import annotations

import functools
import importlib
import math

import triton
import triton.language as tl

LOG2E = 1.4426950408889634

# ---------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_slot, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: copy its ``[num_kv_heads, head_dim]`` K and V to its slot."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token: nothing to store
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    src_k = key_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = value_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * stride_c_slot + offs_h[:, None] * stride_c_head + offs_d[None, :]
    tl.store(key_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(value_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


@triton.jit
def _kv_tile_offsets(block_tables_ptr, row_table, n, n_mask, kv_head,
                     stride_c_blk, stride_c_tok, stride_c_head, BLOCK_SIZE: tl.constexpr):
    """Element offsets of tokens ``n`` (logical positions) of one row in the paged cache."""
    blk = tl.load(block_tables_ptr + row_table + n // BLOCK_SIZE, mask=n_mask, other=0)
    return blk.to(tl.int64) * stride_c_blk + (n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head


@triton.jit
def _decode_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    scale_log2, window, split_len, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (row, kv_head, split): the GROUP query heads of one kv head over one split.

    With ``DIRECT`` (a single split) the normalised output is written straight to
    ``out``; otherwise the split's normalised partial output and its log2-sum-exp go
    to ``part_o [B, H, S, D]`` / ``part_lse [B, H, S]`` for ``_decode_reduce_kernel``.
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    start = 0
    if USE_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    lo = start + split * split_len
    hi = tl.minimum(lo + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    part_row = (row * NUM_HEADS + heads) * num_splits + split
    if lo >= hi:  # this split lies past the row's context: an empty partial
        if not DIRECT:
            tl.store(part_lse_ptr + part_row, tl.full([BLOCK_G], float("-inf"), tl.float32), mask=g_mask)
        return

    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    row_table = row.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        offs = _kv_tile_offsets(block_tables_ptr, row_table, n, n_mask, kv_head,
                                stride_c_blk, stride_c_tok, stride_c_head, BLOCK_SIZE)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # The first token of every tile is valid, so m_new is finite here.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    if DIRECT:
        den = l
        if USE_SINKS:
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            m_all = tl.maximum(m, sink)
            acc = acc * tl.exp2(m - m_all)[:, None]
            den = l * tl.exp2(m - m_all) + tl.exp2(sink - m_all)
        o = acc / den[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        o = acc / l[:, None]
        tl.store(part_o_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + part_row, m + tl.log2(l), mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, num_splits, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Program (row, head): merge the splits' partial outputs by their log-sum-exp."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = (row * NUM_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    live = lse > float("-inf")  # empty splits wrote -inf and no output
    m = tl.max(lse, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.where(live, tl.exp2(lse - m), 0.0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=live[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    den = tl.sum(w, 0)
    if USE_SINKS:
        den += tl.exp2(sink - m)
    o = tl.sum(o * w[:, None], 0) / den
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    sinks_ptr, out_ptr,
    scale_log2, window, first_row,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (row, query tile, kv_head): a chunk's queries over the row's paged context.

    The tile's ``BLOCK_M`` rows are (query token, head of the kv group) pairs, so the
    GROUP heads sharing a kv head read each K/V tile once. A query at position ``p``
    sees keys ``[0, p]`` (window: ``(p - w, p]``): causal inside the chunk, full over
    the context cached by earlier steps.
    """
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    row = tl.program_id(0) + first_row
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + row)
    q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    t0 = tile * TOKENS
    if t0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    context = seq_len - q_len  # tokens cached before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = t0 + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    m_valid = (offs_m < TOKENS * GROUP) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_mask[None, :], other=0.0)
    q_pos = context + tok
    hi = tl.minimum(seq_len, context + t0 + TOKENS)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(context + t0 - window + 1, 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_table = row.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        offs = _kv_tile_offsets(block_tables_ptr, row_table, n, n_mask, kv_head,
                                stride_c_blk, stride_c_tok, stride_c_head, BLOCK_SIZE)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        seen = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    den = l
    if USE_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=m_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m, sink)
        acc = acc * tl.exp2(m - m_all)[:, None]
        den = l * tl.exp2(m - m_all) + tl.exp2(sink - m_all)
    o = acc / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])


# ---------------------------------------------------------------------------------
# Host side: checks, planning and launches (framework-neutral)
# ---------------------------------------------------------------------------------

_DTYPES = ("float16", "bfloat16", "float32")


def _dtype_name(t) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


def _float32_like(t):
    """The float32 dtype of ``t``'s framework (torch or Paddle), found without importing either here."""
    return importlib.import_module(type(t).__module__.split(".")[0]).float32


def _shape(t) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.cache
def _num_sms() -> int:
    """Multiprocessor count of the current GPU (1 under the CPU interpreter)."""
    try:
        driver = triton.runtime.driver.active
        return int(driver.utils.get_device_properties(driver.get_current_device())["multiprocessor_count"])
    except Exception:  # noqa: BLE001 - interpreter or no GPU driver: any count plans a correct launch
        return 1


def _check_cache(key_cache, value_cache) -> tuple[int, int, int, int]:
    """Validate the paged K/V caches; return ``(num_blocks, block_size, num_kv_heads, head_dim)``."""
    shape = _shape(key_cache)
    if len(shape) != 4 or _shape(value_cache) != shape:
        raise ValueError(
            f"key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
            f"got {shape} and {_shape(value_cache)}"
        )
    if tuple(key_cache.stride()) != tuple(value_cache.stride()) or key_cache.stride()[3] != 1:
        raise ValueError("key_cache and value_cache need equal strides and a contiguous head_dim")
    if _dtype_name(key_cache) not in _DTYPES or key_cache.dtype != value_cache.dtype:
        raise TypeError(f"caches must share one of {_DTYPES}; got {key_cache.dtype} and {value_cache.dtype}")
    return shape


def _check_query(query, key_cache, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Validate ``query [T, num_heads, head_dim]``; return ``(num_heads, group)``."""
    shape = _shape(query)
    if len(shape) != 3 or shape[2] != head_dim:
        raise ValueError(f"query must be [T, num_heads, {head_dim}]; got {shape}")
    if shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != key_cache.dtype:
        raise TypeError(f"query dtype {query.dtype} differs from the cache dtype {key_cache.dtype}")
    if query.stride()[2] != 1:
        raise ValueError("query needs a contiguous head_dim")
    return shape[1], shape[1] // num_kv_heads


def _dot_precision(t) -> str:
    # fp32 caches (CPU tests, debugging) get exact fp32 products instead of tf32.
    return "ieee" if _dtype_name(t) == "float32" else "tf32"


def store_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the paged caches.

    Token ``t`` goes to slot ``slot_mapping[t]`` (int64 ``[T]``), i.e. block
    ``slot // block_size``, offset ``slot % block_size``; slot -1 is skipped.
    """
    _, block_size, num_kv_heads, head_dim = _check_cache(key_cache, value_cache)
    num_tokens = _shape(slot_mapping)[0]
    for name, t in (("key", key), ("value", value)):
        if _shape(t) != (num_tokens, num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [{num_tokens}, {num_kv_heads}, {head_dim}]; got {_shape(t)}")
        if t.stride()[2] != 1 or t.dtype != key_cache.dtype:
            raise ValueError(f"{name} needs a contiguous head_dim and the cache dtype {key_cache.dtype}")
    if key_cache.stride()[0] != block_size * key_cache.stride()[1]:
        raise ValueError("store_kv needs the blocks of the cache laid out back to back (slot = block*bs + p)")
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride()[0], key.stride()[1], value.stride()[0], value.stride()[1],
        key_cache.stride()[1], key_cache.stride()[2],
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=_next_pow2(num_kv_heads), BLOCK_D=_next_pow2(head_dim),
    )


def _window_arg(sliding_window) -> int:
    if sliding_window is None:
        return 0
    if int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None; got {sliding_window}")
    return int(sliding_window)


def _check_sinks(sinks, num_heads: int):
    if sinks is not None and _shape(sinks) != (num_heads,):
        raise ValueError(f"sinks must be [num_heads={num_heads}]; got {_shape(sinks)}")


def plan_decode_splits(
    num_rows: int, num_kv_heads: int, max_span: int, *, block_n: int, num_sms: int,
    programs_per_sm: int = 2, max_splits: int = 64,
) -> tuple[int, int]:
    """Choose how to split each row's context (flash-decoding): ``(num_splits, split_len)``.

    One program handles one (row, kv head, split). A batch with at least one program
    per multiprocessor is not split (a split costs a second launch and a partial
    write, and measured slower on an H200). A smaller batch gets its contexts cut into
    splits of ``split_len`` tokens (a multiple of ``block_n``) until about
    ``programs_per_sm * num_sms`` programs run, never below one tile per split. The
    default 2 is one wave of the default kernel (three stages of 64-token bf16 K/V
    tiles at head_dim 128 leave room for two programs per H200 multiprocessor); more
    splits pay for a partial wave, as measured at batch 16 (``benchmarks/results``).
    """
    programs = max(1, num_rows * num_kv_heads)
    tiles = max(1, math.ceil(max_span / block_n))
    want = 1 if programs >= num_sms else math.ceil(programs_per_sm * num_sms / programs)
    splits = max(1, min(want, tiles, max_splits))
    split_len = math.ceil(tiles / splits) * block_n
    return math.ceil(max(max_span, 1) / split_len), split_len


def decode_attention(
    query, key_cache, value_cache, block_tables, seq_lens_kv, *,
    max_seq_len: int, scale: float, sliding_window: int | None = None, sinks=None, out=None,
    num_rows: int | None = None, num_splits: int | None = None,
    block_n: int = 64, num_warps: int = 4, num_stages: int = 3, programs_per_sm: int = 2,
):
    """Decode attention over block tables: one query token per row, GQA, split-K.

    Args:
      query: ``[T, num_heads, head_dim]``; token ``i < B`` is row ``i``'s single query
        (the leading rows of a decode-first packed batch). ``block_tables [>=B, max_blocks]``
        int32 and ``seq_lens_kv [>=B]`` int32 describe the rows' contexts.
      num_rows: ``B``, the number of decode rows (default ``T``); tokens past it are
        neither read nor written, so a packed batch needs no slicing.
      max_seq_len: a host upper bound on ``seq_lens_kv[:B]`` (plans the splits, no sync).
      num_splits: force this many context splits (default: ``plan_decode_splits``).
      block_n / num_warps / num_stages / programs_per_sm: tuning knobs.
    Returns ``out [T, num_heads, head_dim]`` (rows ``[0, B)`` written; in place when given).
    """
    _, block_size, num_kv_heads, head_dim = _check_cache(key_cache, value_cache)
    num_heads, group = _check_query(query, key_cache, num_kv_heads, head_dim)
    _check_sinks(sinks, num_heads)
    window = _window_arg(sliding_window)
    num_rows = _shape(query)[0] if num_rows is None else int(num_rows)
    out = query.new_empty(_shape(query)) if out is None else out
    if num_rows == 0:
        return out
    max_span = min(int(max_seq_len), window) if window else int(max_seq_len)
    if num_splits is None:
        num_splits, split_len = plan_decode_splits(
            num_rows, num_kv_heads, max_span, block_n=block_n, num_sms=_num_sms(),
            programs_per_sm=programs_per_sm)
    else:
        split_len = math.ceil(max(max_span, 1) / (int(num_splits) * block_n)) * block_n
        num_splits = math.ceil(max(max_span, 1) / split_len)
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # unused by the kernel
    else:
        f32 = _float32_like(query)
        part_o = query.new_empty((num_rows, num_heads, num_splits, head_dim), dtype=f32)
        part_lse = query.new_empty((num_rows, num_heads, num_splits), dtype=f32)
    cs = key_cache.stride()
    _decode_kernel[(num_rows, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens_kv,
        sinks if sinks is not None else query, out, part_o, part_lse,
        float(scale) * LOG2E, window, split_len, num_splits,
        query.stride()[0], query.stride()[1], out.stride()[0], out.stride()[1],
        cs[0], cs[1], cs[2], block_tables.stride()[0],
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        USE_WINDOW=bool(window), USE_SINKS=sinks is not None, DIRECT=direct,
        DOT_PRECISION=_dot_precision(query), num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        _decode_reduce_kernel[(num_rows, num_heads)](
            part_o, part_lse, sinks if sinks is not None else part_lse, out, num_splits,
            out.stride()[0], out.stride()[1],
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim),
            BLOCK_S=max(2, _next_pow2(num_splits)), USE_SINKS=sinks is not None, num_warps=4,
        )
    return out


def prefill_attention(
    query, key_cache, value_cache, block_tables, seq_lens_kv, cu_seqlens_q, *,
    first_row: int, num_rows: int, max_query_len: int, scale: float,
    sliding_window: int | None = None, sinks=None, out=None,
    block_m: int = 64, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
):
    """Attention of packed prefill chunks over the paged cache (causal in the chunk).

    Rows ``[first_row, first_row + num_rows)`` of the packed batch are computed: row
    ``i``'s queries are tokens ``[cu_seqlens_q[i], cu_seqlens_q[i+1])`` of ``query
    [T, num_heads, head_dim]``, at positions ``seq_lens_kv[i] - q_len + j``; their K/V
    are already in the cache. ``max_query_len`` (host int) bounds the rows' query
    lengths. Other tokens of ``out`` are left untouched. Returns ``out [T, H, D]``.
    """
    _, block_size, num_kv_heads, head_dim = _check_cache(key_cache, value_cache)
    num_heads, group = _check_query(query, key_cache, num_kv_heads, head_dim)
    _check_sinks(sinks, num_heads)
    window = _window_arg(sliding_window)
    out = query.new_empty(_shape(query)) if out is None else out
    if num_rows <= 0 or max_query_len <= 0:
        return out
    block_m = max(block_m, _next_pow2(group))
    tokens_per_tile = block_m // group
    grid = (int(num_rows), math.ceil(int(max_query_len) / tokens_per_tile), num_kv_heads)
    cs = key_cache.stride()
    _prefill_kernel[grid](
        query, key_cache, value_cache, block_tables, seq_lens_kv, cu_seqlens_q,
        sinks if sinks is not None else query, out,
        float(scale) * LOG2E, window, int(first_row),
        query.stride()[0], query.stride()[1], out.stride()[0], out.stride()[1],
        cs[0], cs[1], cs[2], block_tables.stride()[0],
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=_next_pow2(head_dim), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, USE_WINDOW=bool(window), USE_SINKS=sinks is not None,
        DOT_PRECISION=_dot_precision(query), num_warps=num_warps, num_stages=num_stages,
    )
    return out


def paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens_kv, cu_seqlens_q, *,
    num_decodes: int, max_query_len: int, max_decode_seq_len: int, scale: float,
    sliding_window: int | None = None, sinks=None, out=None,
):
    """A whole decode-first packed batch: decode kernel for rows ``[0, num_decodes)``,
    prefill kernel for the rest. ``query``/``out`` ``[T, num_heads, head_dim]``.

    Host ints: ``max_query_len`` bounds the prefill rows' query lengths and
    ``max_decode_seq_len`` the decode rows' context lengths.
    """
    out = query.new_empty(_shape(query)) if out is None else out
    num_reqs = _shape(seq_lens_kv)[0]
    if num_decodes > 0:
        decode_attention(
            query, key_cache, value_cache, block_tables, seq_lens_kv, num_rows=num_decodes,
            max_seq_len=max_decode_seq_len, scale=scale, sliding_window=sliding_window, sinks=sinks,
            out=out)
    if num_reqs > num_decodes:
        prefill_attention(
            query, key_cache, value_cache, block_tables, seq_lens_kv, cu_seqlens_q,
            first_row=num_decodes, num_rows=num_reqs - num_decodes, max_query_len=max_query_len,
            scale=scale, sliding_window=sliding_window, sinks=sinks, out=out)
    return out
