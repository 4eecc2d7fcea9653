"""Tests of fleetlab.BlockPool with the hash-chain prefix cache: reference counts, LRU free queue,
lazy eviction, prefix caching."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import fleetlab.prefix_cache.hash_chain as block_pool_module
from fleetlab.inspect.pool import BlockInfo, BlockPoolStats, check_pool, pool_snapshot, pool_stats
from fleetlab.kv.block_pool import BlockPool as PlainPool
from fleetlab.kv.block_pool import NoFreeBlocksError
from fleetlab.prefix_cache.hash_chain import HashChainCache


class BlockPool:
    """A pool and its hash-chain cache spoken to as one object, as these tests were written (the
    pool hands out blocks, the cache finds and registers prefixes, inspection is beside both)."""

    def __init__(self, num_blocks, block_size, enable_prefix_caching=True):
        self.cache = HashChainCache(block_size) if enable_prefix_caching else None
        self.pool = PlainPool(num_blocks, block_size, self.cache)

    def __getattr__(self, name):
        return getattr(self.pool if hasattr(self.pool, name) else self.cache, name)

    def lookup(self, tokens, **kw):
        return self.cache.lookup(tokens, **kw) if self.cache else []

    def cache_blocks(self, tokens, blocks, num_cached, num_full):
        return self.cache.cache_blocks(tokens, blocks, num_cached, num_full) if self.cache else num_full

    def record_lookup(self, *args):
        if self.cache:
            self.cache.record_lookup(*args)

    def can_allocate(self, n):
        return 0 <= n <= self.pool.num_free_blocks

    def reset_prefix_cache(self):
        return self.cache.reset()

    def snapshot(self):
        return pool_snapshot(self.pool)

    def stats(self):
        return pool_stats(self.pool)

    def check_invariants(self):
        check_pool(self.pool)


def _run_request(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Admit a request the way the scheduler will: hit, touch, allocate the rest, cache full blocks."""
    hits = pool.lookup(tokens)
    pool.touch(hits)
    blocks = hits + pool.allocate(-(-len(tokens) // pool.block_size) - len(hits))
    pool.cache_blocks(tokens, blocks, len(hits), len(tokens) // pool.block_size)
    return blocks


# ---------------------------------------------------------------- allocation basics
def test_allocate_and_free_track_reference_counts():
    pool = BlockPool(num_blocks=6, block_size=4)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert len(set(a + b)) == 5
    assert all(pool.ref_count(x) == 1 for x in a + b)
    assert pool.num_free_blocks == 1 and pool.can_allocate(1) and not pool.can_allocate(2)
    assert pool.allocate(0) == []
    pool.free(a)
    assert all(pool.ref_count(x) == 0 for x in a)
    assert pool.num_free_blocks == 3
    pool.free(b)
    s = pool.stats()
    assert isinstance(s, BlockPoolStats)
    assert (s.num_free_blocks, s.num_used_blocks, s.num_cached_blocks) == (6, 0, 0)
    pool.check_invariants()


def test_allocation_takes_from_the_head_and_free_appends_tail_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.allocate(4)
    assert blocks == [0, 1, 2, 3]  # a fresh queue is in id order
    pool.free(blocks)
    assert [i.block_id for i in sorted(pool.snapshot(), key=lambda i: i.lru_position)] == [3, 2, 1, 0]


def test_shared_block_needs_every_owner_to_free_it():
    pool = BlockPool(num_blocks=4, block_size=2)
    first = _run_request(pool, [1, 2, 3, 4, 5])
    second = _run_request(pool, [1, 2, 3, 4, 9])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert [pool.ref_count(b) for b in first] == [2, 2, 1]
    pool.free(first)
    assert [pool.ref_count(b) for b in second] == [1, 1, 1]
    assert pool.num_free_blocks == 1
    pool.free(second)
    assert pool.num_free_blocks == 4
    pool.check_invariants()


# ---------------------------------------------------------------- error paths
@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4)])
def test_constructor_rejects_empty_pools(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockPool(num_blocks, block_size)


def test_allocating_too_many_raises_and_takes_nothing():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError, match=r"asked for 5 .* only 3") as info:
        pool.allocate(5)
    assert isinstance(info.value, RuntimeError)
    assert pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="negative"):
        pool.allocate(-1)


