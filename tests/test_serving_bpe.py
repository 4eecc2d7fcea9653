"""Real text through the OpenAI-compatible server, over real HTTP: a tiny random Llama over the tests'
small byte-level BPE (its outputs split characters over tokens all the time), and the shipped code
model (its 4,096-token byte-level BPE) for structured outputs.

- streamed deltas (completions and chat) join to the whole response's text, which is the offline
  engine's, which is the full decode of the full-forward greedy tokens; no delta holds a U+FFFD
  that the text does not hold there;
- a stop string that ends inside a token cuts the text exactly there;
- structured outputs over the code model's vocabulary (llguidance with the tokenizer's byte tokens):
  a JSON schema offline, in ``response_format``, and the ``openai`` client's ``parse`` return valid JSON;
- logprobs' token strings are the tokens' own text;
- odd input (a lone surrogate in the prompt or a message, an empty prompt, ids outside the
  vocabulary) is a 400 naming the field.
"""

import json
import re

import httpx
import pytest
from bpe_helpers import bpe_llama, expected_text, stops_inside_tokens

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

from fleetlab import LLM, SamplingParams
from fleetlab.models import load_code
from fleetlab.patching.parity import reference_greedy
from fleetlab.serving import AsyncLLM, ServerThread
from fleetlab.serving.chat_template import encode_text

PROMPT = 'def naïve(x):\n    return "日本'
MAX_TOKENS = 24
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


class Point(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # else a small model may add properties for ever
    x: int = pydantic.Field(ge=-99, le=99)
    label: str = pydantic.Field(max_length=6)


@pytest.fixture(scope="module")
def served():
    model, tok = bpe_llama(seed=3)
    ids = encode_text(tok, PROMPT)
    ref = reference_greedy(model, [ids], MAX_TOKENS)[0][0]
    with ServerThread(AsyncLLM(LLM(model, tok, block_size=16, max_num_seqs=8)), "code") as s:
        yield s, tok, ids, ref


@pytest.fixture(scope="module")
def code_server():
    model, tok = load_code()
    with ServerThread(AsyncLLM(LLM(model, tok, block_size=16, max_num_seqs=8)), "code") as s:
        yield s, tok


def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def greedy(**extra):
    return dict(max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True, **extra})


def test_streamed_deltas_join_to_the_text_of_the_full_forward_tokens(served):
    server, tok, ids, ref = served
    text = tok.decode(ref, skip_special_tokens=True)
    assert any("\ufffd" in tok.decode([t]) for t in ref)  # the greedy tokens split characters
    c = client(server)
    whole = c.completions.create(model="code", prompt=PROMPT, **greedy()).choices[0].text
    chunks = [ch.choices[0].text for ch in c.completions.create(model="code", prompt=PROMPT, stream=True, **greedy())]
    assert whole == "".join(chunks) == text
    sent = 0
    for chunk in chunks:  # a U+FFFD goes out only where the text holds one for good
        assert text[sent:sent + len(chunk)] == chunk
        sent += len(chunk)
    chat = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="code", messages=[{"role": "user", "content": PROMPT}], stream=True, **greedy()) if ch.choices]
    assert "".join(chat) == c.chat.completions.create(
        model="code", messages=[{"role": "user", "content": PROMPT}], **greedy()).choices[0].message.content


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ending_inside_a_token_cuts_the_text_there(served, include):
    server, tok, ids, ref = served
    stop = stops_inside_tokens(tok, ref)[0]
    _, want, reason = expected_text(tok, ref, [stop], include)
    assert reason == stop
    for stream in (False, True):
        r = client(server).completions.create(model="code", prompt=PROMPT, stream=stream, stop=[stop],
                                              **greedy(include_stop_str_in_output=include))
        got = "".join(ch.choices[0].text for ch in r) if stream else r.choices[0].text
        assert got == want


