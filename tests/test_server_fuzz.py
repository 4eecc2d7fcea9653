"""Fuzzing the server's JSON bodies (issue 35): for every body hypothesis makes -- valid fields, values
out of range, wrong types, unknown fields, anything JSON can hold -- the answer is a 200 with a
well-formed body (or stream), or a 4xx whose ``param`` names a field the body sent (or one whose
default applied) and whose message names it too; never a 500, never a hang, and the server keeps
serving with every KV block back in the pool.

One server (uvicorn on a thread) serves the shipped tiny model; its queue holds 8 sequences so
that ``n`` and lists of prompts reach "can never fit". The examples are few and small (seconds).
"""

import json
import re
import time

import pytest

httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetlab import LLM
from fleetlab.models import load_tiny
from fleetlab.serving import AsyncLLM, ServerThread

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLM(LLM(*load_tiny(), block_size=16, max_num_seqs=4, max_num_batched_tokens=256), max_queue_len=4)
    with ServerThread(engine, "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:  # a hang fails the test, it does not wait forever
        yield c


# ----- what a body may hold -----
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=6))
ANYTHING = st.recursive(SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                      max_size=3), max_leaves=5)


NOTHING = st.nothing()


def field(valid, hostile=NOTHING):
    """Mostly a value the field takes, sometimes one it refuses (out of range, of the wrong type,
    anything JSON can hold)."""
    return st.one_of(valid, valid, valid, valid, hostile, ANYTHING)


def rarely(valid, hostile):
    """For the fields inside a list (each message's): a bad one among three spoils the body."""
    return st.one_of(*[valid] * 12, hostile, ANYTHING)


def body(required: dict, optional: dict):
    """``required`` and at most four of ``optional`` (a body of every field would never be valid)."""
    keys = st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({**required, **{k: optional[k] for k in ks}}))


TEXT = st.text(alphabet="0123456789+=-* abcdefghijklmnopqrstuvwxyz\nÄ²€😀", max_size=12)
TOKEN = st.integers(4, 54)  # the tiny vocabulary: ids 0-54, 0-3 special
BAD_TOKEN = st.sampled_from([-1, 55, 10**6, 2**40])
SPEC = {  # field: (values it takes, values it refuses)
    "model": (st.just("tiny"), st.just("gpt-9")),
    "max_tokens": (st.integers(1, 6), st.sampled_from([0, -1, 200, 10**9, True, "4", 4.0])),
    "temperature": (st.floats(0, 2), st.sampled_from([-1, 3, "0.5", float("nan"), float("inf")])),
    "top_p": (st.floats(0.01, 1), st.sampled_from([0, 1.5, -0.1])),
    "top_k": (st.integers(-1, 100), st.just(-3)),
    "seed": (st.integers(0, 2**63 - 1), st.sampled_from([-1, 2**63, 2**64])),
    "stop": (TEXT | st.lists(TEXT, max_size=3), st.just([""])),
    "stream": (st.booleans(), st.just("true")),
    "stream_options": (st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
                       st.just({"continuous_usage_stats": True})),
    "n": (st.integers(1, 3), st.sampled_from([0, -1, 9, 100])),
    "best_of": (st.integers(1, 3), st.sampled_from([0, 9])),
    "presence_penalty": (st.floats(-2, 2), st.just(3)),
    "frequency_penalty": (st.floats(-2, 2), st.just(-3)),
    "repetition_penalty": (st.floats(0.1, 3), st.sampled_from([0, -1])),
    "logit_bias": (st.dictionaries(TOKEN.map(str), st.floats(-300, 300), max_size=3),
                   st.dictionaries(st.sampled_from(["²", "-1", "99999", "x", "1e3"]),
                                   st.floats(-300, 300) | st.sampled_from([float("nan"), "1"]), min_size=1,
                                   max_size=2)),
    "ignore_eos": (st.booleans(), st.just(1)),
    "min_tokens": (st.integers(0, 3), st.just(-1)),
    "stop_token_ids": (st.lists(TOKEN, max_size=3), st.lists(BAD_TOKEN, min_size=1, max_size=2)),
    "include_stop_str_in_output": (st.booleans(), st.just("no")),
    "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                        st.sampled_from([{"type": "nope"}, {"type": "json_schema", "json_schema": {"name": "n"}},
                                         {"type": "json_schema",
                                          "json_schema": {"name": "n", "schema": {"type": "integer"}}}])),
    "structured_outputs": (st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[0-9]{1,3}"}]),
                           st.sampled_from([{"choice": []}, {"json": True}, {"regex": "("}, {"grammar": 5}])),
    "user": (TEXT, st.just(5)),
    "min_p": (st.just(0), st.just(0.1)),
    "frobnicate": (st.nothing(), ANYTHING),
}
COMMON = {k: field(valid, hostile) for k, (valid, hostile) in SPEC.items()}
PROMPT = field(TEXT.filter(bool) | st.lists(TEXT.filter(bool), min_size=1, max_size=3)
               | st.lists(TOKEN, min_size=1, max_size=8) | st.lists(st.lists(TOKEN, min_size=1, max_size=5),
                                                                    min_size=1, max_size=3),
               st.sampled_from(["", [], [[]], [10**6], "1+" * 100]))
COMPLETION = body({"prompt": PROMPT}, {**COMMON, "logprobs": field(st.integers(0, 5), st.sampled_from([-1, 21, True])),
                                       "echo": field(st.booleans()), "suffix": field(st.just(""), TEXT)})
