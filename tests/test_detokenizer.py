"""Incremental detokenization and stop strings over a byte-level BPE, checked against decoding the
full token list (property tests over random token sequences, many of them splitting characters).

The promises (``fleetlab/output/detokenizer.py``, ``fleetlab/output/text.py``):

- the deltas joined are, after every step, the full decode of the ids so far less a held-back tail
  that ends in half a character (U+FFFD); nothing sent is ever taken back, so no delta holds a
  U+FFFD that a later token completes; after the flush, exactly the full decode;
- a stop string ends the text at the first token after which the text (whole characters) holds
  it, cut exactly at the string, also when it ends inside a token; with ``min_tokens``, only a
  string that ends in text added by token ``min_tokens`` or later counts.
"""

import pytest
from bpe_helpers import bpe_tokenizer, encode, expected_text, partial_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetlab.models.tokenizer import CharTokenizer
from fleetlab.output.detokenizer import (
    FastIncrementalDetokenizer,
    SlowIncrementalDetokenizer,
    incremental_detokenizer,
)
from fleetlab.output.text import TextStream

FFFD = "\ufffd"
TOK = bpe_tokenizer()
PARTIAL = partial_tokens(TOK)


def decode(ids) -> str:
    return TOK.decode(list(ids), skip_special_tokens=True)


def oracle(ids, stops, include, min_tokens):
    return expected_text(TOK, ids, stops, include, min_tokens)


token_ids = st.lists(st.one_of(st.sampled_from(PARTIAL), st.integers(0, len(TOK) - 1)), max_size=40)
splits = st.lists(st.integers(1, 5), min_size=1, max_size=40)


def pieces(ids, sizes):
    """``ids`` cut into steps of the given sizes (the last step takes the rest)."""
    out, i = [], 0
    for n in sizes:
        if i >= len(ids):
            break
        out.append(ids[i:i + n])
        i += n
    return out + ([ids[i:]] if i < len(ids) else [])


@pytest.mark.parametrize("cls", [FastIncrementalDetokenizer, SlowIncrementalDetokenizer])
@settings(max_examples=150, deadline=None)
@given(prompt=token_ids, ids=token_ids, sizes=splits)
def test_deltas_join_to_the_full_decode_at_every_step(cls, prompt, ids, sizes):
    detok, sent, seen = cls(TOK, prompt), "", []
    for step in pieces(ids, sizes):
        sent += detok.push(step)
        seen += step
        full = decode(seen)
        assert full.startswith(sent)
        held = full[len(sent):]
        assert held == "" or held.endswith(FFFD), (sent, held)  # only half a character is held back
    sent += detok.flush()
    assert sent == decode(ids) == detok.text  # and so every delta sent stays: none is taken back


def test_a_character_split_over_tokens_is_sent_whole():
    ids = encode(TOK, "x ✓ 本日 🙂 é")
    single = [i for i in ids if i in PARTIAL]
    assert single, "the fixture's merges must split some character"
    detok = incremental_detokenizer(TOK, encode(TOK, "say:"))
    assert isinstance(detok, FastIncrementalDetokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == "x ✓ 本日 🙂 é" and not any(FFFD in d for d in deltas)
    assert any(d == "" for d in deltas)  # a token that ends inside a character adds nothing yet


def test_the_first_output_token_decodes_in_context_but_takes_nothing_from_the_prompt():
    cut = encode(TOK, "日")  # three bytes: ends the prompt inside a character with its first token alone
    prompt = encode(TOK, "héllo ") + cut[:1]
    detok = incremental_detokenizer(TOK, prompt)
    out = detok.push(cut[1:]) + detok.flush()
    assert out == decode(cut[1:])  # the output's own bytes, not the prompt's character completed


def test_the_char_tokenizer_takes_the_offsets_path_and_skips_specials():
    tok = CharTokenizer()
    detok = incremental_detokenizer(tok, tok.encode("12+7="))
    assert isinstance(detok, SlowIncrementalDetokenizer)
    assert [detok.push([i]) for i in tok.encode("19", add_bos=False) + [tok.eos_token_id]] == ["1", "9", ""]


# --- stop strings -----------------------------------------------------------------------------


@st.composite
def stop_case(draw):
    ids = draw(st.lists(st.one_of(st.sampled_from(PARTIAL), st.integers(3, len(TOK) - 1)), min_size=1,
                        max_size=30))
    text = decode(ids).replace(FFFD, "")
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.booleans()):
            start = draw(st.integers(0, len(text) - 1))
            stops.append(text[start: start + draw(st.integers(1, 4))])
        else:
            stops.append(draw(st.sampled_from(["zz", "日本", " ", "\n\n", "é"])))
    return ids, stops


@settings(max_examples=200, deadline=None)
@given(case=stop_case(), sizes=splits, include=st.booleans(), min_tokens=st.integers(0, 4))
def test_stop_strings_cut_where_the_full_decode_says(case, sizes, include, min_tokens):
    ids, stops = case
    stream, sent = TextStream(TOK, encode(TOK, "hi "), stops, include, min_tokens), ""
    for step in pieces(ids, sizes):
        sent += stream.push(step)
        assert stream.text.startswith(sent)
        if stream.stopped:
            break
    sent += stream.finish()
    kept, text, reason = oracle(ids, stops, include, min_tokens)
    assert (sent, stream.stop_reason) == (text, reason)
    assert stream.num_kept_tokens == (kept if reason is not None else None)


