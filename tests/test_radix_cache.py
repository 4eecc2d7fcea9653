"""The radix-tree prefix cache: insert splits, match walks, LRU leaf eviction, referenced blocks kept."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fleetlab.inspect.pool import check_pool
from fleetlab.kv.block_pool import BlockPool, NoFreeBlocksError
from fleetlab.prefix_cache import PREFIX_CACHES, build_prefix_cache
from fleetlab.prefix_cache.radix import RadixCache


def make(num_blocks=16, block_size=2):
    cache = RadixCache(block_size)
    return BlockPool(num_blocks, block_size, cache), cache


def run(pool, cache, tokens):
    """Admit a request: hit, touch, allocate the rest, insert its full pages."""
    hits = cache.lookup(tokens)
    pool.touch(hits)
    blocks = hits + pool.allocate(-(-len(tokens) // pool.block_size) - len(hits))
    cache.cache_blocks(tokens, blocks, len(hits), len(tokens) // pool.block_size)
    return blocks


def edges(cache):
    """The tree as ``(depth, tokens)`` per node, depth first."""
    return [(d, list(n.token_ids)) for d, n in cache.nodes()]


def test_insert_splits_a_node_where_two_prompts_part():
    pool, cache = make()
    a = run(pool, cache, [1, 2, 3, 4, 5, 6, 0])
    assert edges(cache) == [(1, [1, 2, 3, 4, 5, 6])]
    b = run(pool, cache, [1, 2, 3, 4, 9, 9, 0])
    assert b[:2] == a[:2]
    assert edges(cache) == [(1, [1, 2, 3, 4]), (2, [5, 6]), (2, [9, 9])]
    check_pool(pool)


def test_match_walks_whole_pages_only():
    pool, cache = make()
    a = run(pool, cache, [1, 2, 3, 4, 5, 6, 0])
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7]) == a[:3]
    assert cache.lookup([1, 2, 3, 4, 5, 9, 7]) == a[:2]  # [5, 9] differs from page [5, 6]: page granular
    assert cache.lookup([1, 2, 3]) == a[:1]
    assert cache.lookup([1, 2, 3, 4]) == a[:1]  # never the whole prompt
    assert cache.lookup([2, 1, 3, 4, 5]) == []
    assert cache.lookup([]) == []


def test_a_leaf_grows_in_place_as_its_request_decodes():
    pool, cache = make()
    tokens = [1, 2, 3]
    blocks = pool.allocate(2)
    num_cached = cache.cache_blocks(tokens, blocks, 0, 1)
    for t in [4, 5, 6, 7]:
        tokens.append(t)
        if len(tokens) > len(blocks) * 2:
            blocks += pool.allocate(1)
        num_cached = cache.cache_blocks(tokens, blocks, num_cached, len(tokens) // 2)
    assert edges(cache) == [(1, [1, 2, 3, 4, 5, 6])]
    assert cache.lookup(tokens) == blocks[:3]


def test_eviction_takes_least_recently_released_leaves_tail_first():
    pool, cache = make(num_blocks=8)
    a = run(pool, cache, [1, 2, 3, 4, 5, 6, 0])  # 4 blocks: 3 pages in the tree + a partial one
    b = run(pool, cache, [1, 2, 3, 4, 9, 9, 0])  # shares 2 pages, 2 blocks of its own
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8 and cache.num_cached_blocks == 4
    # The never-used blocks and the two partial ones (never cached) are in the free queue: first out.
    assert pool.allocate(4) == [6, 7, a[3], b[3]]
    assert pool.allocate(1) == [a[2]]  # a's leaf [5, 6] was released first
    assert pool.allocate(1) == [b[2]]  # then b's leaf [9, 9]; the shared pages become a leaf
    assert pool.allocate(1) == [a[1]]  # its tail page first
    assert cache.lookup([1, 2, 3, 4, 5]) == a[:1]
    assert cache.evictions == 3
    check_pool(pool)


def test_eviction_never_takes_a_referenced_block():
    pool, cache = make(num_blocks=7)
    a = run(pool, cache, [1, 2, 3, 4, 5, 6, 0])  # held
    b = run(pool, cache, [7, 8, 7, 8, 0])
    pool.free(b)
    assert pool.num_free_blocks == 3  # b's three blocks (two cached, one plain)
    got = pool.allocate(3)
    assert sorted(got) == sorted(b) and not set(got) & set(a)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    assert cache.lookup([1, 2, 3, 4, 5, 6, 0]) == a[:3]
    assert cache.evict(10) == []  # everything cached is held
    check_pool(pool)


def test_a_hit_revives_a_kept_block_and_a_duplicate_stays_out():
    pool, cache = make(num_blocks=8)
    a = run(pool, cache, [1, 2, 3, 4, 0])
    pool.free(a)
    hits = cache.lookup([1, 2, 3, 4, 0])
    pool.touch(hits)
    assert [pool.ref_count(h) for h in hits] == [1, 1] and pool.num_free_blocks == 6
    twin = pool.allocate(3)  # computed side by side with a, so it could not hit
    assert cache.cache_blocks([1, 2, 3, 4, 5, 6], twin, 0, 3) == 3
    assert not any(cache.is_cached(b) for b in twin)  # the tree holds page [1, 2] in a's block
    check_pool(pool)


def test_uncache_drops_a_page_and_everything_below_it():
    pool, cache = make()
    a = run(pool, cache, [1, 2, 3, 4, 5, 6, 0])
    b = run(pool, cache, [1, 2, 3, 4, 9, 9, 0])
    pool.uncache([a[1]])  # page [3, 4] and both children go
    assert edges(cache) == [(1, [1, 2])]
    assert [cache.is_cached(x) for x in a[:3] + b[2:3]] == [True, False, False, False]
    pool.free(b)
    pool.free(a)
    check_pool(pool)
    assert pool.num_free_blocks == 16


def test_the_registry_names_both_designs():
    assert {"hash", "radix"} <= set(PREFIX_CACHES.names())
    assert isinstance(build_prefix_cache("radix", 4), RadixCache) and build_prefix_cache(None, 4) is None
    with pytest.raises(ValueError, match="prefix_cache"):
        build_prefix_cache("trie", 4)


class RadixMachine(RuleBasedStateMachine):
    """Random requests admit with hits, decode, finish (keeping their tail page or not) and fail a step,
    against what each block holds.

    ``content[b]`` is the prefix block ``b`` held when it became full; ``owners`` the live
    requests' tables. Checked after every rule: the pool's and tree's bookkeeping, every hit
    holds the prompt's own prefix, a hit is as long as the tree allows, a partial hit's block holds
    the prompt's own prefix up to the tokens it lends, and an allocation
    never hands out a block a live request holds.
    """

    BS, NUM_BLOCKS = 2, 10

    def __init__(self):
        super().__init__()
        self.pool, self.cache = make(self.NUM_BLOCKS, self.BS)
        self.requests: dict[int, dict] = {}
        self.next_id = 0
        self.content: dict[int, tuple[int, ...]] = {}

    def _held(self) -> set[int]:
        return {b for r in self.requests.values() for b in r["blocks"]}

    def _allocate(self, n: int) -> list[int]:
        held = self._held()
        blocks = self.pool.allocate(n)
        assert not set(blocks) & held, "an allocation handed out a block in use"
        for b in blocks:
            self.content.pop(b, None)
        return blocks

    def _fill(self, req, end: int) -> None:
        for i in range(req["num_cached"], end):
            self.content[req["blocks"][i]] = tuple(req["tokens"][: (i + 1) * self.BS])
        req["num_cached"] = self.cache.cache_blocks(req["tokens"], req["blocks"], req["num_cached"], end)

    def _check_lookup(self, tokens) -> list[int]:
        hits = self.cache.lookup(tokens)
        for i, b in enumerate(hits):
            assert self.content[b] == tuple(tokens[: (i + 1) * self.BS])
        cached = {self.content[b] for b in self.content if self.cache.is_cached(b)}
        longest = max([k for k in range(1, (len(tokens) - 1) // self.BS + 1)
                       if tuple(tokens[: k * self.BS]) in cached], default=0)
        assert len(hits) == longest
        partial = self.cache.lookup_partial(tokens, len(hits))
        if partial is not None:  # a block that holds the very same prefix up to the tokens it lends
            b, k = partial
            end = len(hits) * self.BS + k
            assert 0 < k < self.BS and end < len(tokens) and self.content[b][:end] == tuple(tokens[:end])
        return hits

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def admit(self, tokens):
        hits = self._check_lookup(tokens)
        self.pool.touch(hits)
        need = -(-len(tokens) // self.BS) - len(hits)
        if need > self.pool.num_free_blocks:
            self.pool.free(hits)
            return
        req = {"tokens": list(tokens), "blocks": hits + self._allocate(need), "num_cached": len(hits)}
        self.requests[self.next_id] = req
        self.next_id += 1
        self._fill(req, len(tokens) // self.BS)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 100), token=st.integers(0, 1))
    def decode(self, pick, token):
        req = self.requests[sorted(self.requests)[pick % len(self.requests)]]
        if len(req["tokens"]) == len(req["blocks"]) * self.BS:
            if not self.pool.num_free_blocks:
                return
            req["blocks"] += self._allocate(1)
        req["tokens"].append(token)
        self._fill(req, len(req["tokens"]) // self.BS)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 100), keep_tail=st.booleans())
    def finish(self, pick, keep_tail):
        req = self.requests.pop(sorted(self.requests)[pick % len(self.requests)])
        tokens, blocks = req["tokens"], req["blocks"]
        if keep_tail and self.cache.cache_tail(tokens, blocks, len(tokens)):  # its partly filled last page
            self.content[blocks[len(tokens) // self.BS]] = tuple(tokens)
        self.pool.free(blocks)

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 100))
    def fail_last_page(self, pick):
        """A step that was to write a request's last full page failed: its registration goes."""
        req = self.requests[sorted(self.requests)[pick % len(self.requests)]]
        if req["num_cached"]:
            self.pool.uncache([req["blocks"][req["num_cached"] - 1]])
            req["num_cached"] -= 1

    @invariant()
    def bookkeeping_is_consistent(self):
        check_pool(self.pool)
        held = self._held()
        assert self.pool.num_free_blocks == self.NUM_BLOCKS - len(held)
        for b in range(self.NUM_BLOCKS):
            assert self.pool.ref_count(b) == sum(r["blocks"].count(b) for r in self.requests.values())


RadixMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_radix_cache_state_machine = RadixMachine.TestCase


def test_the_tree_drawn_beside_the_hash_chain_on_the_same_requests():
    from matplotlib.figure import Figure

    from fleetlab.lab.viz import draw_prefix_tree, hash_chain_nodes, radix_nodes
    from fleetlab.prefix_cache.hash_chain import HashChainCache

    trees = {}
    for cache in (RadixCache(2), HashChainCache(2)):
        pool = BlockPool(16, 2, cache)
        a = run(pool, cache, [1, 2, 3, 4, 5, 6, 0])
        run(pool, cache, [1, 2, 3, 4, 9, 9, 0])
        pool.free(a)
        nodes = (radix_nodes if isinstance(cache, RadixCache) else hash_chain_nodes)(cache, pool)
        trees[cache.name] = nodes
        fig = draw_prefix_tree(nodes, title=cache.name)
        assert isinstance(fig, Figure)
        boxes = {t.get_gid(): t for t in fig.axes[0].texts if (t.get_gid() or "").startswith("prefix-tree:")}
        assert len(boxes) == len(nodes)
    assert [n.token_ids for n in trees["radix"]] == [(1, 2, 3, 4), (5, 6), (9, 9)]
    assert [n.held for n in trees["radix"]] == [True, False, True]  # a left; b holds the stem and its branch
    assert len(trees["hash"]) == 4 and sum(n.parent is None for n in trees["hash"]) == 1
    assert sorted(b for n in trees["radix"] for b in n.block_ids) == sorted(n.key for n in trees["hash"])
