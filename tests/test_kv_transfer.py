"""The KV-connector API: the null connector changes nothing; shared storage and the offload
tier serve K/V from outside the pool, and greedy tokens still equal the model's full forward;
a failed load is recomputed; a load arriving between steps holds its request out of the batch
(``WAITING_FOR_REMOTE_KVS``); a bad config is refused naming the field."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
from conftest import random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetlab import LLM, KVConnector, SamplingParams
from fleetlab.inspect.pool import check_kv_manager
from fleetlab.kv_transfer.block_store import LoadError
from fleetlab.kv_transfer.shared_storage import SharedStorageConnector
from fleetlab.patching.parity import reference_greedy

MAX_NEW = 5
SP = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
BS = 4


class Scheduled:
    """An observer keeping each step's ``num_scheduled_tokens``."""

    def __init__(self):
        self.steps = []

    def on_step(self, sched, result, outputs):
        self.steps.append(dict(sched.num_scheduled_tokens))

    def computed(self, rid):
        return sum(s.get(rid, 0) for s in self.steps)


def engine(model, connector=None, **config):
    kv = None if connector is None else {"connector": connector[0], "role": connector[1], **connector[2]}
    llm = LLM(model, block_size=BS, max_num_batched_tokens=32, kv_transfer_config=kv, **config)
    llm.observers.append(Scheduled())
    return llm


def generate(llm, prompts, ids=None):
    outs = []
    for i, p in enumerate(prompts):  # one after another: each sees what the earlier ones saved
        llm.add_request(prompt_token_ids=p, sampling_params=SP, request_id=None if ids is None else ids[i])
        while llm.has_unfinished_requests():
            outs += [o for o in llm.step() if o.finished]
    return [o.token_ids for o in outs]


def assert_idle(llm):
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    check_kv_manager(llm.scheduler.kv, [])
    assert llm.scheduler._held == {}


@pytest.fixture(scope="module")
def prompts_and_want(fleet_model):
    prompts = random_prompts([13, 9, 18], vocab=100, seed=3)
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    return prompts, want


def test_null_connector_is_the_default(fleet_model, prompts_and_want):
    prompts, want = prompts_and_want
    llm = engine(fleet_model)
    assert type(llm.kv_connector) is KVConnector
    assert generate(llm, prompts) == want
    assert_idle(llm)
    llm.close()


