"""GPU readiness, proven as far as a CPU can: a host-sync budget per step, dtypes that mean what
they say, every tensor on the model's device."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import paddle
import pytest
from conftest import random_prompts
from sampler_helpers import host_tensors

import fleetlab
from fleetlab import LLM, SamplingParams
from fleetlab.attention import tiled
from fleetlab.attention import triton_backend as tb
from fleetlab.engine.sampler import Sampler
from fleetlab.models import tiny
from fleetlab.patching import patch_model
from fleetlab.syncs import count_syncs, describe

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=20, seed=3)
# Uploads per step: the 4 metadata arrays (2: one copy per dtype), input ids and logits indices in
# one, the tiled attention's plan (2: one per dtype), and each of the InputBatch's 5 device fields
# only when it changed -- plus up to 4 when some rows sample (uniforms, drafts, a banned-token mask).
UPLOAD_BUDGET = 10
SAMPLING_EXTRA = 4
# Only steps with a request that asks for logprobs or sets a penalty or bias upload more: the
# logprob rows and the prompt positions' targets, and one int64 and one float32 array for the
# penalties and biases (fleetlab/processors/penalties.py).
LOGPROBS_EXTRA = 4


def steps_with_syncs(llm, prompts, sp):
    for p in prompts:
        llm.add_request(prompt_token_ids=p, sampling_params=sp)
    logs = []
    while llm.has_unfinished_requests():
        with count_syncs() as log:
            llm.step()
        logs.append(log)
    return logs


@pytest.mark.parametrize("num_requests,num_layers,tile_scale", [(2, 1, 1), (9, 3, 1), (24, 3, 1), (24, 2, 64)])
def test_a_step_reads_the_device_once_and_uploads_a_fixed_number(monkeypatch, num_requests, num_layers,
                                                                  tile_scale):
    if tile_scale > 1:  # tiny tiles: many per step, yet their uploads stay the same
        small = tiled.TileLimits(tiled.CPU_TILE_LIMITS.score_elements // tile_scale,
                                     tiled.CPU_TILE_LIMITS.kv_elements // tile_scale, 8)
        monkeypatch.setattr(tiled, "tile_limits", lambda: small)
    model = tiny("fleet", seed=1, num_layers=num_layers)
    prompts = random_prompts(np.resize([5, 30, 9, 17], num_requests).tolist(), seed=num_requests)
    with LLM(model, block_size=4, max_num_batched_tokens=48) as llm:
        logs = steps_with_syncs(llm, prompts, GREEDY)
    for log in logs:
        assert log.num_reads == 1, describe(log)  # the sampled token ids, nothing else
        assert log.num_uploads <= UPLOAD_BUDGET, describe(log)
        assert [e.site.split(":")[0] for e in log.reads] == ["engine/sampler.py"]


def test_sampling_adds_a_fixed_number_of_uploads_and_no_read(fleet_model):
    prompts = random_prompts([5, 12, 7, 9, 3, 11], seed=2)
    with LLM(fleet_model, block_size=4) as llm:
        logs = steps_with_syncs(llm, prompts, SAMPLED)
    assert all(log.num_reads == 1 for log in logs)
    assert max(log.num_uploads for log in logs) <= UPLOAD_BUDGET + SAMPLING_EXTRA


@pytest.mark.parametrize("num_requests", [3, 12])
def test_logprobs_and_penalties_come_back_in_the_same_read(fleet_model, num_requests):
    prompts = random_prompts(np.resize([5, 12, 7], num_requests).tolist(), seed=8)
    sps = [SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2),
           SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.8, seed=1, logprobs=1,
                          frequency_penalty=0.5, logit_bias={4: 2.0}),
           SamplingParams(max_tokens=4, ignore_eos=True, repetition_penalty=1.2)]
    with LLM(fleet_model, block_size=4, max_num_batched_tokens=48) as llm:
        for i, p in enumerate(prompts):
            llm.add_request(prompt_token_ids=p, sampling_params=sps[i % 3])
        logs = []
        while llm.has_unfinished_requests():
            with count_syncs() as log:
                llm.step()
            logs.append(log)
    for log in logs:
        assert log.num_reads == 1, describe(log)
        assert [e.site.split(":")[0] for e in log.reads] == ["engine/sampler.py"]
        assert log.num_uploads <= UPLOAD_BUDGET + SAMPLING_EXTRA + LOGPROBS_EXTRA, describe(log)


@pytest.mark.parametrize("method,reads", [("ngram", 1), ("draft", 2)])
def test_speculation_reads_the_accepted_ids_and_a_draft_models_drafts(fleet_model, method, reads):
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft":
        spec["model"] = tiny("fleet", seed=0, num_layers=1)
    prompts = [p * 3 for p in random_prompts([4, 6, 3], seed=3, vocab=30)]
    with LLM(fleet_model, block_size=4, speculative_config=spec) as llm:
        logs = steps_with_syncs(llm, prompts, GREEDY)
        assert llm.stats()["num_draft_tokens"] > 0
    assert max(log.num_reads for log in logs) == reads


def test_grammar_masks_add_one_upload_only_in_steps_with_a_constrained_row():
    """The step's masks and the rows they belong to go up in one upload; a step without a
    constrained row uploads nothing more; the one read stays one."""
    from fleetlab.models.json_tiny import json_tokenizer

    tok = json_tokenizer()
    model = tiny("fleet", seed=1, num_layers=1, vocab_size=tok.vocab_size)
    short = SamplingParams(max_tokens=6, structured_outputs={"choice": ["yes", "no"]})
    with LLM(model, tok, block_size=4, max_num_batched_tokens=48) as llm:
        llm.generate(prompt_token_ids=[[1, 5, 6]], sampling_params=short, use_tqdm=False)  # one-off constants
        for i, p in enumerate(random_prompts([5, 9, 7, 12], seed=5, vocab=tok.vocab_size, low=4)):
            llm.add_request(prompt_token_ids=p, sampling_params=short if i % 2 else GREEDY)
        seen = {True: 0, False: 0}
        while llm.has_unfinished_requests():
            constrained = any("structured_output" in r.extra for r in llm.scheduler.running + llm.scheduler.waiting)
            with count_syncs() as log:
                llm.step()
            grammar = [e for e in log.uploads if e.site.startswith("structured_output/")]
            assert log.num_reads == 1 and log.num_uploads - len(grammar) <= UPLOAD_BUDGET, describe(log)
            assert len(grammar) <= (1 if constrained else 0), describe(log)
            seen[constrained] += len(grammar) if constrained else 1
    assert seen[True] and seen[False]  # steps with masks, and steps after every constrained request finished


class StubKernels:
    """The Triton kernels' interface in plain Paddle, so the backend's host code runs on a CPU.

    The kernels themselves (tested on an H200 against float64) are not the subject here: what
    is, is that ``TritonBackend`` plans once per step and launches per layer without a
    device-to-host read. The stub records what the backend asked for.
    """

    def __init__(self):
        self.batches, self.layer_calls = [], []
        stub = self

        class PagedBatch:
            @staticmethod
            def from_host(*tensors, **host):
                assert all(isinstance(v, (int, np.ndarray)) for v in host.values()), host  # host data only
                stub.batches.append(host)
                return host

        class StepPlans:
            def __init__(self, batch, like, known):
                self.batch = batch

            def for_layer(self, query, key_cache, sliding_window=None, sinks=None):
                stub.layer_calls.append(self.batch)
                return StubPlan()

        self.PagedBatch, self.StepPlans = PagedBatch, StepPlans


class StubPlan:
    def store_kv(self, key, value, key_cache, value_cache):
        pass

    def run(self, query, key_cache, value_cache, *, scale, sinks=None, out=None):
        return paddle.zeros_like(query)


def test_the_triton_backends_host_code_never_reads_the_device(fleet_model, monkeypatch):
    monkeypatch.setattr(tb.TritonBackend, "supported_devices", ("cpu", "gpu"))
    stub = StubKernels()
    monkeypatch.setattr(tb, "load_triton_kernels", lambda: stub)
    prompts = random_prompts([5, 17, 3, 9], seed=4)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    with LLM(fleet_model, backend="triton", block_size=4, max_num_batched_tokens=16, speculative_config=spec,
             record_traces=True) as llm:
        logs = steps_with_syncs(llm, prompts, GREEDY)
        assert any(t.reordered and t.num_decodes for t in llm.traces)
    for log in logs:
        assert log.num_reads == 1 and log.num_uploads <= UPLOAD_BUDGET - 2, describe(log)
    # one batch planned per step, and every layer call of a step used that step's plans
    layers = fleet_model.config.num_layers
    assert len(stub.batches) == len(logs) and len(stub.layer_calls) == len(logs) * layers
    assert all(call is stub.batches[i // layers] for i, call in enumerate(stub.layer_calls))


def test_count_syncs_sees_each_kind_once_with_its_call_site():
    t = paddle.to_tensor([1.5, 2.0])
    with count_syncs() as log:
        t.numpy()
        t[0].item()  # item() goes through numpy(): still one read
        float(t[0])
        if t[1] > 0:
            pass
        t.set_value(np.zeros(2, np.float32))
        paddle.assign(np.ones(2, np.float32))
        paddle.assign(t)  # a device copy, not an upload
    assert [e.api for e in log.reads] == ["numpy", "item", "__float__", "__bool__"]
    assert [e.api for e in log.uploads] == ["set_value", "assign"]
    assert all("test_gpu_readiness.py" in e.site for e in log.events)
    assert log.by_site("read")


# ---------------------------------------------------------------- dtypes
@pytest.mark.parametrize("family", ["llama", "fleet"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tiny_models_take_the_dtype_they_are_given(family, dtype):
    model = tiny(family, dtype=dtype)
    assert {str(p.dtype) for p in model.parameters()} == {f"paddle.{dtype}"}
    with pytest.raises(ValueError, match=f"dtype '{dtype}' cannot run on device 'cpu'"):
        LLM(model)
    assert "_fleetlab_patch" not in model.__dict__  # the failed construction unpatched it


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype='int8'"):
        tiny("llama", dtype="int8")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_kv_cache_stores_the_models_dtype(dtype):
    handle = patch_model(tiny("llama", dtype=dtype))
    try:
        cache = fleetlab.PagedKVCache.for_handle(handle, num_blocks=4, block_size=2)
        assert cache.dtype == dtype and cache.key_cache(0).dtype == getattr(paddle, dtype)
    finally:
        handle.unpatch()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_sampler_works_in_float32_whatever_the_logits(dtype):
    logits = paddle.to_tensor(np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32))
    n = 6
    st = host_tensors(np.r_[np.zeros(3), np.ones(3)].astype(np.float32), np.zeros(n, np.int64),
                                   np.ones(n, np.float32), np.arange(n), np.zeros(n, np.int64))
    want = Sampler().sample(logits.astype(dtype).astype("float32"), st).tokens
    assert (Sampler().sample(logits.astype(dtype), st).tokens == want).all()


# ---------------------------------------------------------------- device placement
def test_every_tensor_a_step_creates_is_on_the_models_device(fleet_model, monkeypatch):
    model_place = str(next(iter(fleet_model.parameters())).place)
    seen = []

    def recording(fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            seen.append((fn.__name__, str(out.place)))
            return out
        return wrapper

    for name in ("empty", "zeros", "full", "ones", "arange", "to_tensor", "zeros_like", "full_like", "assign"):
        monkeypatch.setattr(paddle, name, recording(getattr(paddle, name)))
    spec = {"method": "draft", "num_speculative_tokens": 2, "model": tiny("fleet", seed=0, num_layers=1)}
    with LLM(fleet_model, block_size=4, speculative_config=spec) as llm:
        llm.generate(prompt_token_ids=random_prompts([5, 9], seed=5), sampling_params=SAMPLED, use_tqdm=False)
    assert seen and {place for _, place in seen} == {model_place}


def test_no_engine_code_names_a_device():
    """No hard-coded CPU: the engine uses Paddle's current device (the model's)."""
    root = Path(fleetlab.__file__).parent
    allowed = {"device.py", "quiet.py", "cpu_tuning.py", "tp_worker.py"}  # tp_worker: a rank program (was distributed/)
    pattern = re.compile(r"CPUPlace\(|CUDAPlace\(|set_device\(|device=['\"](cpu|gpu)")
    offenders = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py")
                 if p.name not in allowed and not p.is_relative_to(root / "lab" / "bench") and
                 not p.is_relative_to(root / "distributed")
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
