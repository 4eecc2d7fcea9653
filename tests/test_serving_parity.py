"""The server's parity with vLLM (issue 35): stop tokens and ``stop_reason``, requests that can never
fit, the tokenizer routes, ``echo`` with ``max_tokens=0``, strict types, the 404 body, CORS and the
metrics vLLM has. One server (uvicorn on a thread) serves the shipped tiny model, its queue small
(``max_num_seqs + max_queue_len = 6``) so that what can never fit is cheap to ask for; the oracle
is the same weights run offline with ``LLM.generate``."""

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families

import fleetlab
from fleetlab import LLM, SamplingParams
from fleetlab.models import load_tiny
from fleetlab.serving import AsyncLLM, ServerThread
from fleetlab.serving.chat_template import render_minimal

ENGINE = {"block_size": 16, "max_num_seqs": 4, "max_num_batched_tokens": 256}
CAPACITY = 6  # max_num_seqs 4 + max_queue_len 2


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def server(tiny):
    with ServerThread(AsyncLLM(LLM(*tiny, **ENGINE), max_queue_len=2), "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny):
    llm = LLM(*tiny, **ENGINE)
    return lambda prompt, **kw: llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)[0]


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def metrics(server) -> dict:
    out = {}
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# ----- stopping -----
def test_stop_token_text_is_dropped_unless_asked_for_and_stop_reason_says_why(client, offline, tiny):
    full = offline("count 3 ", max_tokens=20)
    assert full.text == "4 5 6 7 8"
    six = tiny[1].encode("6", add_bos=False)[0]
    cut = offline("count 3 ", max_tokens=20, stop_token_ids=(six,))  # the engine's: the token stays in token_ids
    for stream in (False, True):
        for include, text in ((False, "4 5 "), (True, "4 5 6")):
            kw = dict(model="tiny", prompt="count 3 ", max_tokens=20, temperature=0,
                      extra_body={"stop_token_ids": [six], "include_stop_str_in_output": include})
            if stream:
                chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
                got = "".join(c.choices[0].text for c in chunks if c.choices)
                last = [c for c in chunks if c.choices][-1].choices[0]
                usage = chunks[-1].usage
                assert all(c.choices[0].model_extra["stop_reason"] is None for c in chunks[:-2] if c.choices)
            else:
                r = client.completions.create(**kw)
                got, last, usage = r.choices[0].text, r.choices[0], r.usage
            assert got == text, (stream, include)
            assert last.finish_reason == "stop" and last.model_extra["stop_reason"] == six
            assert usage.completion_tokens == len(cut.token_ids) == 5  # the stop token is counted, as in vLLM
    # a stop string: cut, or kept with include_stop_str_in_output; stop_reason is the string
    for include, text in ((False, "4 5 "), (True, "4 5 6 7")):
        r = client.completions.create(model="tiny", prompt="count 3 ", max_tokens=20, temperature=0, stop=["6 7"],
                                      extra_body={"include_stop_str_in_output": include})
        assert r.choices[0].text == text and r.choices[0].model_extra["stop_reason"] == "6 7"
        chunks = list(client.completions.create(model="tiny", prompt="count 3 ", max_tokens=20, temperature=0,
                                                stop=["6 7"], stream=True,
                                                extra_body={"include_stop_str_in_output": include}))
        assert "".join(c.choices[0].text for c in chunks) == text
        assert chunks[-1].choices[0].model_extra["stop_reason"] == "6 7"
    # EOS: stop_reason null; chat carries it too; length: null
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "12+7="}], temperature=0)
    assert r.choices[0].message.content == "19" and r.choices[0].finish_reason == "stop"
    assert "stop_reason" in r.choices[0].model_extra and r.choices[0].model_extra["stop_reason"] is None
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count 3 "}],
                                       temperature=0, extra_body={"stop_token_ids": [six]})
    assert r.choices[0].message.content == "4 5 " and r.choices[0].model_extra["stop_reason"] == six
    r = client.completions.create(model="tiny", prompt="count 3 ", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].model_extra["stop_reason"] is None


