"""Token-granular prefix reuse: a radix match that ends inside a block copies the matched head of that
block into the request's own block. The tree names the block, the KV manager pins and plans the copy,
the runner applies it on every layer; greedy tokens equal the model's own full forward under chunking,
preemption, n > 1, speculation, the overlapped loop and KV connectors, and the radix cache computes
fewer prompt tokens than the hash chain where a shared prefix ends inside a block."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetlab import LLM, SamplingParams
from fleetlab.engine.request import Request
from fleetlab.errors import ExtensionError
from fleetlab.inspect.pool import check_kv_manager, check_pool
from fleetlab.kv.block_pool import BlockPool
from fleetlab.kv.copies import BlockCopy
from fleetlab.kv.manager import KVCacheManager
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.patching.parity import reference_greedy
from fleetlab.prefix_cache import check_partial_hit
from fleetlab.prefix_cache.radix import RadixCache

MAX_NEW = 4
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


# ---------------------------------------------------------------- the tree names the block
def tree(block_size, *prompts):
    """A radix cache holding each prompt's full pages (each in blocks of its own)."""
    cache = RadixCache(block_size)
    pool = BlockPool(64, block_size, cache)
    for tokens in prompts:
        hits = cache.lookup(tokens)
        pool.touch(hits)
        blocks = hits + pool.allocate(-(-len(tokens) // block_size) - len(hits))
        cache.cache_blocks(tokens, blocks, len(hits), len(tokens) // block_size)
        pool.free(blocks)  # finished: the tree keeps its full pages
    return cache, pool


def test_lookup_partial_names_the_page_that_continues_the_match():
    cache, _ = tree(4, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 5, 6, 0, 0])
    # after page [1 2 3 4] the tree parts: [5 6 7 8 ...] and [5 6 0 0]; [5 6 7 9] shares 3 with the first
    hits = cache.lookup([1, 2, 3, 4, 5, 6, 7, 9, 9])
    assert len(hits) == 1
    block, n = cache.lookup_partial([1, 2, 3, 4, 5, 6, 7, 9, 9], 1)
    assert n == 3 and cache._node_of[block].token_ids[:4] == (5, 6, 7, 8)
    assert cache.lookup_partial([1, 2, 3, 4, 5, 6, 0, 1, 1], 1)[1] == 3  # the other child
    assert cache.lookup_partial([1, 2, 3, 4, 9], 1) is None  # no page starts with 9
    # a page whose K/V are not written yet is passed over for the next best
    other = cache.lookup([1, 2, 3, 4, 5, 6, 0, 0, 9])[1]
    assert cache.lookup_partial([1, 2, 3, 4, 5, 6, 7, 9, 9], 1, exclude={block}) == (other, 2)
    assert cache.lookup_partial([1, 2, 3, 4, 5, 6, 7, 9, 9], 1, exclude={block, other}) is None
    # inside an edge: [9 10 11 12] is the third page of the first prompt's edge
    assert cache.lookup_partial([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0], 2)[1] == 2
    # never the prompt's last token: a whole cached prompt leaves one token to compute
    assert len(cache.lookup([1, 2, 3, 4, 5, 6, 7, 8])) == 1
    assert cache.lookup_partial([1, 2, 3, 4, 5, 6, 7, 8], 1)[1] == 3
    assert cache.lookup_partial([1, 2], 0)[1] == 1
    assert cache.lookup_partial([1], 0) is None


def test_the_hash_chain_matches_whole_blocks_only():
    from fleetlab.prefix_cache.hash_chain import HashChainCache

    assert HashChainCache(4).lookup_partial([1, 2, 3, 4, 5], 1) is None


class BadPartial(RadixCache):
    def __init__(self, block_size, answer):
        super().__init__(block_size)
        self.answer = answer

    def lookup_partial(self, token_ids, num_hit_blocks, exclude=()):
        return self.answer


@pytest.mark.parametrize("answer, match", [((0, 4), "1 to 3 tokens"), ((0, 0), "1 to 3 tokens"), ((1, 2), "excluded"),
                                           ((7, 2), "cached block"), ("xy", "block_id, num_tokens"),
                                           ((0, 2, 1), "block_id, num_tokens")])
def test_a_bad_partial_hit_is_refused_naming_the_design(answer, match):
    cache = BadPartial(4, answer)
    cache._node_of[0] = cache._node_of[1] = cache.root  # blocks 0 and 1 are cached (1 is excluded below)
    with pytest.raises(ExtensionError, match=match) as e:
        check_partial_hit(cache, cache.lookup_partial([1] * 9, 1), [1] * 9, 1, exclude={1})
    assert "BadPartial" in str(e.value) and "lookup_partial" in str(e.value)


# ---------------------------------------------------------------- the cache copies
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_copy_blocks_copies_the_heads_on_every_layer(dtype):
    cache = PagedKVCache(3, 6, 4, 2, 3, dtype=dtype)
    rng = np.random.default_rng(0)
    for layer in range(3):
        for t in (cache.key_cache(layer), cache.value_cache(layer)):
            t.set_value(paddle.to_tensor(rng.standard_normal(t.shape).astype(dtype)))
    before = [(cache.key_cache(i).numpy().copy(), cache.value_cache(i).numpy().copy()) for i in range(3)]
    cache.copy_blocks([BlockCopy("a", 1, 4, 3), BlockCopy("b", 2, 5, 1)])
    for layer, (k, v) in enumerate(before):
        for got, old in ((cache.key_cache(layer).numpy(), k), (cache.value_cache(layer).numpy(), v)):
            want = old.copy()
            want[4, :3], want[5, :1] = old[1, :3], old[2, :1]
            np.testing.assert_array_equal(got, want)
    cache.copy_blocks([])  # nothing to do


# ---------------------------------------------------------------- the manager pins and plans
def request(rid, tokens):
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=GREEDY, seed=0,
                   arrival_order=0)


def admitted(kv, req):
    """Admit ``req`` as the scheduler does: hits, allocation, computed tokens."""
    hits, n = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n, hits=hits) is not None
    req.num_computed_tokens = n
    return hits, n


