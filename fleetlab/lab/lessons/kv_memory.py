"""KV memory arithmetic for lessons: what cached tokens actually fill, against the blocks holding them."""

from __future__ import annotations

from fleetlab.kv.paged_cache import PagedKVCache


def bytes_for_tokens(cache: PagedKVCache, num_tokens: int) -> int:
    """Bytes that ``num_tokens`` cached tokens fill in ``cache`` (all layers, K and V).

    Compare with the bytes of the blocks holding them to see paging's waste.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0; got {num_tokens}")
    per_token = PagedKVCache.bytes_per_block(cache.num_layers, cache.num_kv_heads, cache.head_dim, 1, cache.dtype)
    return int(num_tokens) * per_token
