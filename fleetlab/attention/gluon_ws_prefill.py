"""Hopper (sm_90) paged prefill, warp-specialised in the style of FlashAttention-3 (Gluon).

What it is for: causal prefill without sliding window or sinks on an H100/H200, the plan's
choice there (``triton_kernels._prefill_launch``); every other case keeps the portable Triton
kernel. Import this module only on a GPU build of Triton: it needs ``triton.experimental.gluon``.

One program (CTA) per (query tile of ``2 x 64`` rows, kv head, batch row); a row of a tile is a
(query token, head of the kv group) pair, as in the portable kernel. Three partitions share
the CTA, talking only through shared memory and mbarriers:

- **the producer** (one warpgroup) copies each K/V tile of ``BLOCK_N`` tokens through the block
  table (one page look-up per token, ``cp.async``, zeros past the last key) into a ring of
  ``STAGES`` buffers; ``ready[s]`` completes when every producer thread's copies have landed.
- **two consumers** (a warpgroup each, 64 rows each) wait on ``ready[s]``, run ``S = Q K^T``
  and ``O += P V`` on the tensor cores (wgmma, Q and K/V from shared memory, P from registers)
  and arrive on ``empty[s]`` once both products have read the buffer. Within a consumer the
  product ``S_j`` is issued before ``O += P_{j-1} V_{j-1}``, so tile ``j``'s softmax runs while
  the tensor cores finish tile ``j - 1``; the two consumers drift apart on their own, one's
  softmax beside the other's products.

The producer never computes and the consumers never load, so the consumers get the registers
(``setmaxnreg``: 240 each, the producer the rest). Shapes: ``query [tokens, heads, head_dim]``,
caches ``[blocks, block_size, kv_heads, head_dim]`` (contiguous head_dim), ``out`` like ``query``.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

WG_ROWS = gl.constexpr(64)  # rows of a consumer warpgroup (one wgmma M)
BLOCK_M = gl.constexpr(2 * 64)
NUM_WARPS = gl.constexpr(4)  # the default partition: consumer 0; consumer 1 and the producer are workers
PRODUCER_WARPS = gl.constexpr(4)
CONSUMER_REGS = gl.constexpr(224)  # consumer 1 (consumer 0 gets what the producer leaves)
PRODUCER_REGS = gl.constexpr(56)
FIRST, SECOND = gl.constexpr(0), gl.constexpr(1)  # the consumers' warpgroup index
MAXNREG = 168  # 12 warps x 32 x 168 fits the 64 Ki registers before setmaxnreg moves them


def kernel_config(head_dim: int) -> dict:
    """K/V tokens per tile and ring depth: Q (2 x 64 rows) plus ``STAGES`` K and V tiles fit
    the 227 KiB of shared memory."""
    return {64: {"BLOCK_N": 128, "STAGES": 4}, 128: {"BLOCK_N": 128, "STAGES": 2},
            256: {"BLOCK_N": 64, "STAGES": 2}}[head_dim]


def gluon_ws_prefill_supported(head_dim: int, group: int, elem_bytes: int, window, sinks, capability) -> bool:
    """Whether the plan may use this kernel: sm_90, 16-bit, head_dim 64/128/256, a kv group that
    fits a tile, causal only (no sliding window, no sinks)."""
    return (capability == (9, 0) and elem_bytes == 2 and head_dim in (64, 128, 256) and group <= 128
            and not window and sinks is None)


@gluon.constexpr_function
def _load_layout(head_dim, num_warps):
    """Blocked layout of a [rows, head_dim] tile: 16-byte vectors along head_dim."""
    lanes_d = min(32, head_dim // 8)
    return gl.BlockedLayout([1, 8], [32 // lanes_d, lanes_d], [num_warps, 1], [1, 0])


@gluon.jit
def _tile_bounds(cu_seqlens_q_ptr, seq_lens_ptr, first_row, TOKENS: gl.constexpr, BLOCK_N: gl.constexpr):
    """(query start, query length, first token of this tile, context length, K/V tiles to read)."""
    tile = gl.num_programs(0) - 1 - gl.program_id(0)  # the last tiles (most keys) launch first
    row = gl.program_id(2) + first_row
    q_start = gl.load(cu_seqlens_q_ptr + row)
    q_len = gl.load(cu_seqlens_q_ptr + row + 1) - q_start
    t0 = tile * TOKENS
    context = gl.load(seq_lens_ptr + row) - q_len
    hi = context + gl.minimum(t0 + TOKENS, q_len)  # one past the tile's last query position
    num_tiles = gl.where(t0 < q_len, gl.cdiv(hi, BLOCK_N), 0)
    return q_start, q_len, t0, context, hi, num_tiles


@gluon.jit
def _producer(k_bufs, v_bufs, ready, empty, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
              cu_seqlens_q_ptr, first_row, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Fill the ring: tile ``j`` into buffer ``j % STAGES`` once both consumers released it."""
    STAGES: gl.constexpr = k_bufs.shape[0]
    LD: gl.constexpr = _load_layout(HEAD_DIM, gl.num_warps())
    _, _, _, _, hi, num_tiles = _tile_bounds(cu_seqlens_q_ptr, seq_lens_ptr, first_row, BLOCK_M // GROUP, BLOCK_N)
    kv_head = gl.program_id(1)
    row_table = (gl.program_id(2) + first_row).to(gl.int64) * stride_bt
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    for j in range(num_tiles):
        s = j % STAGES
        mbarrier.wait(empty.index(s), (j // STAGES & 1) ^ 1)  # a fresh barrier passes phase 1 at once
        n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
        n_mask = n < hi
        blk = gl.load(block_tables_ptr + row_table + n // BLOCK_SIZE, mask=n_mask, other=0).to(gl.int64)
        offs = (blk * stride_c_blk + (n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head)[:, None] + d[None, :]
        mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
        async_copy.async_copy_global_to_shared(k_bufs.index(s), key_cache_ptr + offs, mask=mask)
        async_copy.async_copy_global_to_shared(v_bufs.index(s), value_cache_ptr + offs, mask=mask)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)  # when this thread's copies land


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
def _consumer(q_smem, k_bufs, v_bufs, ready, empty, q_ptr, out_ptr, seq_lens_ptr, cu_seqlens_q_ptr, first_row,
              scale_log2, stride_qt, stride_qh, stride_ot, stride_oh,
              WG: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """Rows ``[WG * 64, WG * 64 + 64)`` of the tile: Q to shared memory, then the K/V ring."""
    STAGES: gl.constexpr = k_bufs.shape[0]
    NW: gl.constexpr = gl.num_warps()
    LD: gl.constexpr = _load_layout(HEAD_DIM, NW)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    TOKENS: gl.constexpr = BLOCK_M // GROUP
    q_start, q_len, t0, context, hi, num_tiles = _tile_bounds(cu_seqlens_q_ptr, seq_lens_ptr, first_row, TOKENS,
                                                              BLOCK_N)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    kv_head = gl.program_id(1)
    # this warpgroup's rows of Q -> shared memory (wgmma's A operand)
    r = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, LD))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    tok = t0 + r // GROUP
    valid = (r < TOKENS * GROUP) & (tok < q_len)
    q_rows = (q_start + tok).to(gl.int64) * stride_qt + (kv_head * GROUP + r % GROUP) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0)
    q_smem.store(q)
    fence_async_shared()  # the generic-proxy store, seen by wgmma's async-proxy reads

    q_pos = context + t0 + (WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, S_L))) // GROUP
    full_tiles = (context + t0 + (WG * WG_ROWS) // GROUP + 1) // BLOCK_N  # tiles all these rows see whole
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=S_L)
    m = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_sum = gl.full([WG_ROWS], 1.0, gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=O_L)
    if num_tiles > 0:
        mbarrier.wait(ready.index(0), 0)
        fence_async_shared()
        k = k_bufs.index(0)
        s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        l_sum = gl.zeros([WG_ROWS], gl.float32, layout=gl.SliceLayout(1, S_L))
        p, m, l_sum, alpha = _softmax_tile(s, m, l_sum, q_pos, 0, full_tiles, scale_log2, BLOCK_N, S_L)
        p_prev = gl.convert_layout(p.to(dtype), P_L)
        for j in range(1, num_tiles):
            st = j % STAGES
            mbarrier.wait(ready.index(st), j // STAGES & 1)
            fence_async_shared()
            k = k_bufs.index(st)
            v_prev = v_bufs.index((j - 1) % STAGES)
            s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            p, m, l_sum, alpha = _softmax_tile(s, m, l_sum, q_pos, j, full_tiles, scale_log2, BLOCK_N, S_L)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)  # K_{j-1} and V_{j-1} are read
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p_prev = gl.convert_layout(p.to(dtype), P_L)
        v_last = v_bufs.index((num_tiles - 1) % STAGES)
        acc = warpgroup_mma(p_prev, v_last, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((num_tiles - 1) % STAGES), count=1)
    o = (acc / gl.convert_layout(l_sum, gl.SliceLayout(1, O_L))[:, None]).to(dtype)
    # stored from the accumulator's own layout: one tile per CTA, no shuffle through shared memory
    r_o = WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, O_L))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
    tok_o = t0 + r_o // GROUP
    valid_o = (r_o < TOKENS * GROUP) & (tok_o < q_len)
    o_rows = (q_start + tok_o).to(gl.int64) * stride_ot + (kv_head * GROUP + r_o % GROUP) * stride_oh
    gl.store(out_ptr + o_rows[:, None] + d_o[None, :], o, mask=valid_o[:, None] & (d_o[None, :] < HEAD_DIM))


@gluon.jit
def _gluon_ws_prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
    scale_log2, first_row,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
):
    """Allocate the shared memory and the barriers, then fork the three partitions."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], SMEM)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], SMEM)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32)  # every producer thread's copies
        mbarrier.init(empty.index(i), count=2)  # both consumers
    gl.warp_specialize([
        (_consumer, (q_smem.index(0), k_bufs, v_bufs, ready, empty, q_ptr, out_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
                     first_row, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, FIRST, GROUP, HEAD_DIM,
                     BLOCK_N)),
        (_consumer, (q_smem.index(1), k_bufs, v_bufs, ready, empty, q_ptr, out_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
                     first_row, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, SECOND, GROUP, HEAD_DIM,
                     BLOCK_N)),
        (_producer, (k_bufs, v_bufs, ready, empty, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
                     cu_seqlens_q_ptr, first_row, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
                     GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_N)),
    ], [NUM_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