def test_the_source_stays_pinned_until_the_step_that_copies_commits():
    kv = KVCacheManager(BlockPool(16, 4, RadixCache(4)))
    a = request("a", range(1, 11))  # pages [1..4] [5..8], then [9 10]
    admitted(kv, a)
    src = kv.get_block_ids("a")[1]
    hits, n = kv.get_computed_blocks(request("probe", [1, 2, 3, 4, 5, 6, 0, 0]))
    assert n == 6 and hits.copy_from == src  # [5 6 7 8] is written by the step being planned: before its copies
    kv.commit_step()
    kv.free(a)
    b = request("b", [1, 2, 3, 4, 5, 6, 0, 0])
    hits, n = admitted(kv, b)
    assert hits.copy_from == src and n == 6 and hits.num_copy_tokens == 2
    assert kv.pool.ref_count(src) == 1  # pinned, its owner gone
    check_kv_manager(kv, ["b"])
    [copy] = kv.take_copies(["b"])
    assert copy == BlockCopy("b", src, kv.get_block_ids("b")[1], 2)
    assert kv.take_copies(["b"]) == []  # taken once
    kv.rollback_step()  # the step failed: the copy is due again, still pinned
    assert kv.pool.ref_count(src) == 1 and kv.take_copies(["b"]) == [copy]
    kv.commit_step()  # the step ran: the source is let go
    assert kv.pool.ref_count(src) == 0 and kv.pool.is_cached(src)
    check_kv_manager(kv, ["b"])


def test_a_block_a_planned_copy_writes_into_lends_nothing():
    kv = KVCacheManager(BlockPool(16, 4, RadixCache(4)))
    a = request("a", range(1, 11))
    admitted(kv, a)
    kv.commit_step()
    kv.free(a)
    p1 = kv.prefix_cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0])[1]
    b = request("b", [1, 2, 3, 4, 5, 6, 0, 0, 0])  # copies [5 6] of p1 into its block D, fills D: [5 6 0 0]
    hits, _ = admitted(kv, b)
    dst = kv.get_block_ids("b")[1]
    assert hits.copy_from == p1 and kv.pool.is_cached(dst)
    # c matches 3 tokens of D but D's head is copied only as the step runs: c takes 2 of p1
    hits, n = kv.get_computed_blocks(request("c", [1, 2, 3, 4, 5, 6, 0, 9, 9]))
    assert (hits.copy_from, hits.num_copy_tokens, n) == (p1, 2, 6)
    kv.take_copies(["b"])
    kv.commit_step()  # b's copy ran: D lends its head now
    hits, n = kv.get_computed_blocks(request("c", [1, 2, 3, 4, 5, 6, 0, 9, 9]))
    assert (hits.copy_from, hits.num_copy_tokens, n) == (dst, 3, 7)


