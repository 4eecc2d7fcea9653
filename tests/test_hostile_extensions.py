"""Hostile input at the newest edges (issue #35, item 1): logprobs, logit_bias keys, ``extra``
and batch fields, parallel-sampling ids, and what a prototype's own code returns (a logits
processor, a proposer, a scheduling policy), checked where the engine receives it.

Every case ends as the project's rule says: a ``ValueError`` (``TypeError`` for a wrong type)
naming the request (or the extension) and the field; the other requests finish with the
model's own greedy tokens; every block is back in the pool.
"""

import numpy as np
import paddle
import pytest
from conftest import random_prompts

from fleetlab import LLM, Field, SamplingParams
from fleetlab.engine.logits_processor import LogitsProcessor
from fleetlab.engine.policies import SchedulingPolicy
from fleetlab.models import tiny
from fleetlab.patching.parity import reference_greedy
from fleetlab.spec_decode.proposer import Proposer, register_proposer

VOCAB = 16  # smaller than MAX_LOGPROBS (20), so the vocabulary is the bound that matters
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny("fleet", seed=0, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def oracle(model):
    prompts = random_prompts([5, 3], vocab=VOCAB, seed=3)
    want, _ = reference_greedy(model, prompts, GREEDY.max_tokens)
    return prompts, want


@pytest.fixture(scope="module")
def engine(model, oracle):  # the oracle runs first, on the unpatched model
    with LLM(model, block_size=4, max_num_batched_tokens=16, max_model_len=32,
             batch_fields=[Field("scale", (3,), "float32"), Field("poison", (), "int32")],
             logits_processors=[PoisonProcessor()]) as llm:
        yield llm


@pytest.fixture()
def llm(engine):
    yield engine
    engine.abort(list(engine.scheduler.requests))


def assert_clean(llm, oracle):
    """Nothing left queued, every block free, and clean requests give the oracle's tokens."""
    assert not llm.scheduler.requests and llm.pool.num_free_blocks == llm.pool.num_blocks
    prompts, want = oracle
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert llm.pool.num_free_blocks == llm.pool.num_blocks


class PoisonProcessor(LogitsProcessor):
    """Makes NaN the logits of rows whose user field ``poison`` is 1 (a prototype's bug)."""

    def __call__(self, logits, st):
        rows = np.flatnonzero(st.batch.np("poison")[st.pos_row] == 1)
        if not len(rows):
            return logits
        bad = np.zeros(logits.shape, dtype=bool)
        bad[rows] = True
        return paddle.where(paddle.to_tensor(bad), paddle.full_like(logits, float("nan")), logits)


# ----------------------------------------------------------------------------- sampling fields
@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_beyond_the_vocabulary_are_refused_at_the_edge(llm, oracle, name):
    sp = SamplingParams(max_tokens=2, **{name: VOCAB + 1})
    with pytest.raises(ValueError, match=rf"request 'lp': sampling field {name}={VOCAB + 1} .*vocabulary"):
        llm.add_request(prompt_token_ids=oracle[0][0], sampling_params=sp, request_id="lp")
    with pytest.raises(ValueError, match=rf"sampling field {name}"):
        llm.generate(prompt_token_ids=oracle[0], sampling_params=sp, use_tqdm=False)
    assert_clean(llm, oracle)


def test_logprobs_of_the_whole_vocabulary_run(llm, oracle):
    out, = llm.generate(prompt_token_ids=oracle[0][:1], sampling_params=SamplingParams(
        max_tokens=3, ignore_eos=True, logprobs=VOCAB, prompt_logprobs=-1), use_tqdm=False)
    assert out.token_ids == oracle[1][0][:3]
    assert all(len(entry.top) == VOCAB for entry in out.logprobs)
    assert all(len(entry.top) == VOCAB for entry in out.prompt_logprobs if entry is not None)
    assert_clean(llm, oracle)


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "\uff15"])  # superscript two, Arabic-Indic one, fullwidth 5
def test_logit_bias_keys_that_look_like_digits_are_refused_naming_the_field(llm, oracle, key):
    with pytest.raises(ValueError, match=r"request 'b': sampling field logit_bias key"):
        llm.add_request(prompt_token_ids=oracle[0][0], request_id="b",
                        sampling_params=SamplingParams(logit_bias={key: 1.0}))
    assert_clean(llm, oracle)


