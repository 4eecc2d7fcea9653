"""OpenAI sampling parity in the engine (issue 25): parallel sampling (``n``, ``best_of``),
log-probabilities against the model's own full forward, and logit bias and penalties against a
plain numpy implementation of vLLM's formulas."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import random_prompts

from fleetlab import LLM, Field, InputBatch, SamplingParams
from fleetlab.engine.batch_fields import DEFAULT_FIELDS
from fleetlab.engine.sampler import SamplingTensors
from fleetlab.lab.lessons.row_moves import swap_rows
from fleetlab.patching.parity import full_forward_logits, reference_greedy
from fleetlab.processors.penalties import PenaltiesProcessor


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def prompt_tokens_computed(traces) -> int:
    """Prompt positions the model ran, summed over every step and row."""
    return sum(min(r.num_computed_tokens + r.num_scheduled_tokens, r.num_prompt_tokens)
               - min(r.num_computed_tokens, r.num_prompt_tokens) for t in traces for r in t.rows)


# ----------------------------------------------------------------------------- parallel sampling
def test_n_greedy_copies_equal_the_single_greedy_output_and_compute_the_prompt_once(fleet_model):
    prompt = random_prompts([21], seed=3)[0]
    want, _ = reference_greedy(fleet_model, [prompt], 5)
    sp = SamplingParams(max_tokens=5, ignore_eos=True, n=4)
    with LLM(fleet_model, block_size=4, record_traces=True) as llm:
        outs = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
        shared = prompt_tokens_computed(llm.traces)
    with LLM(fleet_model, block_size=4, record_traces=True, enable_prefix_caching=False) as llm:
        assert [o.token_ids for o in llm.generate(prompt_token_ids=[prompt], sampling_params=sp,
                                                  use_tqdm=False)] == want * 4
        unshared = prompt_tokens_computed(llm.traces)
    assert [(o.request_id, o.index) for o in outs] == [(outs[0].request_id, i) for i in range(4)]
    assert [o.token_ids for o in outs] == want * 4
    # 21 tokens = 5 full blocks + 1: the first child computes 21, each other child only the last one
    assert (shared, unshared) == (21 + 3 * 1, 4 * 21)


def test_seeded_children_differ_from_each_other_and_are_reproducible(fleet_model):
    prompts = random_prompts([9, 5], seed=4)
    sp = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7, n=4)
    with LLM(fleet_model, block_size=4) as llm:
        first = [o.token_ids for o in llm.generate(prompt_token_ids=prompts[:1], sampling_params=sp, use_tqdm=False)]
        again = llm.generate(prompt_token_ids=prompts[::-1], sampling_params=sp, use_tqdm=False)  # other company
        alone = [llm.generate(prompt_token_ids=prompts[:1], sampling_params=SamplingParams(
            max_tokens=8, ignore_eos=True, temperature=1.0, seed=7 + i), use_tqdm=False)[0].token_ids
            for i in range(4)]
    assert len({tuple(t) for t in first}) == 4
    assert [o.token_ids for o in again[4:]] == first and [o.index for o in again[4:]] == [0, 1, 2, 3]
    assert alone == first  # child i draws with seed + i


def test_best_of_returns_the_n_with_the_highest_cumulative_logprob(fleet_model):
    prompt = random_prompts([7], seed=5)[0]
    base = dict(max_tokens=6, ignore_eos=True, temperature=1.0, seed=11)
    with LLM(fleet_model, block_size=4) as llm:
        every = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**base, n=5, logprobs=0),
                             use_tqdm=False)
        best = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(**base, n=2, best_of=5),
                            use_tqdm=False)
    ranked = sorted(every, key=lambda o: -o.cumulative_logprob)
    assert [o.token_ids for o in best] == [o.token_ids for o in ranked[:2]]
    assert [o.index for o in best] == [0, 1] and all(o.logprobs is None for o in best)
    for out in every:  # the cumulative logprob is the model's own
        seq = prompt + out.token_ids
        lp = log_softmax(full_forward_logits(fleet_model, seq))
        own = sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(out.token_ids))
        assert out.cumulative_logprob == pytest.approx(own, abs=1e-4)


def test_aborting_a_parallel_request_stops_every_sequence(fleet_model):
    with LLM(fleet_model, block_size=4) as llm:
        rid = llm.add_request(prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=50, n=3))
        llm.step()
        outs = llm.abort(rid)
        assert sorted(o.index for o in outs) == [0, 1, 2] and {o.request_id for o in outs} == {rid}
        assert not llm.has_unfinished_requests() and llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


# ----------------------------------------------------------------------------- log-probabilities
def check_logprobs(model, prompt, out, k, prompt_k):
    """Every logprob the engine returned against log_softmax of the unpatched model's full forward."""
    seq = prompt + out.token_ids
    lp = log_softmax(full_forward_logits(model, seq))
    rows = [(len(prompt) - 1 + i, item) for i, item in enumerate(out.logprobs or [])]
    if prompt_k is not None:
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        rows += [(j - 1, item) for j, item in enumerate(out.prompt_logprobs) if j]
    for pos, item in rows:
        want = lp[pos]
        assert item.token_id == seq[pos + 1]
        assert item.logprob == pytest.approx(want[item.token_id], abs=1e-4)
        assert item.rank == 1 + int((want > want[item.token_id] + 1e-6).sum())
        top = np.argsort(-want)[: len(item.top)]
        assert [t for t, _ in item.top] == top.tolist()
        assert np.allclose([v for _, v in item.top], want[top], atol=1e-4)
    if out.logprobs is not None:
        assert len(out.logprobs) == len(out.token_ids) and len(out.logprobs[0].top) == k
        assert out.cumulative_logprob == pytest.approx(sum(x.logprob for x in out.logprobs), abs=1e-6)
    return len(rows)