def test_a_request_freed_before_its_copy_lets_the_source_go():
    kv = KVCacheManager(BlockPool(16, 4, RadixCache(4)))
    a = request("a", range(1, 11))
    admitted(kv, a)
    kv.commit_step()
    kv.free(a)
    b = request("b", [1, 2, 3, 4, 5, 6, 0, 0])
    hits, _ = admitted(kv, b)
    kv.free(b)  # preempted or aborted while its K/V still arrive: never scheduled
    assert kv.pool.ref_count(hits.copy_from) == 0 and kv.take_copies(["b"]) == []
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    check_kv_manager(kv, [])


# ---------------------------------------------------------------- the engine
class Copies:
    """An observer keeping every copy the steps carried."""

    def __init__(self):
        self.copies = []

    def on_step(self, sched, result, outputs):
        self.copies += sched.kv_copies


def run(model, prompts, cache, sp=GREEDY, **config):
    """Tokens, prompt tokens computed, hit rate and copies of one engine run (its pool left idle)."""
    with LLM(model, prefix_cache=cache, **config) as llm:
        seen = Copies()
        llm.observers.append(seen)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        s = llm.stats()
        check_pool(llm.pool)
        check_kv_manager(llm.scheduler.kv, [])
        assert s["num_free_blocks"] == s["num_blocks"]
    return [o.token_ids for o in outs], s["prefix_cache_query_tokens"] - s["prefix_cache_hit_tokens"], \
        s["prefix_cache_hit_rate"], seen.copies


@pytest.fixture(scope="module")
def shared(fleet_model):
    """Prompts sharing a 13-token prefix (inside a block at block_size 4), tails long enough to fill
    the block the prefix ends in, one repeated, one unrelated; the full forward's greedy tokens."""
    head = random_prompts([13], seed=3)[0]
    tails = random_prompts([5, 7, 3, 9, 6], seed=4)
    prompts = [head + t for t in tails] + [head + tails[1]] + random_prompts([11], seed=5)
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    return prompts, want


def test_one_at_a_time_radix_computes_exactly_the_copied_tokens_fewer(fleet_model, shared):
    prompts, want = shared
    got, computed, rate, copies = run(fleet_model, prompts, "radix", block_size=4, max_num_seqs=1)
    got_h, computed_h, rate_h, copies_h = run(fleet_model, prompts, "hash", block_size=4, max_num_seqs=1)
    assert got == got_h == want
    assert copies and not copies_h
    assert computed == computed_h - sum(c.num_tokens for c in copies) and rate > rate_h


CONFIGS = {
    "chunk-3": dict(block_size=4, max_num_batched_tokens=3),
    "chunk-7-overlapped": dict(block_size=4, max_num_batched_tokens=7, async_scheduling=True),
    "preempting": dict(block_size=4, num_blocks=10, max_num_batched_tokens=12),
    "preempting-overlapped": dict(block_size=4, num_blocks=10, max_num_batched_tokens=12, async_scheduling=True),
    "lpm-preempting": dict(block_size=4, num_blocks=12, max_num_batched_tokens=12, scheduling_policy="lpm"),
    "no-chunking": dict(block_size=4, max_num_batched_tokens=64, max_num_seqs=2, max_model_len=64,
                        enable_chunked_prefill=False),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_radix_copies_and_keeps_the_full_forwards_tokens(fleet_model, shared, name):
    prompts, want = shared
    got, _, _, copies = run(fleet_model, prompts, "radix", **CONFIGS[name])
    assert got == want
    assert copies


def test_n_greater_than_one(fleet_model, shared):
    prompts, want = shared
    got, _, _, copies = run(fleet_model, prompts[:4], "radix", SamplingParams(n=2, max_tokens=MAX_NEW, ignore_eos=True),
                            block_size=4, max_num_batched_tokens=16)
    assert got == [w for w in want[:4] for _ in range(2)]
    assert copies


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding(fleet_model, shared, method):
    prompts, want = shared
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft":
        from fleetlab.models import tiny

        spec = {"method": "draft", "num_speculative_tokens": 3, "model": tiny("fleet", seed=0)}
    with LLM(fleet_model, prefix_cache="radix", block_size=4, max_num_seqs=1, speculative_config=spec) as llm:
        seen = Copies()
        llm.observers.append(seen)
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)]
        s = llm.stats()
        check_kv_manager(llm.scheduler.kv, [])
    assert got == want and seen.copies and s["num_draft_tokens"] > 0
    if method == "draft":  # the draft model is the target itself: its cache got the copies too, so all agree
        assert s["spec_acceptance_rate"] == 1.0


