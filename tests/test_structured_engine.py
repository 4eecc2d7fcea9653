"""Structured outputs through the engine: ``SamplingParams(structured_outputs=...)`` on ``LLM``.

JSON needs a vocabulary that can spell it: the tiny random models here are built with the JSON
character tokenizer's vocabulary (88 tokens), so a constrained output is valid whatever their
weights; choices and regexes run on the shipped trained model too. Every constrained output is
checked (``jsonschema`` for JSON, exact for choices and regexes) and every unconstrained one
against a run without any constrained request.
"""

import json
import re
import threading

import numpy as np
import pytest

import fleetlab.lab  # noqa: F401  (the lab quiets library notices first)
from fleetlab import LLM, SamplingParams
from fleetlab.models import FAMILIES, tiny
from fleetlab.models.json_tiny import json_tokenizer
from fleetlab.structured_output.examples import MAX_JSON_CHARS, SCHEMAS

jsonschema = pytest.importorskip("jsonschema")

TOK = json_tokenizer()
CHOICES = ["yes", "no", "maybe", "it is"]
REGEX = r"[0-9]{2,3}-[a-z]{2}"
GRAMMAR = 'start: "(" NUM "+" NUM ")" | NUM\nNUM: /[1-9][0-9]?/'


def constraint(i: int) -> dict:
    """The ``i``-th of a rotation of bounded constraints (every output ends with EOS in time)."""
    kinds = [{"json": s, "disable_any_whitespace": True} for s in SCHEMAS.values()]
    kinds += [{"choice": CHOICES}, {"regex": REGEX}, {"grammar": GRAMMAR}]
    return kinds[i % len(kinds)]


def check_output(fields: dict, text: str) -> None:
    """The output follows its constraint exactly."""
    if "json" in fields:
        jsonschema.validate(json.loads(text), fields["json"])
    elif "choice" in fields:
        assert text in fields["choice"], text
    elif "regex" in fields:
        assert re.fullmatch(fields["regex"], text), text
    else:
        assert re.fullmatch(r"\([1-9][0-9]?\+[1-9][0-9]?\)|[1-9][0-9]?", text), text


def json_model(family: str):
    """A one-layer tiny random ``family`` model over the JSON character vocabulary."""
    layers = {"num_layers": 1} if family == "fleet" else {"num_hidden_layers": 1}
    return tiny(family, seed=0, vocab_size=TOK.vocab_size, **layers)