def test_shared_storage_new_engine_computes_only_the_tail(fleet_model, prompts_and_want, tmp_path):
    prompts, want = prompts_and_want
    a = engine(fleet_model, ("shared_storage", "both", {"path": tmp_path}))
    assert generate(a, prompts) == want
    assert a.kv_connector.stats.saved_blocks > 0 and list(tmp_path.rglob("layer_*.safetensors"))
    a.close()
    b = engine(fleet_model, ("shared_storage", "consumer", {"path": tmp_path}))
    assert generate(b, prompts, ids=["p0", "p1", "p2"]) == want
    for rid, p in zip(["p0", "p1", "p2"], prompts):
        loaded = (len(p) - 1) // BS * BS
        # the prompt's tokens past what the files hold, then one token per new token but the last
        assert b.observers[-1].computed(rid) == len(p) - loaded + MAX_NEW - 1
    assert b.kv_connector.stats.loaded_tokens == sum((len(p) - 1) // BS * BS for p in prompts)
    assert b.kv_connector.stats.saved_blocks == 0  # a consumer only loads
    assert_idle(b)
    b.close()


def test_shared_storage_prefix_shared_by_another_prompt(fleet_model, tmp_path):
    base = random_prompts([12], vocab=100, seed=4)[0]
    a, b = base + [7, 8, 9], base + [11, 12]
    want, _ = reference_greedy(fleet_model, [a, b], MAX_NEW)
    llm = engine(fleet_model, ("shared_storage", "producer", {"path": tmp_path}))
    assert generate(llm, [a]) == want[:1]
    llm.close()
    llm = engine(fleet_model, ("shared_storage", "consumer", {"path": tmp_path}))
    assert generate(llm, [b], ids=["b"]) == want[1:]
    assert llm.kv_connector.stats.loaded_tokens == 12  # the three blocks of the shared prefix
    llm.close()


class FailingStorage(SharedStorageConnector):
    """Shared storage whose loads of one layer fail."""

    name = "failing_storage"

    def read(self, key, layer_id):
        if layer_id == self.spec.num_layers - 1:
            raise LoadError("disk on fire")
        return super().read(key, layer_id)


def test_failed_load_is_recomputed(fleet_model, prompts_and_want, tmp_path):
    prompts, want = prompts_and_want
    a = engine(fleet_model, ("shared_storage", "producer", {"path": tmp_path}))
    generate(a, prompts)
    a.close()
    # Two requests admitted in one step share the failed request's blocks: both recomputed.
    b = LLM(fleet_model, block_size=BS, max_num_batched_tokens=64,
            kv_transfer_config={"connector": FailingStorage, "role": "consumer", "path": tmp_path})
    outs = b.generate(prompt_token_ids=[prompts[0], prompts[0], prompts[1]], sampling_params=SP, use_tqdm=False)
    assert [o.token_ids for o in outs] == [want[0], want[0], want[1]]
    assert b.kv_connector.stats.failed_loads >= 2
    assert b.stats()["num_preemptions"] >= 3  # the copy that shared the failed blocks was recomputed too
    assert_idle(b)
    b.close()


def test_offload_working_set_twice_the_pool(fleet_model):
    prompts = random_prompts([16, 16, 16, 16], vocab=100, seed=5)
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    # 12 blocks of 4 tokens; each request needs 6 (16 prompt + 5 new): the four prompts' 16 blocks of
    # prompt are more than the pool, so by the time a prompt comes back the pool has evicted it.
    pool_only = engine(fleet_model, num_blocks=12, max_num_seqs=1)
    host = engine(fleet_model, ("offload", "both", {"capacity_bytes": 10**7}), num_blocks=12, max_num_seqs=1)
    order = [0, 1, 2, 3, 0, 1, 2, 3]
    for llm in (pool_only, host):
        assert generate(llm, [prompts[i] for i in order]) == [want[i] for i in order]
        assert_idle(llm)
    assert pool_only.stats()["prefix_cache_hit_rate"] == 0
    s = host.kv_connector.stats
    assert s.hit_rate > 0 and s.loaded_tokens == 4 * 12  # each repeat loads 3 of its 4 prompt blocks
    total = [sum(sum(step.values()) for step in llm.observers[-1].steps) for llm in (pool_only, host)]
    assert total[1] == total[0] - 4 * 12  # the tokens loaded were not computed
    pool_only.close()
    host.close()


def test_offload_capacity_evicts_least_recently_used(fleet_model):
    prompts = random_prompts([9, 9, 9], vocab=100, seed=6)
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    probe = engine(fleet_model, ("offload", "both", {"capacity_bytes": 10**7}))
    per_block = probe.kv_connector.spec.bytes_per_block
    probe.close()
    llm = engine(fleet_model, ("offload", "both", {"capacity_bytes": 3 * per_block}), num_blocks=8, max_num_seqs=1)
    assert generate(llm, prompts + prompts[:1]) == want + want[:1]
    c = llm.kv_connector
    assert c.bytes_used <= 3 * per_block and c.num_blocks_held == 3
    assert c.stats.extra["evicted_blocks"] > 0
    assert_idle(llm)
    llm.close()


@pytest.mark.parametrize("config, field", [
    ({"role": "both"}, "connector"),
    ({"connector": "nope"}, "connector"),
    ({"connector": "shared_storage", "role": "prefill", "path": "/tmp/x"}, "role"),
    ({"connector": "shared_storage"}, "path"),
    ({"connector": "shared_storage", "path": "/tmp/x", "capacity": 3}, "capacity"),
    ({"connector": "offload", "capacity_bytes": -1}, "capacity_bytes"),
    ({"connector": "offload", "capacity_bytes": 1}, "capacity_bytes"),
    ({"connector": "offload", "capacity_bytes": "lots"}, "capacity_bytes"),
    ("shared_storage", "kv_transfer_config"),
])
def test_bad_config_is_refused_naming_the_field(fleet_model, config, field):
    with pytest.raises((ValueError, TypeError), match=field):
        LLM(fleet_model, block_size=BS, kv_transfer_config=config)


class HoldingConnector(KVConnector):
    """Keeps a finished request's blocks until the step after it retired (an asynchronous save)."""

    name = "holding"

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        self.retired = set()

    def request_finished(self, request, block_ids):
        self.retired.add(request.request_id)
        return True

    def get_finished(self, finished_req_ids):
        done, self.retired = self.retired, set()
        return done, set()


def test_request_finished_delays_the_free(fleet_model, prompts_and_want):
    prompts, want = prompts_and_want
    llm = LLM(fleet_model, block_size=BS, kv_transfer_config={"connector": HoldingConnector()})
    llm.add_request(prompt_token_ids=prompts[0], sampling_params=SP, request_id="a")
    llm.add_request(prompt_token_ids=prompts[1], sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
    while "a" not in llm.scheduler._held:
        llm.step()
    assert len(llm.scheduler.kv.get_block_ids("a")) > 0  # retired, its blocks kept
    llm.step()
    assert "a" not in llm.scheduler._held and len(llm.scheduler.kv.get_block_ids("a")) == 0
    while llm.has_unfinished_requests():
        llm.step()
    llm.close()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(2, 14), min_size=1, max_size=4), seed=st.integers(0, 50),
       budget=st.sampled_from([3, 8, 32]))