# ----- what can never fit -----
@pytest.mark.parametrize("body, param", [
    ({"prompt": "1+1=", "n": CAPACITY + 1}, "n"),
    ({"prompt": "1+1=", "n": 1, "best_of": CAPACITY + 1}, "best_of"),
    ({"prompt": ["1+1="] * (CAPACITY + 1)}, "prompt"),
    ({"prompt": ["1+1=", "2+2="], "n": 4}, "prompt"),  # 8 sequences; one prompt's 4 would fit
    ({"prompt": "1+" * 200}, "prompt"),  # longer than the model's 128 positions
])
def test_a_request_that_can_never_fit_is_400_naming_the_field_not_503(server, body, param):
    r = post(server, "/v1/completions", {"model": "tiny", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert "retry-after" not in r.headers
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err


def test_as_many_choices_as_the_server_holds_are_served(client):
    r = client.completions.create(model="tiny", prompt="1+1=", max_tokens=2, n=CAPACITY, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == list(range(CAPACITY))


# ----- the tokenizer routes -----
def test_tokenize_detokenize_tokenizer_info_and_version_in_vllms_shapes(server, client, tiny):
    tok = tiny[1]
    r = post(server, "/tokenize", {"model": "tiny", "prompt": "12+7="}).json()
    assert r == {"count": 6, "max_model_len": 128, "tokens": tok.encode("12+7="), "token_strs": None}
    r = post(server, "/tokenize", {"prompt": "12+7=", "add_special_tokens": False, "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("12+7=", add_bos=False) and r["token_strs"] == list("12+7=")
    messages = [{"role": "system", "content": "add"}, {"role": "user", "content": "12+7="}]
    r = post(server, "/tokenize", {"messages": messages}).json()
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
    assert r["count"] == chat.usage.prompt_tokens and r["tokens"] == tok.encode("add\n12+7=")
    r = post(server, "/detokenize", {"model": "tiny", "tokens": tok.encode("12+7=")}).json()
    assert r == {"prompt": "<bos>12+7="}  # special tokens written, as vLLM does
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == "CharTokenizer" and info["eos_token"] == "<eos>"
    assert info["bos_token"] == "<bos>" and info["pad_token"] == "<pad>"
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(info["chat_template"])
    assert template.render(messages=messages) == render_minimal(messages)  # what the server renders
    assert httpx.get(server.url + "/version").json() == {"version": fleetlab.__version__}


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "1", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "1", "truncate": 3}, "truncate"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ x }}"}, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"prompt": "1", "model": "gpt-9"}, "model"),
    ("/detokenize", {"tokens": [1, 999]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenizer_routes_refuse_bad_bodies_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_lm_eval_remote_tokenizer_request_shapes(server, tiny):
    """What lm-evaluation-harness's ``RemoteTokenizer`` sends and reads (lm_eval/utils.py, 0.4.13):
    the server's base is its completions URL without ``/v1/completions``."""
    base = (server.base_url + "/completions").replace("/v1/completions", "")
    info = httpx.get(base + "/tokenizer_info").json()
    assert isinstance(info, dict) and "eos_token" in info and "chat_template" in info
    tokens = post(server, "/tokenize", {"prompt": "count 3 ", "add_special_tokens": False}).json()["tokens"]
    assert tokens == tiny[1].encode("count 3 ", add_bos=False)
    assert post(server, "/detokenize", {"tokens": tokens}).json()["prompt"] == "count 3 "


def test_lm_eval_remote_tokenizer_itself(server, tiny):
    """lm-evaluation-harness's own client, where it is installed (``pip install --no-deps lm-eval`` is
    enough: it needs requests, jinja2 and pyyaml)."""
    lm_utils = pytest.importorskip("lm_eval.utils")
    url = server.base_url + "/completions"
    assert lm_utils.check_remote_tokenizer_support(url)
    rt = lm_utils.RemoteTokenizer(url)
    assert rt.encode("12+7=") == tiny[1].encode("12+7=", add_bos=False)
    assert rt.decode(rt.encode("the red cat ")) == "the red cat "
    assert rt.eos_token == "<eos>" and rt.bos_token == "<bos>"
    assert rt.apply_chat_template([{"role": "user", "content": "12+7="}]) == "12+7="


# ----- bodies -----
def test_echo_with_max_tokens_0_scores_the_prompt(client, offline, tiny):
    want = offline("count 3 ", max_tokens=1, prompt_logprobs=2)
    for stream in (False, True):
        kw = dict(model="tiny", prompt="count 3 ", max_tokens=0, echo=True, logprobs=2, temperature=0)
        if stream:
            chunks = list(client.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            lps = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            text, lps, finish = r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.choices[0].finish_reason
            assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(want.prompt_token_ids)
        assert text == "count 3 " and finish == "length"
        assert len(lps) == len(want.prompt_token_ids) and lps[0] is None  # the prompt's positions only
        assert lps[1:] == pytest.approx([x.logprob for x in want.prompt_logprobs[1:]], abs=1e-4)
    r = client.completions.create(model="tiny", prompt=[tiny[1].encode("12+7=")], max_tokens=0, echo=True)
    assert r.choices[0].text == "12+7=" and r.choices[0].logprobs is None
    for extra, param in (({"echo": False}, "max_tokens"), ({"echo": True, "best_of": 2}, "best_of")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny", prompt="1+1=", max_tokens=0, extra_body=extra)
        assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1"}], max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


@pytest.mark.parametrize("endpoint, field, value", [
    ("completions", "max_tokens", True),
    ("completions", "max_tokens", "4"),
    ("completions", "max_tokens", 4.0),
    ("completions", "logprobs", True),
    ("completions", "n", "2"),
    ("completions", "stream", "true"),
    ("completions", "echo", 1),
    ("completions", "temperature", "0.5"),
    ("completions", "stop_token_ids", [True]),
    ("completions", "include_stop_str_in_output", "no"),
    ("completions", "logit_bias", {"²": 1.0}),  # passes str.isdigit(), is no ASCII integer
    ("chat/completions", "logprobs", 1),
    ("chat/completions", "max_completion_tokens", "8"),
    ("chat/completions", "seed", False),
])
def test_types_are_strict_never_coerced(server, endpoint, field, value):
    body = {"model": "tiny", "max_tokens": 2, field: value}
    body.update({"prompt": "1+1="} if endpoint == "completions" else {"messages": [{"role": "user", "content": "1"}]})
    r = post(server, f"/v1/{endpoint}", body)
    assert r.status_code == 400, (field, value, r.text)
    err = r.json()["error"]
    assert err["param"].split("[")[0] == field and field in err["message"], err


def test_404_and_405_bodies_say_which_routes_exist(server):
    r = httpx.get(server.url + "/v1/embeddings")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    message = r.json()["error"]["message"]
    assert "GET /v1/embeddings" in message
    for route in ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
                  "POST /tokenize", "POST /detokenize", "GET /tokenizer_info", "GET /version", "GET /metrics"):
        assert route in message, (route, message)
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "POST /v1/completions" in r.json()["error"]["message"]


# ----- CORS and the key -----
def test_cors_only_for_the_allowed_origins(server):
    preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    r = httpx.options(server.url + "/v1/completions", headers=preflight)  # the default: no CORS
    assert "access-control-allow-origin" not in r.headers
    cors = {"allow_origins": ["http://app.example"], "allow_methods": ["*"], "allow_headers": ["*"]}
    with ServerThread(server.engine, "tiny", shutdown_engine=False, cors=cors, api_key="k") as s:
        r = httpx.options(s.url + "/v1/completions", headers=preflight)  # a preflight needs no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.options(s.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = httpx.get(s.url + "/v1/models", headers={"Origin": "http://app.example", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        assert httpx.post(s.url + "/tokenize", json={"prompt": "1"}).status_code == 401  # keyed like /v1
        assert httpx.get(s.url + "/version").status_code == 200


def test_cors_flags():
    from fleetlab.serving.cli import build_parser, cors_options

    assert cors_options(build_parser().parse_args([])) is None
    args = build_parser().parse_args(["--allowed-origins", '["http://a.example"]', "--allow-credentials"])
    assert cors_options(args) == {"allow_origins": ["http://a.example"], "allow_methods": ["*"],
                                  "allow_headers": ["*"], "allow_credentials": True}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", "http://a.example"])  # not a JSON list


# ----- metrics -----
def test_request_params_and_iteration_tokens_metrics(server, client):
    before = metrics(server)
    r = client.completions.create(model="tiny", prompt="the red cat ", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    alone = metrics(server)
    delta = {k: v - before.get(k, 0) for k, v in alone.items()}
    # alone on the engine: its prefill, then four one-token steps
    assert delta["fleetlab:iteration_tokens_total_count"] == delta["fleetlab:engine_steps_total"] == 5
    assert delta["fleetlab:iteration_tokens_total_sum"] == r.usage.prompt_tokens + 4
    assert delta["fleetlab:iteration_tokens_total_bucket{le=1.0}"] == 4  # the decode steps
    client.completions.create(model="tiny", prompt=["1+1=", "2+2="], max_tokens=3, n=2, temperature=1.0, seed=3)
    m = metrics(server)
    delta = {k: v - before.get(k, 0) for k, v in m.items()}
    assert delta["fleetlab:request_params_n_count"] == 3 and delta["fleetlab:request_params_n_sum"] == 1 + 2 * 2
    assert delta["fleetlab:request_params_max_tokens_sum"] == 5 + 3 + 3
    assert delta["fleetlab:request_params_n_bucket{le=1.0}"] == 1
    assert delta["fleetlab:request_params_max_tokens_bucket{le=5.0}"] == 3
    assert m["fleetlab:iteration_tokens_total_bucket{le=+Inf}"] == m["fleetlab:iteration_tokens_total_count"]
    assert "fleetlab:spec_decode_num_drafts_total" not in m  # no speculation here
