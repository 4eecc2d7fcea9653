"""The block pool of the paged KV cache: reference counts, an LRU free queue and prefix caching.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` token slots each. A request
owns a list of block ids (its *block table*); the token at logical position ``p`` lives in
block ``block_table[p // block_size]``. This module only hands out and takes back block *ids*;
the K/V tensors themselves live in :class:`fleetlab.PagedKVCache`.

**Prefix caching.** Many requests start with the same tokens (a system prompt, a few-shot
preamble, the earlier turns of a chat). Their K/V for those tokens are identical, so a new
request can *share* the blocks an earlier request already filled instead of recomputing them.
Each full block gets a key that identifies the exact tokens from the start of the sequence up
to the end of that block; a new prompt looks its blocks' keys up and reuses every block found,
in order, until the first miss.

**Why only full blocks.** A block that is still being filled will change (the owner keeps
writing into its free slots), so it cannot be shared; and a key must name a fixed token
content. Once a block's ``block_size`` tokens are all written it is immutable and can be cached.

**Why keys chain.** The K/V of a token depend on *every* token before it (attention looks
back), not just on the tokens in its own block. So a block's key combines its parent block's
key with its own token ids: two blocks holding the same tokens after different prefixes get
different keys. Keys compare their exact tokens (the whole chain), so a hash collision can
never hand out the wrong block; Python's ``hash`` only picks the dictionary bucket.

**Reference counts and lazy eviction.** Several live requests may share one block; its
reference count is the number of owners. A block whose count drops to zero goes to the tail of
the free queue *but keeps its cached key*: a later request with the same prefix may still hit
it and revive it with :meth:`BlockPool.touch`. Only when the block is taken from the head of
the queue for a new allocation is its key dropped (an *eviction*). The free queue is in LRU
order, so the least recently freed block is evicted first.
"""

from __future__ import annotations

import operator
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than the pool has free."""


def _chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Bucket hash of a block key. Only speeds up lookups: equality checks the exact tokens."""
    return hash((parent_hash, token_ids))


class BlockKey:
    """The identity of a full block's content: its parent's key plus its own token ids.

    ``parent`` is ``None`` for the first block of a sequence. Two keys are equal only when
    their token ids are equal block by block all the way back to the first block, so equal
    keys mean equal K/V content. The chain hash is computed once and cached.
    """

    __slots__ = ("_hash", "parent", "token_ids")

    def __init__(self, parent: BlockKey | None, token_ids: Sequence[int]):
        self.parent = parent
        self.token_ids = tuple(int(t) for t in token_ids)
        self._hash = _chain_hash(None if parent is None else parent._hash, self.token_ids)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        a: BlockKey | None = self
        b: BlockKey | None = other
        # Walk both chains; stop early when they reach the very same parent object
        # (the pool reuses cached key objects as parents, so hits usually stop at once).
        while a is not b:
            if a is None or b is None or a._hash != b._hash or a.token_ids != b.token_ids:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        depth, k = 0, self.parent
        while k is not None:
            depth, k = depth + 1, k.parent
        return f"BlockKey(index={depth}, token_ids={self.token_ids}, hash={self._hash:#x})"


