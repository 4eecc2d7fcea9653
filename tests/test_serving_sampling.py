"""The server's sampling parameters (issue 25), driven by the official ``openai`` client: ``n`` and
``best_of``, ``logprobs`` / ``top_logprobs`` and ``echo``, the penalties and ``logit_bias``. The oracle
is the same weights run offline through ``LLM.generate`` (whose logprobs
``tests/test_sampling_parity.py`` holds to the model's own full forward)."""

import math

import pytest

openai = pytest.importorskip("openai")

from fleetlab import LLM, SamplingParams
from fleetlab.models import load_tiny
from fleetlab.serving import AsyncLLM, ServerThread

ENGINE = {"block_size": 16, "max_num_seqs": 32, "max_num_batched_tokens": 256}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


@pytest.fixture(scope="module")
def server(tiny):
    with ServerThread(AsyncLLM(LLM(*tiny, **ENGINE)), "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny):
    llm = LLM(*tiny, **ENGINE)
    return lambda prompts, **kw: llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=60)


def test_n_choices_are_the_engines_n_sequences_streamed_with_their_index(client, offline):
    want = offline(["count 3 ", "12+7="], max_tokens=8, temperature=1.0, seed=5, n=3)
    r = client.completions.create(model="tiny", prompt=["count 3 ", "12+7="], max_tokens=8, temperature=1.0, seed=5,
                                  n=3)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert len({c.text for c in r.choices[:3]}) > 1  # the seeds differ per choice
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want[::3])  # each prompt once
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    texts = {}
    for chunk in client.completions.create(model="tiny", prompt=["count 3 ", "12+7="], max_tokens=8, temperature=1.0,
                                           seed=5, n=3, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(6)] == [w.text for w in want]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count 3 "}],
                                          max_tokens=8, temperature=1.0, seed=5, n=3)
    assert [c.message.content for c in chat.choices] == [w.text for w in want[:3]]


def test_best_of_returns_the_best_and_is_not_streamed(client, offline):
    every = offline(["the red cat "], max_tokens=6, temperature=1.0, seed=9, n=4, logprobs=0)
    best = sorted(every, key=lambda o: -o.cumulative_logprob)[:2]
    r = client.completions.create(model="tiny", prompt="the red cat ", max_tokens=6, temperature=1.0, seed=9, n=2,
                                  best_of=4)
    assert [c.text for c in r.choices] == [o.text for o in best] and [c.index for c in r.choices] == [0, 1]
    assert all(c.logprobs is None for c in r.choices)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=1.0, n=1, best_of=2, stream=True)
    assert info.value.body["param"] == "best_of" and "cannot be streamed" in info.value.body["message"]


def test_completion_logprobs_and_echo(client, offline):
    (want,) = offline(["count 3 "], max_tokens=4, logprobs=3, prompt_logprobs=3)
    r = client.completions.create(model="tiny", prompt="count 3 ", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == want.text
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    for top, x, token in zip(lp.top_logprobs, want.logprobs, lp.tokens):
        assert token in top and len(top) in (3, 4)  # the top 3, and the chosen token when not among them
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([v for _, v in x.top], abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    echo = client.completions.create(model="tiny", prompt="count 3 ", max_tokens=4, temperature=0, logprobs=3,
                                     echo=True)
    e = echo.choices[0]
    assert e.text == "count 3 " + want.text
    assert len(e.logprobs.tokens) == len(want.prompt_token_ids) + len(want.token_ids)
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    prompt_lps = [x.logprob for x in want.prompt_logprobs[1:]]
    assert e.logprobs.token_logprobs[1:len(want.prompt_token_ids)] == pytest.approx(prompt_lps, abs=1e-4)
    chunks = list(client.completions.create(model="tiny", prompt="count 3 ", max_tokens=4, temperature=0, logprobs=3,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == e.text
    streamed = [t for c in chunks for t in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(e.logprobs.token_logprobs[1:], abs=1e-4)
    assert [t for c in chunks for t in c.choices[0].logprobs.text_offset] == e.logprobs.text_offset


def test_chat_logprobs_and_top_logprobs(client, offline, tiny):
    (want,) = offline(["45+38="], max_tokens=8, logprobs=2)
    messages = [{"role": "user", "content": "45+38="}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tiny[1].decode([t], skip_special_tokens=False) for t in want.token_ids]
    assert "".join(c.token for c in content) == want.text + "<eos>"  # the EOS that stopped it is shown
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and bytes(c.bytes).decode() == c.token for c in content)
    assert all(math.isclose(c.top_logprobs[0].logprob, x.top[0][1], abs_tol=1e-4)
               for c, x in zip(content, want.logprobs))
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in plain.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [x.logprob for ch in chunks for x in (ch.choices[0].logprobs.content if ch.choices[0].logprobs else [])]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-4)


def test_penalties_and_logit_bias_are_applied(client, offline):
    kw = dict(max_tokens=10, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3)
    (want,) = offline(["count 3 "], **kw)
    (plain,) = offline(["count 3 "], max_tokens=10)
    r = client.completions.create(model="tiny", prompt="count 3 ", temperature=0, max_tokens=10,
                                  presence_penalty=0.8, frequency_penalty=0.6, extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].text == want.text != plain.text
    first = plain.token_ids[0]
    (biased,) = offline(["count 3 "], max_tokens=4, logit_bias={first: -100.0, 7: 5.0})
    r = client.completions.create(model="tiny", prompt="count 3 ", temperature=0, max_tokens=4,
                                  logit_bias={str(first): -100, "7": 5})
    assert r.choices[0].text == biased.text and biased.token_ids[0] != first


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"n": 0}, "n"), ("completions", {"n": 2, "best_of": 1}, "best_of"),
    ("completions", {"logprobs": 21}, "logprobs"), ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"echo": True}, "echo"),
])
def test_bad_values_are_400_naming_the_field(client, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "completions":
            client.completions.create(model="tiny", prompt="1+1=", max_tokens=2, extra_body=fields)
        else:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1+1="}],
                                           max_tokens=2, extra_body=fields)
    assert info.value.body["param"] == param, info.value.body