# ----------------------------------------------------------------------------- extra and batch fields
@pytest.mark.parametrize("extra, exc, words", [
    ([("scale", 1.0)], TypeError, r"=\[\('scale', 1.0\)\] must be a dict"),
    ("scale", TypeError, "='scale' must be a dict"),
    ({"temperature": -5.0}, ValueError, "field 'temperature' is not one of this LLM's own batch fields"),
    ({"token_ids": [1] * 32}, ValueError, "field 'token_ids'"),
    ({"seed": 3}, ValueError, "field 'seed'"),
    ({"presence_penalty": 9.0}, ValueError, "field 'presence_penalty'"),
    ({"prompt_embeds": 5}, ValueError, "field 'prompt_embeds'"),
    ({"structured_output": 5}, ValueError, "field 'structured_output'"),
    ({"logit_bias": {3: 1.0}}, ValueError, "field 'logit_bias' is not one"),
    ({"lora": 1}, ValueError, r"field 'lora' is not one .*batch_fields=\[Field\('lora'"),
    ({"scale": [7.0]}, ValueError, r"scale has shape \[1\]; the field holds float32 values of shape \[3\]"),
    ({"scale": 7.0}, ValueError, r"scale=7.0 does not fit the field"),
    ({"scale": [[1.0, 2.0, 3.0]]}, ValueError, "scale"),
    ({"scale": ["a", "b", "c"]}, ValueError, "scale"),
    ({"poison": 2**40}, ValueError, "poison"),
    ({1: 2}, TypeError, "field name 1 must be a str"),
], ids=["list", "str", "temperature", "token_ids", "seed", "penalty", "prompt_embeds", "grammar", "bias", "unknown",
        "broadcast", "scalar", "rank", "text", "overflow", "int-key"])
def test_extra_is_checked_at_the_edge(llm, oracle, extra, exc, words):
    with pytest.raises(exc, match=r"request 'x': extra.*" + words):
        llm.add_request(prompt_token_ids=oracle[0][0], request_id="x", extra=extra)
    assert_clean(llm, oracle)


def test_a_device_field_paddle_cannot_hold_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"field 'mask': dtype 'uint32' cannot live on the device"):
        Field("mask", (), "uint32", "device")


def test_extra_args_and_generate_extra_fill_user_fields(llm, oracle):
    """A field prototype needs no hand loop: ``generate(extra=...)`` (one per prompt) or
    ``SamplingParams(extra_args=...)``; keys naming no field stay for processors to read."""
    prompts, want = oracle
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, extra=[{"poison": 1}, None],
                        use_tqdm=False)
    assert outs[0].finish_reason == "error" and outs[1].token_ids == want[1]
    sp = SamplingParams(max_tokens=6, ignore_eos=True, extra_args={"poison": 1, "my_knob": "anything"})
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[sp, GREEDY], use_tqdm=False)
    assert outs[0].finish_reason == "error" and outs[1].token_ids == want[1]
    with pytest.raises(TypeError, match="sampling field extra_args"):
        llm.add_request(prompt_token_ids=prompts[0], sampling_params=SamplingParams(extra_args=[1]))
    with pytest.raises(ValueError, match="generate: 1 extra dicts for 2 prompts"):
        llm.generate(prompt_token_ids=prompts, extra=[{}], use_tqdm=False)
    assert_clean(llm, oracle)