def test_a_json_schema_on_the_code_model_is_valid_json_offline_and_served(code_server):
    server, tok = code_server
    schema = Point.model_json_schema()
    model, _ = load_code()
    with LLM(model, tok, block_size=16) as offline:
        outs = offline.generate([PROMPT, "# a point\n"], SamplingParams(
            max_tokens=48, temperature=0, structured_outputs={"json": schema, "disable_any_whitespace": True}),
            use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        Point.model_validate(json.loads(out.text))
    c = client(server)
    r = c.chat.completions.create(model="code", messages=[{"role": "user", "content": PROMPT}], max_tokens=48,
                                  temperature=0, extra_body=COMPACT, response_format={
                                      "type": "json_schema", "json_schema": {"name": "point", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    for seed in range(3):
        parsed = c.chat.completions.parse(model="code", messages=[{"role": "user", "content": "a point"}],
                                          response_format=Point, max_tokens=48, temperature=1.0, seed=seed,
                                          extra_body=COMPACT)
        assert isinstance(parsed.choices[0].message.parsed, Point), parsed.choices[0].message.content


def test_logprobs_token_strings_are_the_tokens_own_text_and_bytes(served):
    """Text as vLLM shows it (a piece of a character: U+FFFD); chat ``bytes`` the token's own (OpenAI's),
    checked against the byte-level alphabet's own table."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    server, tok, ids, ref = served
    r = client(server).completions.create(model="code", prompt=PROMPT, logprobs=2, **greedy())
    assert r.choices[0].logprobs.tokens == [tok.decode([t]) for t in ref]
    r = client(server).chat.completions.create(model="code", messages=[{"role": "user", "content": PROMPT}],
                                               logprobs=True, top_logprobs=2, **greedy())
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [tok.decode([t]) for t in ref]
    assert [e.bytes for e in content] == [[byte_of[ch] for ch in tok.convert_ids_to_tokens(t)] if t > 2
                                          else list(tok.decode([t], skip_special_tokens=False).encode()) for t in ref]
    assert any(e.token == "\ufffd" and len(e.bytes) < 3 for e in content)  # a piece of a character, its bytes


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a\ud800b"}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [5, 4096]}, "prompt"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages[0].content[0].text"),
])
def test_odd_input_is_a_400_naming_the_field(served, body, param):
    server = served[0]
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    raw = json.dumps({"model": "code", "max_tokens": 4, **body})  # json writes a lone surrogate as its escape
    r = httpx.post(server.url + route, content=raw, timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_odd_input_offline_names_the_request_and_the_field():
    model, tok = load_code()
    with LLM(model, tok, block_size=16) as llm:
        for kwargs, words in [
                (dict(prompt="a\ud800b"), "prompt is not valid UTF-8 text: a lone surrogate \\ud800"),
                (dict(prompt_token_ids=[]), "prompt is empty"),
                (dict(prompt_token_ids=[3, 4096]), "prompt_token_ids [4096] outside the vocabulary [0, 4096)")]:
            with pytest.raises(ValueError, match=re.escape(f"request 'odd': {words}")):
                llm.add_request(request_id="odd", **kwargs)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_n_sampled_choices_stream_the_text_they_return_cut_at_their_stop_strings(served, route):
    server, tok, _, _ = served
    c, stops = client(server), [" ", "o", "é"]
    kwargs = dict(model="code", n=3, seed=11, temperature=1.0, max_tokens=MAX_TOKENS, stop=stops,
                  extra_body={"ignore_eos": True})
    if route == "chat":
        call, kwargs["messages"] = c.chat.completions.create, [{"role": "user", "content": PROMPT}]
    else:
        call, kwargs["prompt"] = c.completions.create, PROMPT

    def text(choice):
        return choice.message.content if route == "chat" else choice.text

    whole = {ch.index: ch for ch in call(**kwargs).choices}
    streamed = {i: "" for i in whole}
    for chunk in call(stream=True, **kwargs):
        for ch in chunk.choices:
            streamed[ch.index] += (ch.delta.content or "") if route == "chat" else ch.text
    assert streamed == {i: text(ch) for i, ch in whole.items()}
    for ch in whole.values():
        assert not any(s in text(ch) for s in stops)
        assert (ch.finish_reason, getattr(ch, "stop_reason", None) in stops) in (("stop", True), ("length", False))
    assert any(ch.finish_reason == "stop" for ch in whole.values())