@dataclass(slots=True)
class BlockPoolStats:
    """Counters of a :class:`BlockPool`.

    num_free_blocks counts evictable cached blocks too (they can be allocated at any time);
    num_cached_blocks counts blocks that hold a prefix-cache key, free or in use.
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


@dataclass(slots=True, frozen=True)
class BlockInfo:
    """One block's state, for drawing the pool as a grid.

    lru_position is the block's place in the free queue (0 = evicted next), None when in use.
    """

    block_id: int
    ref_count: int
    is_cached: bool
    in_free_queue: bool
    lru_position: int | None


class BlockPool:
    """Hands out KV-cache blocks by id, counts their owners and caches full-block prefixes.

    Args:
      num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).
      block_size: token slots per block.
      enable_prefix_caching: when False, :meth:`lookup` always misses and
        :meth:`cache_blocks` registers nothing (blocks are still reference counted).

    A request's life: ``hits = lookup(prompt)``; ``touch(hits)``; ``allocate(n)`` for the
    rest; after each step ``cache_blocks(...)`` for blocks that became full; at the end
    ``free(block_table)``. Touch the hits *before* allocating: a hit block may sit in the
    free queue, and an allocation could otherwise evict the very blocks just found (for the
    same reason, ask :meth:`can_allocate` after touching).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if int(num_blocks) < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if int(block_size) < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref_counts = [0] * self.num_blocks
        # Free queue in LRU order: head = evicted/allocated next, tail = most recently freed.
        # An OrderedDict gives O(1) pop from the head, append at the tail and removal from
        # the middle (a cache hit reviving a free block).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))
        self._block_key: list[BlockKey | None] = [None] * self.num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._queries = self._hit_tokens = self._query_tokens = self._evictions = 0

    # ------------------------------------------------------------------ allocation
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, including free blocks still holding a cached prefix."""
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether :meth:`allocate` of ``n`` blocks would succeed."""
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue; each gets reference count 1.

        A taken block that still holds a cached prefix is evicted now (its key is dropped).
        Raises NoFreeBlocksError when fewer than ``n`` blocks are free (nothing is taken).
        """
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        blocks = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def _evict(self, block_id: int) -> None:
        """Drop the cached key of a block that is about to get new content."""
        key = self._block_key[block_id]
        if key is not None:
            del self._cached[key]
            self._block_key[block_id] = None
            self._evictions += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block of a request's block table.

        Blocks are released tail first, so the request's *first* block lands at the tail of
        the free queue and is evicted last: the head of a prefix is what other requests are
        most likely to share, and a cached child block is useless once its parent is evicted
        (lookups stop at the first miss). Raises ValueError, changing nothing, if a block is
        unknown or would be freed more times than it is referenced.
        """
        ids = [self._check_id(b) for b in block_ids]
        for block_id, times in Counter(ids).items():
            if self._ref_counts[block_id] < times:
                raise ValueError(
                    f"block {block_id} has reference count {self._ref_counts[block_id]}, "
                    f"cannot free it {times} time(s) (double free?)"
                )
        for block_id in reversed(ids):
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block that :meth:`lookup` returned.

        A free cached block (count 0) leaves the free queue, so it can no longer be evicted.
        Raises ValueError, changing nothing, for an unknown id or a free block with no cached
        prefix (there is nothing to share in it).
        """
        ids = [self._check_id(b) for b in block_ids]
        for block_id in ids:
            if self._ref_counts[block_id] == 0 and self._block_key[block_id] is None:
                raise ValueError(f"block {block_id} is free and holds no cached prefix")
        for block_id in ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def ref_count(self, block_id: int) -> int:
        """Number of live owners of a block (0 when free)."""
        return self._ref_counts[self._check_id(block_id)]

    def _check_id(self, block_id: int) -> int:
        block_id = operator.index(block_id)
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"unknown block id {block_id} (pool has {self.num_blocks} blocks)")
        return block_id

    # ------------------------------------------------------------------ prefix caching
    def block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Chained keys of every *full* block of ``token_ids`` (a trailing partial block has none)."""
        keys: list[BlockKey] = []
        parent = None
        for i in range(len(token_ids) // self.block_size):
            parent = BlockKey(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            keys.append(parent)
        return keys

    def lookup(self, token_ids: Sequence[int], *, record_stats: bool = True) -> list[int]:
        """Cached blocks holding the longest full-block prefix of ``token_ids``, in order.

        The hit never covers the whole prompt: at least one token must still run through
        the model to produce the logits of the next token, so a prompt of exactly
        ``k * block_size`` tokens can hit at most ``k - 1`` blocks (that last block is
        recomputed). Counts one query unless ``record_stats=False`` (a caller that may retry
        the same lookup counts it once with :meth:`record_lookup`); takes no references
        (call :meth:`touch` for that).
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        hits: list[int] = []
        parent = None
        for i in range(max_blocks):
            key = BlockKey(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block_id = self._cached.get(key)
            if block_id is None:
                break
            hits.append(block_id)
            parent = self._block_key[block_id]  # the stored object: later compares stop early
        if record_stats:
            self.record_lookup(len(token_ids), len(hits))
        return hits

    def record_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count one prefix-cache query of ``num_tokens`` tokens that hit ``num_hit_blocks`` blocks."""
        if not self.enable_prefix_caching:
            return
        self._queries += 1
        self._query_tokens += int(num_tokens)
        self._hit_tokens += int(num_hit_blocks) * self.block_size

    def cache_blocks(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> int:
        """Register the keys of a request's blocks that just became full.

        Args:
          token_ids: the request's tokens so far (at least ``num_full_blocks * block_size``).
          block_ids: the request's block table.
          num_cached_blocks: its blocks already handled by earlier calls (or prefix hits).
          num_full_blocks: its blocks that are full now.
        Returns ``num_full_blocks``, the request's new cached count. A block whose key is
        already cached under another block is left uncached: the existing mapping stays,
        so every key maps to one block.
        """
        num_cached_blocks, num_full_blocks = self._check_cache_args(
            token_ids, block_ids, num_cached_blocks, num_full_blocks
        )
        if not self.enable_prefix_caching or num_full_blocks == num_cached_blocks:
            return num_full_blocks
        parent = self._parent_key(token_ids, block_ids, num_cached_blocks)
        bs = self.block_size
        for i in range(num_cached_blocks, num_full_blocks):
            key = BlockKey(parent, token_ids[i * bs : (i + 1) * bs])
            parent = self._register(key, block_ids[i])
        return num_full_blocks

    def _check_cache_args(self, token_ids, block_ids, num_cached_blocks, num_full_blocks):
        num_cached_blocks = operator.index(num_cached_blocks)
        num_full_blocks = operator.index(num_full_blocks)
        if not 0 <= num_cached_blocks <= num_full_blocks:
            raise ValueError(
                f"need 0 <= num_cached_blocks ({num_cached_blocks}) <= num_full_blocks ({num_full_blocks})"
            )
        if num_full_blocks > len(block_ids):
            raise ValueError(f"num_full_blocks ({num_full_blocks}) exceeds the {len(block_ids)} blocks given")
        if num_full_blocks * self.block_size > len(token_ids):
            raise ValueError(
                f"{len(token_ids)} tokens fill only {len(token_ids) // self.block_size} blocks, "
                f"not num_full_blocks={num_full_blocks}"
            )
        for b in block_ids[num_cached_blocks:num_full_blocks]:
            if self._ref_counts[self._check_id(b)] == 0:
                raise ValueError(f"block {b} is free: only owned blocks can be cached")
        return num_cached_blocks, num_full_blocks

    def _parent_key(self, token_ids, block_ids, num_cached_blocks: int) -> BlockKey | None:
        """Key of block ``num_cached_blocks - 1``: the stored object when it has one."""
        if num_cached_blocks == 0:
            return None
        stored = self._block_key[self._check_id(block_ids[num_cached_blocks - 1])]
        if stored is not None:
            return stored
        return self.block_keys(token_ids[: num_cached_blocks * self.block_size])[-1]

    def _register(self, key: BlockKey, block_id: int) -> BlockKey:
        """Cache ``key`` under ``block_id`` unless it is already cached; return the stored key."""
        existing = self._cached.get(key)
        if existing is not None:
            return self._block_key[existing]
        if self._block_key[block_id] is not None:
            raise ValueError(f"block {block_id} already caches {self._block_key[block_id]!r}, not {key!r}")
        self._cached[key] = block_id
        self._block_key[block_id] = key
        return key

    def is_cached(self, block_id: int) -> bool:
        """Whether the block holds a cached prefix (live or free)."""
        return self._block_key[self._check_id(block_id)] is not None

    def uncache(self, block_ids: Sequence[int]) -> None:
        """Drop the cached keys of these blocks (their content is not what the key says,
        e.g. the step that was to write it failed). Blocks stay allocated or free."""
        for block_id in block_ids:
            key = self._block_key[self._check_id(block_id)]
            if key is not None:
                del self._cached[key]
                self._block_key[block_id] = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (blocks stay allocated or free as they were).

        Returns the number of keys dropped.
        """
        dropped = len(self._cached)
        self._cached.clear()
        self._block_key = [None] * self.num_blocks
        return dropped

    # ------------------------------------------------------------------ inspection
    def stats(self) -> BlockPoolStats:
        """A snapshot of the pool's counters."""
        free = len(self._free)
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            num_free_blocks=free,
            num_used_blocks=self.num_blocks - free,
            num_cached_blocks=len(self._cached),
            queries=self._queries,
            hit_tokens=self._hit_tokens,
            query_tokens=self._query_tokens,
            hit_rate=self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
            evictions=self._evictions,
        )

    def snapshot(self) -> list[BlockInfo]:
        """Per-block state in block id order, for drawing the pool."""
        position = {block_id: i for i, block_id in enumerate(self._free)}
        return [
            BlockInfo(
                block_id=b,
                ref_count=self._ref_counts[b],
                is_cached=self._block_key[b] is not None,
                in_free_queue=b in position,
                lru_position=position.get(b),
            )
            for b in range(self.num_blocks)
        ]

    def check_invariants(self) -> None:
        """Raise RuntimeError if the pool's bookkeeping is inconsistent (for tests and debugging)."""
        counts = self._ref_counts
        for b, count in enumerate(counts):
            if count < 0:
                raise RuntimeError(f"block {b} has negative reference count {count}")
        for b in self._free:
            if not 0 <= b < self.num_blocks:
                raise RuntimeError(f"free queue holds unknown block id {b}")
            if counts[b] != 0:
                raise RuntimeError(f"block {b} is in the free queue with reference count {counts[b]}")
        used = sum(1 for c in counts if c > 0)
        if len(self._free) + used != self.num_blocks:
            raise RuntimeError(f"free ({len(self._free)}) + used ({used}) != total ({self.num_blocks})")
        self._check_cache_invariants()

    def _check_cache_invariants(self) -> None:
        for key, b in self._cached.items():
            if self._block_key[b] is not key:
                raise RuntimeError(f"key {key!r} maps to block {b}, which caches {self._block_key[b]!r}")
        num_keyed = sum(1 for k in self._block_key if k is not None)
        if num_keyed != len(self._cached):
            raise RuntimeError(f"{num_keyed} blocks hold a key but the cache maps {len(self._cached)} keys")

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"BlockPool(num_blocks={s.num_blocks}, block_size={self.block_size}, "
            f"free={s.num_free_blocks}, cached={s.num_cached_blocks}, "
            f"hit_rate={s.hit_rate:.2f}, evictions={s.evictions})"
        )
