"""Triton kernels for paged attention: store K/V, decode (split-K, multi-token), packed prefill.

This module imports with Triton alone: no Paddle, and no torch at import time. The
host side only uses what torch and Paddle tensors both offer (``.shape``, ``.stride()``,
``.dtype``, ``.new_empty``, ``.data_ptr()``), so the same kernels run on torch tensors
(tests, benchmarks) and on Paddle tensors under ``paddle.compat.enable_torch_proxy``
(``fleetlab.attention.triton_backend``).

Plan once per step, launch per layer (as FlashInfer's plan/run): everything that depends
only on the batch and the layer's shapes (kernel knobs, context splits, grids, scratch
buffers for split partials) is decided by ``plan_attention`` into an ``AttentionPlan``;
``StepPlans`` keeps one per layer geometry for a step. Every layer then calls
``AttentionPlan.run``, which only launches: each ``Launch`` calls its compiled kernel
directly with arguments bound at plan time. ``decode_attention``, ``prefill_attention``
and ``paged_attention`` plan and run in one call (tests, one-off use, tuning knobs).

Layouts:
  key_cache / value_cache  ``[num_blocks, block_size, num_kv_heads, head_dim]``
  block_tables             int32 ``[B, max_blocks]`` (-1 unused)
  slot_mapping             int64 ``[T]``, slot = block * block_size + p % block_size, -1 = skip
  query / out              ``[T, num_heads, head_dim]`` packed, row ``i`` owns tokens
                           ``[cu_seqlens_q[i], cu_seqlens_q[i+1])``
  seq_lens_kv              int32 ``[B]`` context length after this step's writes
Decode rows come first: rows ``[0, num_decodes)`` carry one query token each (decode
token ``i`` is row ``i``), or up to ``MAX_DECODE_ROWS // group`` tokens each (speculative
verification: ``k + 1`` tokens, causal among themselves); the decode kernel reads each
row's K/V once for all of them. Small batches of single-token rows take the latency path
instead (``_decode_latency_kernel`` + ``_decode_reduce_kernel``, see ``decode_config``).

Masked positions contribute nothing, whatever the cache holds there (stale slots of
reused blocks, the unused tail of the last block, NaN): a key or value no query of a
tile may see is never loaded, and block-table entries past a row's context (-1) are
never used as addresses.

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
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import triton
import triton.language as tl
from triton import knobs
from triton.compiler import CompiledKernel

LOG2E = 1.4426950408889634
MAX_SPLITS = 64  # context splits per decode row, at most

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
def _normalize(acc, m, l, sinks_ptr, heads, m_valid, USE_SINKS: tl.constexpr):
    """``acc / l`` per row; a sink adds ``exp(sink)`` to the denominator (both in base 2 here)."""
    den = l
    if USE_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=m_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        m_all = tl.maximum(m, sink)
        rescale = tl.exp2(m - m_all)  # m = -inf (nothing seen) gives 0, not NaN
        acc = acc * rescale[:, None]
        den = l * rescale + tl.exp2(sink - m_all)
    return acc / tl.where(den > 0, den, 1.0)[:, None]


@triton.jit
def _online_softmax(s, v, m, l, acc, DOT_PRECISION: tl.constexpr):
    """Fold one K/V tile into a decode program's running softmax: scores ``s [M, N]`` (base 2,
    -inf where unseen), values ``v [N, D]``, running max ``m [M]``, sum ``l [M]`` and output
    ``acc [M, D]``. Returns the new ``(m, l, acc)``; a row that has seen nothing yet keeps
    ``m = -inf`` and adds nothing (no NaN from ``-inf - -inf``)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _decode_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, sinks_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, counter_ptr,
    scale_log2, window, split_len, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    GROUP: tl.constexpr, HEADS: tl.constexpr, MAX_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, SPLIT: tl.constexpr, MERGE_HERE: tl.constexpr,
    MERGE_ROWS: tl.constexpr, SPLIT_CHUNK: tl.constexpr, SPLITS_POW2: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, group of HEADS kv heads, split): all query tokens of one decode row.

    The tile's ``BLOCK_M`` rows are (query token, kv head of the program, query head of
    its GQA group) triples, so each K/V tile is read once for every query token and
    query head that uses it. With ``HEADS > 1`` the program reads the K/V of several
    adjacent kv heads as one ``[BLOCK_N, HEADS * HEAD_DIM]`` tile (longer contiguous
    runs per token) and multiplies a block-diagonal query (each row non-zero only in
    its own head's columns); the output keeps each row's own head's columns.

    Query token ``i`` of a row with ``q`` tokens sits at position ``seq_len - q + i`` and
    sees keys ``<=`` its position (window: ``(p - w, p]``). Only keys visible to some
    token of the row are loaded: a cache may hold anything (NaN) elsewhere.

    ``SPLIT``: the context is cut into ``num_splits`` splits; each program writes its
    normalised partial output and log2-sum-exp. With ``MERGE_HERE`` the last program of
    a (row, heads) to finish (an atomic counter, reset afterwards) merges them
    (``_merge_splits``): no second launch, but a serial tail (fence, atomic, merge) after
    the slowest split. Without it ``_decode_merge_kernel`` merges them in a second launch;
    ``PDL`` lets that launch begin early (``gdc_launch_dependents``), its programs waiting
    on the device for this grid's writes instead of starting after it drains: 1 at once,
    2 once every split has read its K/V.
    """
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0)
    hg = tl.program_id(1)
    split = tl.program_id(2)
    if MAX_Q == 1:
        q_start = row
        q_len = 1
    else:
        q_start = tl.load(cu_seqlens_q_ptr + row)
        q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + row)
    first_pos = seq_len - q_len  # position of the row's first query token
    lo = split * split_len
    if USE_WINDOW:
        lo += tl.maximum(first_pos + 1 - window, 0)
    hi = tl.minimum(lo + split_len, seq_len)

    ROWS: tl.constexpr = GROUP * HEADS  # tile rows per query token
    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // ROWS
    heads = hg * ROWS + offs_m % ROWS  # query head of each tile row
    m_valid = (tok < q_len) & (offs_m < MAX_Q * ROWS)
    q_pos = first_pos + tok
    offs_c = tl.arange(0, BLOCK_D)
    if HEADS == 1:
        d = offs_c
        own = m_valid[:, None] & (offs_c < HEAD_DIM)[None, :]
    else:  # column c belongs to kv head c // HEAD_DIM of the program
        d = offs_c % HEAD_DIM
        own = m_valid[:, None] & ((offs_c // HEAD_DIM)[None, :] == ((offs_m // GROUP) % HEADS)[:, None])
    c_valid = offs_c < HEADS * HEAD_DIM
    tok_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + tok_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=own, other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_table = row.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        offs = _kv_tile_offsets(block_tables_ptr, row_table, n, n_mask, hg * HEADS,
                                stride_c_blk, stride_c_tok, stride_c_head, BLOCK_SIZE)
        kv_mask = n_mask[:, None] & c_valid[None, :]
        k = tl.load(key_cache_ptr + offs[:, None] + offs_c[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + offs[:, None] + offs_c[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        seen = n_mask[None, :]
        if MAX_Q > 1:  # causal among the row's own new tokens
            seen = seen & (n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m, l, acc = _online_softmax(s, v, m, l, acc, DOT_PRECISION)

    if PDL == 2:  # K/V all read: the merge's programs may start coming in
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT:
        # Partials keep only the MERGE_ROWS leading tile rows (the valid ones), so the
        # merge below works on a small tile and loads SPLIT_CHUNK splits at once.
        pid = row * tl.num_programs(1) + hg
        part = (pid * num_splits + split).to(tl.int64) * MERGE_ROWS + offs_m
        keep = offs_m < MERGE_ROWS
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=keep)
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_c[None, :],
                 acc / tl.where(l > 0, l, 1.0)[:, None], mask=own & keep[:, None])
        if MERGE_HERE:
            tl.debug_barrier()  # every thread's partial is written before the counter moves
            finished = tl.atomic_add(counter_ptr + pid, 1, sem="acq_rel", scope="gpu")
            if finished == num_splits - 1:  # the last split of this (row, heads) to finish merges them all
                _merge_splits(part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, pid, num_splits, hg, q_start, q_len, 0,
                              stride_ot, stride_oh, GROUP, HEADS, MAX_Q, HEAD_DIM, BLOCK_D, MERGE_ROWS,
                              MERGE_ROWS, SPLIT_CHUNK, SPLITS_POW2, USE_SINKS)
                tl.atomic_xchg(counter_ptr + pid, 0)  # ready for the next launch
    else:
        o = _normalize(acc, m, l, sinks_ptr, heads, m_valid, USE_SINKS)
        tl.store(out_ptr + tok_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=own)


@triton.jit
def _merge_splits(
    part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, pid, num_splits, hg, q_start, q_len, r0,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEADS: tl.constexpr, MAX_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, MERGE_ROWS: tl.constexpr, ROWS_HERE: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    SPLITS_POW2: tl.constexpr, USE_SINKS: tl.constexpr,
):
    """Merge tile rows ``[r0, r0 + ROWS_HERE)`` of the splits' normalised partial outputs by
    their log2-sum-exp (``SPLITS_POW2``: ``num_splits`` rounded up to a power of two). When
    all splits fit one ``SPLIT_CHUNK`` load, one round trip; otherwise every log2-sum-exp
    first, then ``SPLIT_CHUNK`` splits per load (independent loads in flight, not one round
    trip per split). Every split wrote its rows (zeros and -inf when it saw nothing); a
    split's partial holds ``MERGE_ROWS`` rows."""
    ROWS: tl.constexpr = GROUP * HEADS
    offs_r = r0 + tl.arange(0, ROWS_HERE)
    offs_c = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, SPLIT_CHUNK)
    tok = offs_r // ROWS
    heads = hg * ROWS + offs_r % ROWS
    r_valid = (tok < q_len) & (offs_r < MAX_Q * ROWS)
    if HEADS == 1:
        d = offs_c
        own = r_valid[:, None] & (offs_c < HEAD_DIM)[None, :]
    else:
        d = offs_c % HEAD_DIM
        own = r_valid[:, None] & ((offs_c // HEAD_DIM)[None, :] == ((offs_r // GROUP) % HEADS)[:, None])
    first = (pid * num_splits).to(tl.int64)
    if SPLIT_CHUNK >= SPLITS_POW2:
        # Every split at once: one round trip for the log2-sum-exps and the partial outputs.
        rows = (first + offs_s)[:, None] * MERGE_ROWS + offs_r[None, :]  # [SPLIT_CHUNK, ROWS_HERE]
        s_ok = offs_s < num_splits
        lse = tl.load(part_lse_ptr + rows, mask=s_ok[:, None] & r_valid[None, :], other=float("-inf"),
                      cache_modifier=".cg")
        o = tl.load(part_o_ptr + rows[:, :, None] * BLOCK_D + offs_c[None, None, :],
                    mask=s_ok[:, None, None] & own[None, :, :], other=0.0, cache_modifier=".cg")
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m_safe[None, :])
        l = tl.sum(w, 0)
        acc = tl.sum(o * w[:, :, None], 0)
    else:
        # Every split's log2-sum-exp in one load: the global max and denominator come first,
        # so the chunks of partial outputs below are independent loads (no rescaling).
        offs_all = tl.arange(0, SPLITS_POW2)
        lse_all = tl.load(part_lse_ptr + (first + offs_all)[:, None] * MERGE_ROWS + offs_r[None, :],
                          mask=(offs_all < num_splits)[:, None] & r_valid[None, :], other=float("-inf"),
                          cache_modifier=".cg")
        m = tl.max(lse_all, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        l = tl.sum(tl.exp2(lse_all - m_safe[None, :]), 0)
        acc = tl.zeros([ROWS_HERE, BLOCK_D], tl.float32)
        for s0 in range(0, num_splits, SPLIT_CHUNK):
            s_idx = s0 + offs_s
            rows = (first + s_idx)[:, None] * MERGE_ROWS + offs_r[None, :]
            s_ok = s_idx < num_splits
            lse = tl.load(part_lse_ptr + rows, mask=s_ok[:, None] & r_valid[None, :], other=float("-inf"),
                          cache_modifier=".cg")
            o = tl.load(part_o_ptr + rows[:, :, None] * BLOCK_D + offs_c[None, None, :],
                        mask=s_ok[:, None, None] & own[None, :, :], other=0.0, cache_modifier=".cg")
            acc += tl.sum(o * tl.exp2(lse - m_safe[None, :])[:, :, None], 0)
    o = _normalize(acc, m, l, sinks_ptr, heads, r_valid, USE_SINKS)
    tok_rows = (q_start + tok).to(tl.int64)
    tl.store(out_ptr + tok_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=own)


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, cu_seqlens_q_ptr, num_splits, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEADS: tl.constexpr, MAX_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, MERGE_ROWS: tl.constexpr, ROWS_HERE: tl.constexpr, SPLIT_CHUNK: tl.constexpr,
    SPLITS_POW2: tl.constexpr, USE_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, group of kv heads, slice of ``ROWS_HERE`` tile rows): the second launch
    of a split decode whose splits do not merge themselves (``MERGE_HERE`` off):
    ``_merge_splits`` over its partials. Slicing the rows spreads a small batch's merge over
    more multiprocessors (1 x 32k at 8 kv heads: 32 programs instead of 8).

    ``PDL``: launched as a programmatic dependent of ``_decode_kernel`` (Hopper), so its
    programs start while the splits finish and wait (``gdc_wait``) only before reading
    their partials."""
    row = tl.program_id(0)
    hg = tl.program_id(1)
    r0 = tl.program_id(2) * ROWS_HERE
    if MAX_Q == 1:
        q_start = row
        q_len = 1
    else:
        q_start = tl.load(cu_seqlens_q_ptr + row)
        q_len = tl.load(cu_seqlens_q_ptr + row + 1) - q_start
    pid = row * tl.num_programs(1) + hg
    if PDL:
        tl.extra.cuda.gdc_wait()  # every split's partial is written and visible
    _merge_splits(part_o_ptr, part_lse_ptr, sinks_ptr, out_ptr, pid, num_splits, hg, q_start, q_len, r0,
                  stride_ot, stride_oh, GROUP, HEADS, MAX_Q, HEAD_DIM, BLOCK_D, MERGE_ROWS, ROWS_HERE,
                  SPLIT_CHUNK, SPLITS_POW2, USE_SINKS)


@triton.jit
def _decode_latency_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    scale_log2, window, split_len, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    """The latency path: program (row, kv_head, split), one query token per row.

    The kernel of small single-token batches (faster there than ``_decode_kernel``, whose
    extra splits and waves cost more than they save at that size): the GROUP query heads
    of one kv head over one split, no in-launch merge. With ``DIRECT`` (a single split)
    the normalised output goes straight to ``out``; otherwise the split's normalised
    partial output and its log2-sum-exp go to ``part_o [B, H, S, D]`` / ``part_lse [B, H, S]`` for
    ``_decode_reduce_kernel``. Only keys ``[lo, hi)`` of the row's visible context are
    loaded (a split past the context writes an empty partial and loads nothing). ``PDL``:
    as in ``_decode_kernel``, the reduce launch may start at once.
    """
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
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
        m, l, acc = _online_softmax(s, v, m, l, acc, DOT_PRECISION)

    if DIRECT:
        o = _normalize(acc, m, l, sinks_ptr, heads, g_mask, USE_SINKS)
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
    USE_SINKS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, head): merge ``_decode_latency_kernel``'s splits by their log-sum-exp
    (``PDL``: a programmatic dependent launch that waits for the splits on the device)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    base = (row * NUM_HEADS + head) * num_splits
    if PDL:
        tl.extra.cuda.gdc_wait()
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
def _prefill_tile(
    acc, m, l, q, q_pos, n0, lo, hi, key_cache_ptr, value_cache_ptr, block_tables_ptr, row_table, kv_head,
    offs_d, scale_log2, window, stride_c_blk, stride_c_tok, stride_c_head,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, PAGE_TILES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One K/V tile of the prefill loop (online softmax).

    ``MASKED``: keys outside ``[lo, hi)`` are neither loaded nor counted, and each query
    sees only keys at or before its position (and inside its window). Unmasked tiles
    (every key visible to every query of the tile) skip all of that. ``PAGE_TILES``: an
    unmasked tile starts at a multiple of ``BLOCK_N`` and lies inside one page, so one
    block id addresses it (contiguous tokens).
    """
    n = n0 + tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    if MASKED:
        n_mask = (n >= lo) & (n < hi)
        offs = _kv_tile_offsets(block_tables_ptr, row_table, n, n_mask, kv_head,
                                stride_c_blk, stride_c_tok, stride_c_head, BLOCK_SIZE)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        seen = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        v = tl.load(value_cache_ptr + offs[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        if PAGE_TILES:
            blk = tl.load(block_tables_ptr + row_table + n0 // BLOCK_SIZE).to(tl.int64)
            offs = blk * stride_c_blk + (n0 % BLOCK_SIZE + tl.arange(0, BLOCK_N)) * stride_c_tok
            offs += kv_head * stride_c_head
        else:
            blk = tl.load(block_tables_ptr + row_table + n // BLOCK_SIZE)
            offs = blk.to(tl.int64) * stride_c_blk + (n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
        if HEAD_DIM == BLOCK_D:
            k = tl.load(key_cache_ptr + offs[:, None] + offs_d[None, :])
        else:
            k = tl.load(key_cache_ptr + offs[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        m_new = tl.maximum(m, tl.max(qk, 1) * scale_log2)
        p = tl.exp2(qk * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        if HEAD_DIM == BLOCK_D:
            v = tl.load(value_cache_ptr + offs[:, None] + offs_d[None, :])
        else:
            v = tl.load(value_cache_ptr + offs[:, None] + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l


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
    PAGE_TILES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Program (query tile, kv_head, row): a chunk's queries over the row's paged context.

    The tile's ``BLOCK_M`` rows are (query token, head of the kv group) pairs, so the
    GROUP heads sharing a kv head read each K/V tile once. A query at position ``p``
    sees keys ``[0, p]`` (window: ``(p - w, p]``): causal inside the chunk, full over
    the context cached by earlier steps. The key range splits in three (FlashAttention-2
    style): a masked band at the window's lower edge, unmasked tiles every query of the
    tile sees whole, and a masked band on the causal diagonal; keys no query of the tile
    sees are skipped. The last query tiles (most keys) are launched first.

    ``PAGE_TILES`` (pages a multiple of ``BLOCK_N``, no window): each unmasked tile is
    addressed by one block id. ``WARP_SPECIALIZE`` asks Triton to split the unmasked loop
    into producer and consumer warps.
    """
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.program_id(2) + first_row
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
    first = context + t0  # position of the tile's first and last query
    last = context + tl.minimum(t0 + TOKENS, q_len) - 1
    hi = last + 1
    lo = 0
    full_lo = 0
    if USE_WINDOW:
        lo = tl.maximum(first - window + 1, 0)
        full_lo = tl.maximum(last - window + 1, 0)
    full_hi = full_lo + (tl.maximum(first + 1 - full_lo, 0) // BLOCK_N) * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row_table = row.to(tl.int64) * stride_bt
    for n0 in range(lo, full_lo, BLOCK_N):  # window's lower edge
        acc, m, l = _prefill_tile(acc, m, l, q, q_pos, n0, lo, full_lo, key_cache_ptr, value_cache_ptr,
                                  block_tables_ptr, row_table, kv_head, offs_d, scale_log2, window,
                                  stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                  True, USE_WINDOW, False, DOT_PRECISION)
    # seen whole by every query of the tile
    for n0 in tl.range(full_lo, full_hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, m, l = _prefill_tile(acc, m, l, q, q_pos, n0, lo, hi, key_cache_ptr, value_cache_ptr,
                                  block_tables_ptr, row_table, kv_head, offs_d, scale_log2, window,
                                  stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                  False, USE_WINDOW, PAGE_TILES, DOT_PRECISION)
    for n0 in range(full_hi, hi, BLOCK_N):  # the causal diagonal
        acc, m, l = _prefill_tile(acc, m, l, q, q_pos, n0, full_hi, hi, key_cache_ptr, value_cache_ptr,
                                  block_tables_ptr, row_table, kv_head, offs_d, scale_log2, window,
                                  stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N,
                                  True, USE_WINDOW, False, DOT_PRECISION)

    o = _normalize(acc, m, l, sinks_ptr, heads, m_valid, USE_SINKS)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])


@triton.jit
def _zero_kernel(ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.zeros([BLOCK], tl.int32), mask=offs < n)


# ---------------------------------------------------------------------------------
# Host side, part 1: what a layer looks like, checked once
# ---------------------------------------------------------------------------------

_DTYPES = ("float16", "bfloat16", "float32")
MAX_DECODE_ROWS = 128  # query tokens x query heads one decode program can hold
_MERGE_TILE = 8192  # fp32 elements of partial output the split merge loads at once


def _dtype_name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _framework_dtype(t, name: str):
    """The dtype ``name`` of ``t``'s framework (torch or Paddle), found without importing either here."""
    return getattr(importlib.import_module(type(t).__module__.split(".")[0]), name)


def _shape(t) -> tuple[int, ...]:
    return tuple(int(s) for s in t.shape)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@functools.cache
def _pdl_supported() -> bool:
    """Programmatic dependent launch: a Hopper (or newer) GPU, not the CPU interpreter."""
    if _interpreting():
        return False
    try:
        target = triton.runtime.driver.active.get_current_target()
        return target.backend == "cuda" and int(target.arch) >= 90
    except Exception:  # noqa: BLE001 - no GPU driver: plain launches
        return False


@functools.cache
def _num_sms() -> int:
    """Multiprocessor count of the current GPU (1 under the CPU interpreter)."""
    try:
        driver = triton.runtime.driver.active
        return int(driver.utils.get_device_properties(driver.get_current_device())["multiprocessor_count"])
    except Exception:  # noqa: BLE001 - interpreter or no GPU driver: any count plans a correct launch
        return 1


class LayerGeometry(NamedTuple):
    """What an attention plan depends on besides the batch: one layer's shapes and options.

    ``query_strides``: (token, head) strides of the queries; the output is allocated
    contiguous, ``[T, num_heads, head_dim]``. ``cache_strides``: the strides of both caches
    ``[num_blocks, block_size, num_kv_heads, head_dim]``. ``window``: the sliding window
    (0: none). ``sinks``: the dtype name of the per-head sink logits (None: no sinks).
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    query_strides: tuple[int, int]
    cache_strides: tuple[int, int, int, int]
    window: int = 0
    sinks: str | None = None

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def elem_bytes(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def dot_precision(self) -> str:
        # fp32 caches (CPU tests, debugging) get exact fp32 products instead of tf32.
        return "ieee" if self.dtype == "float32" else "tf32"

    @classmethod
    def of(cls, query, key_cache, value_cache=None, sliding_window=None, sinks=None) -> LayerGeometry:
        """The geometry of ``query [T, num_heads, head_dim]`` over these caches; raises a
        ``ValueError``/``TypeError`` naming what does not fit."""
        shape = _shape(key_cache)
        value_cache = key_cache if value_cache is None else value_cache
        if len(shape) != 4 or _shape(value_cache) != shape:
            raise ValueError(
                f"key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; "
                f"got {shape} and {_shape(value_cache)}")
        if tuple(key_cache.stride()) != tuple(value_cache.stride()) or key_cache.stride()[3] != 1:
            raise ValueError("key_cache and value_cache need equal strides and a contiguous head_dim")
        dtype = _dtype_name(key_cache.dtype)
        if dtype not in _DTYPES or key_cache.dtype != value_cache.dtype:
            raise TypeError(f"caches must share one of {_DTYPES}; got {key_cache.dtype} and {value_cache.dtype}")
        _, block_size, num_kv_heads, head_dim = shape
        q_shape = _shape(query)
        if len(q_shape) != 3 or q_shape[2] != head_dim:
            raise ValueError(f"query must be [T, num_heads, {head_dim}]; got {q_shape}")
        if q_shape[1] % num_kv_heads:
            raise ValueError(f"num_heads {q_shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
        if query.dtype != key_cache.dtype:
            raise TypeError(f"query dtype {query.dtype} differs from the cache dtype {key_cache.dtype}")
        if query.stride()[2] != 1:
            raise ValueError("query needs a contiguous head_dim")
        if sliding_window is not None and int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1 or None; got {sliding_window}")
        if sinks is not None and _shape(sinks) != (q_shape[1],):
            raise ValueError(f"sinks must be [num_heads={q_shape[1]}]; got {_shape(sinks)}")
        return cls(q_shape[1], num_kv_heads, head_dim, block_size, dtype, tuple(query.stride()[:2]),
                   tuple(key_cache.stride()), int(sliding_window or 0),
                   None if sinks is None else _dtype_name(sinks.dtype))


def layer_key(query, key_cache, sliding_window=None, sinks=None) -> tuple:
    """A cheap hashable summary of one layer call: layers with equal keys share a plan. It
    leaves out the step's token count, so a layer keeps its key from step to step."""
    return (tuple(query.shape[1:]), tuple(query.stride()), tuple(key_cache.shape), tuple(key_cache.stride()),
            query.dtype, sliding_window, None if sinks is None else sinks.dtype)


@dataclass(frozen=True)
class PagedBatch:
    """One step's packed batch as the kernels read it: device tensors and host bounds.

    Device tensors: ``block_tables`` int32 ``[B, max_blocks]``, ``seq_lens_kv`` int32 ``[B]``,
    ``cu_seqlens_q`` int32 ``[B + 1]``, ``slot_mapping`` int64 ``[T]`` (None: the plans store
    no K/V). Rows ``[0, num_decodes)`` are decodes (their tokens first); the host ints bound
    what the kernels are planned for, so planning never reads the device.
    """

    block_tables: Any
    seq_lens_kv: Any
    cu_seqlens_q: Any
    slot_mapping: Any
    block_size: int
    num_reqs: int
    num_tokens: int
    num_decodes: int
    num_decode_tokens: int
    max_decode_query_len: int
    max_decode_seq_len: int
    max_prefill_query_len: int

    @classmethod
    def from_host(cls, block_tables, seq_lens_kv, cu_seqlens_q, slot_mapping=None, *, block_size: int,
                  num_decodes: int, cu_seqlens_q_host, seq_lens_kv_host) -> PagedBatch:
        """The batch, its bounds computed from host copies of ``cu_seqlens_q`` and ``seq_lens_kv``."""
        cu = np.asarray(cu_seqlens_q_host, dtype=np.int64)
        lens = np.asarray(seq_lens_kv_host, dtype=np.int64)
        q_lens = np.diff(cu)
        nd = int(num_decodes)
        return cls(block_tables, seq_lens_kv, cu_seqlens_q, slot_mapping, int(block_size), len(lens), int(cu[-1]),
                   nd, int(cu[nd]), int(q_lens[:nd].max(initial=0)), int(lens[:nd].max(initial=0)),
                   int(q_lens[nd:].max(initial=0)))


# ---------------------------------------------------------------------------------
# Host side, part 2: a launch with its arguments bound once
# ---------------------------------------------------------------------------------

# Positions of the per-layer tensors in the tuple a plan hands its launches.
_LAYER_TENSORS = {"q_ptr": 0, "key_cache_ptr": 1, "value_cache_ptr": 2, "out_ptr": 3, "sinks_ptr": 4}
_STORE_TENSORS = {"key_ptr": 0, "value_ptr": 1, "key_cache_ptr": 2, "value_cache_ptr": 3}


class Launch:
    """One kernel launch, its grid and every argument bound at plan time except the
    per-layer tensors (``layer``: parameter name -> position in the tuple of tensors each
    call passes) and ``scale_log2``. ``config`` records the knobs it was planned with.

    The first call looks the compiled kernel up by everything it depends on (the bound
    arguments' exact values, the tensors' dtypes and 16-byte alignment, the options) in a
    cache shared by all plans, so a later step's plan finds it there; on a miss it goes
    through Triton's JIT, which compiles the kernel (or finds it in its own cache). From
    then on a call hands the arguments, the tensors as addresses, straight to the compiled
    kernel's launcher: no argument binding, no specialisation, no cache lookup. A call
    whose tensors are not all 16-byte aligned goes through the JIT (the compiled kernel may
    assume alignment). Under the CPU interpreter every call goes through the JIT.
    """

    __slots__ = ("name", "kernel", "grid", "options", "config", "fallback", "_args", "_binds", "_scale_at",
                 "_fast", "_launch")

    def __init__(self, name: str, kernel, grid, args: dict, options: dict, layer: dict[str, int],
                 config: dict | None = None, fallback: Launch | None = None):
        names = kernel.arg_names
        unknown = set(args) - set(names)
        missing = [n for n in names if n not in args and n not in layer and n != "scale_log2"]
        if unknown or missing:
            raise TypeError(f"{kernel.__name__}: no parameters {sorted(unknown)}, unbound {missing}")
        self.name, self.kernel, self.options = name, kernel, options
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.config = config or {}
        self.fallback = fallback  # launched instead when the tensors are not all 16-byte aligned
        self._args = [args.get(n) for n in names]
        self._binds = tuple((i, layer[n]) for i, n in enumerate(names) if n in layer)
        self._scale_at = names.index("scale_log2") if "scale_log2" in names else -1
        self._fast = None  # the bound arguments with tensors as addresses, once compiled
        self._launch = None  # launch(stream, args) of the compiled kernel

    def __call__(self, tensors, ptrs, aligned: bool, scale_log2: float, stream) -> None:
        """Launch with this layer's ``tensors`` (and their addresses ``ptrs``) on ``stream``."""
        if not aligned and self.fallback is not None:
            self.fallback(tensors, ptrs, aligned, scale_log2, stream)
            return
        if aligned and self._fast is not None:
            args = self._fast.copy()
            for i, j in self._binds:
                args[i] = ptrs[j]
            if self._scale_at >= 0:
                args[self._scale_at] = scale_log2
            self._launch(stream, args)
            return
        if aligned:
            key = self._key(tensors)
            found = _COMPILED.get(key)
            if found is not None:
                self._fast, self._launch = self._addresses(), _launcher(found, self.grid)
                self(tensors, ptrs, aligned, scale_log2, stream)
                return
        args = self._args.copy()
        for i, j in self._binds:
            args[i] = tensors[j]
        if self._scale_at >= 0:
            args[self._scale_at] = scale_log2
        compiled = self.kernel[self.grid](*args, **self.options)
        if aligned and isinstance(compiled, CompiledKernel):
            _COMPILED[key] = compiled
            self._fast, self._launch = self._addresses(), _launcher(compiled, self.grid)

    def _key(self, tensors) -> tuple:
        """What the compiled kernel depends on: options, bound values, tensor dtypes and alignment."""
        key = [self.kernel, tuple(sorted(self.options.items())), _current_device()]
        for a in self._args:
            key.append((str(a.dtype), a.data_ptr() % 16 == 0) if hasattr(a, "data_ptr") else a)
        key += [str(tensors[j].dtype) for _, j in self._binds]
        return tuple(key)

    def _addresses(self) -> list:
        return [a.data_ptr() if hasattr(a, "data_ptr") else a for a in self._args]

    def __repr__(self) -> str:
        return f"Launch({self.name!r}, {self.kernel.__name__}, grid={self.grid}, {self.config})"


# Compiled kernels by everything they depend on but the grid (``Launch._key``): found again by
# later steps' plans.
_COMPILED: dict[tuple, CompiledKernel] = {}


def _launcher(compiled, grid):
    """``launch(stream, args)`` of a compiled kernel: its launcher called directly where
    Triton's launcher is the one this module knows (no scratch memory, no launch hooks),
    else the compiled kernel's own ``kernel[grid](*args, stream=...)``."""
    run = compiled.run
    direct = getattr(run, "launch", None)
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)  # profilers' (Proton's)
    if (direct is None or getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1)
            or any(h is not None and getattr(h, "calls", True) for h in hooks)):
        runner = compiled[grid]
        return lambda stream, args: runner(*args, stream=stream)
    head = (*grid, None, compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
            compiled.packed_metadata, None, None, None)

    def launch(stream, args):
        direct(head[0], head[1], head[2], stream, *head[4:], *args)

    return launch


@functools.cache
def _driver():
    return triton.runtime.driver.active


def _current_device() -> int:
    return _driver().get_current_device()


def _current_stream():
    driver = _driver()
    return driver.get_current_stream(driver.get_current_device())


def _launch_all(launches, tensors, scale_log2: float = 0.0) -> None:
    """Run ``launches`` with one layer's ``tensors``: their addresses read once, one stream."""
    ptrs = [t.data_ptr() for t in tensors]
    bits = 0
    for p in ptrs:
        bits |= p
    aligned = not bits & 15 and not _interpreting()  # the interpreter has no compiled kernels
    stream = _current_stream() if aligned else None
    for launch in launches:
        launch(tensors, ptrs, aligned, scale_log2, stream)


@functools.cache
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class AttentionPlan:
    """One step's attention for one layer geometry, planned: its launches, their grids,
    knobs and scratch buffers fixed. Every layer of that geometry then calls ``store_kv``
    and ``run``, which only launch.

    ``run`` trusts its tensors to have the plan's geometry (``StepPlans.for_layer`` picks
    the plan by their shapes); it checks the token count and whether sinks were given.
    """

    geometry: LayerGeometry
    num_tokens: int
    launches: tuple[Launch, ...]
    store: Launch | None = None

    def store_kv(self, key, value, key_cache, value_cache) -> None:
        """Write contiguous ``key``/``value`` ``[T, num_kv_heads, head_dim]`` to their slots."""
        if self.store is None:
            raise ValueError("this plan was made without a slot_mapping: it stores no K/V")
        _launch_all((self.store,), (key, value, key_cache, value_cache))

    def run(self, query, key_cache, value_cache, *, scale: float, sinks=None, out=None):
        """Attention of ``query [T, num_heads, head_dim]`` over the caches; returns ``out``
        (allocated like ``query`` when not given)."""
        if query.shape[0] != self.num_tokens:
            raise ValueError(f"the plan covers {self.num_tokens} tokens; query has {query.shape[0]}")
        if (sinks is None) != (self.geometry.sinks is None):
            raise ValueError("sinks given to a plan made without them, or missing from one made with them")
        if out is None:
            out = query.new_empty(query.shape)
        elif tuple(out.stride()[:2]) != (self.geometry.num_heads * self.geometry.head_dim, self.geometry.head_dim):
            raise ValueError("out must be contiguous [T, num_heads, head_dim]")
        tensors = (query, key_cache, value_cache, out, query if sinks is None else sinks)
        _launch_all(self.launches, tensors, float(scale) * LOG2E)
        return out


class StepPlans:
    """The plans of one engine step, one per layer geometry: what ``build_metadata`` makes.

    Geometries in ``known`` (a dict kept by the caller across steps: layer key ->
    geometry) are planned here, up front; a layer with a new geometry is planned on its
    first call and added to ``known``, so from the next step on it is planned up front
    too. ``like``: any device tensor, for the scratch buffers' device.
    """

    def __init__(self, batch: PagedBatch, like, known: dict | None = None):
        self.batch, self.like = batch, like
        self.known = {} if known is None else known
        self._plans = {key: plan_attention(batch, geometry, like) for key, geometry in self.known.items()}

    def for_layer(self, query, key_cache, sliding_window=None, sinks=None) -> AttentionPlan:
        """The plan for a layer with these tensors (one dictionary lookup once planned)."""
        key = layer_key(query, key_cache, sliding_window, sinks)
        plan = self._plans.get(key)
        if plan is None:
            geometry = LayerGeometry.of(query, key_cache, None, sliding_window, sinks)
            if geometry.block_size != self.batch.block_size:
                raise ValueError(f"cache block size {geometry.block_size} differs from the batch's "
                                 f"block_size {self.batch.block_size}")
            plan = self._plans[key] = plan_attention(self.batch, geometry, self.like)
            self.known[key] = geometry
        return plan


# ---------------------------------------------------------------------------------
# Host side, part 3: configuration tables and split planning
# ---------------------------------------------------------------------------------


class DecodeConfig(NamedTuple):
    """Knobs of the decode kernels: K/V tokens per tile, warps, pipeline depth, programs per
    multiprocessor the split planner aims for, kv heads per program, where split contexts
    merge (in the same launch, by the last split to finish, or in a second launch),
    whether the planner may split contexts at all, whether the latency path
    (``_decode_latency_kernel`` + ``_decode_reduce_kernel``) runs instead of ``_decode_kernel``,
    how many tile rows one program of the second-launch merge takes (0: all of its
    (row, kv head group)'s rows), and whether that merge is a programmatic dependent launch
    (Hopper) let in at the split kernel's start (1) or once its K/V are read (2), or not (0)."""

    block_n: int
    num_warps: int
    num_stages: int
    programs_per_sm: int
    heads_per_program: int
    merge_in_launch: bool = True
    may_split: bool = True
    latency_kernel: bool = False
    merge_slice: int = 0
    pdl: int = 0


# The latency path's knobs (contexts of 8k tokens and more buffer deeper: 5 stages, see ``decode_config``).
LATENCY_CONFIG = DecodeConfig(64, 4, 3, 2, 1, merge_in_launch=False, latency_kernel=True)


class PrefillConfig(NamedTuple):
    """Knobs of the prefill kernel: tile rows (query tokens x GQA heads), K/V tokens per tile,
    warps, pipeline depth, whether a tile inside one page is addressed by one block id
    (``PAGE_TILES``), and whether Triton may warp-specialise the unmasked loop."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    page_tiles: bool = True
    warp_specialize: bool = False


def decode_config(head_dim: int, group: int, num_kv_heads: int, elem_bytes: int,
                  max_query_len: int = 1, kv_heads_contiguous: bool = True, num_rows: int = 1024,
                  max_span: int = 0, num_sms: int = 132, latency_path: bool = True) -> DecodeConfig:
    """The decode kernels' default knobs for a shape, chosen by timing every setting on an
    H200 in bf16 (``python -m fleetlab.lab.bench.triton_attention --tune decode``; the
    figures behind each rule are in the README's Triton section).

    ``latency_path=False``: never the latency path (``_decode_kernel``'s knobs only).

    - ``heads_per_program > 1`` (several adjacent kv heads per program) where one head's
      row of K is short (MHA at head_dim 64: 128 bytes per token and head).
    - ``num_stages`` counts the block-table load as a stage of its own: 3 leaves one K/V
      tile in flight per program, 5 two. A batch with several programs per
      multiprocessor hides latency with programs (3); a batch whose contexts are split
      (one program per multiprocessor) buffers deeper (5), over long contexts with
      128-token tiles; rows of several query tokens want 5 past 16 tile rows.
    - ``programs_per_sm`` 2 where two 5-stage programs' buffers fit a multiprocessor's
      shared memory (head_dim 64), else 1.
    - Single-token rows, when the batch would be split:

      * a batch whose programs nearly fill the multiprocessors once (>= 7/8 of them) is
        not split: a split and its merge cost more than the idle multiprocessors (at
        head_dim 256 on 8 warps: the 64-token tiles of a 512-byte row need them);
      * small work (rows x kv heads x context <= 2**17 tokens) takes the latency path:
        one kv head per program, 64-token tiles, about two programs per multiprocessor
        (splits rounded up), merged by a second launch; 5 stages from 8k tokens on;
      * larger work keeps ``_decode_kernel`` with one kv head per program and merges in
        a second launch of one program per tile row, as a programmatic dependent launch:
        let in at the split kernel's start where two split programs share a
        multiprocessor, once the K/V are read where one fills it.
    """
    heads = 1
    if kv_heads_contiguous and max_query_len == 1 and group == 1:
        while (heads * 2 * head_dim * elem_bytes <= 256 and num_kv_heads % (heads * 2) == 0):
            heads *= 2
    wide = elem_bytes * head_dim * heads > 256  # head_dim 256 or fp32: half the tile
    groups = num_kv_heads // heads
    if num_rows * groups >= 2 * num_sms:  # no split
        return DecodeConfig(32 if wide else 64, 4, 5 if max_query_len * group * heads > 16 else 3, 2, heads)
    if max_query_len == 1:
        if num_rows * groups * 8 >= num_sms * 7:
            deep = max_span >= 2048  # 128-token tiles: more bytes in flight on each multiprocessor
            return DecodeConfig((64 if wide else 128) if deep else (32 if wide else 64), 8 if wide else 4, 5, 1,
                                heads, may_split=False)
        if latency_path and num_rows * num_kv_heads * max_span <= 2**17 and elem_bytes * head_dim <= 256:
            return LATENCY_CONFIG._replace(num_stages=5) if max_span >= 8192 else LATENCY_CONFIG
        heads = 1
        wide = elem_bytes * head_dim > 256
    long = max_span >= 8192 and max_query_len == 1
    block_n = (64 if wide else 128) if long else (32 if wide else 64)
    # 5 stages buffer two K/V tiles; where two programs' buffers fit a multiprocessor's
    # shared memory (head_dim 64), plan for two.
    two_fit = max_query_len == 1 and 2 * 2 * (2 * block_n * head_dim * heads * elem_bytes) <= 200 * 1024
    return DecodeConfig(block_n, 4, 5, 2 if two_fit else 1, heads, merge_in_launch=max_query_len > 1,
                        merge_slice=1, pdl=1 if two_fit else 2)


def prefill_config(head_dim: int, group: int, elem_bytes: int, num_programs: int,
                   max_query_len: int = 2048, num_sms: int = 132, block_size: int = 16) -> PrefillConfig:
    """The prefill kernel's default knobs for a shape (from an H200 sweep, bf16).

    ``num_programs``: programs the launch would have with 128-row tiles. Long chunks and
    launches that leave multiprocessors idle (a chunk after a long context) want 64-token
    K/V tiles on 8 warps, pipelined 5 deep; shorter chunks 32-token tiles on 4 warps. Pages
    of 64 tokens or more hold a whole 64-token tile (one block id per tile), which makes
    the 64-token tiles pay from 2k-token chunks on.
    """
    if elem_bytes * head_dim > 256:  # head_dim 256 (or fp32): registers and shared memory run short
        return PrefillConfig(64, 32, 4, 2)
    whole_pages = block_size % 64 == 0
    if num_programs < num_sms or max_query_len >= 4096 or (whole_pages and max_query_len >= 2048):
        return PrefillConfig(128, 64, 8, 5)
    return PrefillConfig(128, 32, 4, 4)


def plan_decode_splits(
    num_rows: int, num_kv_heads: int, max_span: int, *, block_n: int, num_sms: int,
    programs_per_sm: int = 2, max_splits: int = MAX_SPLITS, whole_waves: bool = True,
) -> tuple[int, int]:
    """Choose how to split each row's context (flash-decoding): ``(num_splits, split_len)``.

    One program handles one (row, kv head group, split); ``num_kv_heads`` here counts
    programs per row and split. A batch with ``programs_per_sm`` programs per
    multiprocessor or more is not split. A smaller batch gets its contexts cut into
    splits of ``split_len`` tokens (a multiple of ``block_n``) until about
    ``programs_per_sm * num_sms`` programs run (rounded down, so that no partial second
    wave of programs follows the first), never below one tile per split.

    ``whole_waves=False`` is the latency path's rule: split only a batch of fewer
    programs than multiprocessors, rounding the split count up.
    """
    programs = max(1, num_rows * num_kv_heads)
    tiles = max(1, math.ceil(max_span / block_n))
    slots = programs_per_sm * num_sms
    if not whole_waves:
        want = 1 if programs >= num_sms else math.ceil(slots / programs)
    elif slots // programs >= 2:
        # Round down where that still splits: a few programs past the last slot would run
        # as a second wave of their own.
        want = slots // programs
    else:
        want = math.ceil(slots / programs)
    splits = max(1, min(want, tiles, max_splits))
    split_len = math.ceil(tiles / splits) * block_n
    return math.ceil(max(max_span, 1) / split_len), split_len


def _splits(num_splits, num_rows: int, programs_per_row: int, max_span: int, cfg: DecodeConfig):
    """``(num_splits, split_len)``: planned (``num_splits`` None) or forced, in whole tiles."""
    if num_splits is None:
        if not cfg.may_split:
            return 1, max(max_span, 1)
        return plan_decode_splits(num_rows, programs_per_row, max_span, block_n=cfg.block_n, num_sms=_num_sms(),
                                  programs_per_sm=cfg.programs_per_sm, whole_waves=not cfg.latency_kernel)
    if not 1 <= int(num_splits) <= MAX_SPLITS:
        raise ValueError(f"num_splits must lie in [1, {MAX_SPLITS}]; got {num_splits}")
    split_len = math.ceil(max(max_span, 1) / (int(num_splits) * cfg.block_n)) * cfg.block_n
    return math.ceil(max(max_span, 1) / split_len), split_len


def _split_chunk(num_splits: int, rows: int, block_d: int) -> int:
    """Splits one merge load takes: as many as fit ``_MERGE_TILE`` fp32 elements of ``rows x block_d``."""
    return max(1, min(_next_pow2(num_splits), _MERGE_TILE // (rows * block_d)))


_COUNTERS: dict[str, object] = {}


def _split_counters(like, n: int):
    """A zeroed int32 buffer of at least ``n`` counters on ``like``'s device, kept across calls.

    The decode kernel's merging program resets each counter it used, so the buffer
    stays zero between launches (one stream at a time may use it: the engine's case).
    """
    key = str(getattr(like, "place", None) or getattr(like, "device", None))
    buf = _COUNTERS.get(key)
    if buf is None or _shape(buf)[0] < n:
        size = max(1024, _next_pow2(n))
        buf = like.new_empty((size,), dtype=_framework_dtype(like, "int32"))
        _zero_kernel[(math.ceil(size / 1024),)](buf, size, BLOCK=1024)
        _COUNTERS[key] = buf
    return buf


# ---------------------------------------------------------------------------------
# Host side, part 4: planning each kernel's launches
# ---------------------------------------------------------------------------------

# The split length an unsplit launch is given: longer than any context, and the same from step to
# step, so that the launch's arguments (and its compiled kernel) stay the same as contexts grow.
_WHOLE_CONTEXT = 1 << 30
_DECODE_KNOBS = ("block_n", "num_warps", "num_stages", "programs_per_sm", "heads_per_program", "merge_in_launch",
                 "latency_kernel", "merge_slice", "pdl")


def _common_args(g: LayerGeometry, block_tables, seq_lens_kv) -> dict:
    """Arguments every attention kernel takes alike (the per-layer tensors are bound per call)."""
    cs = g.cache_strides
    return {"block_tables_ptr": block_tables, "seq_lens_ptr": seq_lens_kv, "window": g.window,
            "stride_qt": g.query_strides[0], "stride_qh": g.query_strides[1],
            "stride_ot": g.num_heads * g.head_dim, "stride_oh": g.head_dim,
            "stride_c_blk": cs[0], "stride_c_tok": cs[1], "stride_c_head": cs[2], "stride_bt": block_tables.stride()[0],
            "HEAD_DIM": g.head_dim, "BLOCK_SIZE": g.block_size, "USE_WINDOW": bool(g.window),
            "USE_SINKS": g.sinks is not None, "DOT_PRECISION": g.dot_precision}


def _decode_launches(g: LayerGeometry, block_tables, seq_lens_kv, cu_seqlens_q, like, *, num_rows: int,
                     max_query_len: int, max_seq_len: int, num_splits=None, **knobs) -> list[Launch]:
    """The decode launches for rows ``[0, num_rows)`` (see ``decode_attention``)."""
    unknown = set(knobs) - set(_DECODE_KNOBS)
    if unknown:
        raise TypeError(f"unknown decode knobs {sorted(unknown)}")
    group = g.group
    max_q = int(max_query_len) if cu_seqlens_q is not None else 1
    if max_q < 1 or max_q * group > MAX_DECODE_ROWS:
        raise ValueError(f"max_query_len {max_query_len} x group {group} must lie in [1, {MAX_DECODE_ROWS}]")
    contiguous_heads = g.cache_strides[2] == g.head_dim
    max_span = max(int(max_seq_len), 1)
    if g.window:
        max_span = min(max_span, g.window + max_q - 1)
    latency = knobs.get("latency_kernel")
    cfg = decode_config(g.head_dim, group, g.num_kv_heads, g.elem_bytes, max_q, contiguous_heads, num_rows,
                        max_span, _num_sms(), latency_path=latency is not False)
    if latency and not cfg.latency_kernel:  # forced: the latency path's own table row
        cfg = LATENCY_CONFIG
    cfg = cfg._replace(**{k: type(getattr(cfg, k))(v) for k, v in knobs.items() if v is not None})
    pdl = cfg.pdl if _pdl_supported() else 0
    if cfg.latency_kernel:
        if max_q > 1 or cfg.heads_per_program != 1:
            raise ValueError("the latency kernel takes single-token rows (no cu_seqlens_q) and heads_per_program 1")
        return _latency_launches(g, block_tables, seq_lens_kv, like, cfg, num_rows, num_splits, max_span, pdl)
    heads = cfg.heads_per_program
    if g.num_kv_heads % heads or (heads > 1 and not contiguous_heads) or max_q * group * heads > MAX_DECODE_ROWS:
        raise ValueError(f"heads_per_program {heads} must divide num_kv_heads {g.num_kv_heads}, with the "
                         "kv heads of a token contiguous and at most MAX_DECODE_ROWS tile rows")
    head_groups = g.num_kv_heads // heads
    num_splits, split_len = _splits(num_splits, num_rows, head_groups, max_span, cfg)
    kernel_split_len = split_len if num_splits > 1 else _WHOLE_CONTEXT
    block_d = _next_pow2(heads * g.head_dim)
    merge_rows = _next_pow2(max_q * group * heads)
    split = num_splits > 1
    merge_here = split and cfg.merge_in_launch
    pdl = pdl if split and not merge_here else 0
    rows_here = merge_rows if cfg.merge_slice <= 0 else min(merge_rows, _next_pow2(cfg.merge_slice))
    if split:
        parts = num_rows * head_groups * num_splits * merge_rows
        part_o = like.new_empty((parts, block_d), dtype=_framework_dtype(like, "float32"))
        part_lse = like.new_empty((parts,), dtype=_framework_dtype(like, "float32"))
        counters = _split_counters(like, num_rows * head_groups) if merge_here else part_lse
    else:
        part_o = part_lse = counters = seq_lens_kv  # not read by the kernel
    cu = cu_seqlens_q if cu_seqlens_q is not None else seq_lens_kv
    config = cfg._asdict() | {"num_splits": num_splits, "split_len": split_len, "pdl": pdl}
    common = _common_args(g, block_tables, seq_lens_kv)
    shared = {"GROUP": group, "HEADS": heads, "MAX_Q": max_q, "BLOCK_D": block_d, "MERGE_ROWS": merge_rows,
              "SPLITS_POW2": _next_pow2(num_splits), "part_o_ptr": part_o, "part_lse_ptr": part_lse,
              "cu_seqlens_q_ptr": cu, "num_splits": num_splits}
    launches = [Launch("decode", _decode_kernel, (num_rows, head_groups, num_splits), common | shared | {
        "counter_ptr": counters, "split_len": kernel_split_len, "BLOCK_M": max(16, _next_pow2(max_q * group * heads)),
        "BLOCK_N": cfg.block_n, "SPLIT": split, "MERGE_HERE": merge_here,
        "SPLIT_CHUNK": _split_chunk(num_splits, merge_rows, block_d), "PDL": pdl,
    }, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, _LAYER_TENSORS, config)]
    if split and not merge_here:
        merge_args = {k: common[k] for k in ("stride_ot", "stride_oh", "HEAD_DIM", "USE_SINKS")} | shared
        launches.append(Launch("merge", _decode_merge_kernel, (num_rows, head_groups, merge_rows // rows_here),
                               merge_args | {"ROWS_HERE": rows_here, "PDL": pdl,
                                             "SPLIT_CHUNK": _split_chunk(num_splits, rows_here, block_d)},
                               {"num_warps": 4, "launch_pdl": bool(pdl)}, _LAYER_TENSORS))
    return launches


def _latency_launches(g: LayerGeometry, block_tables, seq_lens_kv, like, cfg: DecodeConfig, num_rows: int,
                      num_splits, max_span: int, pdl: int) -> list[Launch]:
    """The latency path: ``_decode_latency_kernel`` over (row, kv head, split), then
    ``_decode_reduce_kernel`` over (row, head) when the contexts are split."""
    num_splits, split_len = _splits(num_splits, num_rows, g.num_kv_heads, max_span, cfg)
    direct = num_splits == 1
    pdl = bool(pdl) and not direct
    if direct:
        part_o = part_lse = seq_lens_kv  # not read by the kernel
    else:
        f32 = _framework_dtype(like, "float32")
        part_o = like.new_empty((num_rows, g.num_heads, num_splits, g.head_dim), dtype=f32)
        part_lse = like.new_empty((num_rows, g.num_heads, num_splits), dtype=f32)
    common = _common_args(g, block_tables, seq_lens_kv)
    shared = {"part_o_ptr": part_o, "part_lse_ptr": part_lse, "num_splits": num_splits, "NUM_HEADS": g.num_heads,
              "BLOCK_D": _next_pow2(g.head_dim), "PDL": pdl}
    config = cfg._asdict() | {"num_splits": num_splits, "split_len": split_len, "pdl": int(pdl)}
    launches = [Launch("decode", _decode_latency_kernel, (num_rows, g.num_kv_heads, num_splits), common | shared | {
        "split_len": split_len if num_splits > 1 else _WHOLE_CONTEXT, "GROUP": g.group,
        "BLOCK_G": max(16, _next_pow2(g.group)), "BLOCK_N": cfg.block_n,
        "DIRECT": direct,
    }, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, _LAYER_TENSORS, config)]
    if not direct:
        reduce_args = {k: common[k] for k in ("stride_ot", "stride_oh", "HEAD_DIM", "USE_SINKS")} | shared
        launches.append(Launch("merge", _decode_reduce_kernel, (num_rows, g.num_heads), reduce_args | {
            "BLOCK_S": max(2, _next_pow2(num_splits))}, {"num_warps": 4, "launch_pdl": pdl}, _LAYER_TENSORS))
    return launches


def _prefill_launch(g: LayerGeometry, block_tables, seq_lens_kv, cu_seqlens_q, *, first_row: int, num_rows: int,
                    max_query_len: int, block_m=None, block_n=None, num_warps=None, num_stages=None,
                    page_tiles=None, warp_specialize=None) -> Launch:
    """The prefill launch for rows ``[first_row, first_row + num_rows)`` (see ``prefill_attention``)."""
    group = g.group
    forced = (block_m, block_n, num_warps, num_stages, page_tiles, warp_specialize)
    big_tiles = num_rows * g.num_kv_heads * math.ceil(max_query_len * group / 128)
    cfg = prefill_config(g.head_dim, group, g.elem_bytes, big_tiles, int(max_query_len), _num_sms(), g.block_size)
    cfg = PrefillConfig(*(c if v is None else type(c)(v) for c, v in zip(cfg, forced)))
    bm = max(cfg.block_m, _next_pow2(group))
    grid = (math.ceil(int(max_query_len) / (bm // group)), g.num_kv_heads, int(num_rows))
    page_tiles = cfg.page_tiles and g.block_size % cfg.block_n == 0 and not g.window
    portable = Launch("prefill", _prefill_kernel, grid, _common_args(g, block_tables, seq_lens_kv) | {
        "cu_seqlens_q_ptr": cu_seqlens_q, "first_row": int(first_row), "GROUP": group,
        "BLOCK_D": _next_pow2(g.head_dim), "BLOCK_M": bm, "BLOCK_N": cfg.block_n, "PAGE_TILES": page_tiles,
        "WARP_SPECIALIZE": cfg.warp_specialize,
    }, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}, _LAYER_TENSORS,
        cfg._asdict() | {"block_m": bm, "page_tiles": page_tiles})
    if all(v is None for v in forced) and _gluon_prefill_usable(g):
        return _gluon_prefill_launch(g, block_tables, seq_lens_kv, cu_seqlens_q, first_row=first_row,
                                     num_rows=num_rows, max_query_len=max_query_len, fallback=portable)
    return portable


GLUON_DEFAULT = "1"


@functools.cache
def _cuda_capability() -> tuple[int, int] | None:
    """(major, minor) of the current CUDA GPU; None under the interpreter or without one."""
    if _interpreting():
        return None
    try:
        target = triton.runtime.driver.active.get_current_target()
        return (int(target.arch) // 10, int(target.arch) % 10) if target.backend == "cuda" else None
    except Exception:  # noqa: BLE001 - no GPU driver: the portable kernel
        return None


def _gluon_prefill_usable(g: LayerGeometry) -> bool:
    """The Hopper Gluon kernel (gluon_ws_prefill.py) for this layer: sm_90, causal, no window or
    sinks, 16-bit, head_dim 64/128/256, unless ``FLEETLAB_GLUON_PREFILL=0`` (then the portable
    kernel; GLUON_DEFAULT: the setting without the variable)."""
    if os.environ.get("FLEETLAB_GLUON_PREFILL", GLUON_DEFAULT) in ("", "0") or _cuda_capability() != (9, 0):
        return False
    from fleetlab.attention import gluon_ws_prefill  # imports Gluon: GPU only

    return gluon_ws_prefill.gluon_ws_prefill_supported(g.head_dim, g.group, g.elem_bytes, g.window, g.sinks, (9, 0))


def _gluon_prefill_launch(g: LayerGeometry, block_tables, seq_lens_kv, cu_seqlens_q, *, first_row: int,
                          num_rows: int, max_query_len: int, fallback: Launch) -> Launch:
    """The warp-specialised Gluon prefill launch; ``fallback`` (the portable kernel's) runs tensors
    off a 16-byte boundary, which its 16-byte asynchronous copies cannot read."""
    from fleetlab.attention import gluon_ws_prefill as gp

    kernel, knobs = gp._gluon_ws_prefill_kernel, dict(gp.kernel_config(g.head_dim, int(max_query_len)))
    num_q_tiles = math.ceil(int(max_query_len) / (gp.BLOCK_M.value // g.group))
    num_items = num_q_tiles * g.num_kv_heads * int(num_rows)
    # persistent: one CTA per multiprocessor walks its share of the items; else one CTA per item
    grid = (min(num_items, _num_sms()) if knobs.pop("persistent") else num_items,)
    args = _common_args(g, block_tables, seq_lens_kv) | {
        "cu_seqlens_q_ptr": cu_seqlens_q, "first_row": int(first_row), "GROUP": g.group, "num_items": num_items,
        "num_kv_heads": g.num_kv_heads, "num_q_tiles": num_q_tiles} | knobs
    args = {k: v for k, v in args.items() if k in kernel.arg_names}
    options = {"num_warps": gp.NUM_WARPS.value, "maxnreg": gp.MAXNREG}
    config = {"kernel": "gluon_ws", "block_m": gp.BLOCK_M.value, "grid": grid[0], **knobs, **options}
    return Launch("prefill", kernel, grid, args, options, _LAYER_TENSORS, config, fallback)


def _store_launch(g: LayerGeometry, slot_mapping, num_tokens: int) -> Launch:
    """``_store_kv_kernel`` for ``num_tokens`` contiguous ``[T, num_kv_heads, head_dim]`` K/V rows."""
    if g.cache_strides[0] != g.block_size * g.cache_strides[1]:
        raise ValueError("store_kv needs the blocks of the cache laid out back to back (slot = block*bs + p)")
    row = g.num_kv_heads * g.head_dim
    return Launch("store_kv", _store_kv_kernel, (num_tokens,), {
        "slot_ptr": slot_mapping, "stride_kt": row, "stride_kh": g.head_dim, "stride_vt": row,
        "stride_vh": g.head_dim, "stride_c_slot": g.cache_strides[1], "stride_c_head": g.cache_strides[2],
        "NUM_KV_HEADS": g.num_kv_heads, "HEAD_DIM": g.head_dim, "BLOCK_H": _next_pow2(g.num_kv_heads),
        "BLOCK_D": _next_pow2(g.head_dim)}, {}, _STORE_TENSORS)


def plan_attention(batch: PagedBatch, geometry: LayerGeometry, like=None) -> AttentionPlan:
    """The plan of a whole decode-first packed batch for one layer geometry: the decode
    kernel on rows ``[0, num_decodes)`` (the prefill kernel when their tokens x heads
    pass ``MAX_DECODE_ROWS``), the prefill kernel on the rest, ``store_kv`` when the batch
    has a ``slot_mapping``. ``like``: a device tensor for the scratch buffers (default
    ``batch.seq_lens_kv``)."""
    like = batch.seq_lens_kv if like is None else like
    b, g, nd = batch, geometry, batch.num_decodes
    launches = []
    if nd and b.max_decode_query_len * g.group > MAX_DECODE_ROWS:
        launches.append(_prefill_launch(g, b.block_tables, b.seq_lens_kv, b.cu_seqlens_q, first_row=0,
                                        num_rows=nd, max_query_len=b.max_decode_query_len))
    elif nd:
        multi = b.num_decode_tokens > nd
        launches += _decode_launches(g, b.block_tables, b.seq_lens_kv, b.cu_seqlens_q if multi else None, like,
                                     num_rows=nd, max_query_len=b.max_decode_query_len if multi else 1,
                                     max_seq_len=b.max_decode_seq_len)
    if b.num_reqs > nd and b.max_prefill_query_len > 0:
        launches.append(_prefill_launch(g, b.block_tables, b.seq_lens_kv, b.cu_seqlens_q, first_row=nd,
                                        num_rows=b.num_reqs - nd, max_query_len=b.max_prefill_query_len))
    store = None
    if b.slot_mapping is not None and b.num_tokens:
        store = _store_launch(g, b.slot_mapping, b.num_tokens)
    return AttentionPlan(g, b.num_tokens, tuple(launches), store)


def plan_decode(geometry: LayerGeometry, block_tables, seq_lens_kv, *, num_tokens: int, max_seq_len: int,
                num_rows: int | None = None, cu_seqlens_q=None, max_query_len: int = 1, like=None,
                num_splits: int | None = None, **knobs) -> AttentionPlan:
    """A plan of decode rows alone (see ``decode_attention`` for the arguments and knobs)."""
    num_rows = num_tokens if num_rows is None else int(num_rows)
    launches = []
    if num_rows > 0:
        launches = _decode_launches(geometry, block_tables, seq_lens_kv, cu_seqlens_q,
                                    seq_lens_kv if like is None else like, num_rows=num_rows,
                                    max_query_len=max_query_len, max_seq_len=max_seq_len, num_splits=num_splits,
                                    **knobs)
    return AttentionPlan(geometry, int(num_tokens), tuple(launches))


def plan_prefill(geometry: LayerGeometry, block_tables, seq_lens_kv, cu_seqlens_q, *, num_tokens: int,
                 first_row: int, num_rows: int, max_query_len: int, **knobs) -> AttentionPlan:
    """A plan of prefill rows alone (see ``prefill_attention`` for the arguments and knobs)."""
    launches = ()
    if num_rows > 0 and max_query_len > 0:
        launches = (_prefill_launch(geometry, block_tables, seq_lens_kv, cu_seqlens_q, first_row=first_row,
                                    num_rows=num_rows, max_query_len=max_query_len, **knobs),)
    return AttentionPlan(geometry, int(num_tokens), launches)


# ---------------------------------------------------------------------------------
# Host side, part 5: one-call entry points (plan, then run once)
# ---------------------------------------------------------------------------------


def store_kv(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the paged caches.

    Token ``t`` goes to slot ``slot_mapping[t]`` (int64 ``[T]``), i.e. block
    ``slot // block_size``, offset ``slot % block_size``; slot -1 is skipped.
    """
    g = LayerGeometry.of(key, key_cache, value_cache)
    num_tokens = _shape(slot_mapping)[0]
    for name, t in (("key", key), ("value", value)):
        if _shape(t) != (num_tokens, g.num_kv_heads, g.head_dim):
            raise ValueError(f"{name} must be [{num_tokens}, {g.num_kv_heads}, {g.head_dim}]; got {_shape(t)}")
        if tuple(t.stride()) != (g.num_kv_heads * g.head_dim, g.head_dim, 1):
            raise ValueError(f"{name} must be contiguous")
    if num_tokens:
        _launch_all((_store_launch(g, slot_mapping, num_tokens),), (key, value, key_cache, value_cache))


def decode_attention(
    query, key_cache, value_cache, block_tables, seq_lens_kv, *,
    max_seq_len: int, scale: float, sliding_window: int | None = None, sinks=None, out=None,
    num_rows: int | None = None, num_splits: int | None = None,
    cu_seqlens_q=None, max_query_len: int = 1, **knobs,
):
    """Decode attention over block tables: 1..R query tokens per row, GQA, split-K.

    Args:
      query: ``[T, num_heads, head_dim]``. Without ``cu_seqlens_q`` token ``i < B`` is
        row ``i``'s single query (the leading rows of a decode-first packed batch); with
        it, row ``i`` owns tokens ``[cu_seqlens_q[i], cu_seqlens_q[i+1])`` (a speculative
        verification row: ``k + 1`` tokens), the last at position ``seq_lens_kv[i] - 1``,
        causal among themselves. Each row's K/V is read once for all its tokens.
        ``block_tables [>=B, max_blocks]`` int32 and ``seq_lens_kv [>=B]`` int32 describe
        the rows' contexts.
      num_rows: ``B``, the number of decode rows (default ``T``); other tokens are
        neither read nor written, so a packed batch needs no slicing.
      max_seq_len: a host upper bound on ``seq_lens_kv[:B]`` (plans the splits, no sync).
      max_query_len: a host upper bound on the rows' query lengths (``cu_seqlens_q`` given);
        ``max_query_len * group`` may not pass ``MAX_DECODE_ROWS``.
      num_splits: force this many context splits (default: ``plan_decode_splits``).
      knobs: ``block_n``, ``num_warps``, ``num_stages``, ``programs_per_sm``,
        ``heads_per_program``, ``merge_in_launch``, ``latency_kernel``, ``merge_slice``
        (default: ``decode_config``). The latency kernel takes single-token rows only (no
        ``cu_seqlens_q``), one kv head per program, and always merges in a second launch.
        ``pdl``: launch a second-launch merge as a programmatic dependent of the split
        kernel: 0 off, 1 let in at the split kernel's start, 2 once its K/V are read
        (default: ``decode_config``'s choice where the GPU has it, Hopper; never under the
        interpreter). The latency path takes 0 or 1.
    Returns ``out [T, num_heads, head_dim]`` (the rows' tokens written; in place when given).
    """
    g = LayerGeometry.of(query, key_cache, value_cache, sliding_window, sinks)
    plan = plan_decode(g, block_tables, seq_lens_kv, num_tokens=_shape(query)[0], max_seq_len=max_seq_len,
                       num_rows=num_rows, cu_seqlens_q=cu_seqlens_q, max_query_len=max_query_len, like=query,
                       num_splits=num_splits, **knobs)
    return plan.run(query, key_cache, value_cache, scale=scale, sinks=sinks, out=out)


def prefill_attention(
    query, key_cache, value_cache, block_tables, seq_lens_kv, cu_seqlens_q, *,
    first_row: int, num_rows: int, max_query_len: int, scale: float,
    sliding_window: int | None = None, sinks=None, out=None, **knobs,
):
    """Attention of packed prefill chunks over the paged cache (causal in the chunk).

    Rows ``[first_row, first_row + num_rows)`` of the packed batch are computed: row
    ``i``'s queries are tokens ``[cu_seqlens_q[i], cu_seqlens_q[i+1])`` of ``query
    [T, num_heads, head_dim]``, at positions ``seq_lens_kv[i] - q_len + j``; their K/V
    are already in the cache. ``max_query_len`` (host int) bounds the rows' query
    lengths. Other tokens of ``out`` are left untouched. Returns ``out [T, H, D]``.
    knobs: ``block_m``, ``block_n``, ``num_warps``, ``num_stages``, ``page_tiles``,
    ``warp_specialize`` (default: ``prefill_config``).
    """
    g = LayerGeometry.of(query, key_cache, value_cache, sliding_window, sinks)
    plan = plan_prefill(g, block_tables, seq_lens_kv, cu_seqlens_q, num_tokens=_shape(query)[0],
                        first_row=first_row, num_rows=num_rows, max_query_len=max_query_len, **knobs)
    return plan.run(query, key_cache, value_cache, scale=scale, sinks=sinks, out=out)


def paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens_kv, cu_seqlens_q, *,
    num_decodes: int, max_query_len: int, max_decode_seq_len: int, scale: float,
    sliding_window: int | None = None, sinks=None, out=None,
    num_decode_tokens: int | None = None, max_decode_query_len: int | None = None,
):
    """A whole decode-first packed batch in one call (``plan_attention``, then ``run``):
    decode kernel for rows ``[0, num_decodes)``, prefill kernel for the rest.
    ``query``/``out`` ``[T, num_heads, head_dim]``.

    Host ints: ``max_query_len`` bounds the prefill rows' query lengths and
    ``max_decode_seq_len`` the decode rows' context lengths. ``num_decode_tokens``
    (default ``num_decodes``) counts the decode rows' tokens: more than one per row
    means multi-token decode rows (speculative verification), whose query lengths
    ``max_decode_query_len`` bounds (default: the largest any split of the tokens allows).
    """
    num_decode_tokens = num_decodes if num_decode_tokens is None else int(num_decode_tokens)
    if max_decode_query_len is None:
        max_decode_query_len = num_decode_tokens - num_decodes + 1 if num_decodes else 0
    g = LayerGeometry.of(query, key_cache, value_cache, sliding_window, sinks)
    batch = PagedBatch(block_tables, seq_lens_kv, cu_seqlens_q, None, block_size=g.block_size,
                       num_reqs=_shape(seq_lens_kv)[0], num_tokens=_shape(query)[0], num_decodes=num_decodes,
                       num_decode_tokens=num_decode_tokens, max_decode_query_len=max_decode_query_len,
                       max_decode_seq_len=max_decode_seq_len, max_prefill_query_len=max_query_len)
    return plan_attention(batch, g, like=query).run(query, key_cache, value_cache, scale=scale, sinks=sinks, out=out)
