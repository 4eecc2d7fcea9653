"""The OpenAI-compatible server, driven by the official ``openai`` client over real HTTP.

One server (uvicorn on a thread, a free loopback port) serves the shipped tiny model to every
test here; the oracle is the same weights loaded again and run offline with ``LLM.generate``.
"""

import asyncio
import contextlib
import json
import math
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families

from fleetlab import LLM, SamplingParams
from fleetlab.lab.demo import make_prompts
from fleetlab.models import load_tiny
from fleetlab.serving import AsyncLLM, ServerThread

ENGINE = {"block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def server():
    model, tokenizer = load_tiny()
    engine = AsyncLLM(LLM(model, tokenizer, **ENGINE))
    with ServerThread(engine, "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def offline():
    """Greedy outputs of the same weights, offline: ``offline(prompts, max_tokens) -> [RequestOutput]``."""
    model, tokenizer = load_tiny()
    llm = LLM(model, tokenizer, **ENGINE)
    return lambda prompts, max_tokens, **kw: llm.generate(prompts, SamplingParams(max_tokens=max_tokens, **kw),
                                                          use_tqdm=False)


def client(server, cls=None):
    return (cls or openai.OpenAI)(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def metrics(server) -> dict:
    """``/metrics`` as ``{sample name with labels: value}`` (labels other than model_name kept)."""
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(server, timeout=10.0) -> dict:
    """Poll ``/metrics`` until no request runs or waits and no KV block is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["fleetlab:num_requests_running"] == 0 and m["fleetlab:num_requests_waiting"] == 0
                and m["fleetlab:kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@contextlib.contextmanager
def slow_steps(engine, seconds=0.01):
    """Make every engine step last at least ``seconds``, so a 100-token request surely outlives a
    client that hangs up after two chunks, however busy the machine is."""
    real = engine.llm.step

    def step(**kw):
        time.sleep(seconds)
        return real(**kw)

    engine.llm.step = step
    try:
        yield
    finally:
        engine.llm.step = real


def test_models_and_health(server):
    models = client(server).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_completion_matches_offline(server, offline):
    prompts = ["12+7=", "count 3 ", "the red cat "]
    want = offline(prompts, 12)
    c = client(server)
    for prompt, w in zip(prompts, want):
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert r.object == "text_completion" and len(r.choices) == 1
        assert r.choices[0].text == w.text
        assert r.choices[0].finish_reason == w.finish_reason
        assert r.usage.prompt_tokens == len(w.prompt_token_ids)
        assert r.usage.completion_tokens == len(w.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # a batch of prompts (strings, then token ids): one choice per prompt, in order
    r = c.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == [w.text for w in want]
    r = c.completions.create(model="tiny", prompt=[w.prompt_token_ids for w in want], max_tokens=12, temperature=0)
    assert [ch.text for ch in r.choices] == [w.text for w in want]
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)


def test_streaming_completion_with_usage(server, offline):
    (want,) = offline(["count 3 "], 6)
    stream = client(server).completions.create(model="tiny", prompt="count 3 ", max_tokens=6, temperature=0,
                                               stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    *text_chunks, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == len(want.token_ids) == 6
    assert last.usage.prompt_tokens == len(want.prompt_token_ids)
    assert all(ch.usage is None for ch in text_chunks)
    assert len(text_chunks) > 3  # streamed step by step, not in one piece
    assert "".join(ch.choices[0].text for ch in text_chunks) == want.text
    assert [ch.choices[0].finish_reason for ch in text_chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])


def test_chat(server, offline):
    (want,) = offline(["45+38="], 8)  # the minimal chat template: one user message is the prompt itself
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "45+38="}], max_tokens=8,
                                  temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text == "83"
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(want.token_ids)
    stream = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "45+38="}],
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "83"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    # max_tokens unset on chat: the answer may run to the model's length (it stops at EOS here)
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "12+7="}], temperature=0)
    assert r.choices[0].message.content == "19"


def test_stop_strings_cut_the_text_and_free_the_request(server, offline):
    (full,) = offline(["count 3 "], 30)
    assert full.text.startswith("4 5 6 7 8")
    c = client(server)
    r = c.completions.create(model="tiny", prompt="count 3 ", max_tokens=30, temperature=0, stop=["6 7", "9"])
    assert r.choices[0].text == "4 5 " and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < len(full.token_ids)
    # streamed: the stop string "6 7" spans steps; no piece of it is ever sent
    chunks = list(c.completions.create(model="tiny", prompt="count 3 ", max_tokens=30, temperature=0,
                                       stop="6 7", stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == "4 5 "
    assert chunks[-1].choices[0].finish_reason == "stop"
    m = wait_idle(server)
    assert m["fleetlab:num_requests_running"] == 0 and m["fleetlab:kv_cache_usage_perc"] == 0


def test_200_concurrent_streams_equal_offline_greedy(server, offline):
    prompts = make_prompts(200, seed=1)
    want = offline(prompts, 10)

    async def one(c, prompt):
        stream = await c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
        text, finish, use = [], None, None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                use = chunk.usage
        return "".join(text), finish, use.completion_tokens

    async def run():
        async with client(server, openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    got = asyncio.run(run())
    assert [g[0] for g in got] == [w.text for w in want]
    assert [g[1] for g in got] == [w.finish_reason for w in want]
    assert [g[2] for g in got] == [len(w.token_ids) for w in want]  # token for token
    assert sum(w.finish_reason == "stop" for w in want) > 50 and sum(w.finish_reason == "length" for w in want) > 20


def test_50_clients_disconnecting_mid_stream_free_everything(server):
    before = metrics(server).get("fleetlab:request_success_total{finished_reason=abort}", 0)

    async def one(c, i):
        stream = await c.completions.create(model="tiny", prompt=f"count {i} ", max_tokens=100, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
        got = 0
        async for chunk in stream:
            got += len(chunk.choices[0].text) > 0
            if got == 2:
                break
        await stream.close()  # hang up mid-stream
        return got

    async def run():
        async with client(server, openai.AsyncOpenAI) as c:
            return await asyncio.gather(*(one(c, i) for i in range(50)))

    with slow_steps(server.engine):
        assert asyncio.run(run()) == [2] * 50
        m = wait_idle(server)
    assert m["fleetlab:num_requests_running"] == 0 and m["fleetlab:num_requests_waiting"] == 0
    assert m["fleetlab:kv_cache_usage_perc"] == 0
    assert m["fleetlab:request_success_total{finished_reason=abort}"] - before == 50
    # and the server still serves
    r = client(server).completions.create(model="tiny", prompt="12+7=", max_tokens=4, temperature=0)
    assert r.choices[0].text == "19"


def test_non_streamed_client_hanging_up_aborts(server):
    before = metrics(server).get("fleetlab:request_success_total{finished_reason=abort}", 0)
    body = {"model": "tiny", "prompt": "count 1 ", "max_tokens": 110, "temperature": 0, "ignore_eos": True}
    # one step per token: 110 steps of >= 10 ms take far longer than the 0.2 s the client waits
    with slow_steps(server.engine), pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.2))
    m = wait_idle(server)
    assert m["fleetlab:kv_cache_usage_perc"] == 0
    assert m["fleetlab:request_success_total{finished_reason=abort}"] - before == 1


BAD_REQUESTS = [
    # (what, endpoint, body or raw bytes, the param the error must name)
    ("malformed JSON", "completions", b'{"model": "tiny", "prompt": ', None),
    ("body not an object", "completions", b"[1, 2]", None),
    ("empty body", "completions", b"", None),
    ("missing prompt", "completions", {"model": "tiny"}, "prompt"),
    ("body not UTF-8", "completions", b'{"model": "tiny", "prompt": "\xff"}', None),
    ("temperature out of range", "completions", {"model": "tiny", "prompt": "1+1=", "temperature": 3}, "temperature"),
    ("max_tokens zero", "completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": 0}, "max_tokens"),
    ("top_p out of range", "completions", {"model": "tiny", "prompt": "1+1=", "top_p": 1.5}, "top_p"),
    ("max_tokens of the wrong type", "completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": "many"},
     "max_tokens"),
    ("prompt too long", "completions", {"model": "tiny", "prompt": "1+" * 100}, "prompt"),
    ("prompt + max_tokens too long", "completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": 500},
     "max_tokens"),
    ("token id outside the vocabulary", "completions", {"model": "tiny", "prompt": [1, 5, 999]}, "prompt"),
    ("empty stop string", "completions", {"model": "tiny", "prompt": "1+1=", "stop": [""]}, "stop"),
    ("min_tokens > max_tokens", "completions", {"model": "tiny", "prompt": "1+1=", "max_tokens": 2, "min_tokens": 5},
     "min_tokens"),
    ("no messages", "chat/completions", {"model": "tiny", "messages": []}, "messages"),
    ("unknown role", "chat/completions", {"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]},
     "messages[0].role"),
]


def test_bad_requests_are_400_naming_the_field_and_the_server_keeps_serving(server):
    assert len({b[0] for b in BAD_REQUESTS}) >= 10
    errors_before = metrics(server).get("fleetlab:request_errors_total{status=400}", 0)
    for what, endpoint, body, param in BAD_REQUESTS:
        url = f"{server.url}/v1/{endpoint}"
        r = (httpx.post(url, content=body, headers={"Content-Type": "application/json"}) if isinstance(body, bytes)
             else httpx.post(url, json=body))
        assert r.status_code == 400, (what, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", what
        assert err["param"] == param, (what, err)
        assert err["message"] and err["code"], what
        assert httpx.get(server.url + "/health").status_code == 200
    assert metrics(server)["fleetlab:request_errors_total{status=400}"] - errors_before == len(BAD_REQUESTS)
    # the official client raises BadRequestError with the body
    with pytest.raises(openai.BadRequestError) as info:
        client(server).completions.create(model="tiny", prompt="1+1=", temperature=-1)
    assert info.value.body["param"] == "temperature"
    r = client(server).completions.create(model="tiny", prompt="12+7=", max_tokens=4, temperature=0)
    assert r.choices[0].text == "19"
    assert wait_idle(server)["fleetlab:kv_cache_usage_perc"] == 0


def test_full_queue_is_refused_at_once_with_503():
    model, tokenizer = load_tiny()
    engine = AsyncLLM(LLM(model, tokenizer, block_size=16, max_num_seqs=2), max_queue_len=1)
    long = {"model": "tiny", "prompt": "count 1 ", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def run(s):
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            held = []
            for _ in range(3):  # max_num_seqs + max_queue_len requests in flight
                resp = await c.send(c.build_request("POST", "/v1/completions", json=long), stream=True)
                assert resp.status_code == 200
                held.append(resp)
            refused = await c.post("/v1/completions", json={**long, "stream": False})
            # At once: the three it would have waited for still run (100 steps of >= 50 ms each),
            # a fact about the order of events rather than a wall-clock bound a loaded machine can break.
            still_running = engine.num_unfinished_requests
            with pytest.raises(openai.InternalServerError):  # the official client's view of a 503
                await client(s, openai.AsyncOpenAI).completions.create(model="tiny", prompt="1+1=", max_tokens=2)
            for resp in held:
                await resp.aclose()
            return refused, still_running

    with ServerThread(engine, "tiny") as s, slow_steps(engine, 0.05):
        refused, still_running = asyncio.run(run(s))
        assert refused.status_code == 503 and still_running == 3
        assert refused.json()["error"]["code"] == "queue_full" and refused.headers["retry-after"]
        assert wait_idle(s)["fleetlab:kv_cache_usage_perc"] == 0
        r = client(s).completions.create(model="tiny", prompt="12+7=", max_tokens=4, temperature=0)
        assert r.choices[0].text == "19"  # room again once the streams were closed


def test_metrics_names_and_histograms(server):
    prompt = "the red cat sat on the old mat by the big door "  # 48 tokens: 2 full blocks of 16, and more
    c = client(server)
    snapshots = [metrics(server)]
    for _ in range(2):  # the second one finds the first one's full blocks in the prefix cache
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
        snapshots.append(metrics(server))
    n = r.usage.prompt_tokens
    before, first, m = snapshots
    delta = {k: v - before.get(k, 0) for k, v in m.items()}
    for name in ("fleetlab:num_requests_running", "fleetlab:num_requests_waiting", "fleetlab:kv_cache_usage_perc",
                 "fleetlab:prefix_cache_hit_rate", "fleetlab:num_preemptions_total", "fleetlab:engine_steps_total"):
        assert name in m, name
    assert not [k for k in m if "_created" in k]
    # vLLM's meanings: prefix-cache counters in tokens (a hit never covers the whole prompt)
    assert delta["fleetlab:prefix_cache_queries_total"] == 2 * n
    second_hits = m["fleetlab:prefix_cache_hits_total"] - first["fleetlab:prefix_cache_hits_total"]
    assert second_hits == 16 * ((n - 1) // 16) >= 32
    # per request: one inter-token latency per gap (8 tokens, one a step: 7 gaps each), one of the rest
    assert delta["fleetlab:inter_token_latency_seconds_count"] == 2 * 7
    for hist in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_inference_time", "request_time_per_output_token"):
        assert delta[f"fleetlab:{hist}_seconds_count"] == 2, hist
        assert delta[f"fleetlab:{hist}_seconds_sum"] >= 0, hist
    assert delta["fleetlab:request_decode_time_seconds_sum"] == pytest.approx(
        delta["fleetlab:inter_token_latency_seconds_sum"])  # the decode is the sum of the gaps
    assert delta["fleetlab:request_inference_time_seconds_sum"] == pytest.approx(
        delta["fleetlab:request_prefill_time_seconds_sum"] + delta["fleetlab:request_decode_time_seconds_sum"])
    assert (delta["fleetlab:e2e_request_latency_seconds_sum"] >= delta["fleetlab:request_queue_time_seconds_sum"]
            + delta["fleetlab:request_inference_time_seconds_sum"])
    assert delta["fleetlab:request_prompt_tokens_sum"] == 2 * n == delta["fleetlab:prompt_tokens_total"]
    assert delta["fleetlab:request_generation_tokens_sum"] == 16 == delta["fleetlab:generation_tokens_total"]
    assert m["fleetlab:cache_config_info{block_size=16,bytes_per_block=32768,enable_prefix_caching=True,num_blocks=128,"
             "prefix_cache=hash}"] == 1  # bytes_per_block: K+V x 4 layers x 16 tokens x 2 heads x 32 dims x 4 bytes
    text = httpx.get(server.url + "/metrics").text
    assert 'fleetlab:num_requests_running{model_name="tiny"}' in text


def test_inter_token_latency_is_observed_while_the_stream_runs(server):
    """As vLLM does, each step's gaps reach /metrics as its tokens are sent, not when the request ends."""
    before = metrics(server)
    stream = client(server).completions.create(model="tiny", prompt="count 1 ", max_tokens=100, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(6):
        next(chunks)
    during = metrics(server)
    stream.close()
    grown = {k: during[k] - before.get(k, 0) for k in ("fleetlab:inter_token_latency_seconds_count",
                                                       "fleetlab:e2e_request_latency_seconds_count")}
    assert grown["fleetlab:inter_token_latency_seconds_count"] >= 3  # six chunks sent: three gaps at least
    assert grown["fleetlab:e2e_request_latency_seconds_count"] == 0  # and the request still running


def test_routes_status_codes_and_body_parsing(server):
    c = client(server)
    errors = metrics(server)
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as info:  # OpenAI's and vLLM's status for an unknown model
        c.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as info:
        c.completions.create(model="gpt-9", prompt="1+1=", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""
    # curl -d sends application/x-www-form-urlencoded: the body is JSON all the same
    body = json.dumps({"model": "tiny", "prompt": "12+7=", "max_tokens": 4, "temperature": 0})
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "19"
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": "\xff"}')
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_encoding"
    # an unknown path is nobody's request to the model: not counted as its error
    nope = httpx.get(server.url + "/nope")
    assert nope.status_code == 404 and nope.json()["error"]["type"] == "not_found_error"
    m = metrics(server)
    assert m["fleetlab:request_errors_total{status=404}"] - errors.get("fleetlab:request_errors_total{status=404}", 0) \
        == 2  # the two unknown models


REFUSED = [
    # (endpoint, fields sent, the field the 400 names, words its message holds): not applied -> refused
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs", "echo=true and logprobs"),
    ("completions", {"use_beam_search": True}, "use_beam_search", "sampler"),
    ("completions", {"length_penalty": 0.5}, "length_penalty", "sampler"),
    ("completions", {"allowed_token_ids": [5]}, "allowed_token_ids", "sampler"),
    ("completions", {"suffix": "x"}, "suffix", "fill in the middle"),
    ("completions", {"bad_words": ["x"]}, "bad_words", "sampler"),
    ("chat/completions", {"echo": True}, "echo", "completions field"),
    ("completions", {"min_p": 0.1}, "min_p", "sampler"),
    ("completions", {"guided_regex": "[0-9]+"}, "guided_regex", "structured outputs"),
    ("completions", {"frobnicate": 1}, "frobnicate", "unrecognized"),
    ("chat/completions", {"guided_choice": ["yes", "no"]}, "guided_choice", "structured outputs"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format", "structured outputs"),
    ("chat/completions", {"functions": [{"name": "f", "parameters": {}}]}, "functions", "function calling"),
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool"),
    ("chat/completions", {"modalities": ["text", "audio"]}, "modalities", "text only"),
    ("chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted outputs"),
    ("chat/completions", {"chat_template": "{{ messages }}"}, "chat_template", "chat template"),
    ("chat/completions", {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "one last chunk"),
]


@pytest.mark.parametrize("endpoint, fields, param, words", REFUSED, ids=[r[2] for r in REFUSED])
def test_fields_not_applied_are_refused_naming_the_field(server, endpoint, fields, param, words):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "completions":
            c.completions.create(model="tiny", prompt="1+1=", max_tokens=2, extra_body=fields)
        else:
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}], extra_body=fields)
    err = info.value.body
    assert err["param"] == param and err["code"] == "unsupported" and words in err["message"], err


def test_no_op_values_are_accepted_and_text_parts_joined(server, offline):
    c = client(server)
    (want,) = offline(["45+38="], 8)
    no_ops = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {},
              "logprobs": False, "top_logprobs": 0, "modalities": ["text"], "tools": [], "tool_choice": "none",
              "response_format": {"type": "text"}, "skip_special_tokens": True, "top_k": -1}
    parts = [{"type": "text", "text": "45+"}, {"type": "text", "text": "38="}]
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=8,
                                  temperature=0, extra_body=no_ops)
    assert r.choices[0].message.content == want.text == "83"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [parts[0], image]}])
    assert "only text parts are supported; got 'image_url'" in info.value.body["message"]
    assert info.value.body["param"] == "messages[0].content[1]"
    with pytest.raises(openai.BadRequestError) as info:  # the template would drop a participant's name
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1=", "name": "ann"}])
    assert info.value.body["param"] == "messages[0].name"