# ----------------------------------------------------------------------------- parallel sampling ids
def test_child_ids_never_clash_with_a_live_users_id(llm, oracle):
    prompt, want = oracle[0][0], oracle[1][0]
    llm.add_request(prompt_token_ids=prompt, sampling_params=GREEDY, request_id="1_p")
    llm.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(
        n=2, max_tokens=6, ignore_eos=True), request_id="p")
    done = {}
    while llm.has_unfinished_requests():
        done.update({(o.request_id, o.index): o for o in llm.step() if o.finished})
    assert sorted(done) == [("1_p", 0), ("p", 0), ("p", 1)]
    assert all(o.token_ids == want for o in done.values())
    assert_clean(llm, oracle)


# ----------------------------------------------------------------------------- logits processors
def test_a_processor_making_nan_stops_only_its_request_naming_the_processor(llm, oracle):
    prompts, want = oracle
    a = llm.add_request(prompt_token_ids=prompts[0], sampling_params=GREEDY, extra={"poison": 1})
    b = llm.add_request(prompt_token_ids=prompts[1], sampling_params=GREEDY)
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    assert done[a].finish_reason == "error" and "PoisonProcessor returned NaN" in done[a].error
    assert done[a].token_ids == []
    assert done[b].token_ids == want[1]
    assert_clean(llm, oracle)


class WrongWidth(LogitsProcessor):
    def __init__(self, extra_columns):
        self.extra_columns = extra_columns

    def __call__(self, logits, st):
        if self.extra_columns > 0:
            return paddle.concat([logits, paddle.full([logits.shape[0], self.extra_columns], 1e9)], axis=1)
        return logits[:, : logits.shape[1] + self.extra_columns]


@pytest.mark.parametrize("columns", [1, -1])
def test_a_processor_returning_the_wrong_shape_is_named(model, oracle, columns):
    with LLM(model, block_size=4, max_num_batched_tokens=16, logits_processors=[WrongWidth(columns)]) as llm:
        llm.add_request(prompt_token_ids=oracle[0][0], sampling_params=GREEDY)
        with pytest.raises(ValueError, match=rf"logits processor WrongWidth returned logits \[1, {VOCAB + columns}\]"):
            llm.step()
        llm.abort(list(llm.scheduler.requests))
        assert llm.pool.num_free_blocks == llm.pool.num_blocks


# ----------------------------------------------------------------------------- proposers
class ScriptedProposer(Proposer):
    """Proposes whatever ``drafts(req_ids)`` gives (a prototype's bug, on purpose)."""

    name = "scripted"
    script = staticmethod(lambda req_ids: {})

    def propose(self, batch, sampled):
        return self.script([r for r in batch.req_ids if r is not None])


@pytest.mark.parametrize("script, words", [
    (lambda ids: {ids[0]: [10**9]}, r"draft ids \[1000000000\] outside the vocabulary \[0, 16\)"),
    (lambda ids: {ids[0]: [VOCAB]}, r"draft ids \[16\] outside the vocabulary"),
    (lambda ids: {ids[0]: [-1]}, r"draft ids \[-1\] outside the vocabulary"),
    (lambda ids: {ids[0]: [1, 2, 3]}, r"3 drafts, more than num_speculative_tokens=2"),
    (lambda ids: {"nobody": [1]}, r"drafts for request 'nobody', which is not in the batch"),
    (lambda ids: {ids[0]: [1.5]}, r"drafts\[0\]=1.5 must be an int"),
    (lambda ids: [1, 2], r"propose returned list; it must return a dict"),
], ids=["1e9", "vocab", "negative", "more-than-k", "unknown-id", "float", "not-a-dict"])
def test_a_proposers_drafts_are_checked_where_the_runner_receives_them(model, oracle, script, words):
    register_proposer("scripted", ScriptedProposer)
    ScriptedProposer.script = staticmethod(script)
    with LLM(model, block_size=4, max_num_batched_tokens=16,
             speculative_config={"method": "scripted", "num_speculative_tokens": 2}) as llm:
        llm.add_request(prompt_token_ids=oracle[0][0], sampling_params=GREEDY)
        with pytest.raises(ValueError, match=r"proposer 'scripted' \(ScriptedProposer\): .*" + words):
            for _ in range(4):
                llm.step()
        llm.abort(list(llm.scheduler.requests))
        assert llm.pool.num_free_blocks == llm.pool.num_blocks


