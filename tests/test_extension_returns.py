"""Every extension's return value is checked where the engine receives it: the error names the
extension and the method, the step is rolled back, and the engine runs on once the extension
behaves; a config that cannot work is refused at the edge naming the field."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from fleetlab import LLM, KVConnector, SamplingParams
from fleetlab.errors import ExtensionError
from fleetlab.inspect.pool import check_kv_manager
from fleetlab.patching.parity import reference_greedy
from fleetlab.prefix_cache.hash_chain import HashChainCache
from fleetlab.prefix_cache.radix import RadixCache

SP = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPTS = random_prompts([9, 6], seed=51, low=10)


@pytest.fixture(scope="module")
def oracle(fleet_model):
    want, _ = reference_greedy(fleet_model, PROMPTS, SP.max_tokens)
    return want


def assert_runs_clean(llm, oracle):
    """The engine, its extension behaving again, serves the same prompts right and ends idle."""
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    assert [o.token_ids for o in outs] == oracle
    assert llm.pool.num_free_blocks == llm.pool.num_blocks and llm.scheduler.requests == {}
    check_kv_manager(llm.scheduler.kv, [])


def bad_once(obj, method, value):
    """``obj.method`` returns ``value`` on its next call, then behaves."""
    real = getattr(obj, method)

    def once(*args, **kwargs):
        setattr(obj, method, real)
        return value

    setattr(obj, method, once)


@pytest.mark.parametrize("method, value, words", [
    ("get_num_new_matched_tokens", "4", r"returned '4' \(str\).*must return an int in \[0, 8\]"),
    ("get_num_new_matched_tokens", 10**6, r"returned 1000000 \(int\).*one token always runs"),
    ("get_num_new_matched_tokens", True, r"returned True \(bool\)"),
    ("update_state_after_alloc", True, r"must return None unless the connector load_kv_async"),
    ("request_finished", None, r"returned None \(NoneType\).*True \(keep the blocks"),
    ("get_finished", None, r"returned None \(NoneType\).*set of request ids"),
    ("get_finished", (set(), {"x"}), r"set of block ids in \[0, \d+\) whose load failed"),
    ("get_finished", (set(), {10**9}), r"returned \(set\(\), \{1000000000\}\)"),
    ("build_connector_meta", RuntimeError, r"raised RuntimeError: boom"),
])
def test_a_connectors_bad_return_is_named_and_rolled_back(fleet_model, oracle, method, value, words):
    llm = LLM(fleet_model, block_size=4, kv_transfer_config={"connector": KVConnector, "role": "both"})
    conn = llm.kv_connector
    if value is RuntimeError:
        bad_once(conn, method, None)
        setattr(conn, method, lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    else:
        bad_once(conn, method, value)
    with pytest.raises(ExtensionError, match=rf"KV connector 'null' \(KVConnector\)\.{method} .*{words}"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    if value is RuntimeError:
        del conn.build_connector_meta  # (the instance attribute: the class's method again)
    assert_runs_clean(llm, oracle)
    llm.close()


class Arriving(KVConnector):
    """Loads between steps (``load_kv_async``), and forgets to return the future."""

    name = "arriving"
    load_kv_async = True

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 4 if request.num_tokens > 8 and not self.offered else 0

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        self.offered = False

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens):
        self.offered = True  # (from now on it offers nothing: requests compute)
        return None


def test_an_async_connector_returning_no_future_is_named(fleet_model, oracle):
    llm = LLM(fleet_model, block_size=4, kv_transfer_config={"connector": Arriving, "role": "both"})
    with pytest.raises(ExtensionError, match=r"'arriving' \(Arriving\)\.update_state_after_alloc returned None.*"
                                             r"must return a concurrent.futures.Future"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    assert_runs_clean(llm, oracle)
    llm.close()


@pytest.mark.parametrize("hits, words", [
    (lambda n: [10**6], r"returned \[1000000\].*distinct block ids in \[0, 64\)"),
    (lambda n: [0, 0], r"distinct block ids"),
    (lambda n: list(range(n)), r"at most 2 for 9 tokens"),
    (lambda n: "0", r"returned '0'"),
])
def test_a_prefix_caches_lookup_outside_the_pool_is_named(fleet_model, oracle, hits, words):
    llm = LLM(fleet_model, block_size=4, num_blocks=64)
    cache = llm.pool.prefix_cache
    bad_once(cache, "lookup", hits(3))
    with pytest.raises(ExtensionError, match=rf"prefix cache 'hash' \(HashChainCache\)\.lookup .*{words}"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    assert_runs_clean(llm, oracle)
    llm.close()


def test_a_prefix_caches_cache_blocks_count_out_of_range_is_named(fleet_model, oracle):
    llm = LLM(fleet_model, block_size=4, num_blocks=64)
    bad_once(llm.pool.prefix_cache, "cache_blocks", 99)
    with pytest.raises(ExtensionError, match=r"cache_blocks returned 99 \(int\).*num_full_blocks=2\]"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    assert_runs_clean(llm, oracle)
    llm.close()


@pytest.mark.parametrize("design", [RadixCache, HashChainCache])
def test_one_prefix_cache_instance_for_two_engines_is_refused_naming_the_option(fleet_model, oracle, design):
    cache = design(4)
    first = LLM(fleet_model, block_size=4, prefix_cache=cache)
    with pytest.raises(ValueError, match=rf"prefix_cache: this {design.__name__} instance already serves another pool"):
        LLM(fleet_model, block_size=4, prefix_cache=cache)
    assert_runs_clean(first, oracle)  # the first engine is untouched
    first.close()


@pytest.mark.parametrize("budget, words", [
    (7 * 10**17, r"kv_cache_memory_bytes=700000000000000000 sizes the pool to \d+ KV blocks .* int32 block ids"),
    (10, r"kv_cache_memory_bytes=10: KV cache budget of 10 bytes fits no block"),
])
def test_a_kv_byte_budget_that_no_block_id_can_address_is_refused_naming_the_field(fleet_model, budget, words):
    with pytest.raises(ValueError, match=rf"engine config: {words}"):
        LLM(fleet_model, block_size=4, kv_cache_memory_bytes=budget)
