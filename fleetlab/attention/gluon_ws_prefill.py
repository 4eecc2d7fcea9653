"""Hopper (sm_90) paged prefill, warp-specialised in the style of FlashAttention-3 (Gluon).

What it is for: causal prefill without sliding window or sinks on an H100/H200, the plan's
choice there (``triton_kernels._prefill_launch``); every other case keeps the portable Triton
kernel. Import this module only on a GPU build of Triton: it needs ``triton.experimental.gluon``.

Persistent: one CTA per multiprocessor walks the work items (query tile of ``2 x 64`` rows, kv
head, batch row), the tiles with the most keys first; a row of a tile is a (query token, head
of the kv group) pair, as in the portable kernel. Three partitions share the CTA, talking only
through shared memory and mbarriers:

- **the producer** (one warpgroup) copies each item's Q tile into one of ``Q_SLOTS`` buffers and
  its K/V tiles of ``BLOCK_N`` tokens through the block table (one page look-up per token,
  ``cp.async``, zeros past the last key) into a ring of ``STAGES`` buffers; a ``ready`` barrier
  completes when every producer thread's copies have landed. The ring runs on across items, so
  the next item's first tiles load while the consumers finish this one.
- **two consumers** (a warpgroup each, 64 rows each) wait on ``ready``, run ``S = Q K^T`` and
  ``O += P V`` on the tensor cores (wgmma, Q and K/V from shared memory, P from registers) and
  arrive on ``empty`` once both products have read the buffer (on the Q slot's once the item's
  last ``S`` is done). Within a consumer ``S_j`` is issued before ``O += P_{j-1} V_{j-1}``, so
  tile ``j``'s softmax runs while the tensor cores finish tile ``j - 1``; the two consumers
  drift apart on their own, one's softmax beside the other's products.

The producer never computes and the consumers never load, so the consumers get the registers
(``setmaxnreg``: 224 each and 56 for the producer, 232 and 40 at head_dim 256; ``kernel_config``).
Shapes: ``query [tokens, heads, head_dim]``, caches ``[blocks, block_size, kv_heads, head_dim]``
(contiguous head_dim), ``out`` like ``query``; every tensor 16-byte aligned (the plan's launch
falls back to the portable kernel otherwise).
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
FIRST, SECOND = gl.constexpr(0), gl.constexpr(1)  # the consumers' warpgroup index
MAXNREG = 168  # 12 warps x 32 x 168 fits the 64 Ki registers before setmaxnreg moves them


def kernel_config(head_dim: int, max_query_len: int) -> dict:
    """K/V tokens per tile, ring depth and Q buffers (they fit the 227 KiB of shared memory), and
    the registers of consumer 1 and of the producer (consumer 0 gets what they leave, the same
    as consumer 1): the most the consumers can have without the producer spilling. At head_dim
    128, chunks of up to 1k tokens take tiles of 64 keys and two Q buffers (an item has few K/V
    tiles, so the next item's Q and the diagonal tile's masked half matter); longer ones 128."""
    regs = {"CONSUMER_REGS": 232, "PRODUCER_REGS": 40} if head_dim == 256 else {
        "CONSUMER_REGS": 224, "PRODUCER_REGS": 56}
    short = max_query_len <= 1024
    ring = {64: {"BLOCK_N": 128, "STAGES": 4, "Q_SLOTS": 2},
            128: {"BLOCK_N": 64, "STAGES": 4, "Q_SLOTS": 2} if short else {"BLOCK_N": 128, "STAGES": 3, "Q_SLOTS": 1},
            256: {"BLOCK_N": 32, "STAGES": 4, "Q_SLOTS": 1}}[head_dim]
    return regs | ring | {"persistent": True}


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
def _item(k, num_items, num_kv_heads, num_q_tiles, cu_seqlens_q_ptr, seq_lens_ptr, first_row,
          TOKENS: gl.constexpr, BLOCK_N: gl.constexpr):
    """This CTA's ``k``-th work item -> (kv head, batch row, query start, query length, first token
    of the tile, context length, one past the last key, K/V tiles to read: 0 for no work).

    Items are numbered the tiles with most keys first; step ``k`` of CTA ``p`` of ``P`` takes item
    ``k * P + p`` on even steps and ``k * P + P - 1 - p`` on odd ones (a snake), so the CTA that
    got the longest item of one round gets the shortest of the next and the totals even out."""
    P = gl.num_programs(0)
    pid = gl.program_id(0)
    item = k * P + gl.where(k % 2 == 0, pid, P - 1 - pid)
    in_range = item < num_items
    item = gl.minimum(item, num_items - 1)
    per_tile = num_items // num_q_tiles
    tile = num_q_tiles - 1 - item // per_tile
    rest = item % per_tile
    kv_head = rest % num_kv_heads
    row = rest // num_kv_heads + first_row
    q_start = gl.load(cu_seqlens_q_ptr + row)
    q_len = gl.load(cu_seqlens_q_ptr + row + 1) - q_start
    t0 = tile * TOKENS
    context = gl.load(seq_lens_ptr + row) - q_len
    hi = context + gl.minimum(t0 + TOKENS, q_len)
    num_tiles = gl.where(in_range & (t0 < q_len), gl.cdiv(hi, BLOCK_N), 0)
    return kv_head, row, q_start, q_len, t0, context, hi, num_tiles


@gluon.jit
def _rows(base, t0, q_start, q_len, kv_head, stride_t, stride_h, GROUP: gl.constexpr, TOKENS: gl.constexpr,
          ROWS: gl.constexpr, LAYOUT: gl.constexpr):
    """Offsets and validity of tile rows ``[base, base + ROWS)``: row r is token ``t0 + r // GROUP``,
    head ``kv_head * GROUP + r % GROUP``."""
    r = base + gl.arange(0, ROWS, layout=LAYOUT)
    tok = t0 + r // GROUP
    valid = (r < TOKENS * GROUP) & (tok < q_len)
    return (q_start + tok).to(gl.int64) * stride_t + (kv_head * GROUP + r % GROUP) * stride_h, valid


@gluon.jit
def _copy_q(q_buf, q_ptr, t0, q_start, q_len, kv_head, stride_qt, stride_qh, GROUP: gl.constexpr,
            HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr, LD: gl.constexpr):
    """Start copying the item's Q tile, ``CHUNK`` rows at a time (few addresses live at once)."""
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    for c in gl.static_range(BLOCK_M // CHUNK):
        offs, valid = _rows(c * CHUNK, t0, q_start, q_len, kv_head, stride_qt, stride_qh, GROUP, BLOCK_M // GROUP,
                            CHUNK, gl.SliceLayout(1, LD))
        async_copy.async_copy_global_to_shared(q_buf.slice(c * CHUNK, CHUNK, dim=0), q_ptr + offs[:, None] + d[None, :],
                                               mask=valid[:, None] & (d[None, :] < HEAD_DIM))


@gluon.jit
def _copy_kv(k_buf, v_buf, key_cache_ptr, value_cache_ptr, block_tables_ptr, row_table, kv_head, n0, hi,
             stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
             BLOCK_N: gl.constexpr, CHUNK: gl.constexpr, LD: gl.constexpr):
    """Start copying K/V tokens ``[n0, n0 + BLOCK_N)`` through the block table (zeros past ``hi``)."""
    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LD))
    for c in gl.static_range(BLOCK_N // CHUNK):
        n = n0 + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LD))
        n_mask = n < hi
        blk = gl.load(block_tables_ptr + row_table + n // BLOCK_SIZE, mask=n_mask, other=0).to(gl.int64)
        offs = (blk * stride_c_blk + (n % BLOCK_SIZE) * stride_c_tok + kv_head * stride_c_head)[:, None] + d[None, :]
        mask = n_mask[:, None] & (d[None, :] < HEAD_DIM)
        async_copy.async_copy_global_to_shared(k_buf.slice(c * CHUNK, CHUNK, dim=0), key_cache_ptr + offs, mask=mask)
        async_copy.async_copy_global_to_shared(v_buf.slice(c * CHUNK, CHUNK, dim=0), value_cache_ptr + offs,
                                               mask=mask)


@gluon.jit
def _producer(q_bufs, k_bufs, v_bufs, bars, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
              cu_seqlens_q_ptr, first_row, num_items, num_kv_heads, num_q_tiles, stride_qt, stride_qh,
              stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
              GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr):
    """Fill the Q slots and the K/V ring, item after item, each buffer once both consumers freed it."""
    ready, empty, q_ready, q_empty = bars
    STAGES: gl.constexpr = k_bufs.shape[0]
    Q_SLOTS: gl.constexpr = q_bufs.shape[0]
    LD: gl.constexpr = _load_layout(HEAD_DIM, gl.num_warps())
    CHUNK: gl.constexpr = min(BLOCK_N, 4096 // HEAD_DIM)  # rows per copy: 32 addresses per thread
    it = 0
    done = 0
    for k in range(gl.cdiv(num_items, gl.num_programs(0))):
        kv_head, row, q_start, q_len, t0, context, hi, num_tiles = _item(
            k, num_items, num_kv_heads, num_q_tiles, cu_seqlens_q_ptr, seq_lens_ptr, first_row, BLOCK_M // GROUP,
            BLOCK_N)
        if num_tiles > 0:
            qs = done % Q_SLOTS
            mbarrier.wait(q_empty.index(qs), (done // Q_SLOTS & 1) ^ 1)  # a fresh barrier passes phase 1 at once
            _copy_q(q_bufs.index(qs), q_ptr, t0, q_start, q_len, kv_head, stride_qt, stride_qh, GROUP, HEAD_DIM,
                    CHUNK, LD)
            async_copy.mbarrier_arrive(q_ready.index(qs), increment_count=False)  # when this thread's copies land
            row_table = row.to(gl.int64) * stride_bt
            for j in range(num_tiles):
                s = (it + j) % STAGES
                mbarrier.wait(empty.index(s), ((it + j) // STAGES & 1) ^ 1)
                _copy_kv(k_bufs.index(s), v_bufs.index(s), key_cache_ptr, value_cache_ptr, block_tables_ptr,
                         row_table, kv_head, j * BLOCK_N, hi, stride_c_blk, stride_c_tok, stride_c_head, HEAD_DIM,
                         BLOCK_SIZE, BLOCK_N, CHUNK, LD)
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
            it += num_tiles
            done += 1


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
def _wait_kv(k_bufs, ready, c, STAGES: gl.constexpr):
    """Wait for ring position ``c`` (the ``c``-th K/V tile this CTA reads); its K buffer."""
    mbarrier.wait(ready.index(c % STAGES), c // STAGES & 1)
    fence_async_shared()  # cp.async's writes, seen by wgmma's async-proxy reads
    return k_bufs.index(c % STAGES)


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, ready, empty, q_free, it, num_tiles, q_pos, full_tiles, scale_log2,
            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
    """One item's online softmax over ring positions ``[it, it + num_tiles)``: (acc, row sums)."""
    STAGES: gl.constexpr = k_bufs.shape[0]
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    dtype: gl.constexpr = q_smem.dtype
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=S_L)
    m = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
    l_sum = gl.zeros([WG_ROWS], gl.float32, layout=gl.SliceLayout(1, S_L))
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=O_L)
    k = _wait_kv(k_bufs, ready, it, STAGES)
    s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    p, m, l_sum, alpha = _softmax_tile(s, m, l_sum, q_pos, 0, full_tiles, scale_log2, BLOCK_N, S_L)
    p_prev = gl.convert_layout(p.to(dtype), P_L)
    for j in range(1, num_tiles):
        k = _wait_kv(k_bufs, ready, it + j, STAGES)
        v_prev = v_bufs.index((it + j - 1) % STAGES)
        s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_prev, v_prev, acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        p, m, l_sum, alpha = _softmax_tile(s, m, l_sum, q_pos, j, full_tiles, scale_log2, BLOCK_N, S_L)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + j - 1) % STAGES), count=1)  # K and V of ring position it + j - 1 are read
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        p_prev = gl.convert_layout(p.to(dtype), P_L)
    mbarrier.arrive(q_free, count=1)  # the item's last S is done: its Q slot may be refilled
    last = (it + num_tiles - 1) % STAGES
    acc = warpgroup_mma(p_prev, v_bufs.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index(last), count=1)
    return acc, l_sum


@gluon.jit
def _consumer(q_bufs, k_bufs, v_bufs, bars, out_ptr, seq_lens_ptr, cu_seqlens_q_ptr, first_row, num_items,
              num_kv_heads, num_q_tiles, scale_log2, stride_ot, stride_oh,
              WG: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr):
    """Rows ``[WG * 64, WG * 64 + 64)`` of every item's tile: attend, normalise, store."""
    ready, empty, q_ready, q_empty = bars
    Q_SLOTS: gl.constexpr = q_bufs.shape[0]
    NW: gl.constexpr = gl.num_warps()
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, BLOCK_N, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1], instr_shape=[16, HEAD_DIM, 16])
    TOKENS: gl.constexpr = BLOCK_M // GROUP
    dtype: gl.constexpr = q_bufs.dtype
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_L))
    it = 0
    done = 0
    for k in range(gl.cdiv(num_items, gl.num_programs(0))):
        kv_head, row, q_start, q_len, t0, context, hi, num_tiles = _item(
            k, num_items, num_kv_heads, num_q_tiles, cu_seqlens_q_ptr, seq_lens_ptr, first_row, TOKENS, BLOCK_N)
        if num_tiles > 0:
            qs = done % Q_SLOTS
            mbarrier.wait(q_ready.index(qs), done // Q_SLOTS & 1)
            q_smem = q_bufs.index(qs).slice(WG * WG_ROWS, WG_ROWS, dim=0)
            q_pos = context + t0 + (WG * WG_ROWS + gl.arange(0, WG_ROWS, layout=gl.SliceLayout(1, S_L))) // GROUP
            full_tiles = (context + t0 + (WG * WG_ROWS) // GROUP + 1) // BLOCK_N  # tiles these rows see whole
            acc, l_sum = _attend(q_smem, k_bufs, v_bufs, ready, empty, q_empty.index(qs), it, num_tiles, q_pos,
                                 full_tiles, scale_log2, HEAD_DIM, BLOCK_N, S_L, O_L)
            o = (acc / gl.convert_layout(l_sum, gl.SliceLayout(1, O_L))[:, None]).to(dtype)
            # stored from the accumulator's own layout: no shuffle through shared memory
            offs, valid = _rows(WG * WG_ROWS, t0, q_start, q_len, kv_head, stride_ot, stride_oh, GROUP, TOKENS,
                                WG_ROWS, gl.SliceLayout(1, O_L))
            gl.store(out_ptr + offs[:, None] + d_o[None, :], o, mask=valid[:, None] & (d_o[None, :] < HEAD_DIM))
            it += num_tiles
            done += 1


@gluon.jit
def _gluon_ws_prefill_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr, out_ptr,
    scale_log2, first_row, num_items, num_kv_heads, num_q_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_SLOTS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
):
    """Allocate the shared memory and the barriers, then fork the three partitions."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_bufs = gl.allocate_shared_memory(dtype, [Q_SLOTS, BLOCK_M, HEAD_DIM], SMEM)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], SMEM)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [Q_SLOTS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=PRODUCER_WARPS * 32)  # every producer thread's copies
        mbarrier.init(empty.index(i), count=2)  # both consumers
    for i in gl.static_range(Q_SLOTS):
        mbarrier.init(q_ready.index(i), count=PRODUCER_WARPS * 32)
        mbarrier.init(q_empty.index(i), count=2)
    bars = (ready, empty, q_ready, q_empty)
    gl.warp_specialize([
        (_consumer, (q_bufs, k_bufs, v_bufs, bars, out_ptr, seq_lens_ptr, cu_seqlens_q_ptr, first_row, num_items,
                     num_kv_heads, num_q_tiles, scale_log2, stride_ot, stride_oh, FIRST, GROUP, HEAD_DIM, BLOCK_N)),
        (_consumer, (q_bufs, k_bufs, v_bufs, bars, out_ptr, seq_lens_ptr, cu_seqlens_q_ptr, first_row, num_items,
                     num_kv_heads, num_q_tiles, scale_log2, stride_ot, stride_oh, SECOND, GROUP, HEAD_DIM, BLOCK_N)),
        (_producer, (q_bufs, k_bufs, v_bufs, bars, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr,
                     seq_lens_ptr, cu_seqlens_q_ptr, first_row, num_items, num_kv_heads, num_q_tiles, stride_qt,
                     stride_qh, stride_c_blk, stride_c_tok, stride_c_head, stride_bt,
                     GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_N)),
    ], [NUM_WARPS, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])
