"""The engine with the radix-tree prefix cache: greedy tokens equal the model's own full forward
under chunked prefill, preemption, speculative decoding, n > 1 and structured outputs; the
longest-prefix-first policy; the prefix-cache choice at the edge; the pool sized from memory."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.engine.longest_prefix_match import LongestPrefixMatch
from fleetlab.engine.request import Request
from fleetlab.engine.scheduler import Scheduler
from fleetlab.inspect.pool import check_kv_manager, check_pool
from fleetlab.kv.block_pool import BlockPool
from fleetlab.kv.manager import KVCacheManager
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.patching.parity import reference_greedy
from fleetlab.prefix_cache.radix import RadixCache

MAX_NEW = 6
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def shared(fleet_model):
    """Prompts sharing a 13-token prefix (not a block boundary at block_size 4), two of them
    twice, one unrelated; and the full forward's greedy tokens for each."""
    head = random_prompts([13], seed=3)[0]
    tails = random_prompts([2, 5, 1, 7, 9], seed=4)
    prompts = [head + t for t in tails] + [head + tails[1], head + tails[3]] + random_prompts([11], seed=5)
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    return prompts, want


def run(model, prompts, sp=GREEDY, **config):
    with LLM(model, prefix_cache="radix", **config) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
        stats = llm.stats()
        check_pool(llm.pool)
        check_kv_manager(llm.scheduler.kv, [])
        assert stats["num_free_blocks"] == stats["num_blocks"]
    return [o.token_ids for o in outs], stats


CONFIGS = {
    "one-at-a-time": dict(block_size=4, max_num_seqs=1),
    "chunk-3": dict(block_size=4, max_num_batched_tokens=3),
    "chunk-7": dict(block_size=4, max_num_batched_tokens=7),
    "no-chunking": dict(block_size=4, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False),
    "preempting-10": dict(block_size=4, num_blocks=10, max_num_batched_tokens=12),
    "preempting-14": dict(block_size=2, num_blocks=14, max_num_batched_tokens=12),
    "lpm-preempting": dict(block_size=4, num_blocks=12, max_num_batched_tokens=12, scheduling_policy="lpm"),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_radix_greedy_equals_the_full_forward(fleet_model, shared, name):
    prompts, want = shared
    got, stats = run(fleet_model, prompts, **CONFIGS[name])
    assert got == want
    assert stats["prefix_cache_hit_tokens"] > 0
    if "preempting" in name:
        assert stats["num_preemptions"] > 0


def test_radix_with_n_greater_than_one(fleet_model, shared):
    prompts, want = shared
    got, stats = run(fleet_model, prompts[:3], SamplingParams(n=3, max_tokens=MAX_NEW, ignore_eos=True),
                     block_size=4, max_num_batched_tokens=16)
    assert got == [w for w in want[:3] for _ in range(3)]
    assert stats["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_radix_with_speculative_decoding(fleet_model, shared, method):
    prompts, want = shared
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft":
        from fleetlab.models import tiny

        spec = {"method": "draft", "num_speculative_tokens": 3, "model": tiny("fleet", seed=0)}
    got, stats = run(fleet_model, prompts, block_size=4, num_blocks=14, max_num_batched_tokens=12,
                     speculative_config=spec)
    assert got == want
    assert stats["num_draft_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0


def test_radix_with_structured_outputs_equals_no_prefix_cache():
    from test_structured_engine import ENGINE, TOK, check_output, constraint, json_model, prompts_for

    model = json_model("llama")
    picks = [0, 5, 6, 7, 0, 5]
    prompts = prompts_for(len(picks) + 1, seed=2)
    sps = [SamplingParams(max_tokens=40, structured_outputs=constraint(i)) for i in picks]
    sps += [SamplingParams(max_tokens=10)]
    config = {**ENGINE, "max_num_seqs": 4, "record_traces": False}
    with LLM(model, TOK, **{**config, "enable_prefix_caching": False}) as llm:
        want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)]
    with LLM(model, TOK, prefix_cache="radix", **config) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
        assert llm.stats()["prefix_cache_hit_tokens"] > 0
    assert [o.token_ids for o in outs] == want
    for out, i in zip(outs, picks):
        check_output(constraint(i), out.text)


# ---------------------------------------------------------------- longest prefix first
def _request(rid, tokens, order):
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=GREEDY, seed=0,
                   arrival_order=order)


def test_lpm_admits_the_longest_cached_prefix_first_and_ages_the_rest():
    cache = RadixCache(4)
    kv = KVCacheManager(BlockPool(32, 4, cache))
    s = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=1, max_model_len=64,
                  policy=LongestPrefixMatch(max_wait_steps=3))
    warm = _request("warm", range(1, 14), 0)
    s.add_request(warm)
    s.schedule()
    kv.commit_step()  # as if the step ran: its registrations stand
    s.abort(["warm"])  # its 3 full blocks stay in the tree
    s.add_request(_request("cold", range(50, 63), 1))
    s.add_request(_request("hot", list(range(1, 14)) + [7], 2))
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["hot"]  # 12 cached tokens beat arrival order
    kv.commit_step()
    s.abort(["hot"])
    for rid in ("hot2", "hot3", "hot4"):
        s.add_request(_request(rid, list(range(1, 14)) + [8], 9))
    order = []
    for _ in range(4):
        out = s.schedule()
        order += list(out.num_scheduled_tokens)
        kv.commit_step()
        s.abort(list(out.num_scheduled_tokens))
    assert "cold" in order[:3]  # it waited max_wait_steps: it goes before the cache-favoured ones


