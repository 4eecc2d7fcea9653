"""What a partial prefix hit costs either way: copy the matched tokens' K/V, or recompute them.

A radix match that ends ``k`` tokens into a block copies those tokens' K/V from the cached block
into the request's own (:meth:`fleetlab.PagedKVCache.copy_blocks`, every layer, K and V) before the
request's first chunk runs; the hash chain recomputes them as part of that chunk. Side by side on
one patched model and one cache, alternating within each round:

- **copy + forward**: ``copy_blocks`` of ``k`` tokens, then a prefill forward of the ``q`` tokens
  after them (a context of ``context`` tokens already cached);
- **forward of k + q**: the same chunk with the ``k`` tokens recomputed in it.

Per token, the copy costs ``copy / k``; a recomputed token ``(forward(k + q) - forward(q)) / k``, the
chunk's extra time. Medians over rounds; the machine's load is recorded beside them.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import paddle

from fleetlab.attention.context import forward_context
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.device import upload
from fleetlab.kv.copies import BlockCopy
from fleetlab.kv.paged_cache import PagedKVCache


def _forward(handle, cache: PagedKVCache, context: int, n: int, table: np.ndarray) -> None:
    """One prefill forward of ``n`` tokens after ``context`` cached ones (row 0 of ``table``)."""
    md = AttentionMetadata.build(np.array([n]), np.array([context]), table, cache.block_size)
    ids = upload(np.full((1, n), 5, np.int64))
    with paddle.no_grad(), forward_context(md, cache):
        handle.compute_logits(ids, md.positions.reshape([1, -1]), upload(np.array([n - 1], np.int64)))


def copy_against_recompute(model, k: int = 6, q: int = 16, context: int = 144, block_size: int = 16,
                           rounds: int = 200) -> dict:
    """Median microseconds of the three timings (see the module) and the per-token costs."""
    from fleetlab.patching import patch_model

    if not 0 < k < block_size or context % block_size:
        raise ValueError(f"need 0 < k ({k}) < block_size ({block_size}) and context ({context}) on a block boundary")
    handle = patch_model(model)
    try:
        num_blocks = -(-(context + k + q) // block_size) + 1
        cache = PagedKVCache.for_handle(handle, num_blocks, block_size)
        table = np.arange(num_blocks - 1, dtype=np.int32)[None, :]
        copy = [BlockCopy("bench", num_blocks - 1, context // block_size, k)]  # the spare block lends k tokens
        sides = {
            "copy_us": lambda: cache.copy_blocks(copy),
            "forward_q_us": lambda: _forward(handle, cache, context + k, q, table),
            "forward_k_plus_q_us": lambda: _forward(handle, cache, context, k + q, table),
        }
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(rounds + 1):  # round 0 warms up
            order = list(sides.items())
            for name, run in order[r % 3:] + order[: r % 3]:  # rotated: each side goes first in turn
                start = time.perf_counter()
                run()
                if r:
                    times[name].append(1e6 * (time.perf_counter() - start))
    finally:
        handle.unpatch()
    med = {name: statistics.median(t) for name, t in times.items()}
    return {**med, "k": k, "q": q, "context": context, "block_size": block_size, "rounds": rounds,
            "copy_us_per_token": med["copy_us"] / k,
            "recompute_us_per_token": (med["forward_k_plus_q_us"] - med["forward_q_us"]) / k,
            "copy_then_forward_over_forward": (med["copy_us"] + med["forward_q_us"]) / med["forward_k_plus_q_us"]}
