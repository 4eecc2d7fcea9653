"""Real text through the engine offline: a tiny random Llama over a byte-level BPE vocabulary, so its
outputs split characters over tokens all the time. Each request's text (``RequestOutput.text`` and
the ``new_text`` of every step) is checked against decoding its full token list
(``bpe_helpers.expected_text``), with stop strings that end inside a token, ``n > 1`` and
speculation (several tokens a step); greedy tokens against the unpatched model's own full forward.
"""

import pytest
from bpe_helpers import bpe_llama, encode, expected_text, stops_inside_tokens

from fleetlab import LLM, SamplingParams
from fleetlab.patching.parity import reference_greedy

PROMPTS = ["héllo wörld ", "def foo(x):\n", "日本語 🙂 ", '{"name": "']
MAX_TOKENS = 20
SPECULATION = [None, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}]


@pytest.fixture(scope="module")
def bpe():
    model, tok = bpe_llama(seed=3)
    prompts = [encode(tok, p) for p in PROMPTS]
    refs, _ = reference_greedy(model, prompts, MAX_TOKENS)
    return model, tok, prompts, refs


def run(llm, prompts, sps):
    """Step the engine to the end; each request's outputs, in order."""
    ids = [llm.add_request(prompt_token_ids=p, sampling_params=sp) for p, sp in zip(prompts, sps)]
    steps = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            steps.setdefault((out.request_id, out.index), []).append(out)
    return [[steps[rid, i] for i in range(sp.n)] for rid, sp in zip(ids, sps)]


def check_steps(outs):
    """Every step's ``text`` is the ``new_text`` so far; the last holds it all."""
    sent = ""
    for out in outs:
        sent += out.new_text
        assert out.text == sent
    return outs[-1]


@pytest.mark.parametrize("speculative", SPECULATION)
def test_text_and_stop_strings_equal_decoding_the_full_forward_tokens(bpe, speculative):
    model, tok, prompts, refs = bpe
    many = 0
    with LLM(model, tok, block_size=4, speculative_config=speculative) as llm:
        for include in (False, True):
            stops = [stops_inside_tokens(tok, ref)[:1] or ["zz"] for ref in refs]
            assert sum(s != ["zz"] for s in stops) >= 2
            sps = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, stop=s,
                                  include_stop_str_in_output=include) for s in stops]
            for outs, ref, s in zip(run(llm, prompts, sps), refs, stops):
                final = check_steps(outs[0])
                kept, text, reason = expected_text(tok, ref, s, include)
                assert (final.token_ids, final.text, final.stop_reason) == (ref[:kept], text, reason), s
                many += sum(len(o.new_token_ids) > 1 for o in outs[0])
        assert llm.pool.num_free_blocks == llm.pool.num_blocks
    assert speculative is None or many > 0  # some verify step gained several tokens


def test_without_stop_strings_the_text_is_the_full_decode(bpe):
    model, tok, prompts, refs = bpe
    with LLM(model, tok, block_size=4) as llm:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0), use_tqdm=False)
    for out, ref in zip(outs, refs):
        assert out.token_ids == ref and out.text == out.new_text == tok.decode(ref, skip_special_tokens=True)
    assert any("\ufffd" in tok.decode([t]) for ref in refs for t in ref)  # characters were split


@pytest.mark.parametrize("speculative", SPECULATION)
def test_n_sampled_sequences_each_cut_at_their_stop_string(bpe, speculative):
    model, tok, prompts, _ = bpe
    stops = [" ", "o", "\n"]
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=7, n=4, stop=stops,
                        min_tokens=2)
    with LLM(model, tok, block_size=4, speculative_config=speculative) as llm:
        results = run(llm, prompts, [sp] * len(prompts))
        assert llm.pool.num_free_blocks == llm.pool.num_blocks
    stopped = 0
    for outs in results:
        for steps in outs:
            final = check_steps(steps)
            kept, text, reason = expected_text(tok, final.token_ids, stops, False, 2)
            assert (kept, final.text, final.stop_reason) == (len(final.token_ids), text, reason)
            stopped += reason is not None
    assert stopped > 0


def test_a_stop_token_s_text_is_left_out(bpe):
    model, tok, prompts, refs = bpe
    token = refs[0][5]
    with LLM(model, tok, block_size=4) as llm:
        drop, keep = llm.generate(prompt_token_ids=prompts[:1] * 2, sampling_params=[
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, stop_token_ids=[token],
                           include_stop_str_in_output=include) for include in (False, True)], use_tqdm=False)
    kept = refs[0][: refs[0].index(token) + 1]
    assert drop.token_ids == keep.token_ids == kept and drop.stop_reason == token
    assert drop.text == tok.decode(kept[:-1]) and keep.text == tok.decode(kept)


@pytest.mark.parametrize("speculative", SPECULATION)
def test_the_code_model_s_text_and_stop_strings_equal_decoding_its_full_forward_tokens(speculative):
    """The same on the shipped code model, whose tokens hold whole words with their leading spaces."""
    from fleetlab.models import load_code

    model, tok = load_code()
    prompts = [tok.encode(p) for p in ["def read_lines(path):\n    with open(path) as f:\n", "import os\n\n\ndef "]]
    refs, _ = reference_greedy(model, prompts, MAX_TOKENS)
    stops = [stops_inside_tokens(tok, ref)[:1] or ["zz"] for ref in refs]
    assert any(s != ["zz"] for s in stops)
    with LLM(model, tok, block_size=4, speculative_config=speculative) as llm:
        for include in (False, True):
            sps = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, stop=s,
                                  include_stop_str_in_output=include) for s in stops]
            for outs, ref, s in zip(run(llm, prompts, sps), refs, stops):
                final = check_steps(outs[0])
                kept, text, reason = expected_text(tok, ref, s, include)
                assert (final.token_ids, final.text, final.stop_reason) == (ref[:kept], text, reason), s
