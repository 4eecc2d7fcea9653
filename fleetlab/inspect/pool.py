"""A block pool seen from outside: its counters, each block's state, and its bookkeeping checked."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fleetlab.errors import refuse


@dataclass(slots=True)
class BlockPoolStats:
    """Counters of a :class:`~fleetlab.kv.block_pool.BlockPool` and its prefix cache.

    num_free_blocks counts cached blocks nobody holds too (they can be allocated at any time);
    num_cached_blocks counts blocks that hold a cached prefix, free or in use.
    hit_rate is ``hit_tokens / query_tokens`` over all lookups (0.0 before any).
    """

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    queries: int
    hit_tokens: int
    query_tokens: int
    hit_rate: float
    evictions: int


def pool_stats(pool) -> BlockPoolStats:
    """The counters of ``pool`` and its prefix cache, now."""
    c, free = pool.prefix_cache, pool.num_free_blocks
    queries, hits, tokens, evictions = (c.queries, c.hit_tokens, c.query_tokens, c.evictions) if c else (0,) * 4
    return BlockPoolStats(pool.num_blocks, free, pool.num_blocks - free, c.num_cached_blocks if c else 0,
                          queries, hits, tokens, hits / tokens if tokens else 0.0, evictions)


@dataclass(slots=True, frozen=True)
class BlockInfo:
    """One block's state, for drawing the pool as a grid.

    in_free_queue: the block can be allocated (free, cached or not); lru_position: its place in
    the order free blocks are handed out (0 = next: the pool's free queue, then the blocks its
    prefix cache would evict, in their order), None when in use.
    """

    block_id: int
    ref_count: int
    is_cached: bool
    in_free_queue: bool
    lru_position: int | None


def pool_snapshot(pool) -> list[BlockInfo]:
    """Per-block state of a :class:`~fleetlab.BlockPool`, in block id order."""
    # The order free blocks are handed out: the free queue, then what the prefix cache would evict.
    free_order = [*pool._free, *(pool.prefix_cache.eviction_order(pool._kept) if pool._kept else [])]
    position = {block_id: i for i, block_id in enumerate(free_order)}
    return [BlockInfo(b, pool.ref_count(b), pool.is_cached(b), b in position, position.get(b))
            for b in range(pool.num_blocks)]


def check_pool(pool) -> None:
    """Raise RuntimeError if a pool's bookkeeping is inconsistent (its prefix cache's included)."""
    counts, free = pool._ref_counts, [*pool._free, *pool._kept]
    negative = [b for b, count in enumerate(counts) if count < 0]
    unknown = [b for b in free if not 0 <= b < pool.num_blocks]
    held = [b for b in free if not unknown and counts[b] != 0]
    both, uncached = sorted(pool._kept & set(pool._free)), [b for b in pool._kept if not pool.is_cached(b)]
    used = sum(1 for c in counts if c > 0)
    refuse([(negative, lambda: f"block {negative[0]} has negative reference count {counts[negative[0]]}"),
            (unknown, lambda: f"free queue holds unknown block id {unknown[0]}"),
            (held, lambda: f"block {held[0]} is in the free queue with reference count {counts[held[0]]}"),
            (both, f"blocks {both} are both queued and kept by the cache"),
            (uncached, lambda: f"block {uncached[0]} is kept by the prefix cache but holds no cached prefix"),
            (pool.num_free_blocks + used != pool.num_blocks,
             f"free ({pool.num_free_blocks}) + used ({used}) != total ({pool.num_blocks})")], RuntimeError)
    if pool.prefix_cache is not None:
        pool.prefix_cache.check_invariants()


def check_kv_manager(kv, live_request_ids) -> None:
    """Raise RuntimeError unless exactly the live requests hold blocks in a
    :class:`~fleetlab.kv.manager.KVCacheManager` and its pool's reference counts equal the holders
    (a request, or a partial prefix hit's copy pinning its source until the step that copies ends)."""
    stale = sorted(set(kv._blocks) - set(live_request_ids))
    counts = Counter(b for blocks in kv._blocks.values() for b in blocks)
    counts.update(c.src_block for c in kv.pinned_copies())
    wrong = [b for b in range(kv.pool.num_blocks) if kv.pool.ref_count(b) != counts[b]]
    refuse([(stale, f"finished requests still hold blocks: {stale}"),
            (wrong, lambda: f"block {wrong[0]}: reference count {kv.pool.ref_count(wrong[0])}, held by "
                            f"{counts[wrong[0]]} request(s)")], RuntimeError)
    check_pool(kv.pool)
