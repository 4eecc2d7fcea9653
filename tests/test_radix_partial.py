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

    def lookup_partial(self, token_ids, num_hit_blocks):
        return self.answer


@pytest.mark.parametrize("answer, match", [((0, 4), "want 1 to 3"), ((0, 0), "want 1 to 3"),
                                           ((7, 2), "does not hold"), ("xy", "two ints"), ((0, 2, 1), "two ints")])
def test_a_bad_partial_hit_is_refused_naming_the_design(answer, match):
    cache = BadPartial(4, answer)
    with pytest.raises(ValueError, match=f"BadPartial.lookup_partial.*{match}|{match}") as e:
        check_partial_hit(cache, cache.lookup_partial([1] * 9, 1), [1] * 9, 1)
    assert "BadPartial.lookup_partial" in str(e.value)


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
    assert n == 4 and hits.copy_from is None  # [5 6 7 8] is written by the step being planned: after its copies
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
        copy, failures = llm.kv_cache.copy_blocks, []

        def copy_then_fail(copies):
            copy(copies)
            if copies and len(failures) < 2:
                failures.append([c.req_id for c in copies])
                raise RuntimeError("injected: the forward after the copies failed")

        llm.kv_cache.copy_blocks = copy_then_fail
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
