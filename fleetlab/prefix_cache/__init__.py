"""Prefix caching, two designs behind one interface: ``LLM(prefix_cache="hash" | "radix" | None)``.

A prefix cache remembers which blocks of the pool hold the K/V of which token prefix, so a new
request starting with the same tokens shares those blocks instead of recomputing them.
Both designs share *whole pages*: a page is one KV block (``block_size`` tokens), and only a
block whose tokens are all written is ever shared. Where a match ends inside a page they differ:

- ``"hash"`` (:class:`~fleetlab.prefix_cache.hash_chain.HashChainCache`, vLLM's design): each
  full block is keyed by a chain of its parent's key and its own tokens; cached blocks with no
  owner wait in the pool's LRU free queue and lose their key when the pool reuses them. A match
  ends on a block boundary: the tokens of a partly matching block are recomputed.
- ``"radix"`` (:class:`~fleetlab.prefix_cache.radix.RadixCache`, SGLang's RadixAttention): a
  radix tree over token ids whose edges are runs of whole pages; it keeps its unreferenced
  blocks itself and gives back least-recently-released leaves when the pool runs short. It
  matches token by token: the matched head of a partly matching page is copied into the
  request's own block (:meth:`PrefixCache.lookup_partial`, :mod:`fleetlab.kv.copies`).

The cache plugs into :class:`~fleetlab.BlockPool` at three named hooks (``keeps``,
``forget``, ``evict``; see :class:`PrefixCache`) and is asked by the
:class:`~fleetlab.kv.manager.KVCacheManager` to ``lookup`` and ``cache_blocks``. Register your
own design with :func:`register_prefix_cache` to choose it by name.
"""

from __future__ import annotations

import operator
from collections.abc import Collection, Sequence

from fleetlab.errors import bad_return, call_extension, int_in
from fleetlab.registry import Registry

KIND = "prefix cache"