MESSAGE = st.fixed_dictionaries(
    {"role": rarely(st.sampled_from(["system", "user", "assistant", "developer"]), st.just("robot")),
     "content": rarely(TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2),
                       st.lists(st.fixed_dictionaries({"type": st.just("image_url")}), min_size=1, max_size=1))},
    optional={"name": rarely(st.nothing(), TEXT)})
CHAT = body({"messages": rarely(st.lists(MESSAGE, min_size=1, max_size=3), st.just([]))}, {
    **COMMON, "max_completion_tokens": field(st.integers(1, 6), st.just(0)), "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(0, 5), st.just(21)), "echo": field(st.just(False), st.just(True)),
    "tools": field(st.just([]))})


# ----- the rule -----
def check_refusal(body: dict, r) -> None:
    """A 4xx naming a field of the body (or ``max_tokens``, whose default applies unsent)."""
    assert r.status_code in (400, 404), (r.status_code, body, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    param = err["param"]
    assert param, (body, err)
    root = re.split(r"[.\[]", param)[0]
    assert root in body or err["code"] == "missing_field" or root == "max_tokens", (body, err)
    assert root in err["message"], (body, err)
    assert len(err["message"]) < 600, err  # short enough to read


def check_answer(body: dict, r, chat: bool) -> None:
    """A well-formed answer: the choices asked for, each finished, the usage adding up."""
    assert r.status_code == 200, (body, r.text)
    if body.get("stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], chunks
        finished = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
        assert sorted(finished) == list(range(len(finished))) and finished, chunks
        return
    answer = r.json()
    choices = answer["choices"]
    assert [c["index"] for c in choices] == list(range(len(choices))) and choices
    prompts = body["prompt"] if not chat else ["-"]
    num_prompts = 1 if isinstance(prompts, str) or not isinstance(prompts[0], (str, list)) else len(prompts)
    assert len(choices) == num_prompts * body.get("n", 1)
    for c in choices:
        text = c["message"]["content"] if chat else c["text"]
        assert isinstance(text, str) and c["finish_reason"] in ("stop", "length"), c
        assert c["stop_reason"] is None or isinstance(c["stop_reason"], (str, int)), c
        assert (c["logprobs"] is None) == (body.get("logprobs") is None or body.get("logprobs") is False), (body, c)
    use = answer["usage"]
    assert use["prompt_tokens"] > 0 and use["total_tokens"] == use["prompt_tokens"] + use["completion_tokens"]


def send(http, path: str, body: dict):
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


@FUZZ
@given(body=COMPLETION)
def test_completion_bodies(http, body):
    r = send(http, "/v1/completions", body)
    check_answer(body, r, chat=False) if r.status_code == 200 else check_refusal(body, r)


@FUZZ
@given(body=CHAT)
def test_chat_bodies(http, body):
    r = send(http, "/v1/chat/completions", body)
    check_answer(body, r, chat=True) if r.status_code == 200 else check_refusal(body, r)


ONE_BAD = st.sampled_from(sorted(SPEC)).flatmap(lambda k: st.tuples(st.just(k), st.one_of(SPEC[k][1], ANYTHING)))


@FUZZ
@given(bad=ONE_BAD, chat=st.booleans())
def test_one_bad_field_on_a_good_body_is_refused_naming_that_field(http, bad, chat):
    """A good body and one field of a value it may refuse: answered, or refused naming that field."""
    key, value = bad
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0, key: value}
    body.update({"messages": [{"role": "user", "content": "12+7="}]} if chat else {"prompt": "12+7="})
    r = send(http, "/v1/chat/completions" if chat else "/v1/completions", body)
    if r.status_code == 200:
        return check_answer(body, r, chat)
    check_refusal(body, r)
    assert re.split(r"[.\[]", r.json()["error"]["param"])[0] in (key, "max_tokens"), (body, r.json())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(
    st.fixed_dictionaries({"prompt": field(TEXT)}, optional={"add_special_tokens": field(st.booleans()),
                                                              "return_token_strs": field(st.booleans()),
                                                              "model": field(st.just("tiny")), "x": ANYTHING}),
    st.fixed_dictionaries({"messages": field(st.lists(MESSAGE, max_size=2))},
                          optional={"add_generation_prompt": field(st.booleans())}),
    st.fixed_dictionaries({"tokens": field(st.lists(TOKEN, max_size=6))}, optional={"model": field(TEXT)})))
def test_tokenizer_route_bodies(http, body):
    path = "/detokenize" if "tokens" in body else "/tokenize"
    r = send(http, path, body)
    if r.status_code != 200:
        return check_refusal(body, r)
    out = r.json()
    if path == "/detokenize":
        assert isinstance(out["prompt"], str)
    else:
        assert out["count"] == len(out["tokens"]) and all(isinstance(t, int) for t in out["tokens"])


def test_the_server_still_serves_with_every_block_free(server, http):
    """Run last in this file: after everything above, nothing is held and answers are right."""
    deadline = time.monotonic() + 10
    while server.engine.stats()["kv_cache_utilization"] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = server.engine.stats()
    assert stats["kv_cache_utilization"] == 0 and stats["num_requests_running"] == 0
    assert stats["num_requests_waiting"] == 0 and server.engine.is_running
    r = send(http, "/v1/completions", {"model": "tiny", "prompt": "12+7=", "max_tokens": 4, "temperature": 0})
    assert r.json()["choices"][0]["text"] == "19"
