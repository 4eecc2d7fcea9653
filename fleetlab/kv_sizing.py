"""How many KV blocks the pool gets: given, from a KV budget, or from memory (vLLM's way).

``LLM(memory_utilization=u)`` sizes the pool as vLLM's ``gpu_memory_utilization`` does: of the
device's memory the engine may use the share ``u``; a forward of ``max_num_batched_tokens``
prompt tokens is run once to find the peak of everything else (weights, activations, the
forward's temporaries), and the rest goes to KV blocks::

    num_blocks = (u * budget - peak of the profiled forward) // bytes_per_block
    bytes_per_block = 2 (K and V) * num_layers * block_size * num_kv_heads * head_dim * itemsize

The device's memory is a GPU's total memory; on a CPU, as SGLang's ``mem_fraction_static`` does
there, the memory the machine has available (psutil's ``virtual_memory().available``, what other
processes leave) plus the weights this engine already loaded out of it. ``memory_budget_bytes``
overrides either. The peak is Paddle's own allocator statistic (device memory on a GPU, host
memory on a CPU), reset just before the forward. Without ``num_blocks``, ``kv_cache_memory_bytes`` or
``memory_utilization`` the pool holds half of ``max_num_seqs`` full-length sequences
(:data:`DEFAULT_SEQS_FRACTION`): every row can run a request of up to half the model's length,
and when more than half the rows hold long ones the scheduler preempts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import paddle

from fleetlab.attention.context import forward_context
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.kv.paged_cache import PagedKVCache

DEFAULT_SEQS_FRACTION = 2  # the default pool holds max_num_seqs / 2 sequences of max_model_len


@dataclass(slots=True, frozen=True)
class KVCacheSizing:
    """How the pool was sized: ``source`` is ``"num_blocks"``, ``"kv_cache_memory_bytes"``,
    ``"memory_utilization"`` or ``"default"``; the memory fields are 0 where not measured."""

    source: str
    num_blocks: int
    bytes_per_block: int
    budget_bytes: int = 0  # memory_utilization * the device's (or stated) memory
    profile_peak_bytes: int = 0  # peak of the profiled forward (weights and activations included)
    profiled_tokens: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


MAX_NUM_BLOCKS = 2**31 - 1  # block ids are int32 (block tables, slot mapping's block part)


def size_kv_cache(handle, cfg, max_model_len: int) -> KVCacheSizing:
    """The pool size the config asks for (see the module); ValueError naming the field that sized
    it when that is no block or more blocks than int32 block ids address."""
    sizing = _size(handle, cfg, max_model_len)
    if sizing.num_blocks > MAX_NUM_BLOCKS:
        field = {"kv_cache_memory_bytes": f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes}",
                 "memory_utilization": f"memory_utilization={cfg.memory_utilization} of {sizing.budget_bytes} bytes",
                 }.get(sizing.source, f"{sizing.source}")
        raise ValueError(f"engine config: {field} sizes the pool to {sizing.num_blocks} KV blocks of "
                         f"{sizing.bytes_per_block} bytes, more than int32 block ids address ({MAX_NUM_BLOCKS})")
    return sizing


def _size(handle, cfg, max_model_len: int) -> KVCacheSizing:
    per_block = PagedKVCache.bytes_per_block(handle.num_layers, handle.num_kv_heads, handle.head_dim,
                                             cfg.block_size, handle.dtype or "float32")
    if cfg.num_blocks is not None:
        return KVCacheSizing("num_blocks", cfg.num_blocks, per_block)
    if cfg.kv_cache_memory_bytes is not None:
        try:
            n = PagedKVCache.num_blocks_for_budget(cfg.kv_cache_memory_bytes, handle.num_layers, handle.num_kv_heads,
                                                   handle.head_dim, cfg.block_size, handle.dtype or "float32")
        except ValueError as exc:
            raise ValueError(f"engine config: kv_cache_memory_bytes={cfg.kv_cache_memory_bytes}: {exc}") from None
        return KVCacheSizing("kv_cache_memory_bytes", n, per_block)
    if cfg.memory_utilization is not None:
        return _from_memory(handle, cfg, per_block)
    seqs = max(1, cfg.max_num_seqs // DEFAULT_SEQS_FRACTION)
    return KVCacheSizing("default", seqs * -(-max_model_len // cfg.block_size), per_block)


def device_memory_bytes(handle, on_gpu: bool) -> int:
    """The memory ``memory_utilization`` shares out by default: a GPU's total memory; on a CPU what
    the machine has available now plus the model's weights (loaded out of it already)."""
    if on_gpu:
        return int(paddle.device.cuda.get_device_properties().total_memory)
    import psutil  # (a dependency: only sizing a CPU pool from memory asks it)

    return int(psutil.virtual_memory().available) + _weight_bytes(handle)


def _weight_bytes(handle) -> int:
    return sum(int(p.numel()) * p.element_size() for p in handle.model.parameters())


def _from_memory(handle, cfg, per_block: int) -> KVCacheSizing:
    on_gpu = paddle.device.get_device().startswith("gpu")
    total = cfg.memory_budget_bytes if cfg.memory_budget_bytes is not None else device_memory_bytes(handle, on_gpu)
    budget = int(cfg.memory_utilization * total)
    tokens = cfg.max_num_batched_tokens
    peak = profile_forward_peak(handle, tokens, cfg.block_size, on_gpu)
    num_blocks = (budget - peak) // per_block
    if num_blocks < 1:
        raise ValueError(f"engine config: memory_utilization={cfg.memory_utilization} of {total} bytes is "
                         f"{budget} bytes, but a forward of {tokens} tokens peaks at {peak} bytes: no room for "
                         f"one KV block of {per_block} bytes")
    return KVCacheSizing("memory_utilization", int(num_blocks), per_block, budget, peak, tokens)


def profile_forward_peak(handle, num_tokens: int, block_size: int, on_gpu: bool) -> int:
    """Peak allocated bytes while the patched model runs one prefill of ``num_tokens`` tokens
    (the KV blocks that forward writes into are left out: the pool pays for those)."""
    num_blocks = -(-num_tokens // block_size)
    kv = PagedKVCache.for_handle(handle, num_blocks, block_size)
    md = AttentionMetadata.build(np.array([num_tokens]), np.array([0]),
                                 np.arange(num_blocks, dtype=np.int32)[None, :], block_size)
    ids = paddle.zeros([1, num_tokens], dtype="int64")
    last = paddle.to_tensor([num_tokens - 1], dtype="int64")
    # What else the process holds (other engines, a notebook's tensors) is not this engine's to
    # count: the forward's own peak over what was allocated before it, plus the model's weights.
    _reset_peak(on_gpu)
    before = _current(on_gpu)
    with paddle.no_grad(), forward_context(md, kv):
        handle.compute_logits(ids, md.positions.reshape([1, -1]), last)
    activations = _peak(on_gpu) - before
    del kv
    return int(_weight_bytes(handle) + activations)


def _reset_peak(on_gpu: bool) -> None:
    if on_gpu:
        paddle.device.cuda.reset_max_memory_allocated()
    else:
        paddle.base.core.host_memory_stat_reset_peak_value("Allocated", 0)


def _current(on_gpu: bool) -> int:
    if on_gpu:
        return int(paddle.device.cuda.memory_allocated())
    return int(paddle.base.core.host_memory_stat_current_value("Allocated", 0))


def _peak(on_gpu: bool) -> int:
    if on_gpu:
        return int(paddle.device.cuda.max_memory_allocated())
    return int(paddle.base.core.host_memory_stat_peak_value("Allocated", 0))