def prompts_for(n: int, seed: int, shared: int = 8) -> list[list[int]]:
    """Prompts of 3-28 tokens; half share their first ``shared`` tokens (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    head = rng.integers(4, TOK.vocab_size, size=shared).tolist()
    out = []
    for i in range(n):
        tail = rng.integers(4, TOK.vocab_size, size=int(rng.integers(3, 21))).tolist()
        out.append([TOK.bos_token_id] + (head if i % 2 else []) + tail)
    return out


class MatcherWatch:
    """An observer: after every step, each row's grammar state is its request's own object, and
    its matcher holds no more tokens than the request committed (drafts never stay in it)."""

    def __init__(self, llm):
        self.llm, self.steps, self.resent_with_output = llm, 0, set()

    def on_step(self, so, result, outputs):
        for new in so.scheduled_new_reqs:
            if new.output_token_ids and new.extra.get("structured_output") is not None:
                self.resent_with_output.add(new.req_id)  # preempted after its first tokens, resent in full
        batch = self.llm.runner.batch
        for rid, row in batch.req_id_to_row.items():
            req = self.llm.scheduler.requests.get(rid)
            if req is None:
                continue  # finished in this step; its row leaves at the next one
            state = batch.np("structured_output")[row]
            assert state is req.extra.get("structured_output")
            if state is not None and state.matcher is not None:
                assert state.matcher.num_accepted_tokens <= len(req.output_token_ids)
        self.steps += 1


def run(llm, prompts, sps):
    watch = MatcherWatch(llm)
    llm.observers.append(watch)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
    llm.observers.remove(watch)
    return outs, watch


ENGINE = {"block_size": 4, "max_num_batched_tokens": 64, "enable_prefix_caching": True, "reorder": True,
          "record_traces": True}


def test_200_constrained_requests_mixed_with_unconstrained_ones():
    """Under reorder, chunked prefill, preemption and prefix caching: every constrained output
    follows its constraint; the unconstrained ones equal a run without any constrained request."""
    model = json_model("fleet")
    prompts = prompts_for(240, seed=0)
    constrained = {i: constraint(i) for i in range(240) if i % 6}  # 200 of them
    sps = [SamplingParams(max_tokens=MAX_JSON_CHARS, structured_outputs=constrained[i]) if i in constrained
           else SamplingParams(max_tokens=12) for i in range(240)]
    with LLM(model, TOK, max_num_seqs=48, num_blocks=220, **ENGINE) as llm:
        outs, watch = run(llm, prompts, sps)
        stats, traces = llm.stats(), llm.traces
    assert len(constrained) == 200
    for i, out in enumerate(outs):
        if i in constrained:
            assert out.finish_reason == "stop", (i, out.text, out.error)
            check_output(constrained[i], out.text)
    assert stats["num_preemptions"] > 0 and watch.resent_with_output  # matchers survived preemption
    assert stats["prefix_cache_hit_rate"] > 0
    assert any(t.reordered and t.order_before != t.order_after for t in traces)
    assert any(r.phase == "prefill" and r.num_computed_tokens + r.num_scheduled_tokens < r.num_prompt_tokens
               for t in traces for r in t.rows)  # a prompt ran in chunks
    plain = [i for i in range(240) if i not in constrained]
    with LLM(model, TOK, max_num_seqs=48, num_blocks=220, **ENGINE) as llm:
        alone = llm.generate(prompt_token_ids=[prompts[i] for i in plain],
                             sampling_params=[sps[i] for i in plain], use_tqdm=False)
    assert [outs[i].token_ids for i in plain] == [o.token_ids for o in alone]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_writes_what_its_constraints_allow(family):
    model = json_model(family)
    prompts = prompts_for(12, seed=1, shared=4)
    sps = [SamplingParams(max_tokens=MAX_JSON_CHARS, structured_outputs=constraint(i)) for i in range(8)]
    sps += [SamplingParams(max_tokens=6)] * 4
    with LLM(model, TOK, max_num_seqs=12, **ENGINE) as llm:
        outs, _ = run(llm, prompts, sps)
        alone = llm.generate(prompt_token_ids=prompts[8:], sampling_params=sps[8:], use_tqdm=False)
    for i in range(8):
        assert outs[i].finish_reason == "stop", (i, outs[i].text, outs[i].error)
        check_output(constraint(i), outs[i].text)
    assert [o.token_ids for o in outs[8:]] == [o.token_ids for o in alone]


def test_choice_and_regex_on_the_shipped_trained_model():
    from fleetlab.models import load_tiny

    model, tok = load_tiny()
    prompts = ["12+7=", "the red ", "45+38=", "the old ", "count 4 ", "9*9="]
    kinds = [{"choice": ["cat", "dog", "old man"]}, {"regex": r"[0-9]{2} (red|blue) [a-z]{3,5}\."},
             {"regex": "[0-9]+"}]
    sps = [SamplingParams(max_tokens=24, structured_outputs=kinds[i % 3]) for i in range(len(prompts))]
    sps += [SamplingParams(max_tokens=8)]
    with LLM(model, tok, block_size=16, max_num_seqs=8) as llm:
        outs = llm.generate(prompts + ["3+4="], sps, use_tqdm=False)
        (plain,) = llm.generate(["3+4="], SamplingParams(max_tokens=8), use_tqdm=False)
    for i, out in enumerate(outs[:-1]):
        assert out.finish_reason == "stop"
        check_output(kinds[i % 3], out.text)
    assert outs[-1].text == plain.text == "7"


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_output_with_speculation_equals_output_without(method):
    """The drafts are the unconstrained model's own choices (a draft model with the target's
    weights), so the grammar refuses many: a refused draft is rejected at its own position,
    and the matcher only ever holds committed tokens."""
    model = json_model("llama")
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    if method == "draft":
        spec["model"] = json_model("llama")
    picks = [0, 2, 5, 6, 7]  # person, flags, choice, regex, grammar
    prompts = prompts_for(len(picks) + 1, seed=2)
    prompts = [p + TOK.encode('{"name":"ZZ","age":1}', add_bos=False) for p in prompts]  # ngram finds drafts
    sps = [SamplingParams(max_tokens=MAX_JSON_CHARS, structured_outputs=constraint(i)) for i in picks]
    sps += [SamplingParams(max_tokens=10)]
    with LLM(model, TOK, max_num_seqs=8, **ENGINE) as llm:
        want = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
    with LLM(model, TOK, max_num_seqs=8, speculative_config=spec, **ENGINE) as llm:
        got, watch = run(llm, prompts, sps)
        stats, traces = llm.stats(), llm.traces
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["num_accepted_tokens"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"]
    assert any(len(r.draft_token_ids) > r.num_accepted_tokens for t in traces for r in t.rows)
    for out, i in zip(got, picks):
        check_output(constraint(i), out.text)


def test_sampled_rows_follow_their_grammar_and_their_seed():
    model = json_model("fleet")
    prompts = prompts_for(6, seed=3)
    sps = [SamplingParams(max_tokens=MAX_JSON_CHARS, temperature=1.5, top_k=20, top_p=0.9, seed=i,
                          structured_outputs=constraint(i + 1)) for i in range(6)]
    with LLM(model, TOK, max_num_seqs=8, **ENGINE) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
        again = llm.generate(prompt_token_ids=prompts[:1], sampling_params=sps[:1], use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.finish_reason == "stop", (out.text, out.error)
        check_output(constraint(i + 1), out.text)
    assert again[0].token_ids == outs[0].token_ids  # seeded: the same draw alone as in a batch


def test_min_tokens_takes_eos_out_of_the_mask_and_a_dead_end_stops_the_request():
    model = json_model("fleet")
    with LLM(model, TOK, **ENGINE) as llm:
        longer, dead = llm.generate(prompt_token_ids=[[1, 30, 31]] * 2, sampling_params=[
            SamplingParams(max_tokens=8, min_tokens=2, structured_outputs={"choice": ["a", "abc"]}),
            SamplingParams(max_tokens=8, min_tokens=2, structured_outputs={"choice": ["a"]})], use_tqdm=False)
    assert longer.text == "abc" and longer.finish_reason == "stop"
    assert dead.finish_reason == "error" and dead.token_ids == [TOK.encode("a", add_bos=False)[0]]
    assert "the grammar allows no token the model has here" in dead.error and "min_tokens" in dead.error


def test_logprobs_are_over_what_the_grammar_allows():
    """vLLM applies its grammar bitmask before its sampler takes raw logprobs: at a position where
    the grammar allows two tokens, the top logprobs rank those two and their probabilities sum to
    one; where it allows one, that token has probability one. Without the grammar they do not."""
    model = json_model("fleet")
    params = dict(max_tokens=8, logprobs=5)
    with LLM(model, TOK, **ENGINE) as llm:
        out, free = llm.generate(prompt_token_ids=[[1, 30, 31]] * 2, sampling_params=[
            SamplingParams(**params, structured_outputs={"choice": ["yes", "no"]}), SamplingParams(**params)],
            use_tqdm=False)
    allowed = {TOK.encode(c, add_bos=False)[0] for c in "yn"}
    first = out.logprobs[0]
    assert {t for t, v in first.top if v > float("-inf")} == allowed
    assert sum(np.exp(v) for t, v in first.top if t in allowed) == pytest.approx(1.0, abs=1e-5)
    assert out.text in ("yes", "no") and len(out.logprobs) == len(out.token_ids)
    assert all(lp.logprob == pytest.approx(0.0, abs=1e-5) and lp.rank == 1 for lp in out.logprobs[1:])
    assert sum(np.exp(v) for _, v in free.logprobs[0].top) < 0.999  # the whole vocabulary shares it


def test_a_request_waits_for_its_grammar_while_the_others_run(monkeypatch):
    from fleetlab.structured_output.guidance import GuidanceBackend

    gate, started = threading.Event(), threading.Event()
    compile_ = GuidanceBackend.compile

    def gated(self, params):
        started.set()
        assert gate.wait(60)
        return compile_(self, params)

    monkeypatch.setattr(GuidanceBackend, "compile", gated)
    model = json_model("fleet")
    with LLM(model, TOK, **ENGINE) as llm:
        slow = llm.add_request(prompt_token_ids=[1, 20, 21], sampling_params=SamplingParams(
            max_tokens=MAX_JSON_CHARS, structured_outputs={"json": SCHEMAS["flags"], "disable_any_whitespace": True}))
        fast = llm.add_request(prompt_token_ids=[1, 22, 23], sampling_params=SamplingParams(max_tokens=4))
        assert started.wait(60)
        done = {}
        while fast not in done:
            done.update({o.request_id: o for o in llm.step() if o.finished})
        assert all(slow not in [r.request_id for r in t.rows] for t in llm.traces)  # never scheduled yet
        gate.set()
        while llm.has_unfinished_requests():
            done.update({o.request_id: o for o in llm.step() if o.finished})
    check_output({"json": SCHEMAS["flags"]}, done[slow].text)


def test_without_compile_ahead_the_grammar_is_ready_on_arrival(monkeypatch):
    """Tensor parallelism compiles on arrival: every rank's scheduler then admits at the same step."""
    import time

    from fleetlab.structured_output.guidance import GuidanceBackend
    from fleetlab.structured_output.processor import StructuredOutputsProcessor

    compile_ = GuidanceBackend.compile
    monkeypatch.setattr(GuidanceBackend, "compile", lambda self, params: time.sleep(0.3) or compile_(self, params))
    for ahead, field in ((True, "nested"), (False, "flags")):
        processor = StructuredOutputsProcessor(TOK, TOK.vocab_size, compile_ahead=ahead)
        state = processor.start("r", {"json": SCHEMAS[field]})
        assert state.compiled.done() is not ahead
        processor.close()