def test_api_key(server):
    with ServerThread(server.engine, "tiny", shutdown_engine=False, api_key="sekret") as s:
        for key in ("none", "sekret2"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=s.base_url, api_key=key, max_retries=0).models.list()
        r = httpx.post(s.url + "/v1/completions", json={"model": "tiny", "prompt": "1+1="})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        keyed = openai.OpenAI(base_url=s.base_url, api_key="sekret", max_retries=0)
        assert keyed.completions.create(model="tiny", prompt="12+7=", max_tokens=4, temperature=0).choices[0].text \
            == "19"
        assert httpx.get(s.url + "/health").status_code == 200 and httpx.get(s.url + "/metrics").status_code == 200


def test_a_list_of_prompts_is_queued_in_one_engine_turn(server, offline):
    prompts = make_prompts(128, seed=3)
    want = offline(prompts, 1)
    steps = metrics(server)["fleetlab:engine_steps_total"]
    r = client(server).completions.create(model="tiny", prompt=prompts, max_tokens=1, temperature=0)
    steps = metrics(server)["fleetlab:engine_steps_total"] - steps
    assert [ch.text for ch in r.choices] == [w.text for w in want]
    # A step takes at most 32 requests (max_num_seqs) and 256 tokens (max_num_batched_tokens); one token
    # each, every request ends in the step that prefills it. Queued one prompt per engine turn, the
    # 128 prompts took a step each (129 steps).
    budget = math.ceil(r.usage.prompt_tokens / 256) + math.ceil(128 / 32) + 1
    assert steps <= budget < 128, (steps, budget)


