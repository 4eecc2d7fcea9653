"""The tiny PaddleFormers models: deterministic, small, CPU-ready, with each family's quirks."""

import numpy as np
import paddle
import pytest

from fleetlab.models.small import TINY_FAMILIES, tiny_paddleformers


def _logits(model, ids):
    with paddle.no_grad():
        out = model(input_ids=paddle.to_tensor([ids], dtype="int64"), use_cache=False, return_dict=True)
    return out.logits[0].numpy()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_is_small_float32_eval_and_runs(family):
    model = tiny_paddleformers(family)
    config = model.config
    assert not model.training
    assert str(model.lm_head.weight.dtype) == "paddle.float32"
    assert config.num_hidden_layers == 3 and config.num_key_value_heads == 2
    for token in (config.bos_token_id, config.eos_token_id, config.pad_token_id):
        assert 0 <= token < config.vocab_size
    logits = _logits(model, [3, 4, 5, 6])
    assert logits.shape == (4, config.vocab_size) and np.isfinite(logits).all()


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_is_a_function_of_its_seed(family):
    ids = [5, 9, 11, 7, 3]
    a, b, c = (_logits(tiny_paddleformers(family, seed=s), ids) for s in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-2


@pytest.mark.parametrize("family", ["llama", "fleet"])
def test_tiny_model_leaves_the_global_random_state_alone(family):
    from fleetlab.models import tiny

    paddle.seed(123)
    want = paddle.rand([4]).numpy()
    paddle.seed(123)
    tiny(family, seed=7)
    np.testing.assert_array_equal(paddle.rand([4]).numpy(), want)


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "phi3"])
def test_sliding_families_mix_window_and_full_layers(family):
    config = tiny_paddleformers(family).config
    assert config.sliding_window == 8
    assert set(config.layer_types) == {"sliding_attention", "full_attention"}


def test_overrides_reach_the_config_and_layer_types_follow_the_layer_count():
    model = tiny_paddleformers("gemma3", num_hidden_layers=4, sliding_window=4)
    assert len(model.model.layers) == 4
    assert len(model.config.layer_types) == 4 and model.config.sliding_window == 4


def test_unknown_family_lists_the_supported_ones():
    with pytest.raises(ValueError, match="qwen2.*supported.*llama.*gpt_oss"):
        tiny_paddleformers("qwen2")
