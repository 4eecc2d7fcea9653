"""The hash-chain prefix cache (vLLM's design): every full block keyed by its whole prefix.

Each full block gets a key that identifies the exact tokens from the start of the sequence up
to the end of that block; a new prompt looks its blocks' keys up and reuses every block found,
in order, until the first miss.

**Why only full blocks.** A block that is still being filled will change (the owner keeps
writing into its free slots), so it cannot be shared; and a key must name a fixed token
content. Once a block's ``block_size`` tokens are all written it is immutable and can be cached.
A prefix that ends inside a block is served at page granularity: its last partial block is
recomputed.

**Why keys chain.** The K/V of a token depend on *every* token before it (attention looks
back), not just on the tokens in its own block. So a block's key combines its parent block's
key with its own token ids: two blocks holding the same tokens after different prefixes get
different keys. Keys compare their exact tokens (the whole chain), so a hash collision can
never hand out the wrong block; Python's ``hash`` only picks the dictionary bucket.

**Lazy eviction.** A cached block whose last owner lets it go stays in the pool's LRU free
queue *with its key* (this cache :meth:`~HashChainCache.keeps` nothing itself): a later request
with the same prefix may still hit it and revive it. Only when the pool takes the block from
the head of its queue for new content is the key dropped (:meth:`~HashChainCache.forget`, an
*eviction*). The pool frees a request's blocks tail first, so a prefix's head is evicted last.
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetlab.prefix_cache import PrefixCache


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
        # (the cache reuses stored key objects as parents, so hits usually stop at once).
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


class HashChainCache(PrefixCache):
    """Full blocks by chained key: ``{BlockKey: block_id}`` and each block's key."""

    name = "hash"

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self._cached: dict[BlockKey, int] = {}
        self._block_key: dict[int, BlockKey] = {}

    def block_keys(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Chained keys of every *full* block of ``token_ids`` (a trailing partial block has none)."""
        keys: list[BlockKey] = []
        parent, bs = None, self.block_size
        for i in range(len(token_ids) // bs):
            parent = BlockKey(parent, token_ids[i * bs : (i + 1) * bs])
            keys.append(parent)
        return keys

    def lookup(self, token_ids: Sequence[int], *, record_stats: bool = True) -> list[int]:
        """Cached blocks holding the longest full-block prefix of ``token_ids``, in order.

        Never the whole prompt (a prompt of exactly ``k`` blocks hits at most ``k - 1``).
        Counts one query unless ``record_stats=False`` (a caller that may retry counts it once
        with :meth:`record_lookup`); takes no references (the pool's ``touch`` does).
        """
        hits: list[int] = []
        parent, bs = None, self.block_size
        for i in range(self.max_hit_blocks(len(token_ids))):
            block_id = self._cached.get(BlockKey(parent, token_ids[i * bs : (i + 1) * bs]))
            if block_id is None:
                break
            hits.append(block_id)
            parent = self._block_key[block_id]  # the stored object: later compares stop early
        if record_stats:
            self.record_lookup(len(token_ids), len(hits))
        return hits

    def cache_blocks(self, token_ids, block_ids, num_cached_blocks, num_full_blocks) -> int:
        """Register the keys of blocks ``[num_cached_blocks, num_full_blocks)`` of a request's
        table (they just became full). Returns ``num_full_blocks``. A block whose key is already
        cached under another block stays uncached: every key maps to one block."""
        start, end = self.check_cache_args(token_ids, block_ids, num_cached_blocks, num_full_blocks)
        if start == end:
            return end
        bs = self.block_size
        parent = self._block_key.get(block_ids[start - 1]) if start else None
        if start and parent is None:  # that block's content was cached under another block
            parent = self.block_keys(token_ids[: start * bs])[-1]
        for i in range(start, end):
            parent = self._register(BlockKey(parent, token_ids[i * bs : (i + 1) * bs]), block_ids[i])
        return end

    def _register(self, key: BlockKey, block_id: int) -> BlockKey:
        """Cache ``key`` under ``block_id`` unless it is already cached; return the stored key."""
        existing = self._cached.get(key)
        if existing is not None:
            return self._block_key[existing]
        if block_id in self._block_key:
            raise ValueError(f"block {block_id} already caches {self._block_key[block_id]!r}, not {key!r}")
        self._cached[key] = block_id
        self._block_key[block_id] = key
        return key

    def forget(self, block_id: int) -> None:
        """The pool reuses this free block: its key goes (an eviction)."""
        key = self._block_key.pop(block_id, None)
        if key is not None:
            del self._cached[key]
            self.evictions += 1

    def uncache(self, block_ids: Sequence[int]) -> list[int]:
        dropped = []
        for block_id in block_ids:
            key = self._block_key.pop(block_id, None)
            if key is not None:
                del self._cached[key]
                dropped.append(block_id)
        return dropped

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._block_key

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def reset(self) -> int:
        """Forget every cached prefix (blocks stay allocated or free); returns the keys dropped."""
        dropped = len(self._cached)
        self._cached.clear()
        self._block_key.clear()
        return dropped

    def check_invariants(self) -> None:
        for key, b in self._cached.items():
            if self._block_key.get(b) is not key:
                raise RuntimeError(f"key {key!r} maps to block {b}, which caches {self._block_key.get(b)!r}")
        if len(self._block_key) != len(self._cached):
            raise RuntimeError(f"{len(self._block_key)} blocks hold a key but the cache maps {len(self._cached)} keys")