def test_refusals_name_the_request_and_the_field():
    model = json_model("fleet")
    with LLM(model, TOK, **ENGINE) as llm:
        for fields, extra, words in [
            ({"json": {"type": "object"}, "regex": "a"}, {}, "structured_outputs must set exactly one"),
            ({"json": "{oops"}, {}, "structured_outputs field json is not valid JSON text"),
            ({"json": {"type": "string", "uniqueItems": 3}}, {}, "structured_outputs field json: cannot be compiled"),
            ({"regex": "(unclosed"}, {}, "structured_outputs field regex: cannot be compiled"),
            ({"choice": ["yes"]}, {"ignore_eos": True}, "sampling field ignore_eos=True cannot go with"),
            ({"choice": ["yes"], "structural_tag": "x"}, {}, "unknown fields ['structural_tag']"),
        ]:
            with pytest.raises(ValueError, match=re.escape(words)) as info:
                llm.add_request(prompt_token_ids=[1, 5], request_id="r-7",
                                sampling_params=SamplingParams(structured_outputs=fields, **extra))
            assert str(info.value).startswith("request 'r-7': ")
        assert not llm.has_unfinished_requests()
    with LLM(model, None, **ENGINE) as llm, pytest.raises(ValueError, match="has no tokenizer"):
        llm.add_request(prompt_token_ids=[1, 5], sampling_params=SamplingParams(structured_outputs={"regex": "a"}))


