"""``AsyncLLM``: one engine thread, one output stream per request, aborts within one step."""

import asyncio
import time

import pytest

import fleetlab
from fleetlab import LLM, SamplingParams
from fleetlab.models import load_tiny
from fleetlab.serving.async_llm import AsyncLLM
from fleetlab.serving.errors import EngineDead, Overloaded

PROMPTS = ["12+7=", "45+38=", "count 3 ", "the red cat ", "6*7=", "count 40 "]


@pytest.fixture
def tiny():
    """A fresh copy of the tiny model per test (an LLM patches its model; a second LLM needs its own)."""
    return load_tiny()


def make_engine(tiny, **kw):
    model, tokenizer = tiny
    queue_len = kw.pop("max_queue_len", None)
    return AsyncLLM(LLM(model, tokenizer, block_size=4, max_num_seqs=kw.pop("max_num_seqs", 4),
                        max_num_batched_tokens=32, **kw), max_queue_len=queue_len)


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_exported_lazily():
    assert fleetlab.AsyncLLM is AsyncLLM


def test_concurrent_streams_equal_offline(tiny):
    model, tokenizer = load_tiny()  # a second copy: the oracle runs offline on its own LLM
    want = LLM(model, tokenizer, block_size=4, max_num_seqs=4, max_num_batched_tokens=32).generate(
        PROMPTS, SamplingParams(max_tokens=10), use_tqdm=False)

    async def one(engine, prompt):
        ids, outs = [], 0
        async for out in engine.generate(prompt, SamplingParams(max_tokens=10)):
            ids += out.new_token_ids
            outs += 1
        return ids, out.finish_reason, outs

    async def run(engine):
        return await asyncio.gather(*(one(engine, p) for p in PROMPTS))

    with make_engine(tiny) as engine:
        got = asyncio.run(run(engine))
        assert [g[0] for g in got] == [w.token_ids for w in want]
        assert [g[1] for g in got] == [w.finish_reason for w in want]
        assert max(g[2] for g in got) > 1  # streamed, not one final output
        wait_for(lambda: engine.stats()["num_requests_running"] == 0)
        assert engine.stats()["kv_cache_utilization"] == 0


def test_abort_frees_blocks_within_one_step(tiny):
    async def run(engine):
        stream = await engine.add_request(prompt_token_ids=[1, 5, 6, 7],
                                          sampling_params=SamplingParams(max_tokens=100, ignore_eos=True))
        for _ in range(3):
            await stream.__anext__()
        assert engine.stats()["kv_cache_utilization"] > 0
        steps = engine.stats()["num_steps"]
        stream.abort()
        return steps

    with make_engine(tiny) as engine:
        steps = asyncio.run(run(engine))
        wait_for(lambda: engine.stats()["kv_cache_utilization"] == 0)
        s = engine.stats()
        assert s["num_requests_running"] == 0 and s["num_free_blocks"] == s["num_blocks"]
        # the step running when abort() was called may finish (and the snapshot read before it
        # may lag one step): no more than that
        assert s["num_steps"] - steps <= 2
        assert engine.num_unfinished_requests == 0


def test_leaving_generate_early_aborts(tiny):
    async def run(engine):
        async for out in engine.generate(prompt_token_ids=[1, 5, 6], sampling_params=SamplingParams(
                max_tokens=100, ignore_eos=True)):
            if len(out.token_ids) >= 2:
                break

    with make_engine(tiny) as engine:
        asyncio.run(run(engine))
        wait_for(lambda: engine.stats()["kv_cache_utilization"] == 0 and engine.num_unfinished_requests == 0)


def test_bad_input_raises_before_queuing_and_full_queue_is_refused(tiny):
    async def run(engine):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request(prompt_token_ids=[1, 999], sampling_params=SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="max_tokens"):
            await engine.add_request("1+1=", SamplingParams(max_tokens=0))
        first = await engine.add_request("count 1 ", SamplingParams(max_tokens=50, ignore_eos=True))
        with pytest.raises(Overloaded):  # max_num_seqs=1 + max_queue_len=0
            await engine.add_request("1+1=", SamplingParams(max_tokens=2))
        first.abort()

    with make_engine(tiny, max_num_seqs=1, max_queue_len=0) as engine:
        asyncio.run(run(engine))
        wait_for(lambda: engine.num_unfinished_requests == 0)