@pytest.mark.parametrize("connector", [{"connector": "offload", "capacity_bytes": 10**6},
                                       {"connector": "shared_storage", "role": "both"}])
def test_kv_connectors(fleet_model, shared, connector, tmp_path):
    prompts, want = shared
    if connector["connector"] == "shared_storage":
        connector = {**connector, "path": tmp_path}
    for _ in range(2):  # the second engine (shared storage) finds the first one's blocks
        got, _, _, copies = run(fleet_model, prompts, "radix", block_size=4, num_blocks=12, max_num_seqs=2,
                                max_num_batched_tokens=12, kv_transfer_config=connector)
        assert got == want and copies


@pytest.mark.parametrize("overlapped", [False, True])
def test_requests_admitted_together_copy_from_each_other(fleet_model, shared, overlapped):
    """All admitted in one step: a block one of them fills this step lends its head to the others
    (each layer copies after it writes), as a full block is shared whole."""
    prompts, want = shared
    got, computed, rate, copies = run(fleet_model, prompts, "radix", block_size=4, async_scheduling=overlapped)
    got_h, computed_h, rate_h, _ = run(fleet_model, prompts, "hash", block_size=4, async_scheduling=overlapped)
    assert got == got_h == want
    assert copies and computed == computed_h - sum(c.num_tokens for c in copies) and rate > rate_h


def test_the_issues_case_a_49_token_prefix_at_block_size_16(fleet_model):
    """A 49-token shared prefix, block size 16: the hash chain recomputes the prefix's last token of
    every request after the first; the radix tree copies it."""
    head = random_prompts([49], seed=11)[0]
    prompts = [head + t for t in random_prompts([16, 20, 18, 22], seed=12)]
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    got_h, computed_h, rate_h, _ = run(fleet_model, prompts, "hash", block_size=16, max_num_seqs=1)
    got, computed, rate, copies = run(fleet_model, prompts, "radix", block_size=16, max_num_seqs=1)
    assert got == got_h == want
    assert computed == computed_h - 3 and [c.num_tokens for c in copies] == [1, 1, 1] and rate > rate_h


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(block_size=st.integers(2, 8), prefix_len=st.integers(1, 20), seed=st.integers(0, 10**6),
       tails=st.lists(st.integers(1, 12), min_size=2, max_size=5),
       config=st.sampled_from(["one-at-a-time", "batched", "chunk-5", "preempting", "overlapped"]))