def test_logprobs_match_the_full_forward_across_chunks_prefix_hits_and_preemption(fleet_model):
    prompts = random_prompts([23, 9, 30, 14], seed=6)
    sps = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3),
           SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=2, logprobs=2),
           SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=0, presence_penalty=1.5),
           SamplingParams(max_tokens=6, ignore_eos=True)]
    with LLM(fleet_model, block_size=4, max_num_batched_tokens=10) as llm:
        llm.generate(prompt_token_ids=prompts, use_tqdm=False)  # the prompts' blocks are now cached
        hits = llm.stats()["prefix_cache_hit_tokens"]
        cached = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
        # the two requests that want prompt logprobs read nothing from the cache; the other two do
        assert llm.stats()["prefix_cache_hit_tokens"] - hits == (9 - 1) // 4 * 4 + (14 - 1) // 4 * 4
    with LLM(fleet_model, block_size=4, max_num_batched_tokens=10, num_blocks=16) as llm:
        preempted = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
    for outs in (cached, preempted):
        checked = [check_logprobs(fleet_model, p, o, sp.logprobs, sp.prompt_logprobs)
                   for p, o, sp in zip(prompts, outs, sps)]
        assert checked == [6 + 22, 6, 29, 0]
        assert outs[3].logprobs is None and outs[3].prompt_logprobs is None and outs[3].cumulative_logprob is None


# ----------------------------------------------------------------------------- bias and penalties
def numpy_penalties(logits, prompt, output, presence=0.0, frequency=0.0, repetition=1.0, bias=None):
    """vLLM's formulas, in numpy: bias, then repetition, frequency, presence."""
    x = logits.astype(np.float64).copy()
    for t, b in (bias or {}).items():
        x[t] += b
    counts = np.bincount(output, minlength=len(x)).astype(np.float64) if len(output) else np.zeros(len(x))
    seen = np.zeros(len(x), bool)
    seen[list(prompt) + list(output)] = True
    x[seen] = np.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    return x - frequency * counts - presence * (counts > 0)


