"""The overlapped loop (``LLM(async_scheduling=True)``, ``fleetlab.overlap``): placeholders,
no extra token after a finish, aborts mid-flight, rollback of both steps in flight, refusals."""

from __future__ import annotations

import time

import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.engine.sampler import Sampler
from fleetlab.inspect.pool import check_kv_manager
from fleetlab.kv.block_pool import BlockPool
from fleetlab.kv.manager import KVCacheManager
from fleetlab.overlap import core as overlap_core
from fleetlab.patching.parity import reference_greedy
from fleetlab.prefix_cache import build_prefix_cache

SP = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts([7, 12, 4, 9], seed=31, low=10)


@pytest.fixture(scope="module")
def oracle(fleet_model):
    return reference_greedy(fleet_model, PROMPTS, SP.max_tokens)[0]


def overlapped(model, **config):
    """An engine that overlaps every step (its gate never runs one in line): these tests are about the overlap."""
    llm = LLM(model, block_size=4, max_num_batched_tokens=16, async_scheduling=True, **config)
    llm.core.gate.always = True
    return llm


def assert_idle(llm):
    assert not llm.has_unfinished_requests() and llm.scheduler.requests == {}
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    check_kv_manager(llm.scheduler.kv, [])


def test_placeholders_are_filled_with_the_step_befores_tokens(fleet_model, oracle, monkeypatch):
    fills = []
    real = overlap_core.fill

    def spy(prepared, result):
        n = real(prepared, result)
        ids = prepared.inputs.input_ids.numpy()[0]
        fills.append([(rid, int(ids[index]), result.sampled_token_ids.get(rid))
                      for rid, _, _, index in prepared.placeholders])
        return n

    monkeypatch.setattr(overlap_core, "fill", spy)
    with overlapped(fleet_model) as llm:
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
        assert [o.token_ids for o in outs] == oracle
        slots = [s for step in fills for s in step]
        assert len(slots) > len(PROMPTS) * (SP.max_tokens - 2)  # nearly every decode read a placeholder
        for _, token, sampled in slots:  # each one the token the step before sampled for it
            assert sampled is not None and token == sampled[-1]
        assert all(r.num_placeholders == 0 for r in llm.scheduler.waiting)
        assert_idle(llm)


def test_a_finished_request_wastes_one_slot_and_gains_no_token(fleet_model, oracle):
    """Requests finish at different steps (max_tokens 1..4, a stop token): tokens and reasons
    as in the synchronous loop. The step planned while a request's last step ran still carries
    it: that slot is wasted and dropped at commit, never a token."""
    stop_at = oracle[3][2]
    sps = [SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=3, ignore_eos=True),
           SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=6, stop_token_ids=[stop_at])]
    with overlapped(fleet_model) as llm, LLM(fleet_model, block_size=4, max_num_batched_tokens=16) as sync:
        got = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sps, use_tqdm=False)
        want = sync.generate(prompt_token_ids=PROMPTS, sampling_params=sps, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [len(o.token_ids) for o in got] == [1, 3, 4, 3]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want] == ["length"] * 3 + ["stop"]

        plans, schedule = [], llm.scheduler.schedule

        def spy():
            plans.append(schedule())
            return plans[-1]

        llm.scheduler.schedule = spy
        rid = llm.add_request(prompt_token_ids=PROMPTS[1], sampling_params=sps[1])
        streamed, finished = [], False
        while llm.has_unfinished_requests():
            for out in llm.step():
                assert not finished, "an output after the finish"
                streamed += out.new_token_ids
                finished = out.finished
        assert streamed == want[1].token_ids
        # A prefill and two decodes made its 3 tokens; the 4th plan was made while the 3rd ran.
        assert [rid in p.num_scheduled_tokens for p in plans] == [True] * 4
        assert llm.core._in_flight is None  # the wasted step was finished with the loop
        assert_idle(llm)


def test_abort_while_the_request_is_in_flight(fleet_model, oracle):
    with overlapped(fleet_model) as llm:
        ids = [llm.add_request(prompt_token_ids=p, sampling_params=SP) for p in PROMPTS]
        gained = {rid: [] for rid in ids}
        for _ in range(4):
            for out in llm.step():
                gained[out.request_id] += out.new_token_ids
        victim = ids[1]
        assert victim in llm.core._in_flight.sched.num_scheduled_tokens  # its next step runs now
        (aborted,) = llm.abort(victim)
        assert aborted.finish_reason == "abort"
        while llm.has_unfinished_requests():
            for out in llm.step():
                assert out.request_id != victim
                gained[out.request_id] += out.new_token_ids
        assert gained[victim] == oracle[1][: len(gained[victim])]
        assert [gained[r] for r in ids if r != victim] == [t for i, t in enumerate(oracle) if i != 1]
        assert_idle(llm)


