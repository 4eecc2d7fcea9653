"""Extension points: user attention backends and scheduling policies keep the engine's guarantees."""

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.attention.backend import AttentionBackend, get_attention_backend, register_attention_backend
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.attention.tiled import paged_attention
from fleetlab.engine.policies import PriorityPolicy
from fleetlab.patching.parity import reference_greedy

GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


class RecordingBackend(AttentionBackend):
    """Delegates to the reference kernel and records each layer-0 call's query lengths."""

    name = "recording"
    calls: ClassVar[list] = []

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None,
               sinks=None):
        if not self.calls or self.calls[-1] is not metadata:
            type(self).calls.append(metadata)
        return paged_attention(query, key_cache, value_cache, metadata, scale=scale,
                               sliding_window=sliding_window, sinks=sinks)


class DecodeFirstBackend(RecordingBackend):
    name = "decode-first"
    requires_reorder = True
    calls: ClassVar[list] = []


@pytest.fixture(scope="module")
def workload(fleet_model):
    prompts = random_prompts([3, 14, 6, 21, 9], seed=21)
    want, _ = reference_greedy(fleet_model, prompts, 5)
    return prompts, want


@pytest.mark.parametrize("cls", [RecordingBackend, DecodeFirstBackend])
def test_user_backend_runs_end_to_end_and_matches(fleet_model, workload, cls):
    register_attention_backend(cls.name, cls)
    assert get_attention_backend(cls.name) is cls
    prompts, want = workload
    cls.calls.clear()
    llm = LLM(fleet_model, backend=cls.name, block_size=4, max_num_batched_tokens=10, record_traces=True)
    try:
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)]
    finally:
        llm.handle.unpatch()
    assert got == want
    assert cls.calls, "the backend was never called"
    mixed = 0
    for md, trace in zip(cls.calls, llm.traces):
        q = md.query_lens_host
        if cls.requires_reorder:
            assert (q[: md.num_decodes] <= 1).all() and (q[md.num_decodes:] > 1).all()
            assert trace.reorder and trace.reordered == (trace.order_before != trace.order_after)
        else:
            assert trace.order_after == trace.order_before  # rows left where they were
        mixed += (q <= 1).any() and (q > 1).any()
    assert mixed, "some step should mix decodes and prefills"


@dataclass(slots=True)
class PlanMetadata(AttentionMetadata):
    """A backend's own per-step metadata: here, a plan and the number of layers that read it."""

    kv_indptr: np.ndarray = None
    reads: list = field(default_factory=list)


class PlanningBackend(AttentionBackend):
    """Builds a plan (CSR offsets of the rows' contexts) once per step; every layer reads it."""

    name = "planning"
    builds: ClassVar[list] = []

    def build_metadata(self, common):
        md = common.extend(PlanMetadata, kv_indptr=np.concatenate([[0], np.cumsum(common.seq_lens_kv_host)]))
        type(self).builds.append(md)
        return md

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None,
               sinks=None):
        metadata.reads.append(int(metadata.kv_indptr[-1]))
        return paged_attention(query, key_cache, value_cache, metadata, scale=scale,
                               sliding_window=sliding_window, sinks=sinks)


def test_a_backend_builds_its_own_metadata_once_per_step(fleet_model, workload):
    prompts, want = workload
    register_attention_backend("planning", PlanningBackend)
    PlanningBackend.builds.clear()
    with LLM(fleet_model, backend="planning", block_size=4, max_num_batched_tokens=10, record_traces=True) as llm:
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)]
        num_layers = llm.handle.num_layers
        assert len(PlanningBackend.builds) == len(llm.traces)  # one plan per step ...
    assert got == want
    for md in PlanningBackend.builds:  # ... read by every layer of that step
        assert md.reads == [int(md.seq_lens_kv_host.sum())] * num_layers


def test_backends_register_lazily_by_module_path(fleet_model):
    register_attention_backend("naive", "fleetlab.attention.naive:NaiveBackend", replace=True)  # a built-in
    from fleetlab.attention.naive import NaiveBackend

    assert get_attention_backend("naive") is NaiveBackend
    with pytest.raises(ValueError, match="module:Class"):
        register_attention_backend("bad", "fleetlab.attention.naive")


def test_backend_needs_the_engine_cannot_meet_fail_at_construction(fleet_model):
    register_attention_backend(DecodeFirstBackend.name, DecodeFirstBackend)
    with pytest.raises(ValueError, match="requires decode-first"):
        LLM(fleet_model, backend=DecodeFirstBackend.name, reorder=False)
    with pytest.raises(ValueError, match="unknown attention backend"):
        LLM(fleet_model, backend="no-such-backend")


@pytest.mark.parametrize("policy", ["fcfs", "spf", "priority"])
def test_every_policy_finishes_everything_with_identical_greedy_tokens(fleet_model, workload, policy):
    prompts, want = workload
    llm = LLM(fleet_model, block_size=4, num_blocks=14, max_num_seqs=3, max_num_batched_tokens=8,
              scheduling_policy=policy)
    try:
        outs = [llm.add_request(prompt_token_ids=p, sampling_params=GREEDY, priority=i % 3)
                for i, p in enumerate(prompts)]
        done = {}
        for _ in range(500):
            done.update({o.request_id: o for o in llm.step()})
            if not llm.has_unfinished_requests():
                break
    finally:
        llm.handle.unpatch()
    assert [done[r].token_ids for r in outs] == want
    assert all(done[r].finish_reason == "length" for r in outs)
    assert llm.stats()["num_free_blocks"] == 14


def admission_step_of_low_priority(fleet_model, policy, steps=80):
    """One low-priority request at step 0, then a fresh high-priority one every step."""
    llm = LLM(fleet_model, block_size=4, max_num_seqs=1, scheduling_policy=policy, record_traces=True)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    try:
        llm.add_request(prompt_token_ids=[5, 6, 7], sampling_params=one, request_id="low", priority=5)
        for step in range(steps):
            llm.add_request(prompt_token_ids=[8, 9], sampling_params=one, request_id=f"hi{step}", priority=0)
            llm.step()
            if any(r.request_id == "low" for r in llm.traces[-1].rows):
                return step
    finally:
        llm.handle.unpatch()
    return None


def test_priority_aging_bounds_starvation(fleet_model):
    aging = 4
    step = admission_step_of_low_priority(fleet_model, PriorityPolicy(aging_steps=aging))
    bound = (5 - 0 + 1) * aging  # documented in PriorityPolicy
    assert step is not None and step <= bound
    assert step >= 5 * aging - 1  # it really waited behind the urgent ones
    assert admission_step_of_low_priority(fleet_model, "fcfs") == 0


def test_unknown_policy(fleet_model):
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(fleet_model, scheduling_policy="lottery")
    assert np.isfinite(PriorityPolicy().aging_steps)