def test_offload_property_tokens_equal_pool_alone(fleet_model, lengths, seed, budget):
    """Any prompts, twice over, any chunk budget, a pool too small to keep them: the offload
    tier changes no token, and every block comes back."""
    base = random_prompts([6], vocab=100, seed=seed)[0]
    prompts = [base[: n // 2] + p for n, p in zip(lengths, random_prompts(lengths, vocab=100, seed=seed + 1))]
    kw = dict(block_size=BS, num_blocks=10, max_num_seqs=2, max_num_batched_tokens=budget)
    ref = LLM(fleet_model, **kw)
    want = [o.token_ids for o in ref.generate(prompt_token_ids=prompts * 2, sampling_params=SP, use_tqdm=False)]
    ref.close()
    llm = LLM(fleet_model, **kw, kv_transfer_config={"connector": "offload", "capacity_bytes": 10**6})
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts * 2, sampling_params=SP, use_tqdm=False)]
    assert got == want
    assert_idle(llm)
    llm.close()


WRITER = """
import json, sys
import fleetlab
from fleetlab import LLM, SamplingParams
from fleetlab.models import tiny

prompts = json.loads(sys.argv[2])
llm = LLM(tiny("fleet", seed=0), block_size=4, kv_transfer_config={"connector": "shared_storage",
                                                                   "role": "producer", "path": sys.argv[1]})
outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=5, ignore_eos=True),
                    use_tqdm=False)
print(json.dumps([o.token_ids for o in outs]))
"""


def test_shared_storage_across_processes(fleet_model, prompts_and_want, tmp_path):
    """Another process writes the directory and exits; this one loads from it (a restart)."""
    import json
    import os
    import subprocess
    import sys

    prompts, want = prompts_and_want
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", WRITER, str(tmp_path), json.dumps(prompts)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want
    llm = engine(fleet_model, ("shared_storage", "consumer", {"path": tmp_path}))
    assert generate(llm, prompts) == want
    assert llm.kv_connector.stats.loaded_tokens == sum((len(p) - 1) // BS * BS for p in prompts)
    assert_idle(llm)
    llm.close()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 50), budget=st.sampled_from([4, 9, 32]), num_blocks=st.sampled_from([8, 40]),
       spec=st.booleans(), n=st.sampled_from([1, 2]))
def test_shared_storage_property_with_the_engine_features(fleet_model, tmp_path_factory, seed, budget, num_blocks,
                                                          spec, n):
    """A second engine loading from the directory writes the first engine's tokens, whatever the
    chunk budget, a pool small enough to preempt, ngram speculation, ``n > 1`` with logprobs."""
    path = tmp_path_factory.mktemp("kv")
    prompts = random_prompts([11, 6, 14], vocab=30, seed=seed)  # a small vocabulary: ngram finds matches
    sp = SamplingParams(max_tokens=6, ignore_eos=True, n=n, temperature=0.8 if n > 1 else 0.0, seed=seed,
                        logprobs=2)
    kw = dict(block_size=BS, num_blocks=num_blocks, max_num_seqs=3, max_num_batched_tokens=budget,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2} if spec else None)
    runs = []
    for role in (None, "both", "consumer"):  # no connector, the engine that saves, a new one that loads
        kv = role and {"connector": "shared_storage", "role": role, "path": path}
        with LLM(fleet_model, **kw, kv_transfer_config=kv) as llm:
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
            runs.append(([o.token_ids for o in outs], [lp.logprob for o in outs for lp in o.logprobs]))
            assert_idle(llm)
            loaded = llm.kv_connector.stats.loaded_tokens
    assert runs[0][0] == runs[1][0] == runs[2][0]
    for other in runs[1:]:  # float32: another batch shape may move the last digits
        np.testing.assert_allclose(other[1], runs[0][1], atol=1e-3)
    assert loaded > 0


@pytest.mark.parametrize("family", ["llama", "ernie4_5", "phi3", "gemma3", "gpt_oss"])
def test_every_family_loads_from_shared_storage(family, family_models, tmp_path):
    model = family_models(family)
    prompts = random_prompts([10, 7], vocab=100, seed=8)
    want, _ = reference_greedy(model, prompts, MAX_NEW)
    for role in ("producer", "consumer"):
        llm = engine(model, ("shared_storage", role, {"path": tmp_path}))
        assert generate(llm, prompts) == want
        assert_idle(llm)
        llm.close()
    assert llm.kv_connector.stats.loaded_tokens == 8 + 4


def test_registering_a_connector_follows_the_registry_rules():
    from fleetlab import register_kv_connector
    from fleetlab.kv_transfer import KV_CONNECTORS

    with pytest.raises(ValueError, match="built in"):
        register_kv_connector("offload", FailingStorage)
    with pytest.raises(ValueError, match="name"):
        register_kv_connector("another-name", FailingStorage)
    register_kv_connector("failing_storage", FailingStorage)
    assert KV_CONNECTORS.get("failing_storage") is FailingStorage