def test_shutdown_timeout_lets_short_requests_finish_and_ends_the_rest(server):
    # 110 steps of >= 50 ms (5.5 s at the least, however fast the machine) can never fit the 3 s drain;
    # 4 of them (0.2 s unloaded) fit it with room for a machine many times slower.
    s = ServerThread(server.engine, "tiny", shutdown_engine=False, shutdown_timeout=3.0)

    async def run():
        async with openai.AsyncOpenAI(base_url=s.base_url, api_key="none", max_retries=0) as c:
            opened = [await c.completions.create(model="tiny", prompt=f"count {i} ", max_tokens=n, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
                      for i, n in ((1, 4), (2, 110))]
            t0 = time.perf_counter()
            stopping = asyncio.get_running_loop().run_in_executor(None, s.stop)
            short = [chunk async for chunk in opened[0]]  # 4 steps of >= 50 ms: done within the drain
            with pytest.raises(openai.APIError, match="shutting down"):  # 110 steps: stopped after 3 s
                async for _ in opened[1]:
                    pass
            await stopping
            return short, time.perf_counter() - t0

    with slow_steps(server.engine, 0.05):
        short, waited = asyncio.run(run())
    assert "".join(ch.choices[0].text for ch in short) and short[-1].choices[0].finish_reason == "length"
    assert waited >= 3.0
    assert wait_idle(server)["fleetlab:kv_cache_usage_perc"] == 0
    r = client(server).completions.create(model="tiny", prompt="12+7=", max_tokens=4, temperature=0)
    assert r.choices[0].text == "19"


def test_speculative_decoding_streams_the_same_text(offline):
    from fleetlab.serving.cli import resolve_draft

    model, tokenizer = load_tiny()
    spec = resolve_draft({"method": "draft", "num_speculative_tokens": 4, "model": "tiny"})
    engine = AsyncLLM(LLM(model, tokenizer, **ENGINE, speculative_config=spec))
    prompts = ["count 12", "the old man", "45+38=", "count 57"]
    want = [o.text for o in offline(prompts, 16)]
    with ServerThread(engine, "tiny") as s:
        c = client(s)
        got = []
        for prompt in prompts:
            chunks = list(c.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True))
            got.append("".join(ch.choices[0].text for ch in chunks if ch.choices))
        assert got == want
        m = metrics(s)
        assert m["fleetlab:num_requests_running"] == 0
        # vLLM's speculative-decoding counters, equal to the engine's own counts
        spec = engine.llm.spec_stats
        assert m["fleetlab:spec_decode_num_drafts_total"] == spec.num_drafts > 0
        drafted = m["fleetlab:spec_decode_num_draft_tokens_total"]
        assert drafted == spec.num_draft_tokens == sum(spec.drafted_per_position)
        assert m["fleetlab:spec_decode_num_accepted_tokens_total"] == spec.num_accepted_tokens > 0
        per_pos = [m[f"fleetlab:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(4)]
        assert per_pos == spec.accepted_per_position and sum(per_pos) == spec.num_accepted_tokens
        assert per_pos == sorted(per_pos, reverse=True)  # a draft is accepted only after the ones before it