def test_a_failing_step_fails_the_streams_and_marks_the_engine_dead(tiny):
    engine = make_engine(tiny)
    real_step = engine.llm.step
    calls = []

    def step(**kw):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("boom")
        return real_step(**kw)

    engine.llm.step = step

    async def run():
        with pytest.raises(EngineDead, match="boom"):
            async for _ in engine.generate("count 1 ", SamplingParams(max_tokens=50, ignore_eos=True)):
                pass
        with pytest.raises(EngineDead):
            await engine.add_request("1+1=", SamplingParams(max_tokens=2))

    try:
        asyncio.run(run())
        assert not engine.is_healthy and not engine.is_running
    finally:
        engine.llm.step = real_step
        engine.shutdown()


def test_shutdown_aborts_what_runs(tiny):
    engine = make_engine(tiny)

    async def run():
        stream = await engine.add_request("count 1 ", SamplingParams(max_tokens=80, ignore_eos=True))
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        async for _ in stream:
            pass
        assert stream.finish_reason == "abort"
        with pytest.raises(EngineDead, match="shut down"):
            await engine.add_request("1+1=", SamplingParams(max_tokens=2))

    asyncio.run(run())
    s = engine.stats()
    assert s["num_requests_running"] == 0 and s["kv_cache_utilization"] == 0


def test_add_requests_queues_them_all_in_one_engine_turn(tiny):
    engine = make_engine(tiny)
    calls = []
    real_add, real_step = engine.llm.add_request, engine.llm.step

    def add_request(**kw):
        calls.append("add")
        return real_add(**kw)

    def step(**kw):
        calls.append("step")
        return real_step(**kw)

    engine.llm.add_request, engine.llm.step = add_request, step

    async def run():
        streams = await engine.add_requests([{"prompt": p, "sampling_params": SamplingParams(max_tokens=3)}
                                             for p in PROMPTS])
        got = []
        for stream in streams:
            got.append([t async for out in stream for t in out.new_token_ids])
        return got

    try:
        got = asyncio.run(run())
    finally:
        engine.shutdown()
    assert calls[:len(PROMPTS)] == ["add"] * len(PROMPTS) and calls.count("add") == len(PROMPTS)
    assert [len(ids) for ids in got] == [3] * len(PROMPTS)


def test_add_requests_is_all_or_none(tiny):
    async def run(engine):
        good = {"prompt": "1+1=", "sampling_params": SamplingParams(max_tokens=2)}
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_requests([good, good, {"prompt_token_ids": [1, 999], "sampling_params": None}])
        assert engine.num_unfinished_requests == 0

    with make_engine(tiny) as engine:
        asyncio.run(run(engine))
        wait_for(lambda: engine.stats()["num_requests_waiting"] == engine.stats()["num_requests_running"] == 0)


def test_stream_times_and_fail(tiny):
    """The engine thread stamps queued <= scheduled <= first token <= last token, one gap per later
    step with tokens; ``fail`` ends a stream with the error after the outputs already waiting."""

    async def run(engine):
        stream = await engine.add_request("count 1 ", SamplingParams(max_tokens=6, ignore_eos=True))
        n = [out async for out in stream]
        t = stream.times
        assert t.arrival <= t.queued <= t.scheduled <= t.first_token <= t.last_token
        assert len(t.token_gaps) == 5 and sum(t.token_gaps) == pytest.approx(t.last_token - t.first_token)
        stream = await engine.add_request("count 2 ", SamplingParams(max_tokens=80, ignore_eos=True))
        first = await stream.__anext__()
        stream.fail(RuntimeError("stopping"))
        with pytest.raises(RuntimeError, match="stopping"):
            async for out in stream:
                assert out.new_token_ids and not out.finished  # what was waiting comes first
        return n, first

    with make_engine(tiny) as engine:
        n, first = asyncio.run(run(engine))
        assert n and first.new_token_ids
        wait_for(lambda: engine.stats()["kv_cache_utilization"] == 0 and engine.num_unfinished_requests == 0)