def test_free_errors_name_the_block_and_change_nothing():
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.allocate(2)
    pool.free([b])
    with pytest.raises(ValueError, match=f"block {b} "):
        pool.free([b])  # double free
    with pytest.raises(ValueError, match="99"):
        pool.free([a, 99])  # unknown id
    with pytest.raises(ValueError, match="-1"):
        pool.free([-1])
    with pytest.raises(ValueError, match=f"block {a} "):
        pool.free([a, a])  # one reference, two frees in one call
    assert pool.ref_count(a) == 1 and pool.ref_count(b) == 0  # all-or-nothing
    pool.check_invariants()


def test_touch_and_ref_count_errors():
    pool = BlockPool(num_blocks=4, block_size=2)
    with pytest.raises(ValueError, match="7"):
        pool.touch([7])
    with pytest.raises(ValueError, match="block 0 .*no cached prefix"):
        pool.touch([0])
    with pytest.raises(ValueError, match="4"):
        pool.ref_count(4)
    assert pool.num_free_blocks == 4


def test_cache_blocks_rejects_bad_ranges():
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.allocate(2)
    tokens = [1, 2, 3, 4]
    with pytest.raises(ValueError, match="num_cached_blocks"):
        pool.cache_blocks(tokens, blocks, 2, 1)
    with pytest.raises(ValueError, match="num_full_blocks"):
        pool.cache_blocks(tokens + [5, 6], blocks, 0, 3)
    with pytest.raises(ValueError, match="3 tokens"):
        pool.cache_blocks(tokens[:3], blocks, 0, 2)
    pool.free(blocks)
    with pytest.raises(ValueError, match=f"block {blocks[0]} is free"):
        pool.cache_blocks(tokens, blocks, 0, 2)
    assert pool.stats().num_cached_blocks == 0


def test_check_invariants_catches_corruption():
    def corrupted(how):
        pool = BlockPool(num_blocks=4, block_size=2)
        blocks = _run_request(pool, [1, 2, 3, 4, 5])
        how(pool, blocks)
        return pool

    cases = {
        "negative": lambda p, b: p._ref_counts.__setitem__(3, -1),
        "free queue with reference count": lambda p, b: p._free.__setitem__(b[0], None),
        r"free \(1\) \+ used \(2\) != total": lambda p, b: p._ref_counts.__setitem__(b[2], 0),
        "maps to block": lambda p, b: p._cached.__setitem__(p._block_key[b[0]], b[1]),
    }
    for message, how in cases.items():
        with pytest.raises(RuntimeError, match=message):
            corrupted(how).check_invariants()


# ---------------------------------------------------------------- prefix caching
def test_block_keys_chain_their_parents():
    pool = BlockPool(num_blocks=4, block_size=2)
    keys = pool.block_keys([1, 2, 3, 4, 5])
    assert len(keys) == 2  # the partial block [5] has no key
    assert keys == pool.block_keys(np.array([1, 2, 3, 4]))
    other = pool.block_keys([9, 2, 3, 4])
    assert other[1].token_ids == keys[1].token_ids
    assert other[1] != keys[1]  # same tokens after a different prefix: different content


def test_hits_only_on_identical_prefixes():
    pool = BlockPool(num_blocks=8, block_size=2)
    blocks = _run_request(pool, [1, 2, 3, 4, 5, 6, 7])
    pool.free(blocks)
    assert pool.lookup([1, 2, 3, 4, 5, 6, 0]) == blocks[:3]
    assert pool.lookup([1, 2, 3, 0, 5, 6, 7]) == blocks[:1]
    assert pool.lookup([0, 2, 3, 4, 5, 6, 7]) == []  # block 0 differs: later matches don't count
    assert pool.lookup([2, 1, 3, 4, 5, 6, 7]) == []
    assert pool.lookup(np.array([1, 2, 3, 4, 9])) == blocks[:2]


