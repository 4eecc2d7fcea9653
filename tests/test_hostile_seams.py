"""Properties over hostile extensions: a KV connector and a prefix cache that, at a random call,
raise, return the wrong type or return a value out of range. Whatever the call, every request
finishes once with the model's own tokens (the full forward's), every block is free at the end,
at most one step failed (named), and the engine serves the same prompts right afterwards."""

from __future__ import annotations

import pytest
from conftest import random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetlab import LLM, SamplingParams
from fleetlab.inspect.pool import check_kv_manager
from fleetlab.kv_transfer.offload import OffloadConnector
from fleetlab.patching.parity import reference_greedy
from fleetlab.prefix_cache.hash_chain import HashChainCache
from fleetlab.prefix_cache.radix import RadixCache

SP = SamplingParams(max_tokens=4, ignore_eos=True)
BS = 4
_PREFIXES = random_prompts([8, 8], seed=61, low=10)
PROMPTS = [_PREFIXES[i % 2] + tail for i, tail in enumerate(random_prompts([1, 5, 9, 3, 7, 2, 6, 4], seed=62, low=10))]
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
KINDS = ("raise", "type", "range")
_NOTHING = object()


@pytest.fixture(scope="module")
def oracle(fleet_model):
    want, _ = reference_greedy(fleet_model, PROMPTS, SP.max_tokens)
    return want


class Fault:
    """Fires once, at the ``at``-th call of any hostile method: raises, or returns a bad value
    of the ``kind`` asked for (a method with no such bad value raises instead)."""

    def __init__(self, at: int, kind: str):
        self.at, self.kind, self.calls, self.fired = at, kind, 0, None

    def check(self, method: str, bad: dict):
        self.calls += 1
        if self.calls != self.at:
            return _NOTHING
        kind = self.kind if self.kind in bad else "raise"
        self.fired = (method, kind)
        if kind == "raise":
            raise RuntimeError(f"injected into {method}")
        return bad[kind]


def hostile(cls, bad: dict):
    """A subclass of ``cls`` whose methods named in ``bad`` (``{method: {kind: value}}``) ask its
    ``fault`` first: instead of running, they may raise or return that bad value."""
    def make(method, values):
        def wrapped(self, *args, **kwargs):
            value = self.fault.check(method, values) if self.fault is not None else _NOTHING
            return getattr(super(sub, self), method)(*args, **kwargs) if value is _NOTHING else value
        return wrapped

    sub = type(f"Hostile{cls.__name__}", (cls,), {"fault": None, **{m: make(m, v) for m, v in bad.items()}})
    return sub


HostileOffload = hostile(OffloadConnector, {
    "get_num_new_matched_tokens": {"type": "4", "range": 10**6},
    "update_state_after_alloc": {"type": True},
    "build_connector_meta": {},
    "request_finished": {"type": None},
    "start_load_kv": {},
    "wait_for_layer_load": {},
    "save_kv_layer": {},
    "wait_for_save": {},
    "get_finished": {"type": None, "range": (set(), {10**9})},
})
CACHE_FAULTS = {"lookup": {"type": "0", "range": [10**6]}, "cache_blocks": {"type": "x", "range": 10**6},
                "keeps": {"type": "yes"}, "forget": {}, "evict": {"type": None, "range": [10**6]}}
HOSTILE_CACHES = {"hash": hostile(HashChainCache, CACHE_FAULTS),
                  "radix": hostile(RadixCache, {**CACHE_FAULTS, "lookup_partial": {"type": 3, "range": (0, 99)}})}


def serve(llm, picks, oracle):
    """Step ``picks`` (indices into PROMPTS) to the end as a server would, carrying on after a
    failed step; every request finishes once with the oracle's tokens; returns the errors."""
    ids = {llm.add_request(prompt_token_ids=PROMPTS[i], sampling_params=SP): i for i in picks}
    done, errors = {}, []
    for _ in range(400):
        if not llm.has_unfinished_requests():
            break
        try:
            outs = llm.step()
        except Exception as exc:  # noqa: BLE001 (the injected fault, whatever shape it takes)
            errors.append(exc)
            continue
        for out in outs:
            if out.finished:
                assert out.request_id not in done, f"{out.request_id} finished twice"
                done[out.request_id] = out.token_ids
    assert set(done) == set(ids), f"lost: {set(ids) - set(done)}"
    assert all(done[rid] == oracle[i] for rid, i in ids.items())
    return errors


def assert_idle(llm):
    assert not llm.has_unfinished_requests() and llm.scheduler.requests == {}
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    check_kv_manager(llm.scheduler.kv, [])


PICKS = st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=6)


@SETTINGS
@given(picks=PICKS, at=st.integers(1, 80), kind=st.sampled_from(KINDS), num_blocks=st.integers(8, 20),
       capacity_blocks=st.integers(1, 24), budget=st.sampled_from([8, 16, 64]))
def test_a_hostile_connector_never_costs_a_token_or_a_block(fleet_model, oracle, picks, at, kind, num_blocks,
                                                            capacity_blocks, budget):
    probe = LLM(fleet_model, block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=budget,
                kv_transfer_config={"connector": HostileOffload, "role": "both", "capacity_bytes": 1 << 30})
    per_block = probe.kv_connector.spec.bytes_per_block
    probe.close()
    llm = LLM(fleet_model, block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=budget,
              kv_transfer_config={"connector": HostileOffload, "role": "both",
                                  "capacity_bytes": capacity_blocks * per_block})
    fault = llm.kv_connector.fault = Fault(at, kind)
    errors = serve(llm, picks, oracle)
    assert len(errors) == (fault.fired is not None), (fault.fired, errors)
    assert_idle(llm)
    llm.kv_connector.fault = None
    assert serve(llm, picks, oracle) == []  # usable after: the same prompts, now partly from the tier
    assert_idle(llm)
    llm.close()


@SETTINGS
@given(picks=PICKS, at=st.integers(1, 60), kind=st.sampled_from(KINDS), design=st.sampled_from(["hash", "radix"]),
       num_blocks=st.integers(8, 20), budget=st.sampled_from([8, 16, 64]), async_scheduling=st.booleans())
def test_a_hostile_prefix_cache_never_costs_a_token_or_a_block(fleet_model, oracle, picks, at, kind, design,
                                                               num_blocks, budget, async_scheduling):
    cache = HOSTILE_CACHES[design](BS)
    llm = LLM(fleet_model, block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=budget,
              prefix_cache=cache, async_scheduling=async_scheduling)
    fault = cache.fault = Fault(at, kind)
    errors = serve(llm, picks, oracle)
    # A failing keeps costs the cache that block, never the step: logged, not raised.
    assert len(errors) == (fault.fired is not None and fault.fired[0] != "keeps"), (fault.fired, errors)
    assert_idle(llm)
    cache.fault = None
    assert serve(llm, picks, oracle) == []
    assert_idle(llm)
    llm.close()