@pytest.mark.parametrize("where", ["sampler", "forward", "metadata", "condense"])
@pytest.mark.parametrize("call", [2, 3, 5])
def test_a_failed_step_rolls_back_both_steps_in_flight(fleet_model, oracle, monkeypatch, where, call):
    """Model-thread faults (sampler, forward) surface one call later, host faults (metadata,
    condense) while the step before runs; either way both open steps are undone."""
    with overlapped(fleet_model, num_blocks=40) as llm:
        owner, name = {"sampler": (Sampler, "sample"), "forward": (llm.handle, "compute_logits"),
                       "metadata": (llm.runner, "prepare_inputs"), "condense": (llm.runner.batch, "condense")}[where]
        real, calls = getattr(owner, name), {"n": 0}

        def flaky(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == call:
                raise KeyboardInterrupt("injected")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, flaky)
        ids = [llm.add_request(prompt_token_ids=p, sampling_params=SP) for p in PROMPTS]
        done = {}
        with pytest.raises(KeyboardInterrupt):
            while llm.has_unfinished_requests():
                done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
        assert llm.core._in_flight is None and len(llm.scheduler.kv._step_logs) == 1
        assert all(r.num_placeholders == 0 for r in llm.scheduler.requests.values())
        while llm.has_unfinished_requests():  # the same requests carry on where the undone steps left them
            done.update({o.request_id: o.token_ids for o in llm.step() if o.finished})
        assert [done[i] for i in ids] == oracle
        assert_idle(llm)


def test_the_kv_step_log_covers_both_open_steps():
    pool = BlockPool(16, 4, build_prefix_cache("hash", 4))
    kv = KVCacheManager(pool)

    class Req:
        def __init__(self, rid, tokens):
            self.request_id, self.all_token_ids = rid, tokens
            self.num_tokens = self.num_cacheable_tokens = len(tokens)
            self.num_computed_tokens = 0

    a, b = Req("a", list(range(8))), Req("b", list(range(100, 108)))
    kv.allocate_slots(a, 8)  # step N registers a's two full blocks
    kv.open_step()
    kv.allocate_slots(b, 8)  # step N+1, planned while N runs, registers b's
    kv.rollback_step()  # both are undone
    assert kv.get_computed_blocks(Req("a2", list(range(8)) + [9]))[1] == 0
    assert kv.get_computed_blocks(Req("b2", list(range(100, 108)) + [9]))[1] == 0
    kv.free(a), kv.free(b)
    c, d = Req("c", list(range(200, 208))), Req("d", list(range(300, 308)))
    kv.allocate_slots(c, 8)
    kv.open_step()
    kv.allocate_slots(d, 8)
    kv.commit_step()  # step N ran: c's registrations stand, d's are still open
    kv.rollback_step()
    assert kv.get_computed_blocks(Req("c2", list(range(200, 208)) + [9]))[1] == 8
    assert kv.get_computed_blocks(Req("d2", list(range(300, 308)) + [9]))[1] == 0


@pytest.mark.parametrize("option, value", [
    ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ("tensor_parallel_size", 2),
    ("kv_transfer_config", {"connector": "shared_storage", "role": "both", "path": "/tmp/fleetlab-never"}),
    ("record_traces", True),
])
def test_what_cannot_overlap_is_refused_naming_the_option(fleet_model, option, value):
    with pytest.raises(ValueError, match=f"async_scheduling=True cannot go with {option}"):
        LLM(fleet_model, async_scheduling=True, **{option: value})


def test_a_structured_request_is_refused_naming_request_and_field(fleet_model):
    with overlapped(fleet_model) as llm:
        sp = SamplingParams(max_tokens=4, structured_outputs={"choice": ["a", "b"]})
        with pytest.raises(ValueError, match="request 'json-1': sampling field structured_outputs.*async_scheduling"):
            llm.add_request(prompt_token_ids=PROMPTS[0], sampling_params=sp, request_id="json-1")
        assert llm.scheduler.requests == {}


