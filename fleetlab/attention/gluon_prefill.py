"""Hopper (sm_90) paged prefill written with Triton's Gluon layer: wgmma from shared memory.

What it is for: causal prefill without sliding window or sinks on an H100/H200, where the
portable ``_prefill_kernel`` (triton_kernels.py) runs short of registers. The plan
(``triton_kernels._prefill_launch``) picks it through ``gluon_prefill_supported``; every other
case, the CPU interpreter and other GPUs keep the portable kernel. Import this module only
on a GPU: it needs ``triton.experimental.gluon``.

One program per (query tile, kv head, row), as in the portable kernel: the tile's
``BLOCK_M`` rows are (query token, head of the kv group) pairs. Q sits in shared memory;
each K/V tile of ``BLOCK_N`` tokens is copied in asynchronously (``cp.async``), one page
look-up per token through the block table, into one of two buffers, so the copy of tile
``j + 1`` runs under the two wgmma (``S = Q K^T``, ``O += P V``) and the online softmax of
tile ``j``. ``P`` feeds the second wgmma from registers. The causal mask is applied only on
the tiles that cross the diagonal. No warp specialisation: all warps load and compute.

Shapes: ``query [tokens, heads, head_dim]``, caches ``[blocks, block_size, kv_heads,
head_dim]`` (any strides with a contiguous head_dim), ``out [tokens, heads, head_dim]``.
"""
from __future__ import annotations

import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

BLOCK_M = 128
NUM_WARPS = 8  # two warpgroups of 64 rows each


def kernel_config(head_dim: int, overlap: bool | None = None) -> dict:
    """K/V tokens per tile (the buffers of K and V plus Q fit 227 KiB of shared memory) and
    whether the FA3-style pipelined loop (three buffers) is used (default: the plain loop;
    ``FLEETLAB_GLUON_OVERLAP=1`` the pipelined one)."""
    if overlap is None:
        overlap = os.environ.get("FLEETLAB_GLUON_OVERLAP", "0") not in ("", "0")
    if overlap:
        return {"BLOCK_N": {64: 128, 128: 64}.get(head_dim, 32), "OVERLAP": True}
    return {"BLOCK_N": 64 if head_dim > 128 else 128, "OVERLAP": False}


def gluon_prefill_supported(head_dim: int, elem_bytes: int, window, sinks, capability) -> bool:
    """Whether the plan may use this kernel: sm_90, 16-bit, head_dim 64/128/256, causal only."""
    return capability == (9, 0) and elem_bytes == 2 and head_dim in (64, 128, 256) and not window and sinks is None


@gluon.constexpr_function
def _load_layout(head_dim, num_warps):
    """Blocked layout of a [rows, head_dim] tile: 16-byte vectors along head_dim."""
    lanes_d = min(32, head_dim // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes_d, lanes_d], [num_warps, 1], [1, 0])


@gluon.jit
def _issue_kv_copy(k_buf, v_buf, key_cache_ptr, value_cache_ptr, block_tables_ptr, row_table, kv_head, n0, hi,
                   stride_c_blk, stride_c_tok, stride_c_head,
                   HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, LD: gl.constexpr):
    """Start the asynchronous copy of K/V tokens ``[n0, n0 + BLOCK_N)`` (zeros past ``hi``)."""
    n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    n_mask = n < hi
    blk = gl.load(block_tables_ptr + row_table + n // BLOCK_SIZE, mask=n_mask, other=0).to(gl.int64)
    offs = blk * stride_c_blk + (n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head
    ptrs = offs[:, None] + d[None, :]
    mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
    async_copy.async_copy_global_to_shared(k_buf, key_cache_ptr + ptrs, mask=mask)
    async_copy.async_copy_global_to_shared(v_buf, value_cache_ptr + ptrs, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _softmax_tile(s, m, l_sum, q_pos, j, full_tiles, scale_log2, BLOCK_N: gl.constexpr, S_L: gl.constexpr):
    """Online softmax of tile ``j``'s scores: (p, new max, new sum, rescale of the old sums)."""
    s = s * scale_log2
    if j >= full_tiles:  # the causal diagonal
        n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        s = gl.where(n[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = gl.maximum(m, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m - m_new)
    return p, m_new, l_sum * alpha + gl.sum(p, 1), alpha


@gluon.jit
def _overlapped_loop(q_smem, k_bufs, v_bufs, key_cache_ptr, value_cache_ptr, block_tables_ptr, row_table, kv_head,
                     hi, num_tiles, full_tiles, q_pos, scale_log2, stride_c_blk, stride_c_tok, stride_c_head,
                     HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     LD: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr, P_L: gl.constexpr):
    """FlashAttention-3's in-warpgroup pipelining over three K/V buffers: ``S_j = Q K_j^T``
    is issued before ``O += P_{j-1} V_{j-1}``, so the softmax of tile ``j`` runs while the
    tensor cores do the second product of tile ``j - 1``. Returns (acc, row sums)."""
    dtype: gl.constexpr = q_smem.dtype
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
    m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_sum = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_L))
    for t in gl.static_range(2):
        _issue_kv_copy(k_bufs.index(t), v_bufs.index(t), key_cache_ptr, value_cache_ptr, block_tables_ptr,
                       row_table, kv_head, t * BLOCK_N, hi, stride_c_blk, stride_c_tok, stride_c_head,
                       HEAD_DIM, BLOCK_SIZE, BLOCK_N, LD)
    async_copy.wait_group(1)
    gl.thread_barrier()
    fence_async_shared()
    k = k_bufs.index(0)
    s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_smem, k))
    p, m, l_sum, alpha = _softmax_tile(s, m, l_sum, q_pos, 0, full_tiles, scale_log2, BLOCK_N, S_L)
    p_prev = gl.convert_layout(p.to(dtype), P_L)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=O_L)
    for j in range(1, num_tiles):
        gl.thread_barrier()  # every warpgroup is done with tile j - 2's buffers
        _issue_kv_copy(k_bufs.index((j + 1) % 3), v_bufs.index((j + 1) % 3), key_cache_ptr, value_cache_ptr,
                       block_tables_ptr, row_table, kv_head, (j + 1) * BLOCK_N, hi, stride_c_blk, stride_c_tok,
                       stride_c_head, HEAD_DIM, BLOCK_SIZE, BLOCK_N, LD)
        async_copy.wait_group(1)
        gl.thread_barrier()
        fence_async_shared()
        k = k_bufs.index(j % 3)
        v_prev = v_bufs.index((j - 1) % 3)
        s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
        s, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(s, q_smem, k))
        p, m, l_sum, alpha = _softmax_tile(s, m, l_sum, q_pos, j, full_tiles, scale_log2, BLOCK_N, S_L)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_prev))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        p_prev = gl.convert_layout(p.to(dtype), P_L)
    v_last = v_bufs.index((num_tiles - 1) % 3)
    acc = warpgroup_mma(p_prev, v_last, acc, is_async=True)
    acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v_last))
    async_copy.wait_group(0)
    return acc, l_sum


