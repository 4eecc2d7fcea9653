"""Speculative decoding: greedy tokens unchanged, sampled distributions unchanged, nothing leaked.

Greedy outputs with speculation on must equal speculation off (which the parity tests tie
to the model's own full forward) under every engine feature: reorder on/off, tiny chunk
budgets, pools small enough to preempt, prefix caching. Sampling is checked by a
chi-square test that a wrong acceptance rule fails.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fleetlab
from fleetlab import LLM, SamplingParams
from fleetlab.engine.input_batch import InputBatch
from fleetlab.inspect.pool import check_kv_manager, check_pool
from fleetlab.lab.lessons.row_moves import swap_rows
from fleetlab.models import FAMILIES, tiny
from fleetlab.spec_decode.proposer_batch import ProposerInputBatch, proposer_fields
from fleetlab.spec_decode.rejection import RejectionSampler

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
TRAINED = SamplingParams(max_tokens=12)  # the trained model's answers end with EOS


def generate(llm, prompts, sp=GREEDY):
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]


def check_clean(llm) -> None:
    """Every block back in the pool (the draft's cache uses the same block ids), nothing
    left queued, the proposer's batch the runner's own rows. (The runner drops the rows
    of finished requests when the next step's message tells it they finished.)"""
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    check_pool(llm.pool)
    check_kv_manager(llm.scheduler.kv, [])
    assert not llm.has_unfinished_requests()
    proposer_batch = getattr(llm.proposer, "batch", None)
    if proposer_batch is not None:
        assert proposer_batch.np("req_id") is llm.runner.batch.buffer("req_id")


def repetitive_prompts(seed):
    """Prompts that repeat themselves, so prompt lookup finds something to propose."""
    return [p * 3 for p in random_prompts([5, 3, 8, 2], seed=seed, vocab=40)]


@pytest.mark.parametrize("family,k", list(zip(FAMILIES, [1, 2, 3, 4, 5, 3])))
def test_ngram_greedy_equals_no_speculation_on_every_family(family_models, family, k):
    model = family_models(family)
    prompts = repetitive_prompts(seed=len(family))
    with LLM(model, block_size=4, max_num_batched_tokens=24) as llm:
        want = generate(llm, prompts)
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(model, block_size=4, max_num_batched_tokens=24, speculative_config=spec) as llm:
        assert generate(llm, prompts) == want
        assert llm.stats()["num_draft_tokens"] > 0
        check_clean(llm)


@pytest.fixture(scope="module")
def trained():
    model, tokenizer = fleetlab.models.load_tiny()
    draft, _ = fleetlab.models.load_tiny_draft()
    prompts = [tokenizer.encode(p) for p in ("count 12", "the old man", "45+38=", "count 57", "7*8=")]
    with LLM(model, block_size=4) as llm:
        want = generate(llm, prompts, TRAINED)
    return model, draft, prompts, want


ENGINE_CONFIGS = {
    "plain": dict(block_size=4),
    "reorder": dict(block_size=4, reorder=True, max_num_batched_tokens=16),
    "no-reorder-budget-4": dict(block_size=4, reorder=False, max_num_batched_tokens=4),
    "preempting-pool": dict(block_size=4, num_blocks=9, max_num_batched_tokens=12),
    "no-prefix-cache": dict(block_size=2, enable_prefix_caching=False, max_num_batched_tokens=7),
}


# Every k on the plain engine; each engine variant at two values of k.
DRAFT_CASES = [("plain", k) for k in (1, 2, 3, 4, 5)] + [
    (config, k) for i, config in enumerate(list(ENGINE_CONFIGS)[1:]) for k in ((2, 4) if i % 2 else (3, 5))]


@pytest.mark.parametrize("config,k", DRAFT_CASES)
def test_draft_greedy_equals_no_speculation(trained, config, k):
    model, draft, prompts, want = trained
    spec = {"method": "draft", "num_speculative_tokens": k, "model": draft}
    with LLM(model, **ENGINE_CONFIGS[config], speculative_config=spec) as llm:
        assert generate(llm, prompts, TRAINED) == want
        stats = llm.stats()
        assert stats["num_accepted_tokens"] > 0 and 0 < stats["spec_acceptance_rate"] <= 1
        if config == "preempting-pool":
            assert stats["num_preemptions"] > 0
        check_clean(llm)


def test_prefix_caching_with_speculation_reuses_blocks_of_both_caches(trained):
    model, draft, prompts, want = trained
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": draft}
    with LLM(model, block_size=2, speculative_config=spec) as llm:
        assert generate(llm, prompts + prompts, TRAINED) == want + want
        assert llm.stats()["prefix_cache_hit_rate"] > 0.3
        check_clean(llm)


def test_traces_show_drafted_accepted_rejected_and_bonus_tokens(trained):
    model, draft, prompts, want = trained
    spec = {"method": "draft", "num_speculative_tokens": 4, "model": draft}
    with LLM(model, block_size=4, speculative_config=spec, record_traces=True) as llm:
        generate(llm, prompts, GREEDY)  # past EOS the text is noise: drafts get rejected too
        verified = [r for t in llm.traces for r in t.rows if r.draft_token_ids]
        assert verified and any(len(r.draft_token_ids) > r.num_accepted_tokens for r in verified)  # a rejection
        for row in verified:
            kept = row.draft_token_ids[: row.num_accepted_tokens]
            assert row.token_ids[: len(kept)] == kept  # accepted drafts first, then the bonus
            assert len(row.token_ids) <= row.num_accepted_tokens + 1
            assert row.num_scheduled_tokens == len(row.draft_token_ids) + 1
        stats = llm.stats()
        assert stats["num_draft_tokens"] == sum(len(r.draft_token_ids) for r in verified)


def test_a_failing_proposer_rolls_the_step_back(trained, monkeypatch):
    model, draft, prompts, want = trained
    spec = {"method": "draft", "num_speculative_tokens": 3, "model": draft}
    with LLM(model, block_size=4, speculative_config=spec) as llm:
        real = type(llm.proposer).propose
        calls = {"n": 0}

        def flaky(self, batch, inputs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise KeyboardInterrupt
            return real(self, batch, inputs)

        monkeypatch.setattr(type(llm.proposer), "propose", flaky)
        with pytest.raises(KeyboardInterrupt):
            generate(llm, prompts, TRAINED)
        check_clean(llm)  # generate aborted its own requests; nothing half-applied stays
        assert generate(llm, prompts, TRAINED) == want


# ---------------------------------------------------------------- ProposerInputBatch lockstep
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 5)),
    st.tuples(st.just("remove"), st.integers(0, 20)),
    st.tuples(st.just("condense")),
    st.tuples(st.just("reorder"), st.integers(1, 4)),
    st.tuples(st.just("swap"), st.integers(0, 20), st.integers(0, 20)),
), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_proposer_batch_moves_in_lockstep_with_the_main_batch(ops):
    fields = fleetlab.DEFAULT_FIELDS.copy()
    for field in proposer_fields(3):
        fields.register(field)
    batch = InputBatch(max_num_seqs=6, max_model_len=16, max_blocks_per_seq=4, fields=fields)
    follower = ProposerInputBatch(batch)
    fingerprint = {}  # request id -> what the proposer wrote into its row
    next_id = 0
    for op in ops:
        live = [r for r in batch.req_ids if r is not None]
        if op[0] == "add" and batch.num_reqs < batch.max_num_seqs:
            rid = f"r{next_id}"
            next_id += 1
            row = batch.add_request(rid, [5] * op[1])
            follower.num_computed_tokens[row] = 100 + next_id
            follower.set_drafts(row, [next_id, next_id + 1][: op[1] % 3])
            fingerprint[rid] = (100 + next_id, [next_id, next_id + 1][: op[1] % 3])
            batch.set_num_scheduled({r: 1 for r in batch.req_ids if r is not None})
        elif op[0] == "remove" and live:
            rid = live[op[1] % len(live)]
            batch.remove_request(rid)
            del fingerprint[rid]
        elif op[0] == "condense":
            batch.condense()
        elif op[0] == "reorder" and not batch.has_holes:
            batch.set_num_scheduled({r: min(int(batch.num_tokens[batch.row_of(r)]), 1 + i % op[1])
                                     for i, r in enumerate(live)})
            batch.reorder_split_prefill_and_decode(decode_threshold=2)
        elif op[0] == "swap" and batch.num_rows:
            swap_rows(batch, op[1] % batch.num_rows, op[2] % batch.num_rows)
        for rid, (computed, drafts) in fingerprint.items():
            row = batch.row_of(rid)
            assert follower.num_computed_tokens[row] == computed
            n = follower.np("num_draft_tokens")[row]
            assert follower.np("draft_token_ids")[row, :n].tolist() == drafts