class OptionProposer(Proposer):
    """Drafts ``token`` ``count`` times: its own options come through ``speculative_config``."""

    name = "option"

    def __init__(self, config, context, *, token: int = 0, count: int = 1):
        super().__init__(config, context)
        self.token, self.count = token, count

    def propose(self, batch, sampled):
        return {rid: [self.token] * self.count for rid in sampled}


def test_a_proposer_class_instance_and_its_options_are_accepted(model, oracle):
    prompts, want = oracle
    for method in (OptionProposer, "option"):
        register_proposer("option", OptionProposer)
        cfg = {"method": method, "num_speculative_tokens": 2, "token": want[0][1], "count": 2}
        with LLM(model, block_size=4, max_num_batched_tokens=16, speculative_config=cfg) as llm:
            assert (llm.proposer.token, llm.proposer.count) == (want[0][1], 2)
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
            assert [o.token_ids for o in outs] == want
            stats = llm.stats()
            assert stats["num_accepted_tokens"] > 0 and stats["num_drafts"] > 0
            assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
            assert len(stats["num_accepted_tokens_per_pos"]) <= 2
    own = r"unknown field\(s\) \['tokn'\].*OptionProposer's own options \['count', 'token'\]"
    with pytest.raises(ValueError, match=own):
        LLM(model, speculative_config={"method": OptionProposer, "num_speculative_tokens": 2, "tokn": 1})


def test_a_proposer_instance_is_used_as_is(model, oracle):
    from fleetlab.spec_decode.config import SpeculativeConfig
    from fleetlab.spec_decode.proposer import ProposerContext

    prompts, want = oracle
    mine = OptionProposer(SpeculativeConfig("option", 2), ProposerContext(None, 0, 4, 64, VOCAB, 3), token=1)
    with LLM(model, block_size=4, max_num_batched_tokens=16,
             speculative_config={"method": mine, "num_speculative_tokens": 2}) as llm:
        assert llm.proposer is mine
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.token_ids for o in outs] == want
    with pytest.raises(ValueError, match="num_speculative_tokens=3, but the proposer instance drafts 2"):
        LLM(model, speculative_config={"method": mine, "num_speculative_tokens": 3})
    with pytest.raises(TypeError, match="method=42 must be a registered proposer"):
        LLM(model, speculative_config={"method": 42, "num_speculative_tokens": 2})


# ----------------------------------------------------------------------------- scheduling policies
class IdVictim(SchedulingPolicy):
    name = "id-victim"

    def pick_victim(self, running):
        return running[-1].request_id  # an id, not the request


class CopyVictim(SchedulingPolicy):
    name = "copy-victim"

    def pick_victim(self, running):
        import copy

        return copy.copy(running[-1])  # a request, but not the running one


@pytest.mark.parametrize("policy, exc, words", [
    (IdVictim(), TypeError, r"scheduling policy 'id-victim' \(IdVictim\): pick_victim returned '\d+'"),
    (CopyVictim(), ValueError, r"scheduling policy 'copy-victim' \(CopyVictim\): pick_victim returned request "
                               r"'\d+', which is not running"),
], ids=["id", "copy"])
def test_a_policy_returning_no_running_request_as_victim_is_named(model, oracle, policy, exc, words):
    with LLM(model, block_size=4, max_num_batched_tokens=16, num_blocks=8, max_model_len=32,
             scheduling_policy=policy) as llm:
        for prompt in oracle[0]:
            llm.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=24, ignore_eos=True))
        with pytest.raises(exc, match=words):
            while llm.has_unfinished_requests():
                llm.step()
        llm.abort(list(llm.scheduler.requests))
        assert llm.pool.num_free_blocks == llm.pool.num_blocks


