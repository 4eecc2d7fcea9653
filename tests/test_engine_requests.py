"""Requests in, outputs out: stop conditions, bad input, errors that must not lose work."""

import numpy as np
import paddle
import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.inspect.recorder import StepRecorder
from fleetlab.patching.parity import reference_greedy


@pytest.fixture()
def llm(fleet_model):
    engine = LLM(fleet_model, block_size=4, max_num_batched_tokens=16, max_model_len=48)
    yield engine
    engine.handle.unpatch()


def test_outputs_come_back_in_input_order_with_ids(llm):
    prompts = random_prompts([9, 2, 5], seed=7)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert len({o.request_id for o in outs}) == 3


@pytest.fixture(scope="module")
def oracle_seq(fleet_model):
    prompt = random_prompts([6], seed=8)[0]
    want, _ = reference_greedy(fleet_model, [prompt], 8)
    return prompt, want[0]


def test_stop_token_and_eos_and_min_tokens(oracle_seq, llm):
    prompt, seq = oracle_seq
    stop_at = seq[3]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        max_tokens=8, stop_token_ids=(stop_at,), ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == seq[: seq.index(stop_at) + 1]

    llm.processor.eos_token_id = seq[2]  # make the model's third token its EOS
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == seq[2]
    assert len(out.token_ids) == seq.index(seq[2]) + 1

    # min_tokens bans EOS until enough tokens exist, so generation must pass it
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=8, min_tokens=5),
                       use_tqdm=False)[0]
    assert len(out.token_ids) >= 5 and seq[2] not in out.token_ids[:5]


