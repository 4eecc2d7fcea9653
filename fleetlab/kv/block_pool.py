"""The block pool of the paged KV cache: reference counts and an LRU free queue.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` token slots each. A request
owns a list of block ids (its *block table*); the token at logical position ``p`` lives in
block ``block_table[p // block_size]``. This module only hands out and takes back block *ids*;
the K/V tensors themselves live in :class:`fleetlab.PagedKVCache`.

Several live requests may share one block; its reference count is the number of owners. A
block whose count drops to zero goes to the tail of the free queue (LRU order: the head is
handed out next). A request's blocks are released tail first, so its *first* block is handed
out last.

**Where a prefix cache plugs in** (``prefix_cache=``, see :mod:`fleetlab.prefix_cache`): a
cache remembers which blocks hold which prefix so that requests can share them. The pool
calls it at three points: when a block's last owner lets it go (``keeps``: the cache may hold
the block itself instead of the free queue), when a free block is taken for new content
(``forget``: its old content is gone), and when the free queue is too short (``evict``: the
cache gives back blocks it holds). :meth:`BlockPool.touch` takes a reference on a block the
cache found, wherever it waits.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter, OrderedDict
from collections.abc import Sequence

from fleetlab.prefix_cache import cache_call, checked_evicted

logger = logging.getLogger(__name__)


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than the pool has free."""


class BlockPool:
    """Hands out KV-cache blocks by id and counts their owners.

    Args:
      num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).
      block_size: token slots per block.
      prefix_cache: a :class:`~fleetlab.prefix_cache.PrefixCache` (e.g. ``HashChainCache``,
        ``RadixCache``) built for ``block_size``, or None for no sharing.

    A request's life: ``hits = prefix_cache.lookup(prompt)``; ``touch(hits)``; ``allocate(n)``
    for the rest; ``prefix_cache.cache_blocks(...)`` for blocks that became full; at the end
    ``free(block_table)``. Touch the hits *before* allocating: a hit block may be free, and
    an allocation could otherwise hand out the very blocks just found.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_cache=None):
        if int(num_blocks) < 1 or int(block_size) < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.prefix_cache = prefix_cache
        if prefix_cache is not None:
            prefix_cache.attach(self)
        self._ref_counts = [0] * self.num_blocks
        # Free queue in LRU order: an OrderedDict pops the head, appends at the tail and
        # removes from the middle (a cache hit reviving a free block) in O(1).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._kept: set[int] = set()  # free blocks the prefix cache holds (its ``keeps`` said so)

    def __repr__(self) -> str:
        """``print(llm.pool)``: its size, blocks in use and free, and the prefix cache's share."""
        cache = self.prefix_cache
        cached = f", {cache.num_cached_blocks} holding a cached prefix ({type(cache).__name__})" if cache else \
            ", no prefix cache"
        in_use = self.num_blocks - self.num_free_blocks
        return (f"BlockPool({self.num_blocks} blocks of {self.block_size} tokens: {in_use} in use, "
                f"{self.num_free_blocks} free{cached})")

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, including free blocks still holding a cached prefix."""
        return len(self._free) + len(self._kept)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks, the free queue's head first, then blocks the prefix cache evicts;
        each gets reference count 1. Raises NoFreeBlocksError when fewer than ``n`` are free
        (nothing is taken)."""
        n = operator.index(n)
        if not 0 <= n <= self.num_free_blocks:
            raise (ValueError if n < 0 else NoFreeBlocksError)(
                f"cannot allocate a negative number of blocks ({n})" if n < 0 else
                f"asked for {n} blocks but only {self.num_free_blocks} of {self.num_blocks} are free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(min(n, len(self._free)))]
        if self.prefix_cache is not None:
            try:
                for block_id in blocks:
                    cache_call(self.prefix_cache, "forget", block_id)
                if len(blocks) < n:
                    evicted = cache_call(self.prefix_cache, "evict", n - len(blocks))
                    evicted = checked_evicted(self.prefix_cache, evicted,
                                              n - len(blocks), self._kept)
                    self._kept.difference_update(evicted)
                    blocks += evicted
            except BaseException:  # the cache failed: nothing is taken (the queue's blocks back at its head)
                for block_id in reversed(blocks):
                    self._free[block_id] = None
                    self._free.move_to_end(block_id, last=False)
                raise
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block of a request's block table, tail first (a
        prefix's head is what others most likely share: it is handed out last). Raises
        ValueError, changing nothing, for an unknown block or one freed more often than held."""
        ids = self._checked(block_ids, "free")
        for block_id in reversed(ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if self.prefix_cache is not None and self._keeps(block_id):
                    self._kept.add(block_id)
                else:
                    self._free[block_id] = None

    def _keeps(self, block_id: int) -> bool:
        """The cache's ``keeps``; if it raises or answers other than a bool, the block is not kept and
        its cached prefix is dropped (logged, not raised: a free never fails half way, and a block
        merely not kept is safe)."""
        try:
            kept = self.prefix_cache.keeps(block_id)
            if isinstance(kept, bool):
                return kept
            raise TypeError(f"returned {kept!r:.40}, not a bool")
        except Exception:
            logger.exception("prefix cache %s.keeps(%d) failed: the block goes to the free queue, its cached "
                             "prefix dropped", type(self.prefix_cache).__name__, block_id)
            self.uncache([block_id])  # (a block below it that the cache kept joins the queue too)
            return False

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block the prefix cache found; a free one stops being free.
        Raises ValueError, changing nothing, for an unknown id or a free block with no cached
        prefix (there is nothing to share in it)."""
        ids = self._checked(block_ids, "touch")
        for block_id in ids:
            if self._ref_counts[block_id] == 0:
                self._kept.discard(block_id)
                self._free.pop(block_id, None)
            self._ref_counts[block_id] += 1

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Drop the cached prefixes of these blocks (their content is not what the cache says,
        e.g. the step that was to write it failed); free ones the cache held join the free
        queue's head."""
        for block_id in self.prefix_cache.uncache(block_ids) if self.prefix_cache is not None else ():
            if block_id in self._kept:
                self._kept.remove(block_id)
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)

    def ref_count(self, block_id: int) -> int:
        """Number of live owners of a block (0 when free)."""
        return self._ref_counts[self._checked([block_id])[0]]

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a cached prefix (live or free)."""
        return self.prefix_cache is not None and self.prefix_cache.is_cached(block_id)

    def _checked(self, block_ids: Sequence[int], use: str = "") -> list[int]:
        """The ids, or ValueError (before anything changes) for an unknown id, a block freed more
        often than it is held (``use="free"``) or a free block with no cached prefix (``"touch"``)."""
        ids = [operator.index(b) for b in block_ids]
        unknown = [b for b in ids if not 0 <= b < self.num_blocks]
        counts = Counter(ids) if use == "free" and not unknown else {}
        over = [f"block {b} has reference count {self._ref_counts[b]}, cannot free it {n} time(s) (double free?)"
                for b, n in counts.items() if self._ref_counts[b] < n]
        empty = [f"block {b} is free and holds no cached prefix" for b in ids if use == "touch" and not unknown
                 and self._ref_counts[b] == 0 and not self.is_cached(b)]
        problems = [f"unknown block id {b} (pool has {self.num_blocks} blocks)" for b in unknown[:1]] + over + empty
        if problems:
            raise ValueError(problems[0])
        return ids