# ---------------------------------------------------------------- rejection sampling keeps the distribution
PROMPT = [5, 17, 33, 9]
NUM_SAMPLES = 1500


def sample_tokens(llm, seed_base):
    """``NUM_SAMPLES`` seeded continuations of 4 tokens: the first comes from the prefill, the
    second and third are verified drafts (k = 2) or their replacements, the fourth a bonus."""
    sps = [SamplingParams(max_tokens=4, temperature=1.0, top_k=5, seed=seed_base + i, ignore_eos=True)
           for i in range(NUM_SAMPLES)]
    outs = llm.generate(prompt_token_ids=[PROMPT] * NUM_SAMPLES, sampling_params=sps, use_tqdm=False)
    return [tuple(o.token_ids) for o in outs]


def pairs(samples, start):
    return [s[start : start + 2] for s in samples]


def chi_square_same_distribution(a, b) -> tuple[float, float]:
    """Two-sample chi-square statistic over the joint categories, and its 0.1% critical value
    (Wilson-Hilferty). Categories with fewer than 10 samples in all are pooled."""
    cats = sorted(set(a) | set(b))
    counts = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]], dtype=float)
    rare = counts.sum(axis=0) < 10
    counts = np.concatenate([counts[:, ~rare], counts[:, rare].sum(axis=1, keepdims=True)], axis=1)
    counts = counts[:, counts.sum(axis=0) > 0]
    expected = counts.sum(axis=1, keepdims=True) * counts.sum(axis=0, keepdims=True) / counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.shape[1] - 1
    z = 3.09  # one-sided 0.1%
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, crit


