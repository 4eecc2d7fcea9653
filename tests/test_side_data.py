"""Per-request side data (``prompt_embeds``) moves with its request through every engine feature."""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams

SP = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts([9, 14, 5, 11], seed=41)


def serve(model, requests, **config):
    """``requests``: ``[(prompt, prompt_embeds or None)]`` -> token ids in order."""
    with LLM(model, **config) as llm:
        ids = [llm.add_request(prompt_token_ids=p, sampling_params=SP, prompt_embeds=e) for p, e in requests]
        done = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in llm.step()})
        assert llm.pool.num_free_blocks == llm.pool.num_blocks
    return [done[i] for i in ids]


def own_embeddings(model, prompt):
    for name, param in model.named_parameters():
        if "embed" in name:
            return param.numpy()[prompt]
    raise AssertionError("no embedding table")


def features(seed, positions, hidden):
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(hidden).astype(np.float32) for p in positions}


@pytest.mark.parametrize("family", ["llama", "fleet"])
def test_the_models_own_embeddings_give_the_token_prompts_outputs(family_models, family):
    model = family_models(family)
    plain = serve(model, [(p, None) for p in PROMPTS], block_size=4)
    embedded = serve(model, [(p, own_embeddings(model, p)) for p in PROMPTS], block_size=4)
    partial = serve(model, [(p, {1: own_embeddings(model, p)[1]}) for p in PROMPTS], block_size=4)
    assert embedded == plain and partial == plain


ENGINES = {
    "plain": dict(block_size=4),
    "reorder": dict(block_size=4, reorder=True, max_num_batched_tokens=10),
    "budget-1": dict(block_size=4, max_num_batched_tokens=1),
    "preempting": dict(block_size=2, num_blocks=11, max_num_batched_tokens=8),
}


@pytest.fixture(scope="module")
def image_requests(family_models):
    model = family_models("fleet")
    hidden = model.config.hidden_size
    # Requests 0 and 2 carry "image features" at a few prompt positions; 1 and 3 are plain.
    reqs = [(PROMPTS[0], features(0, [2, 3, 4], hidden)), (PROMPTS[1], None),
            (PROMPTS[2], features(1, [0, 4], hidden)), (PROMPTS[3], None)]
    return model, reqs, serve(model, reqs, **ENGINES["plain"])


@pytest.mark.parametrize("engine", list(ENGINES)[1:])
def test_side_data_follows_its_request_through_reorder_chunks_and_preemption(image_requests, engine):
    model, reqs, want = image_requests
    with LLM(model, **ENGINES[engine], record_traces=True) as llm:
        ids = [llm.add_request(prompt_token_ids=p, sampling_params=SP, prompt_embeds=e) for p, e in reqs]
        done = {}
        while llm.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in llm.step()})
        if engine == "preempting":
            assert llm.stats()["num_preemptions"] > 0
        if engine == "reorder":
            assert any(t.order_before != t.order_after for t in llm.traces)
    assert [done[i] for i in ids] == want


def test_side_data_changes_the_output_and_is_never_shared_through_the_prefix_cache(image_requests):
    model, reqs, want = image_requests
    plain = serve(model, [(p, None) for p, _ in reqs], block_size=4)
    assert want[0] != plain[0] and want[2] != plain[2]  # the features are really used
    assert want[1] == plain[1] and want[3] == plain[3]
    prompt, embeds = reqs[0]
    other = features(9, list(embeds), model.config.hidden_size)
    # Same tokens, other features, same step and later steps: each gets its own answer.
    got = serve(model, [(prompt, embeds), (prompt, other), (prompt, None), (prompt, embeds)], block_size=2)
    alone = serve(model, [(prompt, other)], block_size=2)
    assert got[0] == got[3] == want[0] and got[1] == alone[0] and got[2] == plain[0]


@pytest.mark.parametrize("embeds,match", [
    ({0: np.zeros(5, np.float32)}, "hidden size"),
    ({99: None}, "int positions to vectors|hidden size"),
    ({40: np.zeros(64, np.float32)}, "lie in the prompt"),
    ({0: np.full(64, np.nan, np.float32)}, "non-finite"),
    (np.zeros((3, 64), np.float32), "num_prompt_tokens"),
    ({}, "empty"),
])
def test_bad_side_data_is_refused_naming_the_request(fleet_model, embeds, match):
    with LLM(fleet_model, block_size=4) as llm:
        with pytest.raises(ValueError, match=f"request 'img': prompt_embeds .*({match})"):
            llm.add_request(prompt_token_ids=PROMPTS[0], request_id="img", prompt_embeds=embeds)
        assert not llm.has_unfinished_requests()


def test_the_batch_carries_side_data_as_a_row_field():
    from fleetlab.engine.input_batch import InputBatch

    batch = InputBatch(4, 16, 4)
    side = (np.array([1]), np.ones((1, 8), np.float32))
    batch.add_request("a", [1, 2, 3])
    batch.add_request("b", [1, 2, 3, 4], extra={"prompt_embeds": side})
    batch.add_request("c", [5])
    batch.remove_request("a")
    batch.condense()
    batch.set_num_scheduled({"b": 4, "c": 1})
    batch.reorder_split_prefill_and_decode()
    assert batch.prompt_embeds[batch.row_of("b")] is side and batch.prompt_embeds[batch.row_of("c")] is None
    assert paddle.to_tensor(side[1]).shape == [1, 8]
