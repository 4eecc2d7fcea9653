"""Every end-to-end scenario, overlapped: ``LLM(async_scheduling=True)`` gives the tokens (and
logprobs, finish reasons) of the synchronous loop, and greedy ones equal the full forward."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.inspect.pool import check_pool
from fleetlab.patching.parity import reference_greedy

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SHARED = random_prompts([13], seed=40)[0]
SCENARIOS = {  # name: (family, prompts, engine config, sampling params, greedy: compare with the full forward)
    "greedy fleet": ("fleet", random_prompts([5, 9, 17, 3, 30, 12], seed=1), {}, GREEDY, True),
    "greedy llama": ("llama", random_prompts([4, 11, 19], seed=2), {}, GREEDY, True),
    "greedy ernie4_5": ("ernie4_5", random_prompts([4, 11, 19], seed=2), {}, GREEDY, True),
    "chunked prefill, budget 3": ("fleet", random_prompts([5, 9, 17], seed=3), {"max_num_batched_tokens": 3},
                                  GREEDY, True),
    "without chunked prefill": ("fleet", random_prompts([5, 9, 17, 30], seed=3),
                                {"max_num_batched_tokens": 64, "max_model_len": 64, "enable_chunked_prefill": False},
                                GREEDY, True),
    "preemption, small pool": ("fleet", random_prompts([5, 9, 17, 3, 30, 12], seed=1),
                               {"num_blocks": 10, "max_num_batched_tokens": 12}, GREEDY, True),
    "prefix hits": ("fleet", [SHARED + p for p in random_prompts([3, 6, 9, 2], seed=4)], {"warm": True}, GREEDY, True),
    "n > 1, seeded": ("fleet", random_prompts([6, 10], seed=5), {},
                      SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7, n=3), False),
    "logprobs": ("fleet", random_prompts([23, 9, 14], seed=6), {"max_num_batched_tokens": 10},
                 [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3),
                  SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=2, logprobs=2),
                  SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=0)], False),
    "penalties and bias": ("fleet", random_prompts([7, 12, 4], seed=8), {},
                           [SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.5),
                            SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=1.8, temperature=0.8,
                                           seed=3),
                            SamplingParams(max_tokens=10, ignore_eos=True, logit_bias={9: 3.0, 11: -2.0})], False),
    "seeded sampling": ("fleet", random_prompts([7, 12, 4, 20], seed=9), {"num_blocks": 14},
                        [SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=1),
                         SamplingParams(max_tokens=8, temperature=1.2, top_p=0.8, seed=2, min_tokens=4),
                         SamplingParams(max_tokens=8, temperature=1.0, seed=3, stop_token_ids=[20, 30, 40]),
                         SamplingParams(max_tokens=8, temperature=0.7)], False),
}


def generate(model, prompts, config, sps, async_scheduling):
    config = dict(config)
    warm = config.pop("warm", False)
    with LLM(model, block_size=4, max_num_batched_tokens=config.pop("max_num_batched_tokens", 16), seed=5,
             async_scheduling=async_scheduling, **config) as llm:
        if warm:  # the prompts' shared blocks are cached first: the measured run hits them
            llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY, use_tqdm=False)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
        check_pool(llm.pool)
        assert llm.pool.num_free_blocks == llm.pool.num_blocks
        return outs, llm.stats()


def logprobs_of(out):
    rows = [(x.token_id, round(x.logprob, 5), x.rank, [(t, round(v, 5)) for t, v in x.top]) for x in out.logprobs or []]
    prompt = [None if x is None else (x.token_id, round(x.logprob, 5)) for x in out.prompt_logprobs or []]
    return rows, prompt


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_overlapped_equals_synchronous(name, family_models):
    family, prompts, config, sps, greedy = SCENARIOS[name]
    model = family_models(family)
    sync, sync_stats = generate(model, prompts, config, sps, False)
    over, stats = generate(model, prompts, config, sps, True)
    assert [(o.request_id, o.index) for o in over] == [(o.request_id, o.index) for o in sync]
    assert [o.token_ids for o in over] == [o.token_ids for o in sync]
    assert [o.finish_reason for o in over] == [o.finish_reason for o in sync]
    assert [logprobs_of(o) for o in over] == [logprobs_of(o) for o in sync]
    if greedy:
        want, _ = reference_greedy(model, prompts, GREEDY.max_tokens)
        assert [o.token_ids for o in over] == want
    if "preemption" in name:
        assert stats["num_preemptions"] > 0
    if "prefix" in name:
        assert stats["prefix_cache_hit_rate"] > 0
    if "logprobs" in name:
        assert all(o.logprobs or o.prompt_logprobs for o in over)