def test_a_constraint_the_vocabulary_cannot_spell_is_refused_naming_what_it_lacks(monkeypatch):
    from fleetlab.models import load_tiny
    from fleetlab.structured_output.guidance import GuidanceBackend

    model, tok = load_tiny()  # its characters have no { } " [ ]
    lacking = r"structured_outputs field json_object: cannot be spelled by the model's vocabulary: it has no '\{', '\}'"
    json_object = SamplingParams(max_tokens=16, structured_outputs={"json_object": True})
    with LLM(model, tok, block_size=16) as llm:
        with pytest.raises(ValueError, match="request '0': " + lacking):
            llm.generate(["1+1="], json_object, use_tqdm=False)
        assert not llm.has_unfinished_requests()  # generate queued nothing
        with pytest.raises(ValueError, match="request 'again': " + lacking):  # known now: refused at once
            llm.add_request("1+1=", json_object, request_id="again")
    # By hand, a refusal found while the request waits ends it with an error, never run to max_tokens.
    gate = threading.Event()
    compile_ = GuidanceBackend.compile
    monkeypatch.setattr(GuidanceBackend, "compile", lambda self, params: gate.wait(60) and compile_(self, params))
    with LLM(model, tok, block_size=16) as llm:
        rid = llm.add_request("1+1=", json_object)
        gate.set()
        outs = []
        while llm.has_unfinished_requests():
            outs += llm.step()
    (out,) = outs
    assert out.request_id == rid and out.finish_reason == "error" and out.token_ids == []
    assert re.match(lacking, out.error)
