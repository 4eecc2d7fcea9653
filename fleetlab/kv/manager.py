"""``KVCacheManager``: the scheduler's view of the block pool, one request at a time.

The pool knows blocks; this knows which blocks each request holds, how many of its
tokens a prefix-cache hit saves, and when its newly filled blocks can be shared.
"""

from __future__ import annotations

from fleetlab.kv.block_pool import BlockPool
from fleetlab.engine.request import Request


class KVCacheManager:
    """Allocates and frees a request's blocks in a :class:`~fleetlab.BlockPool`."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Cached blocks that already hold a prefix of the request (never all of it).

        Counts nothing in the pool's hit rate: a request that cannot be admitted is looked
        up again next step. The scheduler counts the query once, on admission
        (``pool.record_lookup``).
        """
        return self.pool.lookup(request.all_token_ids, record_stats=False)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``computed_blocks`` (first admission only) are prefix-cache hits: the request
        takes a reference on them and starts computing after them. Returns False, with
        nothing changed, when the pool cannot supply the blocks.
        """
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        held = len(request.block_ids) + len(computed_blocks)
        num_new_blocks = max(0, self.blocks_needed(num_computed + num_new_tokens) - held)
        # A hit on a block nobody holds takes it out of the free queue, so it costs a free block too.
        revived = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        if num_new_blocks + revived > self.pool.num_free_blocks:
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            request.block_ids.extend(computed_blocks)
            request.num_computed_tokens = num_computed
            request.num_cached_blocks = len(request.block_ids)
        if num_new_blocks:
            request.block_ids.extend(self.pool.allocate(num_new_blocks))
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Share the request's blocks that are now full of computed tokens.

        Called after the step's forward pass, never at allocation: a block must hold
        written K/V before another request may hit it, and a request preempted in the
        same step would otherwise leave a cached block with nothing in it.
        """
        num_full = request.num_computed_tokens // self.block_size
        if num_full > request.num_cached_blocks:
            request.num_cached_blocks = self.pool.cache_blocks(
                request.all_token_ids, request.block_ids, request.num_cached_blocks, num_full)

    def free(self, request: Request) -> None:
        """Give back every block of the request (tail first, so its prefix lives longest)."""
        self.pool.free(request.block_ids)  # the pool releases them tail first
        request.block_ids = []
        request.num_cached_blocks = 0