class PrefixCache:
    """The interface a prefix-cache design implements (and its hit-rate counters).

    Called by the KV manager: :meth:`lookup` (hits for a new prompt), :meth:`lookup_partial` (a
    block whose head continues the match, to copy; none by default), :meth:`cache_blocks`
    (blocks that became full), :meth:`uncache` (registrations of a step that never ran),
    :meth:`is_cached`. Called by the pool, at its hooks:

    - ``keeps(block_id)``: the block's last owner let it go; True if the cache holds on to it
      (it leaves the pool's free queue until :meth:`evict` gives it back);
    - ``forget(block_id)``: the pool takes a block from its free queue for new content;
    - ``evict(n)``: the free queue is short; give back up to ``n`` unreferenced blocks.
    """

    name = ""

    def __init__(self, block_size: int):
        self.block_size = int(block_size)
        self.queries = self.hit_tokens = self.query_tokens = self.evictions = 0
        self._ref_count = lambda block_id: 0  # the pool's, once attached

    def attach(self, pool) -> None:
        """Called by the pool this cache serves (the cache reads its reference counts). One cache
        serves one pool: a second pool is refused (two engines would share its entries, each
        naming blocks of the other's pool)."""
        if pool.block_size != self.block_size:
            raise ValueError(f"{type(self).__name__} has block_size {self.block_size}, the pool {pool.block_size}")
        serving = getattr(self._ref_count, "__self__", None)
        if serving is not None and serving is not pool:
            raise ValueError(f"prefix_cache: this {type(self).__name__} instance already serves another pool (another "
                             "engine's); give each engine its own: a name or a class, or a new instance")
        self._ref_count = pool.ref_count

    # ----- pool hooks (defaults: a cache that keeps nothing of its own)
    def keeps(self, block_id: int) -> bool:
        return False

    def forget(self, block_id: int) -> None:
        pass

    def evict(self, n: int) -> list[int]:
        return []

    # ----- what the manager asks
    def lookup(self, token_ids: Sequence[int], *, record_stats: bool = True) -> list[int]:
        """The cached blocks holding the longest prefix of ``token_ids`` in whole blocks, in order
        (at most :meth:`max_hit_blocks`); counts the query when ``record_stats``. Takes no
        references (the manager touches the hits)."""
        raise self._missing("lookup")

    def lookup_partial(self, token_ids: Sequence[int], num_hit_blocks: int,
                       exclude: Collection[int] = ()) -> tuple[int, int] | None:
        """A cached block whose first tokens continue the match past the ``num_hit_blocks`` blocks
        :meth:`lookup` found: ``(block_id, num_tokens)``, ``0 < num_tokens < block_size``, the
        match never reaching the prompt's last token; never a block in ``exclude`` (a copy of this
        step writes into it); None when no block does (the default: a design that shares whole pages
        only). Takes no references, counts nothing."""
        return None

    def cache_tail(self, token_ids: Sequence[int], block_ids: Sequence[int], num_tokens: int) -> bool:
        """A finished request lets its blocks go; the first ``num_tokens`` of ``token_ids`` have their
        K/V written, the last ``num_tokens % block_size`` of them in its partly filled block
        ``block_ids[num_tokens // block_size]``. True if the cache keeps that block to copy from
        (:meth:`lookup_partial`); the default keeps whole blocks only."""
        return False

    def cache_blocks(self, token_ids: Sequence[int], block_ids: Sequence[int], num_cached_blocks: int,
                     num_full_blocks: int) -> int:
        """Register a request's blocks ``[num_cached_blocks, num_full_blocks)`` of ``block_ids``,
        each now full of the tokens ``token_ids`` holds there (:meth:`check_cache_args` checks
        the arguments); returns the new ``num_cached_blocks`` (the request's blocks registered)."""
        raise self._missing("cache_blocks")

    def uncache(self, block_ids: Sequence[int]) -> list[int]:
        """Drop these blocks' entries; returns every block that left the cache."""
        raise self._missing("uncache")

    def is_cached(self, block_id: int) -> bool:
        """True while ``block_id`` holds a prefix this cache can hand out (owned or not); the pool
        and :func:`fleetlab.inspect.check_pool` read it."""
        raise self._missing("is_cached")

    @property
    def num_cached_blocks(self) -> int:
        """How many blocks of the pool this cache names now (what ``LLM.stats()`` reports)."""
        raise self._missing("num_cached_blocks")

    def _missing(self, method: str) -> NotImplementedError:
        return NotImplementedError(f"prefix cache {type(self).__name__!r} does not implement {method}(): a "
                                   f"PrefixCache subclass must define lookup, cache_blocks, uncache, is_cached "
                                   f"and num_cached_blocks")

    def check_invariants(self) -> None:
        """Raise RuntimeError if the cache's bookkeeping is inconsistent (tests, debugging)."""

    def eviction_order(self, block_ids) -> list[int]:
        """The free blocks this cache keeps, in the order :meth:`evict` would give them (drawings)."""
        return sorted(block_ids)

    # ----- shared pieces
    def max_hit_blocks(self, num_tokens: int) -> int:
        """A hit never covers the whole prompt: one token must run to give the next logits."""
        return max(0, (num_tokens - 1) // self.block_size)

    def record_lookup(self, num_tokens: int, num_hit_blocks: int, num_copied_tokens: int = 0) -> None:
        """Count one query of ``num_tokens`` tokens that hit ``num_hit_blocks`` blocks and
        ``num_copied_tokens`` tokens of one more (a partial hit, copied)."""
        self.queries += 1
        self.query_tokens += int(num_tokens)
        self.hit_tokens += int(num_hit_blocks) * self.block_size + int(num_copied_tokens)

    def lookup_counters(self) -> tuple[int, int, int]:
        """``(queries, query_tokens, hit_tokens)``: what :meth:`restore_lookup_counters` puts back
        when a step that counted admissions is rolled back (it never happened)."""
        return self.queries, self.query_tokens, self.hit_tokens

    def restore_lookup_counters(self, counters: tuple[int, int, int]) -> None:
        self.queries, self.query_tokens, self.hit_tokens = counters

    def check_cache_args(self, token_ids, block_ids, num_cached_blocks, num_full_blocks) -> tuple[int, int]:
        """The arguments of :meth:`cache_blocks`, checked (ValueError names the bad one)."""
        num_cached_blocks, num_full_blocks = operator.index(num_cached_blocks), operator.index(num_full_blocks)
        if not 0 <= num_cached_blocks <= num_full_blocks:
            raise ValueError(f"need 0 <= num_cached_blocks ({num_cached_blocks}) <= num_full_blocks "
                             f"({num_full_blocks})")
        if num_full_blocks > len(block_ids):
            raise ValueError(f"num_full_blocks ({num_full_blocks}) exceeds the {len(block_ids)} blocks given")
        if num_full_blocks * self.block_size > len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens fill only {len(token_ids) // self.block_size} blocks, "
                             f"not num_full_blocks={num_full_blocks}")
        for b in block_ids[num_cached_blocks:num_full_blocks]:
            if self._ref_count(b) == 0:
                raise ValueError(f"block {b} is free: only owned blocks can be cached")
        return num_cached_blocks, num_full_blocks


def cache_call(cache: PrefixCache, method: str, *args, **kwargs):
    """``cache.method(...)``, an exception it raises named (:class:`~fleetlab.errors.ExtensionError`)."""
    return call_extension(KIND, cache, method, *args, **kwargs)


def checked_hits(cache: PrefixCache, hits, num_tokens: int, num_blocks: int) -> list[int]:
    """What ``lookup`` returned for ``num_tokens`` tokens: distinct block ids of the pool
    (``[0, num_blocks)``), at most ``max_hit_blocks(num_tokens)`` of them; else ExtensionError."""
    most = cache.max_hit_blocks(num_tokens)
    try:
        ids = [operator.index(b) for b in hits]
    except TypeError:
        ids = None
    if ids is not None and len(ids) <= most and len(set(ids)) == len(ids) and all(0 <= b < num_blocks for b in ids):
        return ids
    raise bad_return(KIND, cache, "lookup", hits, f"it must return distinct block ids in [0, {num_blocks}), at "
                     f"most {most} for {num_tokens} tokens (a hit never covers the whole prompt)")


def checked_evicted(cache: PrefixCache, value, n: int, kept: set) -> list[int]:
    """What ``evict(n)`` returned: ``n`` distinct blocks among those it keeps (``kept``, the pool's
    count of free blocks included them); else ExtensionError."""
    try:
        ids = [operator.index(b) for b in value]
    except TypeError:
        ids = None
    if ids is not None and len(ids) == n and len(set(ids)) == n and all(b in kept for b in ids):
        return ids
    raise bad_return(KIND, cache, "evict", value, f"asked for {n} blocks, it must return {n} distinct blocks "
                     "among the free ones it keeps")


def checked_num_cached(cache: PrefixCache, value, num_cached_blocks: int, num_full_blocks: int) -> int:
    """What ``cache_blocks`` returned: the request's new count of cached leading blocks, an int in
    ``[num_cached_blocks, num_full_blocks]``; else ExtensionError."""
    if (n := int_in(value, num_cached_blocks, num_full_blocks)) is not None:
        return n
    raise bad_return(KIND, cache, "cache_blocks", value,
                     f"it must return an int in [num_cached_blocks={num_cached_blocks}, "
                     f"num_full_blocks={num_full_blocks}] (the leading blocks now cached)")


def check_partial_hit(cache: PrefixCache, hit, token_ids: Sequence[int], num_hit_blocks: int,
                      exclude: Collection[int] = ()):
    """What :meth:`PrefixCache.lookup_partial` returned, checked where the KV manager receives it:
    None, or ``(block_id, num_tokens)`` of a cached block outside ``exclude`` with ``0 < num_tokens
    < block_size`` and the match short of the prompt's last token; else ExtensionError."""
    if hit is None:
        return None
    limit = min(cache.block_size - 1, len(token_ids) - 1 - num_hit_blocks * cache.block_size)
    try:
        block_id, num_tokens = (operator.index(x) for x in hit)
    except (TypeError, ValueError):
        block_id = num_tokens = None
    rule = (f"it must return None or (block_id, num_tokens) of a cached block, 1 to {limit} tokens for a prompt "
            f"of {len(token_ids)} after {num_hit_blocks} whole blocks")
    if num_tokens is None or not 0 < num_tokens <= limit or not cache.is_cached(block_id):
        raise bad_return(KIND, cache, "lookup_partial", hit, rule)
    if block_id in exclude:
        raise bad_return(KIND, cache, "lookup_partial", hit, "that block was excluded: a copy planned in this step "
                         "writes into it")
    return block_id, num_tokens


PREFIX_CACHES = Registry("prefix_cache", PrefixCache, {
    "hash": "fleetlab.prefix_cache.hash_chain:HashChainCache",
    "radix": "fleetlab.prefix_cache.radix:RadixCache",
})
register_prefix_cache = PREFIX_CACHES.register


def build_prefix_cache(spec, block_size: int) -> PrefixCache | None:
    """The cache ``LLM(prefix_cache=spec)`` names: None for none, else a registered name, a
    :class:`PrefixCache` subclass (built with ``block_size``) or an instance."""
    return None if spec is None else PREFIX_CACHES.make(spec, block_size)