def test_random_shared_prefixes_keep_the_tokens_and_never_compute_more(fleet_model, block_size, prefix_len, seed,
                                                                       tails, config):
    rng = np.random.default_rng(seed)
    head = rng.integers(3, 100, prefix_len).tolist()
    prompts = [head + rng.integers(3, 100, n).tolist() for n in tails]
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    kw = {"one-at-a-time": dict(max_num_seqs=1), "batched": dict(max_num_batched_tokens=64),
          "chunk-5": dict(max_num_batched_tokens=5), "overlapped": dict(max_num_seqs=2, async_scheduling=True),
          "preempting": dict(num_blocks=2 * (-(-(prefix_len + 12 + MAX_NEW) // block_size)),
                             max_num_batched_tokens=12)}[config]
    got, computed, _, copies = run(fleet_model, prompts, "radix", block_size=block_size, **kw)
    assert got == want
    if config == "one-at-a-time":  # same whole-block hits in both designs: the copies are all the difference
        _, computed_h, _, _ = run(fleet_model, prompts, "hash", block_size=block_size, **kw)
        assert computed == computed_h - sum(c.num_tokens for c in copies)


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_step_that_fails_after_its_copies_is_redone_with_them(fleet_model, shared, overlapped):
    """The copy ran, then the step failed: the plan is rolled back, the copies are due again (their
    sources still pinned) and the retried step gives the full forward's tokens."""
    prompts, want = shared
    with LLM(fleet_model, prefix_cache="radix", block_size=4, max_num_seqs=2, async_scheduling=overlapped) as llm:
        apply, failures, last = llm.kv_cache.apply_copies, [], llm.kv_cache.num_layers - 1

        def copy_then_fail(layer_id, plan):
            apply(layer_id, plan)
            if plan is not None and layer_id == last and len(failures) < 2:
                failures.append([c.req_id for c in plan.copies])
                raise RuntimeError("injected: the forward after the copies failed")

        llm.kv_cache.apply_copies = copy_then_fail
        ids = [llm.add_request(prompt_token_ids=p, sampling_params=GREEDY) for p in prompts]
        done = {}
        while llm.has_unfinished_requests():
            try:
                outs = llm.step()
            except RuntimeError as e:
                assert "injected" in str(e)
                check_kv_manager(llm.scheduler.kv, [r.request_id for r in llm.scheduler.running])
                continue
            done.update({o.request_id: o.token_ids for o in outs if o.finished})
        check_kv_manager(llm.scheduler.kv, [])
        assert llm.pool.num_free_blocks == llm.pool.num_blocks
    assert len(failures) == 2 and [done[i] for i in ids] == want


# ---------------------------------------------------------------- tail pages
def test_a_finished_requests_tail_page_is_kept_and_lent():
    cache, pool = tree(4, [1, 2, 3, 4, 5, 6, 7, 8])
    blocks = cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 0])
    pool.touch(blocks)
    own = pool.allocate(1)
    assert cache.cache_tail([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], blocks + own, 10)  # [9 10] in its last block
    assert not cache.cache_tail([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], blocks + own, 10)  # kept already
    assert not cache.cache_tail([1, 2, 3, 4, 5, 6, 7, 8], blocks, 8)  # no token past a full page
    assert not cache.cache_tail([9, 9, 9, 9, 1], [7, 8], 5)  # its full pages are not in the tree
    pool.free(blocks + own)
    cache.check_invariants()
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == blocks  # a tail page is never shared whole
    assert cache.lookup_partial([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 2) == (own[0], 2)
    assert cache.lookup_partial([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2) == (own[0], 1)  # the prompt's last stays
    # a longer prompt that passes the tail splits the leaf there; the tail stays a leaf of its own
    hits = cache.lookup([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0])
    pool.touch(hits)
    more = pool.allocate(2)
    cache.cache_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 0], hits + more, 2, 3)
    cache.check_invariants()
    assert cache.lookup_partial([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 0], 2) == (more[0], 3)
    pool.free(hits + more)
    assert pool.allocate(pool.num_blocks)  # evicting a tail page and the rest keeps the books
    cache.check_invariants()
    assert cache.num_cached_blocks == 0


def test_multi_turn_chats_copy_the_last_turns_tail(fleet_model):
    """Turn 2's prompt is turn 1's prompt, its answer and a new message: the hash chain recomputes
    the tokens of turn 1's last, partly filled block; the radix tree copies them from its tail page."""
    firsts = random_prompts([10, 13, 7], seed=21)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    results = {}
    for cache in ("hash", "radix"):
        with LLM(fleet_model, prefix_cache=cache, block_size=4, max_num_seqs=2) as llm:
            seen = Copies()
            llm.observers.append(seen)
            turn1 = llm.generate(prompt_token_ids=firsts, sampling_params=sp, use_tqdm=False)
            seconds = [q + o.token_ids + [7, 8, 9] for q, o in zip(firsts, turn1)]
            turn2 = llm.generate(prompt_token_ids=seconds, sampling_params=sp, use_tqdm=False)
            s = llm.stats()
            check_kv_manager(llm.scheduler.kv, [])
        results[cache] = ([o.token_ids for o in turn1 + turn2], s["prefix_cache_query_tokens"]
                          - s["prefix_cache_hit_tokens"], seen.copies, seconds)
    (got_h, computed_h, _, seconds), (got, computed, copies, _) = results["hash"], results["radix"]
    want, _ = reference_greedy(fleet_model, firsts + seconds, 5)
    assert got == got_h == want
    # each chat's turn 1 wrote len(prompt) + 4 tokens' K/V (the 5th answer token is not computed)
    tails = [(len(q) + 4) % 4 for q in firsts]
    assert sorted(c.num_tokens for c in copies) == sorted(t for t in tails if t)
    assert computed == computed_h - sum(tails)