# ----------------------------------------------------------------------------- rollback
class RaiseOnce(LogitsProcessor):
    armed = False

    def __call__(self, logits, st):
        if self.armed:
            self.armed = False
            raise RuntimeError("a processor's bug, once")
        return logits


def test_a_rolled_back_step_leaves_the_prefix_cache_counters_unchanged(model, oracle):
    prompt = oracle[0][0] * 3  # 15 tokens: three full blocks to hit
    proc = RaiseOnce()
    with LLM(model, block_size=4, max_num_batched_tokens=32, logits_processors=[proc]) as llm:
        llm.generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
        keys = ("prefix_cache_queries", "prefix_cache_query_tokens", "prefix_cache_hit_tokens")
        before = {k: llm.stats()[k] for k in keys}
        llm.add_request(prompt_token_ids=prompt, sampling_params=GREEDY, request_id="again")
        proc.armed = True
        with pytest.raises(RuntimeError, match="a processor's bug"):
            llm.step()
        assert {k: llm.stats()[k] for k in keys} == before  # the step never happened
        while llm.has_unfinished_requests():
            llm.step()
        after = {k: llm.stats()[k] for k in keys}
        assert after["prefix_cache_queries"] == before["prefix_cache_queries"] + 1  # counted once, not twice
        assert after["prefix_cache_hit_tokens"] == before["prefix_cache_hit_tokens"] + 12
        assert llm.pool.num_free_blocks == llm.pool.num_blocks


def test_step_trace_reordered_means_rows_moved(model, oracle):
    with LLM(model, block_size=4, max_num_batched_tokens=16, reorder=True, record_traces=True) as llm:
        llm.generate(prompt_token_ids=oracle[0][:1], sampling_params=GREEDY, use_tqdm=False)  # one row: nothing moves
        assert llm.traces and all(t.reorder and not t.reordered for t in llm.traces)
        llm.generate(prompt_token_ids=[oracle[0][0] * 3, *oracle[0]], sampling_params=GREEDY, use_tqdm=False)
        moved = [t for t in llm.traces if t.reordered]
        assert all(t.order_before != t.order_after for t in moved)
        assert all(t.order_before == t.order_after for t in llm.traces if not t.reordered)


class IdsTokenizer:
    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_offline_text_leaves_out_the_stop_tokens_text_as_vllm(model, oracle):
    prompt, want = oracle[0][0], oracle[1][0]
    stop = want[2]
    with LLM(model, IdsTokenizer(), block_size=4, max_num_batched_tokens=16) as llm:
        for include in (False, True):
            sp = SamplingParams(max_tokens=6, stop_token_ids=[stop], include_stop_str_in_output=include)
            out, = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
            end = want.index(stop) + 1
            assert out.token_ids == want[:end] and out.stop_reason == stop  # the token stays in the ids
            # decoded in the prompt's context, as vLLM decodes: each token adds " <id>" after the prompt's text
            assert out.text == "".join(f" {t}" for t in want[: end if include else end - 1])


class AlsoScale(LogitsProcessor):
    fields = (Field("scale", (), "float32"),)

    def __call__(self, logits, st):
        return logits


def test_a_field_declared_twice_names_who_declared_it_first(model):
    with pytest.raises(ValueError, match=r"field 'scale' of logits processor AlsoScale is already registered by "
                                         r"LLM\(batch_fields=...\)"):
        LLM(model, batch_fields=[Field("scale", (3,), "float32")], logits_processors=[AlsoScale()])
    with pytest.raises(ValueError, match=r"field 'seed' of LLM\(batch_fields=...\) is already registered by the "
                                         r"engine"):
        LLM(model, batch_fields=[Field("seed")])
