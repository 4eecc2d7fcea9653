"""Hostile input (issue #14, items 3-6): whatever a user passes, a request is either refused
before anything is queued, with a message naming the request and the field, or it is safe
to run: nothing that passes validation may raise inside ``step()``.

Every case ends the same way: nothing is left queued, every block is free, and a clean
request on the same ``LLM`` still gives the model's own greedy tokens.
"""

import logging

import numpy as np
import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.errors import FieldTypeError
from fleetlab.patching.parity import reference_greedy

MAX_MODEL_LEN = 48
SP = SamplingParams


class ScriptedTokenizer:
    """A tokenizer whose ``encode`` returns whatever a test sets in ``output``."""

    def __init__(self):
        self.output = [5, 6, 7]

    def encode(self, text):
        return self.output

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.fixture(scope="module")
def oracle(fleet_model):
    """A clean prompt and the model's own greedy tokens for it (and for a second prompt)."""
    prompts = random_prompts([6, 4], seed=8)
    want, _ = reference_greedy(fleet_model, prompts, 8)
    return prompts, want


@pytest.fixture(scope="module")
def engine(fleet_model, oracle):
    llm = LLM(fleet_model, ScriptedTokenizer(), block_size=4, max_num_batched_tokens=16, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.close()


@pytest.fixture()
def llm(engine):
    engine.tokenizer.output = [5, 6, 7]
    yield engine
    engine.abort(list(engine.scheduler.requests))  # a failing case must not leak into the next


def assert_clean(llm, oracle):
    """Nothing queued, every block free, and a clean request still gives the oracle's tokens."""
    assert not llm.has_unfinished_requests() and not llm.scheduler.requests
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    prompts, want = oracle
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SP(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert llm.pool.num_free_blocks == llm.pool.num_blocks and not llm.scheduler.requests


def run(llm, request_id, **kwargs):
    """Add one request and step until it finishes; returns its output."""
    rid = llm.add_request(request_id=request_id, **kwargs)
    done = {}
    for _ in range(200):
        done.update({o.request_id: o for o in llm.step() if o.finished})
        if rid in done:
            return done[rid]
    raise AssertionError(f"request {rid!r} did not finish")


# ----------------------------------------------------------------------------- item 3
# Each passes validation and must then run: before the fix these raised OverflowError
# inside step() or wrapped silently in an int32 buffer.


def test_huge_max_tokens_is_clamped_to_max_model_len(llm, oracle):
    prompt, want = oracle[0][0], oracle[1][0]
    for sp in (SP(max_tokens=2**64, ignore_eos=True), SP(max_tokens=2**64, min_tokens=2**64, ignore_eos=True)):
        out = run(llm, "huge", prompt_token_ids=prompt, sampling_params=sp)
        assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == MAX_MODEL_LEN
        assert out.token_ids[:8] == want
    assert_clean(llm, oracle)


def test_min_tokens_beyond_int32_still_bans_the_stop_id(llm, oracle):
    # 2**32 wrapped to 0 in the int32 buffer: the stop id (the first greedy token) ended the
    # request at once. Clamped with max_tokens, it keeps its meaning: no stop before the end.
    prompt, want = oracle[0][0], oracle[1][0]
    sp = SP(max_tokens=2**32, min_tokens=2**32, stop_token_ids=(want[0],), ignore_eos=True)
    out = run(llm, "wrap", prompt_token_ids=prompt, sampling_params=sp)
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == MAX_MODEL_LEN
    assert want[0] not in out.token_ids
    assert_clean(llm, oracle)


def test_huge_top_k_means_no_limit(llm, oracle):
    prompt = oracle[0][0]
    free = run(llm, "k0", prompt_token_ids=prompt, sampling_params=SP(temperature=1.0, top_k=0, seed=3))
    huge = run(llm, "k63", prompt_token_ids=prompt, sampling_params=SP(temperature=1.0, top_k=2**63, seed=3))
    assert huge.token_ids == free.token_ids and huge.finish_reason == free.finish_reason
    assert_clean(llm, oracle)


@pytest.mark.parametrize("sp", [SP(temperature=1e-40, top_k=1), SP(temperature=1e-6, seed=5),
                                SP(temperature=1.0, top_p=1e-30, seed=5), SP(temperature=1.0, top_k=1, seed=5)],
                         ids=["T=1e-40,top_k=1", "T=1e-6", "top_p=1e-30", "top_k=1"])
def test_limits_of_sampling_are_greedy(llm, oracle, sp):
    # A temperature below 1e-5 is greedy (logits / T would overflow float32 and ignore top_k).
    prompt, want = oracle[0][0], oracle[1][0]
    out = run(llm, "cold", prompt_token_ids=prompt, sampling_params=SamplingParams(
        max_tokens=8, ignore_eos=True, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=sp.seed))
    assert out.token_ids == want
    assert_clean(llm, oracle)


def test_largest_seed_runs(llm, oracle):
    out = run(llm, "seed", prompt_token_ids=oracle[0][0], sampling_params=SP(temperature=1.0, seed=2**63 - 1))
    assert len(out.token_ids) >= 1
    assert_clean(llm, oracle)


def test_numpy_numbers_are_numbers(llm, oracle):
    prompt = oracle[0][0]
    plain = run(llm, "plain", prompt_token_ids=prompt,
                sampling_params=SP(temperature=0.7, max_tokens=3, top_k=5, top_p=0.9, seed=7, min_tokens=1,
                                   ignore_eos=True, stop_token_ids=(1,)))
    numpy = run(llm, np.int64(12), prompt_token_ids=np.asarray(prompt, dtype=np.int32),
                sampling_params=SP(temperature=np.float32(0.7), max_tokens=np.int64(3), top_k=np.int32(5),
                                   top_p=np.array(0.9), seed=np.uint64(7), min_tokens=np.array(1),
                                   ignore_eos=np.bool_(True), stop_token_ids=np.array([1])))
    assert numpy.request_id == "12" and numpy.token_ids == plain.token_ids and len(plain.token_ids) == 3
    outs = llm.generate(prompt_token_ids=np.asarray(oracle[0][:1]), sampling_params=SP(max_tokens=8, ignore_eos=True),
                        use_tqdm=False)  # a 2-D numpy array: one prompt per row
    assert [o.token_ids for o in outs] == oracle[1][:1]
    assert_clean(llm, oracle)


def test_validation_does_not_touch_the_users_params(llm, oracle):
    sp = SP(max_tokens=2**40, temperature=1e-9, top_k=2**40, stop_token_ids=[9], seed=np.int64(1))
    run(llm, "shared", prompt_token_ids=oracle[0][0], sampling_params=sp)
    assert sp == SP(max_tokens=2**40, temperature=1e-9, top_k=2**40, stop_token_ids=[9], seed=np.int64(1))
    assert_clean(llm, oracle)


# ----------------------------------------------------------------------------- items 4 and 5
# (call, kwargs, exception, words the message must hold, words it must not hold).
# "add": llm.add_request(request_id="bad", **kwargs); "gen": llm.generate(prompt_token_ids=[good] + ids
# or prompts=[...]) so that a good request shares the call and must not be queued either.
T, V = FieldTypeError, ValueError
REFUSED = [
    # token ids are ints: nothing is coerced
    ("float ids", "add", dict(prompt_token_ids=[3.7, 5.2]), T, ["prompt_token_ids", "float"], []),
    ("float 3.0", "add", dict(prompt_token_ids=[3.0, 5]), T, ["prompt_token_ids"], []),
    ("numeric str", "add", dict(prompt_token_ids=["12", 5]), T, ["prompt_token_ids", "str"], []),
    ("str prompt ids", "add", dict(prompt_token_ids="12"), T, ["prompt_token_ids", "str"], []),
    ("nan id", "add", dict(prompt_token_ids=[float("nan"), 5]), T, ["prompt_token_ids"], []),
    ("bool ids", "add", dict(prompt_token_ids=[True, 5]), T, ["prompt_token_ids", "bool"], []),
    ("numpy bool ids", "add", dict(prompt_token_ids=np.array([True, False])), T, ["prompt_token_ids"], []),
    ("numpy float ids", "add", dict(prompt_token_ids=np.array([3.0, 4.0])), T, ["prompt_token_ids"], []),
    ("list of lists", "add", dict(prompt_token_ids=[[3, 4], [5, 6]]), T, ["prompt_token_ids", "flat"], []),
    ("ids=5", "add", dict(prompt_token_ids=5), T, ["prompt_token_ids", "int"], ["not iterable"]),
    ("triple nested", "gen", dict(prompt_token_ids=[[[3, 4], [5]]]), T, ["prompt_token_ids", "flat"],
     ["inhomogeneous"]),
    ("ragged in one", "gen", dict(prompt_token_ids=[[3, [4, 5]]]), T, ["prompt_token_ids"], ["inhomogeneous"]),
    ("out of vocab", "gen", dict(prompt_token_ids=[[3, 10**30]]), V, ["prompt_token_ids", "vocabulary"], []),
    # prompts
    ("prompts=[None]", "gen", dict(prompts=[None]), T, ["prompt", "str"], ["exactly one"]),
    ("prompts=[ids]", "gen", dict(prompts=[[3, 4]]), T, ["prompt", "prompt_token_ids"], []),
    ("tok floats", "tok", [1.5, 2.0], T, ["tokenizer", "float"], []),
    ("tok None", "tok", None, T, ["tokenizer", "NoneType"], []),
    ("tok str", "tok", "abc", T, ["tokenizer", "str"], []),
    ("tok no input_ids", "tok", {"ids": [1, 2]}, V, ["tokenizer", "input_ids"], ["KeyError"]),
    ("tok nested", "tok", {"input_ids": [[5, 6]]}, T, ["tokenizer", "flat"], []),
    # sampling fields: types
    ("temperature str", "add", dict(sampling_params=SP(temperature="0.7")), T, ["temperature"], []),
    ("max_tokens float", "add", dict(sampling_params=SP(max_tokens=3.0)), T, ["max_tokens"], []),
    ("max_tokens bool", "add", dict(sampling_params=SP(max_tokens=True)), T, ["max_tokens", "bool"], []),
    ("top_k float", "add", dict(sampling_params=SP(top_k=2.0)), T, ["top_k"], []),
    ("seed float", "add", dict(sampling_params=SP(seed=1.0)), T, ["seed"], []),
    ("ignore_eos str", "add", dict(sampling_params=SP(ignore_eos="no")), T, ["ignore_eos"], []),
    ("stop ids=5", "add", dict(sampling_params=SP(stop_token_ids=5)), T, ["stop_token_ids"], ["not iterable"]),
    ("stop ids float", "add", dict(sampling_params=SP(stop_token_ids=(4.0,))), T, ["stop_token_ids"], []),
    ("stop ids bool", "add", dict(sampling_params=SP(stop_token_ids=(True,))), T, ["stop_token_ids"], []),
    ("sampling dict", "add", dict(sampling_params={"max_tokens": 3}), T, ["sampling_params"], []),
    ("priority str", "add", dict(priority="high"), T, ["priority"], []),
    # sampling fields: bounds
    ("temperature inf", "add", dict(sampling_params=SP(temperature=float("inf"))), V, ["temperature"], []),
    ("temperature nan", "add", dict(sampling_params=SP(temperature=float("nan"))), V, ["temperature"], []),
    ("temperature>f32", "add", dict(sampling_params=SP(temperature=1e39)), V, ["temperature"], []),
    ("top_p nan", "add", dict(sampling_params=SP(top_p=float("nan"))), V, ["top_p"], []),
    ("top_p 0 in f32", "add", dict(sampling_params=SP(top_p=1e-50)), V, ["top_p", "float32"], []),
    ("seed 2**63", "add", dict(sampling_params=SP(seed=2**63)), V, ["seed"], []),
    ("seed -1", "add", dict(sampling_params=SP(seed=-1)), V, ["seed"], []),
    ("min_tokens 2**64", "add", dict(sampling_params=SP(min_tokens=2**64)), V, ["min_tokens"], []),
    ("stop id negative", "add", dict(sampling_params=SP(stop_token_ids=(-3,))), V, ["stop_token_ids"], []),
    ("stop id huge", "add", dict(sampling_params=SP(stop_token_ids=(2**64,))), V, ["stop_token_ids"], []),
]


@pytest.mark.parametrize("how,kwargs,exc,words,banned", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_refused_naming_request_and_field_and_nothing_queued(llm, oracle, how, kwargs, exc, words, banned):
    good = oracle[0][0]
    with pytest.raises(exc) as err:
        if how == "add":
            kwargs = {"prompt_token_ids": good, **kwargs}
            llm.add_request(request_id="hostile", **kwargs)
        elif how == "tok":
            llm.tokenizer.output = kwargs
            llm.generate(["some text"], use_tqdm=False)
        elif "prompts" in kwargs:
            llm.generate(prompts=["fine text"] + kwargs["prompts"], use_tqdm=False)
        else:
            llm.generate(prompt_token_ids=[good] + kwargs["prompt_token_ids"], use_tqdm=False)
    message = str(err.value)
    assert isinstance(err.value, ValueError)  # what the server answers with a 400
    assert ("request 'hostile'" if how == "add" else "request '") in message
    for word in words:
        assert word in message
    for word in banned:
        assert word not in message
    assert_clean(llm, oracle)


GENERATE_SHAPES = [
    ("prompt_token_ids=5", dict(prompt_token_ids=5), ["prompt_token_ids"]),
    ("prompt_token_ids=0-d array", dict(prompt_token_ids=np.array(5)), ["prompt_token_ids"]),
    ("prompt_token_ids str", dict(prompt_token_ids="12"), ["prompt_token_ids"]),
    ("prompts=5", dict(prompts=5), ["prompts"]),
]


@pytest.mark.parametrize("kwargs,words", [c[1:] for c in GENERATE_SHAPES], ids=[c[0] for c in GENERATE_SHAPES])
def test_generate_names_a_misshapen_argument(llm, oracle, kwargs, words):
    with pytest.raises(FieldTypeError) as err:
        llm.generate(use_tqdm=False, **kwargs)
    assert "generate" in str(err.value) and all(w in str(err.value) for w in words)
    assert "not iterable" not in str(err.value)
    assert_clean(llm, oracle)


# ----------------------------------------------------------------------------- engine config
CONFIG_REFUSED = [
    ("block_size=True", dict(block_size=True), T, ["block_size", "bool"]),
    ("block_size=4.0", dict(block_size=4.0), T, ["block_size"]),
    ("block_size=2**40", dict(block_size=2**40), V, ["block_size"]),
    ("prefix caching 'no'", dict(enable_prefix_caching="no"), T, ["enable_prefix_caching"]),
    ("chunked prefill 1", dict(enable_chunked_prefill=1), T, ["enable_chunked_prefill"]),
    ("record_traces 'yes'", dict(record_traces="yes"), T, ["record_traces"]),
    ("reorder 'no'", dict(reorder="no"), T, ["reorder"]),
    ("seed=-1", dict(seed=-1), V, ["seed"]),
    ("seed=1.5", dict(seed=1.5), T, ["seed"]),
    ("max_num_seqs=2.5", dict(max_num_seqs=2.5), T, ["max_num_seqs"]),
    ("num_blocks=0", dict(num_blocks=0), V, ["num_blocks"]),
    ("max_model_len=True", dict(max_model_len=True), T, ["max_model_len"]),
    ("backend=3", dict(backend=3), T, ["backend"]),
]


@pytest.mark.parametrize("kwargs,exc,words", [c[1:] for c in CONFIG_REFUSED], ids=[c[0] for c in CONFIG_REFUSED])
def test_engine_config_refusals_name_the_field(fleet_model, kwargs, exc, words):
    with pytest.raises(exc) as err:
        LLM(fleet_model, **kwargs)
    assert isinstance(err.value, ValueError) and str(err.value).startswith("engine config:")
    assert all(w in str(err.value) for w in words)


SPEC_REFUSED = [
    ("k=True", dict(method="ngram", num_speculative_tokens=True), ["num_speculative_tokens"]),
    ("k=2.0", dict(method="ngram", num_speculative_tokens=2.0), ["num_speculative_tokens"]),
    ("k=99", dict(method="ngram", num_speculative_tokens=99), ["num_speculative_tokens"]),
    ("method list", dict(method=["ngram"], num_speculative_tokens=2), ["method"]),
]


@pytest.mark.parametrize("spec,words", [c[1:] for c in SPEC_REFUSED], ids=[c[0] for c in SPEC_REFUSED])
def test_speculative_config_refusals_name_the_field(fleet_model, spec, words):
    with pytest.raises(ValueError) as err:
        LLM(fleet_model, speculative_config=spec)
    assert str(err.value).startswith("speculative_config:") and all(w in str(err.value) for w in words)


def test_numpy_config_values_work_and_reach_paddle_as_ints(fleet_model, oracle):
    with LLM(fleet_model, block_size=np.int64(4), max_num_seqs=np.int32(4), max_num_batched_tokens=np.int64(16),
             max_model_len=np.int16(MAX_MODEL_LEN), enable_prefix_caching=np.bool_(False), seed=np.uint8(3),
             speculative_config={"method": "ngram", "num_speculative_tokens": np.int64(2)}) as llm:
        cfg = llm.config
        assert type(cfg.block_size) is int and type(cfg.max_model_len) is int and cfg.enable_prefix_caching is False
        assert type(llm.spec_config.num_speculative_tokens) is int
        outs = llm.generate(prompt_token_ids=oracle[0], sampling_params=SP(max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == oracle[1]
        assert llm.pool.num_free_blocks == llm.pool.num_blocks


def test_max_model_len_beyond_the_model_is_logged(fleet_model, caplog):
    model_len = LLM(fleet_model, block_size=16, num_blocks=8)
    limit = model_len.max_model_len
    model_len.close()
    with caplog.at_level(logging.WARNING, logger="fleetlab"):
        with LLM(fleet_model, block_size=16, num_blocks=8, max_model_len=10**6) as llm:
            assert llm.max_model_len == limit
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "max_model_len" in r.getMessage()]
    assert len(warnings) == 1 and "1000000" in warnings[0].getMessage() and str(limit) in warnings[0].getMessage()


# ----------------------------------------------------------------------------- item 6


def test_engine_ids_never_collide_with_user_ids(llm, oracle):
    prompts, want = oracle
    sp = SP(max_tokens=8, ignore_eos=True)
    n = int(llm.add_request(prompt_token_ids=prompts[0], sampling_params=sp))  # the engine's last id
    taken = {str(n), str(n + 1), str(n + 2)}
    llm.add_request(prompt_token_ids=prompts[0], sampling_params=sp, request_id=str(n + 1))  # the ids it
    llm.add_request(prompt_token_ids=prompts[0], sampling_params=sp, request_id=n + 2)  # would pick next
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert not {o.request_id for o in outs} & taken
    assert_clean(llm, oracle)


def test_a_fresh_engines_ids_skip_a_user_id(fleet_model, oracle):
    with LLM(fleet_model, block_size=4, max_model_len=MAX_MODEL_LEN) as llm:
        llm.add_request(prompt_token_ids=oracle[0][0], request_id="0", sampling_params=SP(max_tokens=2))
        outs = llm.generate(prompt_token_ids=oracle[0], sampling_params=SP(max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == oracle[1] and "0" not in {o.request_id for o in outs}
        assert not llm.has_unfinished_requests() and llm.pool.num_free_blocks == llm.pool.num_blocks


def test_a_finished_requests_id_can_be_reused_at_once(llm, oracle):
    prompts, want = oracle
    sp = SP(max_tokens=8, ignore_eos=True)
    assert run(llm, "again", prompt_token_ids=prompts[0], sampling_params=sp).token_ids == want[0]
    # its batch row leaves at the next step: the same id arrives before that step
    assert run(llm, "again", prompt_token_ids=prompts[1], sampling_params=sp).token_ids == want[1]
    ids = [o.request_id for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)]
    assert run(llm, ids[0], prompt_token_ids=prompts[1], sampling_params=sp).token_ids == want[1]
    aborted = llm.add_request(prompt_token_ids=prompts[0], sampling_params=sp, request_id="aborted")
    llm.step()
    llm.abort(aborted)
    assert run(llm, "aborted", prompt_token_ids=prompts[0], sampling_params=sp).token_ids == want[0]
    assert_clean(llm, oracle)


def test_a_live_duplicate_id_is_refused_and_nothing_queued(llm, oracle):
    prompts, want = oracle
    sp = SP(max_tokens=8, ignore_eos=True)
    assert llm.add_request(prompt_token_ids=prompts[0], sampling_params=sp, request_id=7) == "7"
    for dup in ("7", 7, np.int64(7)):
        with pytest.raises(ValueError, match="request '7': request_id '7' is already used"):
            llm.add_request(prompt_token_ids=prompts[1], sampling_params=sp, request_id=dup)
    assert list(llm.scheduler.requests) == ["7"] and len(llm.scheduler.waiting) == 1
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step()})
    assert done["7"].token_ids == want[0]
    assert_clean(llm, oracle)


@pytest.mark.parametrize("rid", [1.5, True, ("a",), b"x", ["a"]], ids=repr)
def test_request_id_must_be_str_or_int(llm, oracle, rid):
    with pytest.raises(FieldTypeError, match="request_id"):
        llm.add_request(prompt_token_ids=oracle[0][0], request_id=rid)
    assert_clean(llm, oracle)