def test_length_limits(llm):
    prompt = random_prompts([40], seed=9)[0]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=30, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 48  # max_model_len
    out = llm.generate(prompt_token_ids=[prompt[:5]], sampling_params=SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2


BAD = [
    (dict(prompt_token_ids=[[]]), "prompt is empty"),
    (dict(prompt_token_ids=[[1, 2, 999]]), "outside the vocabulary"),
    (dict(prompt_token_ids=[[-1, 2]]), "outside the vocabulary"),
    (dict(prompt_token_ids=[list(range(3, 51))]), "max_model_len"),
    (dict(prompt_token_ids=[[3, 4]], sampling_params=SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(prompt_token_ids=[[3, 4]], sampling_params=SamplingParams(temperature=-0.5)), "temperature"),
    (dict(prompt_token_ids=[[3, 4]], sampling_params=SamplingParams(top_p=0.0)), "top_p"),
    (dict(prompt_token_ids=[[3, 4]], sampling_params=SamplingParams(top_p=1.5)), "top_p"),
    (dict(prompt_token_ids=[[3, 4]], sampling_params=SamplingParams(top_k=-2)), "top_k"),
    (dict(prompts=["hello"]), "no tokenizer"),
    (dict(prompt_token_ids=[[3, 4]], sampling_params=SamplingParams(stop_token_ids=(5, 999))), "stop_token_ids"),
    (dict(prompt_token_ids=[[3, 4]], sampling_params=SamplingParams(stop_token_ids=tuple(range(3, 12)))),
     "stop_token_ids"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[b[1] for b in BAD])
def test_bad_input_raises_value_error_naming_request_and_field_and_queues_nothing(llm, kwargs, field):
    good = [[5, 6, 7]]
    ids = kwargs.pop("prompt_token_ids", None)
    if ids is not None:
        kwargs["prompt_token_ids"] = good + ids
    with pytest.raises(ValueError, match=field) as err:
        llm.generate(use_tqdm=False, **kwargs)
    assert "request" in str(err.value)
    assert not llm.has_unfinished_requests()  # the good request was not queued either


def test_pool_too_small_for_one_request(fleet_model):
    llm = LLM(fleet_model, block_size=4, num_blocks=3)
    try:
        with pytest.raises(ValueError, match="num_blocks"):
            llm.generate(prompt_token_ids=[[3] * 10], sampling_params=SamplingParams(max_tokens=8), use_tqdm=False)
    finally:
        llm.handle.unpatch()


def test_bad_engine_config():
    with pytest.raises(ValueError, match="block_size"):
        LLM(None, block_size=0)
    with pytest.raises(TypeError, match="unknown engine config"):
        LLM(None, blok_size=4)


def test_an_error_found_mid_run_finishes_only_that_request(llm, monkeypatch):
    prompts = random_prompts([5, 6, 7], seed=10)
    real = llm.handle.compute_logits
    poisoned = {"row": None}

    def compute_logits(input_ids, positions, rows, inputs_embeds=None):
        logits = real(input_ids, positions, rows, inputs_embeds)
        if llm.runner.batch.num_reqs == 3:  # poison request "1" once all three run
            row = llm.runner.batch.req_id_to_row[ids[1]]
            poisoned["row"] = row
            mask = np.zeros(logits.shape, dtype=bool)
            mask[row] = True
            logits = paddle.where(paddle.to_tensor(mask), paddle.full_like(logits, float("nan")), logits)
        return logits

    monkeypatch.setattr(llm.handle, "compute_logits", compute_logits)
    ids = [llm.add_request(prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
           for p in prompts]
    finished = {}
    for _ in range(50):
        for out in llm.step():
            finished[out.request_id] = out
        if not llm.has_unfinished_requests():
            break
    assert poisoned["row"] is not None
    assert finished[ids[1]].finish_reason == "error" and "non-finite" in finished[ids[1]].error
    assert finished[ids[0]].finish_reason == finished[ids[2]].finish_reason == "length"
    assert len(finished[ids[0]].token_ids) == 4
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_step_by_hand_and_stats(llm):
    llm.add_request(prompt_token_ids=[3, 4, 5], sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    recorder = StepRecorder(llm)  # an observer: a StepTrace of every step from now on
    llm.hooks.attach(recorder)
    outs = llm.step()
    trace = recorder.traces[-1]
    assert trace.rows[0].phase == "prefill" and trace.num_batched_tokens == 3
    assert not [o for o in outs if o.finished] and llm.has_unfinished_requests()
    outs = llm.step()
    trace = recorder.traces[-1]
    assert trace.rows[0].phase == "decode" and outs[0].finish_reason == "length"
    llm.hooks.detach(recorder)  # it sees no step from now on
    llm.add_request(prompt_token_ids=[3, 4], sampling_params=SamplingParams(max_tokens=1, ignore_eos=True))
    llm.step()
    assert len(recorder.traces) == 2 and not any(recorder in ls for ls in llm.hooks.listeners.values())
    s = llm.stats()
    for key in ("num_blocks", "num_free_blocks", "prefix_cache_hit_rate", "num_preemptions", "kv_cache_utilization"):
        assert key in s


def test_a_request_waiting_for_blocks_counts_one_prefix_query(fleet_model):
    # The pool holds only the first request: the second is looked up every step until it fits,
    # but the hit rate must count each admission once, not each retry.
    llm = LLM(fleet_model, block_size=4, num_blocks=4, max_num_batched_tokens=10, max_model_len=48)
    try:
        outs = llm.generate(prompt_token_ids=random_prompts([10, 10], seed=3),
                            sampling_params=SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [6, 6]
        assert llm.stats()["num_steps"] > 8  # the second request really waited
        assert llm.stats()["prefix_cache_queries"] == 2
    finally:
        llm.handle.unpatch()


def test_abort_frees_blocks_at_once_and_others_finish(llm):
    prompts = random_prompts([9, 5, 7], seed=11)
    ids = [llm.add_request(prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=12, ignore_eos=True))
           for p in prompts]
    llm.step()
    llm.step()
    outs = llm.abort([ids[1], "no-such-request"])
    assert [o.request_id for o in outs] == [ids[1]] and outs[0].finish_reason == "abort"
    waiting_id = llm.add_request(prompt_token_ids=prompts[0], sampling_params=SamplingParams(max_tokens=4))
    assert [o.finish_reason for o in llm.abort(waiting_id)] == ["abort"]  # aborted before it ever ran
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step()})
    assert set(done) == {ids[0], ids[2]} and all(len(o.token_ids) == 12 for o in done.values())
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    assert llm.abort(ids) == []  # finished ids are ignored


def test_stream_outputs_carry_each_steps_new_tokens(llm):
    prompts = random_prompts([6, 3], seed=12)
    want = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    ids = [llm.add_request(prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=5, ignore_eos=True))
           for p in prompts]
    streamed = {rid: [] for rid in ids}
    finished = set()
    while llm.has_unfinished_requests():
        for out in llm.step():
            assert out.new_token_ids, "a stream output always carries the step's tokens"
            streamed[out.request_id] += out.new_token_ids
            assert out.token_ids == streamed[out.request_id]
            if out.finished:
                finished.add(out.request_id)
    assert finished == set(ids)
    assert [streamed[rid] for rid in ids] == [o.token_ids for o in want]