def test_a_stop_string_that_ends_inside_a_token_cuts_the_text_there():
    ids = encode(TOK, "def foo(x):\n    return x + 1\n\n\nclass Bar:")
    text = decode(ids)
    for stop in ("\n  ", "retu", "1\n"):  # each ends inside a token ("\n   ", "urn", "\n\n")
        for include in (False, True):
            stream = TextStream(TOK, [], [stop], include)
            sent = stream.push(ids) + stream.finish()
            cut = text.index(stop)
            assert sent == text[: cut + len(stop) if include else cut] and stream.stop_reason == stop
            kept = decode(ids[: stream.num_kept_tokens])
            assert stop in kept and not kept.endswith(stop) and stop not in decode(ids[: stream.num_kept_tokens - 1])


def test_a_stop_token_s_text_is_left_out_unless_asked_for():
    ids = encode(TOK, "héllo wörld")
    for include, want in ((False, decode(ids[:-1])), (True, decode(ids))):
        stream = TextStream(TOK, [], include_stop=include)
        assert stream.push(ids, stopped_on_token=True) + stream.finish() == want
        assert stream.num_tokens == len(ids)


def test_the_end_that_may_begin_a_stop_string_waits():
    stream = TextStream(TOK, [], ["wörld!"])
    assert stream.push(encode(TOK, "héllo wö")) == "héllo "  # "wö" may begin it
    assert stream.push(encode(TOK, "rld")) == ""
    assert stream.push(encode(TOK, " ok")) == "wörld ok" and not stream.stopped


class SentencePieceLike:
    """One token per UTF-8 byte (ids 1..256; 0 a special token), and SentencePiece's habit of
    dropping the leading space of a decoded sequence: a leading space survives only in context."""

    def encode(self, text):
        return [b + 1 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens=True):
        text = bytes(i - 1 for i in ids if i > 0).decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text


@pytest.mark.parametrize("sizes", [[1] * 40, [3] * 14, [7, 1, 2, 30]])
def test_the_offsets_path_keeps_a_leading_space_in_the_prompt_s_context(sizes):
    tok, text = SentencePieceLike(), " héllo wörld, ünïcode ∑ ok"
    detok = incremental_detokenizer(tok, tok.encode("say:"))
    deltas = [detok.push(step) for step in pieces(tok.encode(text), sizes)] + [detok.flush()]
    assert "".join(deltas) == text and not any(FFFD in d for d in deltas)


def test_text_stream_on_the_char_tokenizer_counts_tokens_and_holds_back():
    tok = CharTokenizer()
    ts = TextStream(tok, tok.encode("count 3 "), stop=["6"])
    out = ts.push(tok.encode("4 5", add_bos=False)) + ts.push(tok.encode(" 6 7", add_bos=False))
    assert out == "4 5 " and ts.stopped and ts.num_tokens == 7 and ts.num_kept_tokens == 5 and ts.finish() == ""
    ts = TextStream(tok, [1], stop=["zz"])
    assert ts.push(tok.encode("abz", add_bos=False)) == "ab"  # "z" may begin "zz"
    assert ts.finish() == "z" and ts.text == "abz" and not ts.stopped
    ts = TextStream(tok, [1], stop=["b", "ab"])  # the earliest match wins
    assert ts.push(tok.encode("xab", add_bos=False)) == "x" and ts.stop_reason == "ab"


@given(text=st.text("ab.", max_size=12), stops=st.lists(st.text("ab.", min_size=1, max_size=5), max_size=3))
def test_what_is_held_back_is_the_longest_end_that_begins_a_stop_string(text, stops):
    from fleetlab.output.stop import partial_stop_length

    want = max((n for n in range(1, len(text) + 1) for s in stops if len(s) > n and s.startswith(text[-n:])),
               default=0)
    assert partial_stop_length(text, stops) == want


def test_a_decode_stream_that_refuses_its_prefix_is_restarted_other_errors_are_not_hidden():
    """``DecodeStream`` raises when a decoder rewrites text it already gave; vLLM starts a new stream
    there and goes on, and so does the fast path."""
    class Refusing:
        def __init__(self, message):
            self.message = message

        def step(self, tokenizer, token_id):
            raise Exception(self.message)

    detok = FastIncrementalDetokenizer(TOK, [])
    detok._stream = Refusing("Invalid prefix encountered")
    assert detok.push(encode(TOK, "ok")) == "ok"
    detok._stream = Refusing("something else")
    with pytest.raises(Exception, match="something else"):
        detok.push(encode(TOK, "x"))


def test_the_text_covers_every_token_when_a_caller_drove_a_step_through_the_scheduler_itself():
    """Notebook 12 runs one step by hand (``schedule``, ``execute``, ``update``), then ``LLM.step``:
    the output processor never saw that step's tokens, and the text must still be all of them."""
    from types import SimpleNamespace

    from fleetlab import SamplingParams
    from fleetlab.engine.outputs import RequestOutput
    from fleetlab.output.processor import OutputProcessor

    ids = encode(TOK, "héllo wörld")
    request = SimpleNamespace(request_id="r", sampling_params=SamplingParams(max_tokens=len(ids), stop=[]),
                              prompt_token_ids=encode(TOK, "say: "))
    processor = OutputProcessor(TOK, eos_token_id=None)
    processor.add(request)
    out = RequestOutput(request_id="r", prompt_token_ids=request.prompt_token_ids, token_ids=list(ids),
                        new_token_ids=list(ids[-1:]), finish_reason="length")
    (user_out,), stopped = processor.process([out])
    assert user_out.text == TOK.decode(ids) and not stopped