def test_lpm_refuses_a_bad_wait():
    with pytest.raises(ValueError, match="max_wait_steps"):
        LongestPrefixMatch(max_wait_steps=0)


# ---------------------------------------------------------------- the choice at the edge
def test_prefix_cache_choice_at_the_edge(fleet_model):
    with LLM(fleet_model, prefix_cache=None) as llm:
        assert llm.pool.prefix_cache is None and llm.config.enable_prefix_caching is False
    with LLM(fleet_model, enable_prefix_caching=False) as llm:
        assert llm.pool.prefix_cache is None and llm.config.prefix_cache is None
    with LLM(fleet_model, prefix_cache="radix") as llm:
        assert isinstance(llm.pool.prefix_cache, RadixCache)
    with pytest.raises(ValueError, match="contradicts prefix_cache"):
        LLM(fleet_model, enable_prefix_caching=False, prefix_cache="radix")
    with pytest.raises(ValueError, match="prefix_cache"):
        LLM(fleet_model, prefix_cache="trie")


# ---------------------------------------------------------------- a pool sized from memory
def test_the_default_pool_preempts_under_load_and_keeps_the_tokens(fleet_model):
    prompts = random_prompts([18, 19, 17, 20], seed=7)  # 5 blocks each at admission: the 20 fill up
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    with LLM(fleet_model, block_size=4, max_num_seqs=4, max_model_len=40) as llm:
        assert llm.kv_sizing.source == "default" and llm.stats()["num_blocks"] == 4 // 2 * 40 // 4
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == want



def test_memory_utilization_gives_what_the_profiled_forward_leaves_to_blocks(fleet_model):
    budget = 64 * 2**20
    with LLM(fleet_model, block_size=4, max_num_batched_tokens=64, memory_utilization=0.5,
             memory_budget_bytes=budget) as llm:
        sizing, stats = llm.kv_sizing, llm.stats()
    h = llm.handle
    per_block = PagedKVCache.bytes_per_block(h.num_layers, h.num_kv_heads, h.head_dim, 4, h.dtype or "float32")
    assert sizing.source == "memory_utilization" and sizing.bytes_per_block == per_block
    assert sizing.profile_peak_bytes > sum(int(p.numel()) * 4 for p in fleet_model.parameters())  # weights + acts
    assert sizing.num_blocks == (budget // 2 - sizing.profile_peak_bytes) // per_block == stats["num_blocks"]
    assert stats["kv_bytes_per_block"] == per_block
    with pytest.raises(ValueError, match="no room for one KV block"):
        LLM(fleet_model, memory_utilization=0.01, memory_budget_bytes=2**20)
    with pytest.raises(ValueError, match="memory_utilization"):
        LLM(fleet_model, memory_utilization=1.5, memory_budget_bytes=budget)
    with pytest.raises(ValueError, match="so does num_blocks"):  # a size not applied is refused
        LLM(fleet_model, memory_utilization=0.5, memory_budget_bytes=budget, num_blocks=8)
    with pytest.raises(ValueError, match="needs memory_utilization"):
        LLM(fleet_model, memory_budget_bytes=budget)


def test_memory_utilization_on_a_cpu_shares_out_the_available_memory(fleet_model, monkeypatch):
    """Without memory_budget_bytes a CPU pool is sized from what psutil says the machine has
    available, plus the weights already loaded out of it (SGLang's fraction on a CPU); here psutil
    is told 48 MiB, so the test allocates little whatever the machine holds."""
    import psutil

    available = 48 * 2**20
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": available})())
    weights = sum(int(p.numel()) * p.element_size() for p in fleet_model.parameters())
    with LLM(fleet_model, block_size=4, max_num_batched_tokens=64, memory_utilization=0.5) as llm:
        z = llm.kv_sizing
        assert z.source == "memory_utilization" and z.budget_bytes == int(0.5 * (available + weights))
        assert z.num_blocks == (z.budget_bytes - z.profile_peak_bytes) // z.bytes_per_block == llm.stats()["num_blocks"]
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)
        assert len(out[0].token_ids) == MAX_NEW
    with LLM(fleet_model, block_size=4, max_num_batched_tokens=64, memory_utilization=0.5,
             memory_budget_bytes=2 * available) as llm:  # the stated budget still overrides
        assert llm.kv_sizing.budget_bytes == available
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"available": 2**20})())
    with pytest.raises(ValueError, match="no room for one KV block"):
        LLM(fleet_model, memory_utilization=0.1)
