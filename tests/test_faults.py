"""Faults: a poisoned request, an exception anywhere in a step, a long run. Nothing may wedge,
poison or leak the engine."""

from __future__ import annotations

import gc

import numpy as np
import paddle
import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.engine.batch_fields import Field
from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.sampler import Sampler
from fleetlab.inspect.batch import check_batch
from fleetlab.inspect.pool import check_kv_manager
from fleetlab.models import tiny
from fleetlab.patching.parity import reference_greedy

SP = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts([7, 12, 4, 9], seed=31, low=10)
POISON_TOKEN = 5  # never in PROMPTS (low=10)


def run(llm, prompts=PROMPTS, sp=SP):
    return llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)


def assert_idle(llm):
    """Nothing queued, every block back, the pool's books consistent."""
    assert not llm.has_unfinished_requests() and llm.scheduler.requests == {}
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    check_kv_manager(llm.scheduler.kv, [])


def embedding_weight(model):
    for name, param in model.named_parameters():
        if "embed" in name:
            return param
    raise AssertionError("no embedding")


@pytest.mark.parametrize("family", ["llama", "fleet"])
def test_a_nan_in_one_request_does_not_poison_later_requests(family):
    # Untied, so that only the token's embedding is NaN (a tied LM head would make every
    # request's logits NaN in that token's column).
    model = tiny(family, seed=3, **({"tie_word_embeddings": False} if family == "llama" else {}))
    want, _ = reference_greedy(model, PROMPTS, SP.max_tokens)
    weight = embedding_weight(model)
    row = weight.numpy()
    row[POISON_TOKEN] = np.nan
    weight.set_value(row)  # token 5's embedding is NaN: every cache slot it writes holds NaN
    with LLM(model, block_size=4, num_blocks=24) as llm:
        poisoned = run(llm, [[11, 12, POISON_TOKEN, 13] * 3])[0]
        assert poisoned.finish_reason == "error" and "non-finite" in poisoned.error
        for _ in range(3):  # later requests reuse the poisoned blocks' stale slots
            assert [o.token_ids for o in run(llm)] == want
        assert_idle(llm)


@pytest.fixture(scope="module")
def oracle(fleet_model):
    want, _ = reference_greedy(fleet_model, PROMPTS, SP.max_tokens)
    return want