def test_the_penalty_processor_matches_numpy_row_by_row():
    rng = np.random.default_rng(0)
    vocab = 40
    fields = DEFAULT_FIELDS.copy()
    for f in PenaltiesProcessor.fields:
        fields.register(f)
    batch = InputBatch(max_num_seqs=6, max_model_len=32, max_blocks_per_seq=8, fields=fields)
    proc = PenaltiesProcessor()
    settings = [dict(presence=0.7, frequency=0.3, repetition=1.4, bias={3: 2.0, 7: -100.0}),
                dict(), dict(repetition=0.6), dict(frequency=-1.5, bias={0: 1.0}), dict(presence=-2.0)]
    seqs = []
    for i, s in enumerate(settings):
        prompt, output = rng.integers(0, vocab, 6 + i).tolist(), rng.integers(0, vocab, 2 * i).tolist()
        sp = SamplingParams(presence_penalty=s.get("presence", 0.0), frequency_penalty=s.get("frequency", 0.0),
                            repetition_penalty=s.get("repetition", 1.0), logit_bias=s.get("bias"))
        batch.add_request(f"r{i}", prompt, output, extra=proc.request_values(sp))
        seqs.append((prompt, output))
    swap_rows(batch, 0, 3)  # the settings move with their rows
    order = [batch.req_ids.index(f"r{i}") for i in range(len(settings))]
    logits = rng.normal(size=(len(settings), vocab)).astype(np.float32) * 3
    rows = np.array(order)
    st = SamplingTensors(greedy=np.ones(len(rows), bool), temperature=None, top_k=None, top_p=None,
                         seeds=np.zeros(len(rows)), draw_index=(batch.num_tokens - batch.num_prompt_tokens)[rows],
                         banned=[[]] * len(rows), pos_row=rows, batch=batch)
    got = proc(paddle.to_tensor(logits), st).numpy()
    for i, (s, (prompt, output)) in enumerate(zip(settings, seqs)):
        want = numpy_penalties(logits[i], prompt, output, s.get("presence", 0.0), s.get("frequency", 0.0),
                               s.get("repetition", 1.0), s.get("bias"))
        assert np.allclose(got[i], want, atol=1e-5), i
    assert proc(paddle.to_tensor(logits[1:2]), SamplingTensors(  # no row sets anything: untouched
        greedy=np.ones(1, bool), temperature=None, top_k=None, top_p=None, seeds=np.zeros(1),
        draw_index=np.zeros(1, np.int64), banned=[[]], pos_row=rows[1:2], batch=batch)).numpy().tolist() == \
        logits[1:2].tolist()


def penalized_greedy(model, prompt, max_tokens, **kw):
    """Greedy decoding from the unpatched model's full forward, penalties applied in numpy."""
    seq = list(prompt)
    for _ in range(max_tokens):
        x = numpy_penalties(full_forward_logits(model, seq)[-1], prompt, seq[len(prompt):], **kw)
        seq.append(int(x.argmax()))
    return seq[len(prompt):]


PENALTIES = [dict(presence=1.2), dict(), dict(frequency=0.9, bias={17: 3.0}), dict(repetition=1.8),
             dict(presence=0.0, frequency=0.0, repetition=1.0, bias={}), dict(presence=-0.5, repetition=0.7)]


@pytest.mark.parametrize("engine", [dict(reorder=True, max_num_batched_tokens=12),
                                    dict(num_blocks=14, max_num_batched_tokens=16),
                                    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_min": 1})],
                         ids=["reorder", "preempting", "ngram"])
def test_greedy_with_bias_and_penalties_matches_numpy_on_the_full_forward(fleet_model, engine):
    prompts = [p * 2 for p in random_prompts([4, 9, 6, 3, 7, 5], seed=9, vocab=40)]
    want = [penalized_greedy(fleet_model, p, 8, **kw) for p, kw in zip(prompts, PENALTIES)]
    sps = [SamplingParams(max_tokens=8, ignore_eos=True, presence_penalty=kw.get("presence", 0.0),
                          frequency_penalty=kw.get("frequency", 0.0), repetition_penalty=kw.get("repetition", 1.0),
                          logit_bias=kw.get("bias")) for kw in PENALTIES]
    with LLM(fleet_model, block_size=4, **engine) as llm:
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)]
        stats = llm.stats()
    assert got == want
    plain, _ = reference_greedy(fleet_model, [prompts[1], prompts[4]], 8)
    assert [got[1], got[4]] == plain  # neutral values are plain greedy
    assert got[0] != reference_greedy(fleet_model, prompts[:1], 8)[0][0]  # the penalties did act
    if "num_blocks" in engine:
        assert stats["num_preemptions"] > 0