def test_async_scheduling_must_be_a_bool(fleet_model):
    with pytest.raises((TypeError, ValueError), match="async_scheduling"):
        LLM(fleet_model, async_scheduling="yes")


def test_serve_has_the_flag():
    from fleetlab.serving.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["--async-scheduling"]))["async_scheduling"] is True
    assert engine_config(build_parser().parse_args([]))["async_scheduling"] is False


def test_async_llm_streams_overlapped_as_offline_and_aborts():
    """The server's engine thread drives an overlapped core: concurrent streams equal the
    synchronous offline outputs, and an abort mid-stream frees every block."""
    import asyncio

    from fleetlab.models import load_tiny
    from fleetlab.serving.async_llm import AsyncLLM

    prompts = ["12+7=", "45+38=", "count 3 ", "6*7="]
    model, tokenizer = load_tiny()
    config = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    with LLM(model, tokenizer, **config) as sync:
        want = sync.generate(prompts, SamplingParams(max_tokens=10), use_tqdm=False)

    async def one(engine, prompt):
        ids = []
        async for out in engine.generate(prompt, SamplingParams(max_tokens=10)):
            ids += out.new_token_ids
        return ids

    async def run(engine):
        got = await asyncio.gather(*(one(engine, p) for p in prompts))
        stream = await engine.add_request(prompt_token_ids=[1, 5, 6, 7],
                                          sampling_params=SamplingParams(max_tokens=100, ignore_eos=True))
        for _ in range(3):
            await stream.__anext__()
        stream.abort()
        return got

    with AsyncLLM(LLM(model, tokenizer, async_scheduling=True, **config)) as engine:
        assert asyncio.run(run(engine)) == [w.token_ids for w in want]
        for _ in range(500):
            if engine.stats()["kv_cache_utilization"] == 0 and engine.num_unfinished_requests == 0:
                break
            time.sleep(0.01)
        stats = engine.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and engine.num_unfinished_requests == 0


def test_timeline_puts_the_forward_on_the_model_thread_and_close_stops_it(fleet_model):
    from fleetlab.lab.viz import draw_overlap
    from fleetlab.overlap import Timeline

    timelines = {}
    for name, overlapped in (("sync", False), ("overlap", True)):
        llm = LLM(fleet_model, block_size=4, max_num_batched_tokens=16, async_scheduling=overlapped)
        if overlapped:
            llm.core.gate.always = True
        timelines[name] = Timeline()
        llm.hooks.attach(timelines[name])
        for p in PROMPTS:
            llm.add_request(prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=12, ignore_eos=True))
        for _ in range(8):
            llm.step()
        llm.close()  # mid-generation: the step in flight is waited for, the model thread stops
        if overlapped:
            assert llm.core._model_thread._shutdown
    forwards = {name: {s.thread for s in t.spans if s.name == "forward"} for name, t in timelines.items()}
    assert forwards == {"sync": {"MainThread"}, "overlap": {"fleetlab-model_0"}}
    assert {s.thread for s in timelines["overlap"].spans if s.name == "schedule"} == {"MainThread"}
    fig = draw_overlap(timelines, first_forward=2, num_steps=2)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["sync: model", "sync: host", "overlap: model",
                                                                      "overlap: host"]


def test_stop_strings_end_requests_as_in_the_synchronous_loop():
    """A stop string is found by the output processor after the step and the request aborted:
    its slot in the step already in flight is dropped, its text and tokens as synchronous."""
    from fleetlab.models import load_tiny

    model, tokenizer = load_tiny()
    prompts = ["12+7=", "45+38=", "count 3 ", "the red cat "]
    sps = [SamplingParams(max_tokens=16, stop=["9"]), SamplingParams(max_tokens=16, stop=["3"]),
           SamplingParams(max_tokens=16, stop=[" 5"]), SamplingParams(max_tokens=16, stop=["t"])]
    outs = {}
    for overlapped in (False, True):
        with LLM(model, tokenizer, block_size=4, max_num_batched_tokens=32, async_scheduling=overlapped) as llm:
            outs[overlapped] = llm.generate(prompts, sps, use_tqdm=False)
            assert_idle(llm)
    assert [(o.text, o.token_ids, o.finish_reason) for o in outs[True]] == [
        (o.text, o.token_ids, o.finish_reason) for o in outs[False]]
    assert sum(o.finish_reason == "stop" and o.stop_reason in ("9", "3", " 5", "t") for o in outs[True]) == 4
