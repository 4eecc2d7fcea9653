"""Fuzzing the engine's edge offline (issue 35, item 2): for every ``SamplingParams``, ``extra``
and structured-outputs spec hypothesis makes -- valid values, values out of range, wrong types,
anything Python can hold -- ``add_request`` either refuses it with a ``ValueError`` (a
``TypeError`` for a wrong type) that names the request and one of the fields it set, or it
runs: no exception inside a step, no hang, a bystander request next to it gives the model's own
greedy tokens, a greedy request without a knob that changes its logits gives them too, and
every block is back in the pool. The server's JSON bodies are fuzzed in ``test_server_fuzz.py``.

One tiny model per module; few, small examples (seconds).
"""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fleetlab import LLM, Field, SamplingParams
from fleetlab.models import tiny, tiny_json
from fleetlab.patching.parity import reference_greedy

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])
VOCAB = 32
MAX_STEPS = 300  # far more than any request here needs: running out of them is a hang
PROMPT, BYSTANDER = [5, 9, 2, 7], [3, 11, 4]
CLEAN = SamplingParams(max_tokens=6, ignore_eos=True)

SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=4),
                   st.integers(-3, 40).map(np.int64), st.floats(-3, 3).map(np.float32))
ANYTHING = st.recursive(SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(
    st.one_of(st.text(max_size=3), st.integers(-2, 40)), c, max_size=3), max_leaves=5)


def field(valid):
    """Mostly a value the field takes, sometimes anything at all."""
    return st.one_of(valid, valid, valid, ANYTHING)


SAMPLING = {
    "max_tokens": field(st.integers(1, 12) | st.just(2**64)),
    "temperature": field(st.sampled_from([0.0, 0.0, 0.7, 1.0, 1e-30, 1e30])),
    "top_k": field(st.integers(-1, VOCAB + 2)),
    "top_p": field(st.floats(1e-3, 1.0)),
    "seed": field(st.integers(0, 2**63 - 1)),
    "stop_token_ids": field(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(0, 4)),
    "n": field(st.integers(1, 3)),
    "best_of": field(st.none() | st.integers(1, 4)),
    "presence_penalty": field(st.floats(-2, 2)),
    "frequency_penalty": field(st.floats(-2, 2)),
    "repetition_penalty": field(st.floats(0.5, 2.0)),
    "logit_bias": field(st.dictionaries(st.integers(0, VOCAB - 1) | st.integers(0, VOCAB - 1).map(str),
                                        st.floats(-200, 200), max_size=3)),
    "logprobs": field(st.none() | st.integers(-1, 5)),
    "prompt_logprobs": field(st.none() | st.integers(-1, 5)),
    "extra_args": field(st.dictionaries(st.sampled_from(["level", "knob"]), st.integers(-3, 3), max_size=2)),
}
LOGIT_KNOBS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
               "stop_token_ids", "extra_args")


@pytest.fixture(scope="module")
def setup():
    model = tiny("fleet", seed=1, vocab_size=VOCAB)
    want = {tuple(p): w for p, w in zip([PROMPT, BYSTANDER], reference_greedy(model, [PROMPT, BYSTANDER], 28)[0])}
    llm = LLM(model, block_size=4, max_num_batched_tokens=16, max_model_len=32,
              batch_fields=[Field("level", (), "int32"), Field("weights", (2,), "float32", "device")])
    yield llm, want
    llm.close()


def run_with_bystander(llm, add):
    """Queue a clean bystander, then ``add()`` (which may raise); step to the end. Returns the
    outputs of the added request (or its refusal) and the bystander's tokens."""
    bystander = llm.add_request(prompt_token_ids=BYSTANDER, sampling_params=CLEAN)
    try:
        rid = add()
    except (ValueError, TypeError) as exc:
        rid, refusal = None, exc
    else:
        refusal = None
    done = {}
    for _ in range(MAX_STEPS):
        if not llm.has_unfinished_requests():
            break
        for out in llm.step():
            if out.finished:
                done.setdefault(out.request_id, []).append(out)
    assert not llm.has_unfinished_requests(), "a request never finished"
    assert llm.pool.num_free_blocks == llm.pool.num_blocks and not llm.scheduler.requests
    return refusal, done.get(rid, []), done[bystander][0].token_ids


def assert_named(exc, rid, names):
    """A refusal names the request and one of the fields it was given."""
    text = str(exc)
    assert f"request {rid!r}" in text, text
    assert any(name in text for name in names), (names, text)
    assert len(text) < 400, text


@FUZZ
@given(st.fixed_dictionaries({}, optional=SAMPLING))
def test_sampling_params_are_refused_naming_a_field_or_run(setup, kwargs):
    llm, want = setup
    rid = "fuzz"
    refusal, outs, bystander = run_with_bystander(
        llm, lambda: llm.add_request(prompt_token_ids=PROMPT, request_id=rid, sampling_params=SamplingParams(**kwargs)))
    assert bystander == want[tuple(BYSTANDER)][:6]
    if refusal is not None:
        assert_named(refusal, rid, list(kwargs) + ["sampling"])
        return
    assert outs and all(o.finish_reason in ("stop", "length") for o in outs), outs
    for o in outs:
        assert all(0 <= t < VOCAB for t in o.token_ids)
    sp = SamplingParams(**kwargs)
    greedy = not isinstance(sp.temperature, (bool, str)) and float(sp.temperature) < 1e-5
    if greedy and not any(kwargs.get(k) for k in LOGIT_KNOBS):
        for o in outs:  # nothing changes the logits: the model's own greedy tokens
            assert o.token_ids == want[tuple(PROMPT)][: len(o.token_ids)]


