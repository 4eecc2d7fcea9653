"""Patching PaddleFormers models: paged logits equal each family's own full forward.

The oracle is the unpatched model recomputing the whole sequence each step
(``reference_greedy``). The patched model prefills several prompts of different lengths
in one packed step, then decodes through a paged cache with shuffled block ids, block
size 4, sequences longer than the sliding window (8).
"""

import numpy as np
import paddle
import pytest

import fleetlab.patching
from fleetlab.attention.context import forward_context, get_forward_context
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.attention.tiled import TiledBackend
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.models.small import TINY_FAMILIES, tiny_paddleformers
from fleetlab.patching import patch_model
from fleetlab.patching.families import experts_mix_tokens, library_fixes
from fleetlab.patching.paddleformers import LAYER_ID_ATTR, WINDOW_ATTR, fleetlab_attention
from fleetlab.patching.parity import paged_greedy, reference_greedy

PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36],
           [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53]]
NEW_TOKENS = 6
ATOL = 1e-4
# (family, config overrides): Gemma3 once more with final-logit soft-capping switched on.
CASES = [(f, {}) for f in TINY_FAMILIES] + [("gemma3", {"final_logit_softcapping": 3.0})]


def _oracle(model, prompts=PROMPTS, new=NEW_TOKENS):
    # library_fixes: GPT-OSS's own MoE mixes the tokens of a forward (see families.py).
    with library_fixes(model):
        return reference_greedy(model, prompts, new)


def _max_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("family,overrides", CASES, ids=[f + ("-softcap" if o else "") for f, o in CASES])
def test_paged_logits_match_the_unpatched_full_forward(family, overrides):
    model = tiny_paddleformers(family, **overrides)
    want_tokens, want_logits = _oracle(model)
    with patch_model(model) as handle:
        got_tokens, got_logits = paged_greedy(handle, PROMPTS, NEW_TOKENS, block_size=4, seed=1)
    assert _max_diff(got_logits, want_logits) < ATOL
    assert got_tokens == want_tokens


def _snapshot(model):
    layers = {name: (type(m), dict(m.__dict__)) for name, m in model.named_sublayers(include_self=True)}
    return layers, dict(vars(model.config))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_unpatch_restores_every_attribute_and_the_outputs(family):
    model = tiny_paddleformers(family)
    ids = paddle.to_tensor([PROMPTS[0]], dtype="int64")
    before = model(input_ids=ids, use_cache=False, return_dict=True).logits.numpy()
    layers, config = _snapshot(model)
    handle = patch_model(model)
    assert model.config._attn_implementation == "fleetlab" and model.config.use_cache is False
    paged_greedy(handle, PROMPTS[:2], 2)
    handle.unpatch()
    after_layers, after_config = _snapshot(model)
    assert after_config == config
    assert after_layers.keys() == layers.keys()
    for name, (cls, attrs) in layers.items():
        assert after_layers[name][0] is cls, name
        assert after_layers[name][1].keys() == attrs.keys(), name
        assert all(after_layers[name][1][k] is v for k, v in attrs.items()), name
    after = model(input_ids=ids, use_cache=False, return_dict=True).logits.numpy()
    np.testing.assert_array_equal(after, before)
    with pytest.raises(RuntimeError, match="unpatched"):
        handle.compute_logits(ids, ids, paddle.to_tensor([0]))


class CountingBackend(TiledBackend):
    """Reference attention that records which layer ids it served."""

    name = "counting"

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, layer_id, *args, **kwargs):
        self.calls.append(layer_id)
        return super().forward(layer_id, *args, **kwargs)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_attention_layer_runs_through_fleetlab_every_step(family):
    # Gemma3 would quietly send its full-attention layers back to "sdpa" without the pin.
    backend = CountingBackend()
    with patch_model(tiny_paddleformers(family), backend=backend) as handle:
        paged_greedy(handle, PROMPTS[:2], 3)
    assert backend.calls == [0, 1, 2] * 3


@pytest.mark.parametrize("family,windows", [("llama", {}), ("ernie4_5", {}), ("phi3", {0: 8, 2: 8}),
                                            ("gemma3", {0: 8, 2: 8}), ("gpt_oss", {0: 8, 2: 8})])
def test_handle_describes_the_model(family, windows):
    with patch_model(tiny_paddleformers(family)) as handle:
        assert handle.family == family
        assert (handle.num_layers, handle.num_kv_heads, handle.head_dim) == (3, 2, 16)
        assert (handle.vocab_size, handle.max_model_len, handle.dtype) == (128, 256, "float32")
        assert handle.sliding_windows == windows and handle.eos_token_id == 2
        assert sorted(handle.layer_ids.values()) == [0, 1, 2]