def interrupt_on_call(monkeypatch, owner, name, call, error=KeyboardInterrupt):
    """Make ``owner.name`` raise ``error`` on its ``call``-th call (1-based), once."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise error("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)


@pytest.mark.parametrize("where", ["sampler", "forward", "metadata", "condense", "add_row"])
@pytest.mark.parametrize("call", [2, 3])
def test_an_interrupted_step_applies_not_at_all(fleet_model, oracle, monkeypatch, where, call):
    llm = LLM(fleet_model, block_size=4, max_num_batched_tokens=12)
    owner, name = {"sampler": (Sampler, "sample"), "forward": (llm.handle, "compute_logits"),
                   "metadata": (llm.runner, "prepare_inputs"), "condense": (llm.runner.batch, "condense"),
                   "add_row": (llm.runner.batch, "add_request")}[where]
    interrupt_on_call(monkeypatch, owner, name, call)
    ids = [llm.add_request(prompt_token_ids=p, sampling_params=SP) for p in PROMPTS]
    with pytest.raises(KeyboardInterrupt):
        while llm.has_unfinished_requests():
            llm.step()
    done = {}
    while llm.has_unfinished_requests():  # the same requests carry on where the failed step left them
        done.update({o.request_id: o.token_ids for o in llm.step()})
    assert [done[i] for i in ids] == oracle
    assert_idle(llm)
    llm.close()


@pytest.mark.parametrize("where", ["sampler", "forward"])
def test_an_interrupted_generate_aborts_its_own_requests(fleet_model, oracle, monkeypatch, where):
    with LLM(fleet_model, block_size=4) as llm:
        other = llm.add_request(prompt_token_ids=PROMPTS[0], sampling_params=SP)  # not generate's
        # Interrupted in its first step, the prompts' full blocks were registered in the prefix
        # cache at allocation; before the forward wrote them, they must not stay there.
        owner = Sampler if where == "sampler" else llm.handle
        interrupt_on_call(monkeypatch, owner, "sample" if where == "sampler" else "compute_logits", 1)
        with pytest.raises(KeyboardInterrupt):
            run(llm)
        assert list(llm.scheduler.requests) == [other]  # generate's own requests are gone, not run later
        assert [o.token_ids for o in run(llm)] == oracle
        llm.abort(other)
        assert_idle(llm)


def test_abort_names_requests_by_id(fleet_model):
    with LLM(fleet_model, block_size=4) as llm:
        rid = llm.add_request(prompt_token_ids=PROMPTS[1], sampling_params=SP)
        llm.step()
        (out,) = llm.abort([rid])
        assert out.finish_reason == "abort" and out.request_id == rid
        assert llm.abort([rid]) == [] and llm.abort("never-seen") == []
        assert_idle(llm)


def test_requests_admitted_together_share_a_prefix_within_the_step():
    model = tiny("llama", seed=4, max_position_embeddings=512)
    prefix = random_prompts([384], seed=5, low=3)[0]
    prompts = [prefix + random_prompts([8], seed=100 + i, low=3)[0] for i in range(8)]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    outs, computed = {}, {}
    for caching in (False, True):
        with LLM(model, block_size=16, max_num_batched_tokens=4096, enable_prefix_caching=caching,
                 record_traces=True) as llm:
            outs[caching] = [o.token_ids for o in run(llm, prompts, sp)]
            first = llm.traces[0]
            assert len(first.rows) == 8  # all admitted in the first step
            computed[caching] = first.num_batched_tokens
    assert outs[True] == outs[False]
    assert computed[False] == 8 * 392
    # The prefix is computed once, in the first request's row; the 7 others read its blocks,
    # written by every layer before it attends (the invariant same-step sharing relies on).
    assert computed[True] == 392 + 7 * 8


def test_long_runs_do_not_grow(fleet_model):
    """2,000 short requests through one LLM: live Python objects and RSS stay flat."""
    prompts = random_prompts([3, 5, 4, 6] * 25, seed=7)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    # Eight rows at a time, so the 2,000 requests take about 500 steps: what leaks per step shows.
    with LLM(fleet_model, block_size=4, max_num_seqs=8, max_num_batched_tokens=64) as llm:
        for _ in range(4):  # warm-up: allocator pools, prefix cache, Paddle's kernel caches
            run(llm, prompts, sp)
        gc.collect()
        objects, rss, steps = len(gc.get_objects()), rss_mb(), llm.stats()["num_steps"]
        for _ in range(16):  # 1,600 more requests
            run(llm, prompts, sp)
        gc.collect()
        assert llm.stats()["num_steps"] - steps > 300
        assert len(gc.get_objects()) - objects < 200, "live Python objects grow with requests served"
        assert rss_mb() - rss < 16, "resident memory grows with requests served"
        assert_idle(llm)


def test_uploads_do_not_leak_python_objects():
    from fleetlab.device import upload

    a = np.arange(12, dtype=np.int64)
    for _ in range(10):
        upload(a)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(1000):
        upload(a)
    gc.collect()
    assert len(gc.get_objects()) - before < 50  # paddle.to_tensor would leave 1,000 lists behind
    assert (upload(a).numpy() == a).all() and upload(a).place == paddle.empty([1]).place


def test_a_nan_fill_field_is_not_reported_as_corrupt():
    fields = InputBatch(2, 4, 2).fields.copy()
    fields.register(Field("score", (), "float32", "host", float("nan"), "a float field filled with NaN"))
    batch = InputBatch(2, 4, 2, fields=fields)
    batch.add_request("a", [1, 2], extra={"score": 0.5})
    batch.remove_request("a")
    check_batch(batch)  # the emptied row holds NaN again: that is its fill, not data
    batch.add_request("b", [1, 2], extra={"score": 0.5})
    batch.np("score")[0] = 0.5
    batch.remove_request("b")
    batch.buffer("score")[0] = 0.25  # a stale value left in an empty row
    with pytest.raises(RuntimeError, match="score"):
        check_batch(batch)