# ----------------------------------------------------------------------------- the edge
@pytest.mark.parametrize("kw,words", [
    (dict(n=0), "n=0"), (dict(n=2, best_of=1), "best_of=1 must be >= n=2"),
    (dict(n=1, best_of=3), "best_of=3 > n=1 needs sampling"), (dict(n=2.0), "n=2.0"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5"), (dict(frequency_penalty=-3), "frequency_penalty=-3"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0"), (dict(repetition_penalty=float("nan")), "repetition"),
    (dict(logit_bias={500: 1.0}), "logit_bias has token ids [500]"), (dict(logit_bias={"x": 1.0}), "logit_bias key"),
    (dict(logit_bias={3: float("inf")}), "logit_bias[3]"), (dict(logit_bias=[1, 2]), "logit_bias=[1, 2]"),
    (dict(logprobs=21), "logprobs=21"), (dict(logprobs=-1), "logprobs=-1 asks for 128"),
    (dict(prompt_logprobs=-2), "prompt_logprobs=-2"), (dict(seed=2**63 - 2, n=4, temperature=1.0), "seed="),
])
def test_every_new_field_is_checked_at_the_edge_naming_request_and_field(fleet_model, kw, words):
    with LLM(fleet_model, block_size=4) as llm, pytest.raises(ValueError) as err:
        llm.add_request(prompt_token_ids=[5, 6], sampling_params=SamplingParams(**kw), request_id="req-9")
    assert "'req-9'" in str(err.value) and words in str(err.value)
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_logprobs_with_speculative_decoding_match_the_full_forward(fleet_model, method):
    """A verify step gains its accepted drafts and one token of its own; each carries the logprob
    of its own position (a draft's, when a sampled row accepts it), as without speculation:
    checked against the unpatched model's full forward, greedy and sampled, prompt logprobs too."""
    from fleetlab.models import tiny

    spec = ({"method": "draft", "num_speculative_tokens": 2, "model": tiny("fleet", seed=0)} if method == "draft"
            else {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    prompts = [[5, 6, 7, 8] * 4, random_prompts([11], seed=7)[0], [9, 10] * 6]
    sps = [SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2),
           SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=4, logprobs=2),
           SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=5, logprobs=0)]
    with LLM(fleet_model, block_size=4, speculative_config=spec, record_traces=True) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
        accepted = {}
        for trace in llm.traces:
            for row in trace.rows:
                accepted[row.request_id] = accepted.get(row.request_id, 0) + row.num_accepted_tokens
    greedy, *sampled = [accepted.get(o.request_id, 0) for o in outs]
    assert greedy > 0 and (method == "ngram" or sum(sampled) > 0)  # steps that gained several tokens
    assert [check_logprobs(fleet_model, p, o, sp.logprobs, sp.prompt_logprobs)
            for p, o, sp in zip(prompts, outs, sps)] == [10 + 15, 10, 10]


def test_the_new_fields_reach_their_batch_row(fleet_model):
    sp = SamplingParams(max_tokens=3, logprobs=2, prompt_logprobs=1, presence_penalty=0.5, logit_bias={9: 1.5})
    with LLM(fleet_model, block_size=4) as llm:
        llm.add_request(prompt_token_ids=[5, 6, 7], sampling_params=sp, request_id="a")
        llm.step()
        b = llm.runner.batch
        row = b.row_of("a")
        assert (b.num_logprobs[row], b.num_prompt_logprobs[row], b.np("presence_penalty")[row]) == (2, 1, 0.5)
        ids, values = b.np("logit_bias")[row]
        assert ids.tolist() == [9] and values.tolist() == [1.5]
        assert isinstance(llm.runner.batch.fields["presence_penalty"], Field)