# --- the parity check catches the classic patching bugs ---------------------------------


def test_double_rope_breaks_parity(monkeypatch):
    from paddleformers.nn.attention.interface import AttentionInterface
    from paddleformers.transformers.llama.modeling import apply_rotary_pos_emb

    model = tiny_paddleformers("llama")
    _, want_logits = _oracle(model, PROMPTS[:2], 3)

    def rotates_again(module, query, key, value, **kwargs):
        positions = get_forward_context().metadata.positions.reshape([1, -1])
        cos, sin = model.model.rotary_emb(query, positions)
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        return fleetlab_attention(module, query, key, value, **kwargs)

    with patch_model(model) as handle:
        monkeypatch.setitem(AttentionInterface._global_mapping, "fleetlab", rotates_again)
        _, got_logits = paged_greedy(handle, PROMPTS[:2], 3)
    assert _max_diff(got_logits, want_logits) > 100 * ATOL


def _retag(handle, new_id):
    for module in handle.model.sublayers():
        if hasattr(module, LAYER_ID_ATTR):
            setattr(module, LAYER_ID_ATTR, new_id(getattr(module, LAYER_ID_ATTR)))


def test_layer_ids_off_by_one_break_parity():
    model = tiny_paddleformers("llama")
    _, want_logits = _oracle(model, PROMPTS[:2], 3)
    with patch_model(model) as handle:
        # Fleet's 1-based layer_number used as a 0-based cache index: the last layer has no cache.
        _retag(handle, lambda i: i + 1)
        with pytest.raises(ValueError, match="layer_id 3 out of range"):
            paged_greedy(handle, PROMPTS[:2], 3)
    with patch_model(model) as handle:
        # Shifted the other way, layers 0 and 1 share a cache: prefill survives, decode reads
        # the other layer's keys.
        _retag(handle, lambda i: max(i - 1, 0))
        _, got_logits = paged_greedy(handle, PROMPTS[:2], 3)
    assert _max_diff(got_logits, want_logits) > 100 * ATOL


@pytest.mark.parametrize("shift", [-1, 1])
def test_window_off_by_one_breaks_parity(shift):
    model = tiny_paddleformers("gemma3")
    _, want_logits = _oracle(model, PROMPTS, 3)
    with patch_model(model) as handle:
        for module in model.sublayers():
            if getattr(module, WINDOW_ATTR, None) is not None:
                setattr(module, WINDOW_ATTR, getattr(module, WINDOW_ATTR) + shift)
        _, got_logits = paged_greedy(handle, PROMPTS, 3)
    assert _max_diff(got_logits, want_logits) > 100 * ATOL


def test_patch_refuses_layer_ids_that_are_not_0_to_L_minus_1():
    model = tiny_paddleformers("llama")
    for layer in model.model.layers:
        layer.self_attn.layer_idx += 1
    with pytest.raises(ValueError, match="layer ids must be 0..2"):
        patch_model(model)


# --- errors ---------------------------------------------------------------------------------


def test_attention_outside_forward_context_raises():
    model = tiny_paddleformers("gemma3")
    ids = paddle.to_tensor([[3, 4, 5]], dtype="int64")
    with patch_model(model) as handle:
        with pytest.raises(RuntimeError, match="outside `fleetlab.forward_context"):
            handle.compute_logits(ids, ids, paddle.to_tensor([2]))
        with pytest.raises(RuntimeError, match="outside `fleetlab.forward_context"):
            model(input_ids=ids, use_cache=False)


def _one_step(handle, input_ids):
    """A prefill step of ``input_ids`` [b, T] as one request, with a fresh cache."""
    num_tokens = input_ids.shape[1]
    md = AttentionMetadata.build([num_tokens], [0], [[0, 1, 2, 3]], 4)
    cache = PagedKVCache.for_handle(handle, num_blocks=4, block_size=4)
    with forward_context(md, cache):
        return handle.compute_logits(input_ids, md.positions.reshape([1, -1]), paddle.to_tensor([num_tokens - 1]))


def test_batch_and_training_mode_are_refused_by_name():
    model = tiny_paddleformers("phi3")
    with patch_model(model) as handle:
        assert _one_step(handle, paddle.to_tensor([[3, 4, 5]])).shape == [1, 128]
        with pytest.raises(ValueError, match="phi3.*batch > 1"):
            _one_step(handle, paddle.to_tensor([[3, 4, 5], [6, 7, 8]]))
        model.train()
        with pytest.raises(NotImplementedError, match="phi3.*training mode"):
            _one_step(handle, paddle.to_tensor([[3, 4, 5]]))