@gluon.jit
def _gluon_prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
    scale_log2, first_row,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, OVERLAP: gl.constexpr,
):
    """Program (query tile, kv_head, row); the last query tiles (most keys) launch first."""
    NW: gl.constexpr = gl.num_warps()
    TOKENS: gl.constexpr = BLOCK_M // GROUP
    LD: gl.constexpr = _load_layout(HEAD_DIM, NW)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    tile = gl.num_programs(0) - 1 - gl.program_id(0)
    kv_head = gl.program_id(1)
    row = gl.program_id(2) + first_row
    q_start = gl.load(cu_seqlens_q_ptr + row)
    q_len = gl.load(cu_seqlens_q_ptr + row + 1) - q_start
    t0 = tile * TOKENS
    if t0 < q_len:
        context = gl.load(seq_lens_ptr + row) - q_len
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        # Q -> shared memory (the A operand of S = Q K^T)
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LD))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
        tok = t0 + offs_m // GROUP
        heads = kv_head * GROUP + offs_m % GROUP
        m_valid = (offs_m < TOKENS * GROUP) & (tok < q_len)
        q_rows = (q_start + tok).to(gl.int64)
        io_mask = m_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
        q = gl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=io_mask, other=0.0)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], SMEM, q)
        BUFS: gl.constexpr = 3 if OVERLAP else 2
        k_bufs = gl.allocate_shared_memory(dtype, [BUFS, BLOCK_N, HEAD_DIM], SMEM)
        v_bufs = gl.allocate_shared_memory(dtype, [BUFS, BLOCK_N, HEAD_DIM], SMEM)

        first = context + t0
        hi = context + gl.minimum(t0 + TOKENS, q_len)  # one past the tile's last query position
        num_tiles = gl.cdiv(hi, BLOCK_N)
        full_tiles = (first + 1) // BLOCK_N  # tiles every query of the tile sees whole
        row_table = row.to(gl.int64) * stride_bt
        q_pos = context + t0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L)) // GROUP

        if OVERLAP:
            acc, l_sum = _overlapped_loop(q_smem, k_bufs, v_bufs, key_cache_ptr, value_cache_ptr, block_tables_ptr,
                                          row_table, kv_head, hi, num_tiles, full_tiles, q_pos, scale_log2,
                                          stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM, BLOCK_SIZE, BLOCK_M,
                                          BLOCK_N, LD, S_L, O_L, P_L)
        else:
            m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
            l_sum = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, S_L))
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=O_L)
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=S_L)
            _issue_kv_copy(k_bufs.index(0), v_bufs.index(0), key_cache_ptr, value_cache_ptr, block_tables_ptr,
                           row_table, kv_head, 0, hi, stride_c_blk, stride_c_tok, stride_c_head,
                           HEAD_DIM, BLOCK_SIZE, BLOCK_N, LD)
            for j in range(num_tiles):
                nxt = (j + 1) % 2
                # the copy of the next tile (zeros past the last) runs under this tile's work
                _issue_kv_copy(k_bufs.index(nxt), v_bufs.index(nxt), key_cache_ptr, value_cache_ptr, block_tables_ptr,
                               row_table, kv_head, (j + 1) * BLOCK_N, hi, stride_c_blk, stride_c_tok, stride_c_head,
                               HEAD_DIM, BLOCK_SIZE, BLOCK_N, LD)
                async_copy.wait_group(1)
                gl.thread_barrier()  # every thread's part of tile j has landed
                fence_async_shared()  # ... and is visible to wgmma's (async proxy) reads
                k = k_bufs.index(j % 2)
                v = v_bufs.index(j % 2)
                s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(s, q_smem, k))
                p, m, l_sum, alpha = _softmax_tile(s, m, l_sum, q_pos, j, full_tiles, scale_log2, BLOCK_N, S_L)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dtype), P_L), v, acc, is_async=True)
                acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, v))
                gl.thread_barrier()  # no warp refills this buffer while another still reads it
            async_copy.wait_group(0)
        o = acc / gl.convert_layout(l_sum, gl.SliceLayout(1, O_L))[:, None]
        o = gl.convert_layout(o.to(dtype), LD)
        gl.store(out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :], o,
                 mask=io_mask)