EXTRA_NAMES = st.sampled_from(["level", "weights", "temperature", "token_ids", "seed", "prompt_embeds",
                               "presence_penalty", "logit_bias", "structured_output", "req_id", "nope"])
EXTRA = st.one_of(st.dictionaries(EXTRA_NAMES, st.one_of(ANYTHING, st.integers(-5, 5),
                                                         st.lists(st.floats(-2, 2), min_size=2, max_size=2)),
                                  max_size=3), ANYTHING)


@FUZZ
@given(EXTRA)
def test_extra_is_refused_naming_the_field_or_runs_with_correct_tokens(setup, extra):
    llm, want = setup
    rid = "fuzz-extra"
    refusal, outs, bystander = run_with_bystander(
        llm, lambda: llm.add_request(prompt_token_ids=PROMPT, request_id=rid, sampling_params=CLEAN, extra=extra))
    assert bystander == want[tuple(BYSTANDER)][:6]
    if refusal is not None:
        assert_named(refusal, rid, ["extra"])
        return
    assert [o.token_ids for o in outs] == [want[tuple(PROMPT)][:6]]  # user fields change no logits here


# ----------------------------------------------------------------------------- structured outputs
SCHEMA = st.recursive(
    st.one_of(st.booleans(), st.sampled_from([{"type": t} for t in ("integer", "string", "boolean", "null",
                                                                     "number", "object", "array", "nope")]),
              st.fixed_dictionaries({"enum": st.lists(SCALAR.filter(lambda v: not isinstance(v, np.generic)),
                                                      max_size=3)}),
              st.fixed_dictionaries({"const": st.text(max_size=3)}),
              st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/x", "nowhere"])})),
    lambda c: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=3), c,
                                                                                         max_size=3)},
                              optional={"required": st.lists(st.text(max_size=3), max_size=2),
                                        "additionalProperties": st.booleans()}),
        st.fixed_dictionaries({"type": st.just("array"), "items": c}, optional={"minItems": st.integers(-1, 3),
                                                                                "maxItems": st.integers(-1, 3)}),
        st.fixed_dictionaries({"anyOf": st.lists(c, max_size=3)})),
    max_leaves=6)
REGEX = st.lists(st.sampled_from(["a", "b+", "[0-9]{1,3}", "(x|y)", "\\d", "[^a]", "(?!x)", "\\", "(", "*", ".",
                                  "[a-", "{2}", "^", "$"]), min_size=1, max_size=5).map("".join)
SPEC = st.one_of(
    st.fixed_dictionaries({"json": SCHEMA}, optional={"disable_any_whitespace": st.booleans()}),
    st.fixed_dictionaries({"regex": REGEX}),
    st.fixed_dictionaries({"choice": st.lists(st.text(max_size=4), max_size=4)}),
    st.fixed_dictionaries({"grammar": st.sampled_from(["start: \"ab\"", "start: /[0-9]+/", "start: x", "", "%%"])}),
    st.fixed_dictionaries({"json_object": ANYTHING}),
    st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar", "whitespace_pattern", "bogus"]),
                    ANYTHING, max_size=2),
    ANYTHING)


@pytest.fixture(scope="module")
def json_setup():
    model, tok = tiny_json("llama", seed=0)
    bystander_ids = tok.encode("b")
    want, _ = reference_greedy(model, [bystander_ids], 4)
    llm = LLM(model, tok, block_size=4, max_num_batched_tokens=64, max_model_len=64)
    yield llm, want[0]
    llm.close()


@FUZZ
@given(SPEC)
@example({"json": {"enum": [math.inf]}})  # found by this test: Python's json wrote it as Infinity, not JSON
@example({"json": '{"const": NaN}'})  # JSON text Python's json reads, with a value JSON has not
@example({"json": {"": None, 0: None}})  # found by this test: keys of two kinds could not be sorted for the cache key
def test_structured_output_specs_are_refused_naming_the_field_or_run(json_setup, spec):
    llm, want = json_setup
    constrained = SamplingParams(max_tokens=12, structured_outputs=spec)
    plain = SamplingParams(max_tokens=4, ignore_eos=True)
    try:
        out, bystander = llm.generate(["a", "b"], [constrained, plain], use_tqdm=False)
    except (ValueError, TypeError) as exc:  # refused before anything ran
        text = str(exc)
        assert text.startswith("request '") and "structured_outputs" in text and len(text) < 500, text
        assert not llm.scheduler.requests and llm.pool.num_free_blocks == llm.pool.num_blocks
        out, = llm.generate(["b"], plain, use_tqdm=False)  # the engine still serves
        assert out.token_ids == want
        return
    assert bystander.token_ids == want
    assert out.finish_reason in ("stop", "length", "error")
    if out.finish_reason == "error":  # stopped at a step: named, short
        assert "structured_outputs field" in out.error and len(out.error) < 500, out.error
    assert not llm.scheduler.requests and llm.pool.num_free_blocks == llm.pool.num_blocks
    assert not math.isnan(len(out.token_ids))
