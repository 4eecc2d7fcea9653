"""Several LLMs on one model: re-running a notebook cell, other configs, other backends."""

import gc

import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.attention.backend import register_attention_backend
from fleetlab.attention.tiled import TiledBackend
from fleetlab.models import tiny
from fleetlab.patching.handle import PATCH_ATTR

PROMPTS = random_prompts([7, 3, 12], seed=21)
SP = SamplingParams(max_tokens=6, ignore_eos=True)


def run(llm):
    return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)]


class OtherBackend(TiledBackend):
    name = "reference_other"


register_attention_backend("reference_other", OtherBackend)


@pytest.mark.parametrize("family", ["llama", "fleet"])
def test_the_same_cell_run_twice_works_and_agrees(family):
    model = tiny(family)
    llm = LLM(model, block_size=4)  # the cell ...
    first = run(llm)
    llm = LLM(model, block_size=4)  # ... run again: the old LLM is dropped, never closed
    assert run(llm) == first
    del llm
    gc.collect()  # a dropped LLM lets go of its share of the patch when it is collected
    assert PATCH_ATTR not in model.__dict__


def test_three_llms_with_different_configs_share_one_model():
    model = tiny("llama")
    configs = [dict(block_size=4, max_num_batched_tokens=5), dict(block_size=8, max_num_batched_tokens=64),
               dict(block_size=2, max_num_batched_tokens=3, num_blocks=20)]
    llms = [LLM(model, **cfg) for cfg in configs]
    outs = [run(llm) for llm in llms]
    assert outs[0] == outs[1] == outs[2]
    assert run(llms[0]) == outs[0]  # the first still works after the others ran
    for llm in llms:
        llm.close()
    assert PATCH_ATTR not in model.__dict__  # the last close restored the model
    assert model.config._attn_implementation != "fleetlab"


def test_a_model_repatched_with_another_backend_says_so():
    model = tiny("llama")
    with LLM(model, block_size=4) as old:
        want = run(old)
        with LLM(model, block_size=4, backend="reference_other") as new:
            assert type(new.handle.backend) is OtherBackend
            with pytest.raises(RuntimeError, match="re-patched with backend 'reference_other'"):
                old.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
            assert old.pool.num_free_blocks == old.pool.num_blocks  # nothing queued or leaked
            assert run(new) == want
    assert PATCH_ATTR not in model.__dict__


def test_context_manager_closes_the_draft_models_patch_too():
    target, draft = tiny("fleet"), tiny("llama")
    with LLM(target, block_size=4, speculative_config={"method": "draft", "num_speculative_tokens": 2,
                                                          "model": draft}) as llm:
        run(llm)
        assert PATCH_ATTR in draft.__dict__
    assert PATCH_ATTR not in draft.__dict__ and PATCH_ATTR not in target.__dict__


@pytest.mark.parametrize("kind", ["traces", "draft", "grammar"])
def test_a_dropped_llm_is_collected_and_its_models_unpatched(kind):
    """An LLM dropped without close() (a notebook cell re-run) is garbage: nothing keeps it alive
    (no recorder holding it, no frozen heap), and collecting it unpatches its models."""
    import weakref

    from fleetlab.models.json_tiny import json_tokenizer

    tok = json_tokenizer()
    model, draft = tiny("llama", vocab_size=tok.vocab_size), tiny("llama", vocab_size=tok.vocab_size)
    config = {"traces": dict(record_traces=True),
              "draft": dict(record_traces=True, speculative_config={"method": "draft", "num_speculative_tokens": 2,
                                                                     "model": draft}),
              "grammar": dict(record_traces=True)}[kind]
    sp = SamplingParams(max_tokens=6, structured_outputs={"choice": ["yes", "no"]} if kind == "grammar" else None)
    frozen = gc.get_freeze_count()
    llm = LLM(model, tok, block_size=4, **config)
    out = llm.generate(prompt_token_ids=[[tok.bos_token_id, 20, 21]], sampling_params=sp, use_tqdm=False)[0]
    assert out.finished and llm.traces
    gone = weakref.ref(llm)
    del llm, out
    gc.collect()
    assert gone() is None, "a dropped LLM is still referenced"
    assert PATCH_ATTR not in model.__dict__ and PATCH_ATTR not in draft.__dict__
    assert gc.get_freeze_count() == frozen  # a library constructor freezes nothing
