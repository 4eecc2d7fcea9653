"""The sampler: greedy, temperature, top-k, top-p, and per-request seeds."""

from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from conftest import random_prompts
from sampler_helpers import host_tensors

from fleetlab import LLM, SamplingParams
from fleetlab.engine.sampler import Sampler


def tensors(n, temperature=1.0, top_k=0, top_p=1.0, seeds=None, draw=None, banned=None):
    return host_tensors(
        np.full(n, temperature, np.float32), np.full(n, top_k, np.int64), np.full(n, top_p, np.float32),
        np.arange(n) if seeds is None else seeds, np.zeros(n, np.int64) if draw is None else draw, banned)


LOGITS = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32))


def draw_many(n=4000, **kw):
    logits = paddle.to_tensor(np.repeat(LOGITS, n, axis=0))
    return Sampler().sample(logits, tensors(n, **kw)).tokens


def test_greedy_is_argmax():
    logits = paddle.to_tensor(np.random.default_rng(0).normal(size=(5, 11)).astype(np.float32))
    got = Sampler().sample(logits, tensors(5, temperature=0.0)).tokens
    assert (got == logits.numpy().argmax(-1)).all()


def test_temperature_one_follows_the_distribution():
    freq = np.bincount(draw_many(), minlength=4) / 4000
    assert np.abs(freq - [0.5, 0.3, 0.15, 0.05]).max() < 0.03


def test_top_k_and_top_p_cut_the_tail():
    assert set(draw_many(top_k=2)) == {0, 1}
    assert set(draw_many(top_k=1)) == {0}
    assert set(draw_many(top_p=0.7)) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    assert set(draw_many(top_p=0.4)) == {0}
    freq = np.bincount(draw_many(top_k=2), minlength=4) / 4000
    assert abs(freq[0] - 0.5 / 0.8) < 0.03


def test_banned_tokens_are_never_drawn():
    got = draw_many(n=500, banned=[[0]] * 500)
    assert 0 not in set(got)


def test_same_seed_same_tokens_whatever_shares_the_batch(fleet_model):
    prompts = random_prompts([6, 9, 4, 12], seed=11)
    sp = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    llm = LLM(fleet_model, block_size=4)
    try:
        alone = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=sp, use_tqdm=False)[0].token_ids
        others = [SamplingParams(max_tokens=8, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
        mixed = llm.generate(prompt_token_ids=prompts[1:] + [prompts[0]], sampling_params=others + [sp],
                             use_tqdm=False)
        other_seed = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=SamplingParams(
            max_tokens=8, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True), use_tqdm=False)[0].token_ids
    finally:
        llm.handle.unpatch()
    assert mixed[-1].token_ids == alone
    assert other_seed != alone  # 8 draws from a random model: a collision would be a fluke


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)])
def test_degenerate_sampling_is_greedy(fleet_model, kw):
    prompts = random_prompts([5, 8], seed=12)
    llm = LLM(fleet_model, block_size=4)
    try:
        g = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=6, ignore_eos=True),
                         use_tqdm=False)
        s = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            max_tokens=6, ignore_eos=True, temperature=kw.get("temperature", 1.0), **{
                k: v for k, v in kw.items() if k != "temperature"}), use_tqdm=False)
    finally:
        llm.handle.unpatch()
    assert [o.token_ids for o in g] == [o.token_ids for o in s]


def test_a_uniform_that_rounds_to_one_never_draws_a_masked_token(monkeypatch):
    # 1 - 1e-9 becomes 1.0 in float32: the inverse CDF must still stop at a kept token.
    monkeypatch.setattr("fleetlab.engine.sampler.request_rng",
                        lambda seed, index: SimpleNamespace(random=lambda: 1 - 1e-9))
    assert set(draw_many(n=8, top_k=2)) == {1}
    banned = [[3]] * 8
    assert set(draw_many(n=8, banned=banned)) == {2}