class AlwaysAccept(RejectionSampler):
    @staticmethod
    def accept(p_draft, u):
        return u >= 0


class ResampleFromTarget(RejectionSampler):
    @staticmethod
    def residual(probs, is_draft):
        return probs  # forgets to take the draft out: the draft's token is drawn too often


@pytest.fixture(scope="module")
def sampling_runs():
    target, draft = tiny("fleet", seed=0), tiny("fleet", seed=0)  # a twin draft: most drafts are plausible
    engine = dict(block_size=4, max_num_seqs=256, max_num_batched_tokens=512)
    with LLM(target, **engine) as llm:
        off = sample_tokens(llm, 0)
    runs = {}
    for name, sampler in (("right", RejectionSampler), ("always_accept", AlwaysAccept),
                          ("no_residual", ResampleFromTarget)):
        spec = {"method": "draft", "num_speculative_tokens": 2, "model": draft}
        with LLM(target, **engine, speculative_config=spec) as llm:
            llm.runner.sampler = sampler()
            runs[name] = (sample_tokens(llm, 10**6), llm.stats()["spec_acceptance_rate"])
    return off, runs


@pytest.mark.parametrize("start", [0, 1], ids=["tokens 1-2", "tokens 2-3"])
def test_rejection_sampling_keeps_the_targets_distribution(sampling_runs, start):
    off, runs = sampling_runs
    on, acceptance = runs["right"]
    assert 0.1 < acceptance < 0.95  # both outcomes of the acceptance test happen often
    stat, crit = chi_square_same_distribution(pairs(off, start), pairs(on, start))
    assert stat < crit, f"chi-square {stat:.1f} >= {crit:.1f}: speculation changed the distribution"


@pytest.mark.parametrize("wrong", ["always_accept", "no_residual"])
def test_the_chi_square_test_catches_a_wrong_acceptance_rule(sampling_runs, wrong):
    off, runs = sampling_runs
    stat, crit = chi_square_same_distribution(pairs(off, 0), pairs(runs[wrong][0], 0))
    assert stat > crit, f"a wrong rule ({wrong}) passed: chi-square {stat:.1f} < {crit:.1f}"


def test_prompt_lookup_prefers_a_recent_match_with_a_full_continuation():
    from fleetlab.spec_decode.ngram import ngram_propose

    run = np.array([7] * 10)
    assert ngram_propose(run, 4, 1, 3) == [7, 7, 7, 7]  # the most recent match would leave one token
    tokens = np.array([1, 2, 3, 9, 9, 9, 9, 1, 2, 3, 8, 8, 8, 8, 5, 1, 2, 3])
    assert ngram_propose(tokens, 4, 2, 3) == [8, 8, 8, 8]  # the later of the two matches
    assert ngram_propose(tokens, 4, 2, 3)[:1] != [9]
    assert ngram_propose(np.array([1, 2, 3, 4]), 3, 1, 2) == []