def test_tensor_parallel_with_a_connector_is_refused(fleet_model, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(fleet_model, tensor_parallel_size=2, kv_transfer_config={"connector": "shared_storage", "path": tmp_path})


def test_side_data_and_prompt_logprobs_limit_what_is_loaded(fleet_model, tmp_path):
    """Blocks past a replaced embedding depend on more than token ids: never loaded (nor saved);
    a request asking for prompt logprobs computes every prompt position itself."""
    prompt = random_prompts([17], vocab=100, seed=9)[0]
    hidden = 64  # the tiny fleet model
    side = {9: np.random.default_rng(0).standard_normal(hidden).astype(np.float32)}
    runs = []
    for role in (None, "both", "consumer"):
        kv = role and {"connector": "shared_storage", "role": role, "path": tmp_path}
        with LLM(fleet_model, block_size=BS, kv_transfer_config=kv) as llm:
            a = llm.add_request(prompt_token_ids=prompt, sampling_params=SP, prompt_embeds=side)
            b = llm.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
                max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=1))
            done = {}
            while llm.has_unfinished_requests():
                done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
            runs.append([done[a], done[b]])
            if role == "consumer":
                assert llm.kv_connector.stats.loaded_tokens == 8  # the two blocks before position 9, for a only
    assert runs[0] == runs[1] == runs[2]


class GatedStorage(SharedStorageConnector):
    """Shared storage whose loads arrive *between* steps, when the test opens a request's gate
    (``gates[rid]``, the future the scheduler waits on): ``load_kv_async``."""

    name = "gated_storage"
    load_kv_async = True

    def __init__(self, config=None, spec=None):
        super().__init__(config, spec)
        self.gates = {}  # (BlockStoreConnector holds each load until its request runs)

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens):
        super().update_state_after_alloc(request, block_ids, num_computed_tokens, num_external_tokens)
        if num_external_tokens:
            self.gates[request.request_id] = gate = Future()
            return gate
        return None


def test_a_request_waits_for_its_kv_outside_the_batch(fleet_model, tmp_path):
    """While a request's K/V is arriving it holds its blocks, runs in no step, offers none of them
    to the prefix cache, and the others decode; it joins when its gate opens; preempted meanwhile
    (a dry pool) it is freed, asks again and still writes the full forward's tokens; aborted, it
    gives every block back."""
    from fleetlab.engine.request import RequestStatus

    long, short = random_prompts([17, 5], vocab=100, seed=8)
    want, _ = reference_greedy(fleet_model, [long, short], 8)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    a = engine(fleet_model, ("shared_storage", "producer", {"path": tmp_path}))
    generate(a, [long])
    a.close()
    for num_blocks, preempt in ((32, False), (7, True)):
        llm = engine(fleet_model, (GatedStorage, "consumer", {"path": tmp_path}), num_blocks=num_blocks)
        llm.add_request(prompt_token_ids=long, sampling_params=sp, request_id="gone")
        llm.step()
        assert llm.scheduler.requests["gone"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
        llm.abort("gone")  # aborted while arriving: every block back, none left in the prefix cache
        assert_idle(llm) or llm.pool.prefix_cache.lookup(long, record_stats=False) == []
        llm.add_request(prompt_token_ids=short, sampling_params=sp, request_id="short")
        llm.step()  # the short prompt has no full block stored: it computes
        llm.add_request(prompt_token_ids=long, sampling_params=sp, request_id="long")
        conn, req = llm.kv_connector, llm.scheduler.requests["long"]
        outs = {}
        for _ in range(4):
            outs.update({o.request_id: o for o in llm.step()})
            assert "long" not in llm.observers[-1].steps[-1]  # held out of every step
            if not preempt:
                assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS and llm.scheduler.kv.get_block_ids("long")
                assert llm.scheduler.kv.get_computed_blocks(req)[1] == 0  # none of its blocks in the prefix cache
        assert len(outs["short"].token_ids) == 5  # the short request decoded meanwhile
        if preempt:  # the short one grew into the long one's blocks: it was the victim, mid-arrival
            assert req.status is RequestStatus.PREEMPTED and not llm.scheduler.kv.get_block_ids("long")
            assert llm.stats()["num_preemptions"] >= 1
        for _ in range(30):
            gate = conn.gates.get("long")
            if gate is not None and not gate.done():
                gate.set_result(True)  # the K/V is here: next step it joins
            outs.update({o.request_id: o for o in llm.step() if o.finished})
            if not llm.has_unfinished_requests():
                break
        assert [outs["long"].token_ids, outs["short"].token_ids] == want
        assert conn.stats.loaded_tokens >= 16
        assert_idle(llm)
        llm.close()