def test_lookup_never_covers_the_whole_prompt():
    pool = BlockPool(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    blocks = _run_request(pool, tokens)
    assert pool.stats().num_cached_blocks == 3
    assert pool.lookup(tokens) == blocks[:2]  # 3 full blocks cached, the last one is recomputed
    assert pool.lookup(tokens + [7]) == blocks
    assert pool.lookup(tokens[:2]) == []
    assert pool.lookup(tokens[:3]) == blocks[:1]
    assert pool.lookup([]) == []


def test_hits_and_query_tokens_are_counted():
    pool = BlockPool(num_blocks=8, block_size=2)
    assert pool.stats().hit_rate == 0.0
    pool.free(_run_request(pool, [1, 2, 3, 4, 5]))
    pool.lookup([1, 2, 3, 4, 5])  # hits 4 tokens
    s = pool.stats()
    assert (s.queries, s.hit_tokens, s.query_tokens) == (2, 4, 10)
    assert s.hit_rate == pytest.approx(0.4)
    assert pool.ref_count(0) == 0  # lookup takes no reference


def test_identical_blocks_are_cached_once():
    pool = BlockPool(num_blocks=8, block_size=2)
    tokens = [1, 2, 3, 4, 5]
    a = pool.allocate(3)
    b = pool.allocate(3)  # computed side by side: neither could hit the other
    assert pool.cache_blocks(tokens, a, 0, 2) == 2
    assert pool.cache_blocks(tokens, b, 0, 2) == 2
    info = pool.snapshot()
    assert [info[x].is_cached for x in a] == [True, True, False]
    assert [info[x].is_cached for x in b] == [False, False, False]
    assert pool.stats().num_cached_blocks == 2
    assert pool.lookup(tokens) == a[:2]
    pool.free(a)
    pool.free(b)
    pool.check_invariants()


def test_cache_blocks_grows_with_decoding():
    pool = BlockPool(num_blocks=8, block_size=2)
    tokens = [1, 2, 3]
    blocks = pool.allocate(2)
    num_cached = pool.cache_blocks(tokens, blocks, 0, 1)
    for t in [4, 5, 6]:
        tokens.append(t)
        if len(tokens) > len(blocks) * 2:
            blocks += pool.allocate(1)
        num_cached = pool.cache_blocks(tokens, blocks, num_cached, len(tokens) // 2)
    assert num_cached == 3
    assert pool.lookup(tokens + [0]) == blocks
    assert pool.block_keys(tokens)[-1] == pool._block_key[blocks[-1]]


def test_hash_collisions_never_give_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(block_pool_module, "_chain_hash", lambda parent_hash, token_ids: 0)
    pool = BlockPool(num_blocks=8, block_size=2)
    a = _run_request(pool, [1, 2, 3, 4, 5])
    b = _run_request(pool, [1, 2, 9, 9, 5])
    assert pool.stats().num_cached_blocks == 3
    assert pool.lookup([1, 2, 9, 9, 0]) == [a[0], b[1]]
    assert pool.lookup([5, 6, 3, 4, 0]) == []
    assert pool.lookup([9, 9, 3, 4, 0]) == []  # [9, 9] is cached, but only after [1, 2]
    assert pool.block_keys([1, 2, 3, 4])[1] != pool.block_keys([9, 9, 3, 4])[1]
    pool.check_invariants()


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(num_blocks=8, block_size=2, enable_prefix_caching=False)
    tokens = [1, 2, 3, 4, 5]
    blocks = pool.allocate(3)
    assert pool.cache_blocks(tokens, blocks, 0, 2) == 2
    pool.free(blocks)
    assert pool.lookup(tokens) == []
    s = pool.stats()
    assert (s.num_cached_blocks, s.queries) == (0, 0)


def test_reset_prefix_cache_forgets_keys_not_references():
    pool = BlockPool(num_blocks=8, block_size=2)
    blocks = _run_request(pool, [1, 2, 3, 4, 5])
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup([1, 2, 3, 4, 5]) == []
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    pool.free(blocks)
    pool.check_invariants()


# ---------------------------------------------------------------- lazy LRU eviction
def test_eviction_is_lazy_and_a_freed_prefix_head_survives_longest():
    pool = BlockPool(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    blocks = _run_request(pool, tokens)
    pool.free(blocks)
    assert pool.stats().num_cached_blocks == 3  # freed but still cached
    assert pool.allocate(1) == [blocks[3]]  # the partial tail block goes first
    assert pool.stats().evictions == 0
    assert pool.allocate(1) == [blocks[2]]
    assert pool.stats().evictions == 1
    assert pool.lookup(tokens) == blocks[:2]
    assert pool.allocate(1) == [blocks[1]]
    assert pool.lookup(tokens) == blocks[:1]
    assert pool.stats().evictions == 2


def test_least_recently_freed_request_is_evicted_first():
    pool = BlockPool(num_blocks=6, block_size=2)
    a_tokens, b_tokens = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    a = _run_request(pool, a_tokens)
    b = _run_request(pool, b_tokens)
    pool.free(a)
    pool.free(b)
    assert sorted(pool.allocate(3)) == sorted(a)
    assert pool.lookup(a_tokens) == []
    assert pool.lookup(b_tokens) == b[:2]


def test_a_hit_refreshes_recency():
    pool = BlockPool(num_blocks=6, block_size=2)
    a_tokens, b_tokens = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    a = _run_request(pool, a_tokens)
    b = _run_request(pool, b_tokens)
    pool.free(a)
    pool.free(b)
    hits = pool.lookup(a_tokens)
    pool.touch(hits)
    assert [pool.ref_count(h) for h in hits] == [1, 1] and pool.num_free_blocks == 4
    pool.free(hits)  # A's prefix is now the most recently freed
    assert sorted(pool.allocate(4)) == sorted([a[2]] + b)
    assert pool.lookup(a_tokens) == a[:2]
    assert pool.lookup(b_tokens) == []


def test_snapshot_describes_every_block():
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = _run_request(pool, [1, 2, 3])
    pool.free(blocks[1:])
    info = pool.snapshot()
    assert all(isinstance(i, BlockInfo) for i in info) and [i.block_id for i in info] == [0, 1, 2, 3]
    assert info[0] == BlockInfo(0, ref_count=1, is_cached=True, in_free_queue=False, lru_position=None)
    assert info[1] == BlockInfo(1, ref_count=0, is_cached=False, in_free_queue=True, lru_position=2)
    assert [info[b].lru_position for b in (2, 3)] == [0, 1]


# ---------------------------------------------------------------- random requests
class PoolMachine(RuleBasedStateMachine):
    """Random requests admit (with prefix hits), decode and finish against a plain reference model.

    The model keeps what the pool should hold, in the simplest form: each block's owners
    and reference count, the free queue as a list (head first), and the prefix cache as a
    dict from a block's whole token prefix to its block. ``content[b]`` is the prefix a block
    held when it became full, so a shared block can be checked against what it really holds.
    """

    BLOCK_SIZE = 2
    NUM_BLOCKS = 10

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.requests: dict[int, dict] = {}
        self.next_id = 0
        self.refs = [0] * self.NUM_BLOCKS
        self.free_order = list(range(self.NUM_BLOCKS))
        self.cache: dict[tuple[int, ...], int] = {}
        self.content: dict[int, tuple[int, ...]] = {}
        self.evictions = 0

    # --- the reference model's operations, each checked against the pool
    def _lookup(self, tokens) -> list[int]:
        bs, hits = self.BLOCK_SIZE, []
        while len(hits) < (len(tokens) - 1) // bs:
            block = self.cache.get(tuple(tokens[: (len(hits) + 1) * bs]))
            if block is None:
                break
            hits.append(block)
        assert self.pool.lookup(tokens) == hits
        return hits

    def _touch(self, blocks) -> None:
        self.pool.touch(blocks)
        for b in blocks:
            if self.refs[b] == 0:
                self.free_order.remove(b)
            self.refs[b] += 1

    def _allocate(self, n: int) -> list[int]:
        blocks, self.free_order = self.free_order[:n], self.free_order[n:]
        for b in blocks:
            self.refs[b] = 1
            self.content.pop(b, None)
            for prefix in [p for p, cached in self.cache.items() if cached == b]:
                del self.cache[prefix]
                self.evictions += 1
        assert self.pool.allocate(n) == blocks
        return blocks

    def _free(self, blocks) -> None:
        self.pool.free(blocks)
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_order.append(b)

    def _fill(self, req, end: int) -> None:
        """Blocks [num_cached, end) of ``req`` just became full: record content, then cache them."""
        for i in range(req["num_cached"], end):
            prefix = tuple(req["tokens"][: (i + 1) * self.BLOCK_SIZE])
            self.content[req["blocks"][i]] = prefix
            self.cache.setdefault(prefix, req["blocks"][i])  # an existing mapping wins
        req["num_cached"] = self.pool.cache_blocks(req["tokens"], req["blocks"], req["num_cached"], end)
        assert req["num_cached"] == end

    def _pick(self, pick: int) -> int:
        return sorted(self.requests)[pick % len(self.requests)]

    # --- rules
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def admit(self, tokens):
        hits = self._lookup(tokens)
        self._touch(hits)
        need = -(-len(tokens) // self.BLOCK_SIZE) - len(hits)
        if not self.pool.can_allocate(need):
            assert need > len(self.free_order)
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(need)
            self._free(hits)  # give the hits back, as a scheduler that can't admit would
            return
        req = {"tokens": list(tokens), "blocks": hits + self._allocate(need), "num_cached": len(hits)}
        self.requests[self.next_id] = req
        self.next_id += 1
        self._fill(req, len(tokens) // self.BLOCK_SIZE)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 100), token=st.integers(0, 1))
    def decode(self, pick, token):
        req = self.requests[self._pick(pick)]
        if len(req["tokens"]) == len(req["blocks"]) * self.BLOCK_SIZE:
            if not self.pool.can_allocate(1):
                return
            req["blocks"] += self._allocate(1)
        req["tokens"].append(token)
        self._fill(req, len(req["tokens"]) // self.BLOCK_SIZE)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 100))
    def finish(self, pick):
        self._free(self.requests.pop(self._pick(pick))["blocks"])

    @rule()
    def reset_cache(self):
        assert self.pool.reset_prefix_cache() == len(self.cache)
        self.cache.clear()

    @precondition(lambda self: self.requests)
    @rule()
    def finish_all(self):
        for rid in list(self.requests):
            self._free(self.requests.pop(rid)["blocks"])

    # --- invariants
    @invariant()
    def bookkeeping_is_consistent(self):
        self.pool.check_invariants()
        s = pool_stats(self.pool)
        assert s.num_free_blocks + s.num_used_blocks == s.num_blocks
        assert (s.num_free_blocks, s.num_cached_blocks, s.evictions) == (
            len(self.free_order),
            len(self.cache),
            self.evictions,
        )
        if not self.requests:
            assert s.num_free_blocks == s.num_blocks  # cached blocks count as free

    @invariant()
    def snapshot_matches_the_model(self):
        info = self.pool.snapshot()
        assert [i.ref_count for i in info] == self.refs
        assert {i.block_id for i in info if i.is_cached} == set(self.cache.values())
        queue = sorted((i for i in info if i.in_free_queue), key=lambda i: i.lru_position)
        assert [i.block_id for i in queue] == self.free_order

    @invariant()
    def ref_counts_equal_owners(self):
        owners: dict[int, list[tuple[int, int]]] = {}
        for rid, req in self.requests.items():
            assert len(set(req["blocks"])) == len(req["blocks"])
            for i, b in enumerate(req["blocks"]):
                owners.setdefault(b, []).append((rid, i))
        for b in range(self.NUM_BLOCKS):
            assert self.pool.ref_count(b) == len(owners.get(b, [])) >= 0
        for b, owned in owners.items():
            if len(owned) > 1:  # shared only through a prefix hit: same full prefix, same index
                reqs = [self.requests[rid] for rid, _ in owned]
                (index,) = {i for _, i in owned}
                end = (index + 1) * self.BLOCK_SIZE
                assert all(len(r["tokens"]) >= end for r in reqs)
                assert len({tuple(r["tokens"][:end]) for r in reqs}) == 1
                assert self.content[b] == tuple(reqs[0]["tokens"][:end])


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_block_pool_state_machine = PoolMachine.TestCase


class CollidingPoolMachine(PoolMachine):
    """The same machine with every key hashing alike: equality alone must keep prefixes apart."""

    def __init__(self):
        self._saved_hash = block_pool_module._chain_hash
        block_pool_module._chain_hash = lambda parent_hash, token_ids: 0
        super().__init__()

    def teardown(self):
        block_pool_module._chain_hash = self._saved_hash


CollidingPoolMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
test_block_pool_state_machine_with_hash_collisions = CollidingPoolMachine.TestCase


def test_a_lookup_can_be_counted_once_by_the_caller():
    pool = BlockPool(num_blocks=8, block_size=4)
    tokens = list(range(9))
    _run_request(pool, tokens)  # caches two blocks, counts one query that missed
    assert pool.lookup(tokens, record_stats=False) == pool.lookup(tokens, record_stats=False)
    assert pool.stats().queries == 1
    pool.record_lookup(len(tokens), 2)
    s = pool.stats()
    assert (s.queries, s.hit_tokens, s.query_tokens) == (2, 8, 18)
    off = BlockPool(num_blocks=8, block_size=4, enable_prefix_caching=False)
    off.record_lookup(9, 0)
    assert off.stats().queries == 0