@pytest.mark.parametrize("family,field,value,match", [
    ("llama", "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
     "llama.*rope_type 'dynamic'"),
    ("phi3", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "phi3.*rope_type 'longrope'"),
    ("ernie4_5", "apply_rope_fusion", True, "ernie4_5.*apply_rope_fusion"),
    ("gemma3", "attn_logit_softcapping", 50.0, "gemma3.*attn_logit_softcapping"),
    ("llama", "tensor_model_parallel_size", 2, "llama.*tensor_model_parallel_size"),
])
def test_unsupported_config_features_are_refused_by_name(family, field, value, match):
    model = tiny_paddleformers(family)
    setattr(model.config, field, value)
    with pytest.raises(NotImplementedError, match=match):
        patch_model(model)
    assert model.config._attn_implementation == "eager"


class NoWindowBackend(TiledBackend):
    name = "no-window"
    supports_sliding_window = False


class NoSinkBackend(TiledBackend):
    name = "no-sink"
    supports_sinks = False


@pytest.mark.parametrize("family,backend,match", [
    ("gemma3", NoWindowBackend, "gemma3: sliding-window attention is not supported by backend 'no-window'"),
    ("phi3", NoWindowBackend, "phi3: sliding-window"),
    ("gpt_oss", NoSinkBackend, "gpt_oss: attention sinks are not supported by backend 'no-sink'"),
])
def test_backend_missing_a_feature_is_refused_and_leaves_the_model_alone(family, backend, match):
    model = tiny_paddleformers(family)
    layers, config = _snapshot(model)
    with pytest.raises(NotImplementedError, match=match):
        patch_model(model, backend=backend())
    assert _snapshot(model)[1] == config
    assert all(type(m) is layers[name][0] for name, m in model.named_sublayers())
    with patch_model(tiny_paddleformers("llama"), backend=backend()):
        pass  # a model without the feature patches fine


def test_backend_class_is_accepted_like_a_name():
    # Fleet-style patching took a backend class; PaddleFormers patching once refused it.
    with patch_model(tiny_paddleformers("llama", num_hidden_layers=1), backend=TiledBackend) as handle:
        assert type(handle.backend) is TiledBackend
        assert _one_step(handle, paddle.to_tensor([[3, 4, 5]])).shape == [1, 128]


def test_unknown_family_is_refused_and_a_second_patch_shares_the_first():
    model = tiny_paddleformers("llama")
    model.config.model_type = "qwen2"
    with pytest.raises(NotImplementedError, match="model_type 'qwen2'.*supported"):
        patch_model(model)
    model.config.model_type = "llama"
    with patch_model(model) as first:
        second = patch_model(model)
        assert second.backend is first.backend and second is not first
        second.unpatch()
        assert model.config._attn_implementation == "fleetlab"  # first still holds the patch
    assert model.config._attn_implementation != "fleetlab"


def test_core_attention_models_go_to_the_fleet_patcher(monkeypatch):
    class Attention(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.core_attention = paddle.nn.Identity()

    seen = []
    monkeypatch.setattr(fleetlab.patching, "patch_fleet_model",
                        lambda model, backend: seen.append((model, backend)) or "fleet-handle")
    model = paddle.nn.Sequential(Attention())
    assert patch_model(model, backend="tiled") == "fleet-handle"
    assert seen == [(model, "tiled")]


# --- the GPT-OSS library bug ----------------------------------------------------------------


def test_gpt_oss_experts_mix_tokens_and_the_fix_makes_each_token_independent():
    model = tiny_paddleformers("gpt_oss")
    experts = model.model.layers[0].mlp.experts
    library_class = type(experts)
    assert experts_mix_tokens(experts)  # PaddleFormers 1.2 as shipped
    mlp = model.model.layers[0].mlp
    x = paddle.randn([1, 5, 64])
    with library_fixes(model):
        assert not experts_mix_tokens(experts)
        together = mlp(x)[0]
        alone = paddle.concat([mlp(x[:, i:i + 1])[0] for i in range(5)], axis=1)
        np.testing.assert_allclose(together.numpy(), alone.numpy(), atol=1e-5)
    assert type(experts) is library_class
    # One token at a time the library was right all along: the fix agrees with it there.
    np.testing.assert_array_equal(mlp(x[:, 2:3])[0].numpy(), alone[:, 2:3].numpy())
