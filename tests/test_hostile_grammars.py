"""Hostile grammars (issue #35): every constraint is refused at the edge with a short message
naming the request and the field, or it runs; a grammar library that gives up mid-output
(a parser limit) stops only its own request, with a short message, and the other prompts of
the same ``generate`` call finish with the model's own greedy tokens."""

import re

import pytest

from fleetlab import LLM, SamplingParams
from fleetlab.models import tiny_json
from fleetlab.patching.parity import reference_greedy

PROMPTS = ["a", "b"]
PLAIN = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_json("llama", seed=0)
    ids = [tok.encode(p) for p in PROMPTS]
    want, _ = reference_greedy(model, ids[1:], PLAIN.max_tokens)
    llm = LLM(model, tok, block_size=4, max_num_batched_tokens=64, max_model_len=128)
    yield llm, want[0]
    llm.close()


def constrained(spec, max_tokens=40):
    return SamplingParams(max_tokens=max_tokens, structured_outputs=spec)


def generate(llm, spec, max_tokens=40):
    """The constrained prompt with a bystander; checks the bystander and the pool."""
    return llm.generate(PROMPTS, [constrained(spec, max_tokens), PLAIN], use_tqdm=False)


def assert_clean(llm):
    assert not llm.scheduler.requests and llm.pool.num_free_blocks == llm.pool.num_blocks


@pytest.mark.parametrize("spec, words", [
    ({"json": False}, r"structured_outputs field json=False is the schema no value satisfies"),
    ({"regex": "a[^\\x00-\\U0010FFFF]"}, r"structured_outputs field regex: matches no output at all"),
    ({"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
     r"structured_outputs field json: matches no output at all"),
    ({"choice": [f"option {i}" for i in range(2500)]},
     r"structured_outputs field choice: has 2500 strings; llguidance's parser takes at most 1999"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}},
     r"structured_outputs field json: cannot be served: .*max is 2000"),
], ids=["false-schema", "unsatisfiable-regex", "cyclic-ref", "2500-choices", "600-optional-properties"])
def test_refused_at_the_edge_short_and_named(setup, spec, words):
    llm, _ = setup
    with pytest.raises(ValueError, match=r"^request '\w+': " + words) as info:
        generate(llm, spec)
    assert len(str(info.value)) < 400  # not the library's whole grammar (40-57 KB before)
    assert_clean(llm)


@pytest.mark.parametrize("spec", [{"json": True}, {"json": "true"}, {"json": {"type": "object",
                                                                              "properties": {"a": True}}}],
                         ids=["true", "true-text", "nested-true"])
def test_boolean_schemas_run(setup, spec):
    llm, want = setup
    out, bystander = generate(llm, spec, max_tokens=6)
    assert out.finish_reason in ("stop", "length") and out.error is None
    assert bystander.token_ids == want
    assert_clean(llm)


def test_a_parser_limit_hit_mid_output_stops_only_its_request(setup):
    """A schema whose short branch passes the edge's checks, its long one a parser limit: forced
    into the long one (a bias on ``{``), the library gives up after one token. Before, that was
    a RuntimeError of about 40 KB from inside ``step()``, and every prompt of the call was lost."""
    llm, want = setup
    brace = llm.tokenizer.encode("{")[-1]
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(600)}}
    sp = SamplingParams(max_tokens=20, logit_bias={brace: 100.0},
                        structured_outputs={"json": {"anyOf": [{"type": "integer"}, wide]}})
    out, bystander = llm.generate(PROMPTS, [sp, PLAIN], use_tqdm=False)
    assert out.finish_reason == "error" and out.token_ids == [brace]
    assert out.error.startswith("structured_outputs field json: llguidance stopped at token") and len(out.error) < 400
    assert bystander.token_ids == want
    assert_clean(llm)


@pytest.fixture(scope="module")
def bpe_setup():
    from bpe_helpers import bpe_llama

    model, tok = bpe_llama(seed=0)
    llm = LLM(model, tok, block_size=4, max_num_batched_tokens=64, max_model_len=128)
    yield llm
    llm.close()


@pytest.mark.parametrize("spec, words", [
    ({"regex": "a[^\\x00-\\U0010FFFF]"}, r"structured_outputs field regex: matches no output at all"),
    ({"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
     r"structured_outputs field json: matches no output at all"),
    ({"choice": [f"option {i}" for i in range(2500)]}, r"structured_outputs field choice: has 2500 strings"),
], ids=["unsatisfiable-regex", "cyclic-ref", "2500-choices"])
def test_over_a_byte_level_bpe_too_refused_at_the_edge(bpe_setup, spec, words):
    """A vocabulary that spells every byte needs no search for what it lacks; a constraint that no text
    satisfies is still refused when it compiles (its first mask allows nothing), not left to run."""
    with pytest.raises(ValueError, match=r"^request '\w+': " + words):
        bpe_setup.generate(PROMPTS, [constrained(spec), PLAIN], use_tqdm=False)
    assert_clean(bpe_setup)


@pytest.mark.parametrize("spec, allowed", [({"regex": "日本[語人]{1,3}"}, r"日本[語人]{1,3}"),
                                           ({"choice": ["héllo", "wörld", "🙂"]}, r"héllo|wörld|🙂")])
def test_multi_byte_constraints_over_a_byte_level_bpe_write_whole_characters(bpe_setup, spec, allowed):
    out, _ = bpe_setup.generate(PROMPTS, [constrained(spec), PLAIN], use_tqdm=False)
    assert out.finish_reason == "stop" and re.fullmatch(allowed, out.text), out.text
    assert_clean(bpe_setup)
