"""Stop strings offline (``SamplingParams.stop``), checked against the unpatched model's own greedy text.

The oracle: the full-forward greedy tokens of each prompt, decoded prefix by prefix; the first
prefix whose text holds a stop string is where the request ends, its text cut at the earliest
stop string in it (after it with ``include_stop_str_in_output``). The shipped tiny model writes
English-like text with a character tokenizer whose special tokens decode to nothing.
"""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetlab import LLM, SamplingParams
from fleetlab.models import load_tiny
from fleetlab.output.stop import find_stop_string
from fleetlab.patching.parity import reference_greedy

PROMPTS = ["the red ", "the old ", "count 4 ", "12+7="]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tiny_text():
    model, tok = load_tiny()
    prompts = [tok.encode(p) for p in PROMPTS]
    refs, _ = reference_greedy(model, prompts, MAX_TOKENS)
    return model, tok, prompts, refs


def expected(tok, ref: list[int], stops: list[str], include: bool):
    """``(token_ids, text, stop_reason)`` the oracle gives for one request."""
    for k in range(1, len(ref) + 1):
        text = tok.decode(ref[:k], skip_special_tokens=True)
        found = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
        if found:
            at, _, s = min(found)
            return ref[:k], text[: at + len(s) if include else at], s
    return ref, tok.decode(ref, skip_special_tokens=True), None


def stop_lists(texts):
    """Per request: one or two stop strings cut from its reference text, or one it never writes."""
    def of(text):
        piece = st.tuples(st.integers(0, len(text) - 1), st.integers(1, 4)).map(lambda p: text[p[0]: p[0] + p[1]])
        return st.lists(st.one_of(piece, st.just("zzz")), min_size=1, max_size=2)
    return st.tuples(*[of(t) for t in texts])


def run_and_check(llm, tok, prompts, refs, stops, include):
    sps = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=s, include_stop_str_in_output=include)
           for s in stops]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sps, use_tqdm=False)
    for out, ref, s in zip(outs, refs, stops):
        ids, text, reason = expected(tok, ref, s, include)
        assert (out.token_ids, out.text, out.stop_reason) == (ids, text, reason), s
        assert out.finish_reason == ("stop" if reason is not None else "length")
    assert llm.pool.num_free_blocks == llm.pool.num_blocks  # a request a stop string ended let go of its blocks


@pytest.mark.parametrize("speculative", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_stop_strings_cut_the_full_forward_greedy_text(tiny_text, speculative):
    """With speculation a verify step gains several tokens: those past the stop are dropped."""
    model, tok, prompts, refs = tiny_text
    texts = [tok.decode(r, skip_special_tokens=True) for r in refs]
    llm = LLM(model, tok, block_size=4, speculative_config=speculative)

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(stops=stop_lists(texts), include=st.booleans())
    def check(stops, include):
        run_and_check(llm, tok, prompts, refs, [list(s) for s in stops], include)

    with llm:
        check()


def test_a_stream_stops_at_the_string_and_the_others_go_on(tiny_text):
    model, tok, prompts, refs = tiny_text
    text = tok.decode(refs[0], skip_special_tokens=True)
    with LLM(model, tok, block_size=4) as llm:
        stopped = llm.add_request(prompt_token_ids=prompts[0], sampling_params=SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, stop=[text[5:8]]))
        other = llm.add_request(prompt_token_ids=prompts[1], sampling_params=SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True))
        streamed, final = {stopped: [], other: []}, {}
        while llm.has_unfinished_requests():
            for out in llm.step():
                streamed[out.request_id] += out.new_token_ids
                assert out.token_ids == streamed[out.request_id]
                if out.finished:
                    final[out.request_id] = out
        assert final[stopped].text == text[:5] and final[stopped].stop_reason == text[5:8]
        assert final[stopped].metrics["finish_time"] is not None
        assert final[other].token_ids == refs[1] and final[other].finish_reason == "length"
        assert stopped not in llm.scheduler.requests and llm.pool.num_free_blocks == llm.pool.num_blocks


def test_a_stop_token_is_the_stop_reason_and_eos_is_none(tiny_text):
    model, tok, prompts, refs = tiny_text
    token = refs[0][3]
    with LLM(model, tok, block_size=4) as llm:
        by_token, by_eos = llm.generate(prompt_token_ids=prompts[:1] * 2, sampling_params=[
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[token]),
            SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=[tok.eos_token_id])], use_tqdm=False)
    assert by_token.token_ids == refs[0][: refs[0].index(token) + 1] and by_token.stop_reason == token
    if by_eos.finish_reason == "stop":  # the model wrote EOS: no stop reason, though it is a stop id too
        assert by_eos.token_ids[-1] == tok.eos_token_id and by_eos.stop_reason is None


@pytest.mark.parametrize("fields, error, words", [
    (dict(stop=[""]), ValueError, "sampling field stop=['']: a stop string cannot be empty"),
    (dict(stop=["a", 3]), TypeError, "sampling field stop=['a', 3] must be a string or a list of strings"),
    (dict(stop="a", include_stop_str_in_output="yes"), TypeError,
     "sampling field include_stop_str_in_output='yes' must be True"),
])
def test_bad_stop_fields_are_refused_naming_the_request(tiny_text, fields, error, words):
    model, tok, prompts, _ = tiny_text
    with LLM(model, tok, block_size=4) as llm:
        with pytest.raises(error, match=re.escape(f"request 'r-1': {words}")):
            llm.add_request(prompt_token_ids=prompts[0], request_id="r-1", sampling_params=SamplingParams(**fields))
        assert not llm.has_unfinished_requests()
    with LLM(model, None, block_size=4) as llm, pytest.raises(ValueError, match="'r-2': sampling field stop: stop "
                                                                                  "strings need a tokenizer"):
        llm.add_request(prompt_token_ids=prompts[0], request_id="r-2", sampling_params=SamplingParams(stop="a"))


@given(text=st.text("ab.", max_size=30), cuts=st.lists(st.integers(0, 30), max_size=6),
       stops=st.lists(st.text("ab.", min_size=1, max_size=3), min_size=1, max_size=3), include=st.booleans())
def test_searching_the_text_as_it_grows_finds_what_a_full_search_finds(text, cuts, stops, include):
    """What a server streaming deltas gets from ``find_stop_string``: the first stop string to
    appear, cut where a search of the whole text so far cuts it."""
    ends = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    seen, got = 0, None
    for end in ends:
        got = find_stop_string(text[:end], stops, end - seen, include)
        seen = end
        if got is not None:
            break
    first = next((end for end in range(len(text) + 1) if any(s in text[:end] for s in stops)), None)
    if first is None:
        assert got is None
        return
    assert got is not None and end >= first
    at, _, s = min((text[:end].find(x), i, x) for i, x in enumerate(stops) if x in text[:end])
    assert got == (s, at + len(s) if include else at)
