"""The Fleet-style model and its ``core_attention`` surgery, checked against the model itself.

Oracle: the unpatched model's own full forward, recomputed every step
(``fleetlab.patching.parity.reference_greedy``).
"""

import numpy as np
import paddle
import pytest

from fleetlab.attention.context import forward_context
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.models import tiny
from fleetlab.models.fleet import DotProductAttention, FleetConfig, apply_rotary, rope_cos_sin
from fleetlab.patching import fleet as patch_fleet
from fleetlab.patching.parity import full_forward_logits, paged_greedy, reference_greedy

PROMPTS = [[5, 9, 3, 7, 1, 4, 100], [8, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3]]
NEW_TOKENS = 6


def max_diff(logits_a, logits_b) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(logits_a, logits_b))


@pytest.fixture(scope="module")
def oracle():
    model = tiny("fleet", seed=0)
    _, ref_logits = reference_greedy(model, PROMPTS, NEW_TOKENS)
    return model, ref_logits


# --- the model ---------------------------------------------------------------------------

def test_tiny_fleet_is_deterministic_and_megatron_shaped():
    a, b, c = tiny("fleet", seed=0), tiny("fleet", seed=0), tiny("fleet", seed=1)
    wa, wb, wc = (m.decoder.layers[0].self_attention.linear_qkv.weight.numpy() for m in (a, b, c))
    assert np.array_equal(wa, wb) and not np.array_equal(wa, wc)
    assert [layer.layer_number for layer in a.decoder.layers] == [1, 2, 3]  # counted from 1
    assert not a.training
    with pytest.raises(TypeError):
        tiny("fleet", no_such_field=1)
    with pytest.raises(ValueError, match="num_kv_heads"):
        FleetConfig(num_attention_heads=4, num_kv_heads=3)


def test_model_is_causal_and_batch_consistent():
    model = tiny("fleet", seed=0, num_layers=2)
    ids = paddle.to_tensor([[5, 9, 3, 7, 1], [8, 2, 6, 4, 10]], dtype="int64")
    with paddle.no_grad():
        both = model(ids).numpy()
        first = model(ids[:1]).numpy()
        prefix = model(ids[:1, :3]).numpy()
        via_hidden = model.output_layer(model.hidden_states(ids)).numpy()
    assert both.shape == (2, 5, 128)
    np.testing.assert_allclose(both[:1], first, atol=1e-5)
    np.testing.assert_allclose(first[:, :3], prefix, atol=1e-5)  # later tokens do not leak back
    np.testing.assert_array_equal(both, via_hidden)


# --- patching: parity with the oracle -------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, {"num_layers": 4, "num_kv_heads": 4}])
def test_paged_matches_full_forward(overrides):
    model = tiny("fleet", seed=3, **overrides)
    ref_tokens, ref_logits = reference_greedy(model, PROMPTS, NEW_TOKENS)
    handle = patch_fleet.patch_fleet_model(model)
    tokens, logits = paged_greedy(handle, PROMPTS, NEW_TOKENS, block_size=4, seed=1)
    handle.unpatch()
    assert tokens == ref_tokens
    assert max_diff(logits, ref_logits) < 1e-4


def test_handle_attributes_and_layer_ids():
    model = tiny("fleet", seed=0)
    handle = patch_fleet.patch_fleet_model(model)
    assert sorted(handle.layer_ids.values()) == [0, 1, 2]
    assert handle.layer_ids["decoder.layers.0.self_attention.core_attention"] == 0
    for layer in model.decoder.layers:
        assert layer.self_attention.core_attention.layer_id == layer.layer_number - 1
        assert layer.self_attention.core_attention.backend is handle.backend
    assert (handle.num_layers, handle.num_kv_heads, handle.head_dim) == (3, 2, 16)
    assert (handle.vocab_size, handle.max_model_len, handle.eos_token_id) == (128, 256, 2)
    assert handle.sliding_windows == {} and handle.family == "fleet"
    with pytest.raises(ValueError, match="already patched"):
        patch_fleet.patch_fleet_model(model)
    handle.unpatch()


def test_unpatch_restores_original_objects_and_outputs():
    model = tiny("fleet", seed=0)
    originals = [layer.self_attention.core_attention for layer in model.decoder.layers]
    before = full_forward_logits(model, PROMPTS[0])
    handle = patch_fleet.patch_fleet_model(model)
    assert all(layer.self_attention.core_attention is not o for layer, o in zip(model.decoder.layers, originals))
    handle.unpatch()
    assert all(layer.self_attention.core_attention is o for layer, o in zip(model.decoder.layers, originals))
    np.testing.assert_array_equal(full_forward_logits(model, PROMPTS[0]), before)
    handle.unpatch()  # a second unpatch is a no-op


# --- the off-by-one and other ways to get it wrong ------------------------------------------

@pytest.mark.parametrize("ids", [[1, 2, 3], [0, 1, 1], [-1, 0, 1], [0, 2]])
def test_check_layer_ids_rejects_bad_ids(ids):
    with pytest.raises(ValueError, match="0-based"):
        patch_fleet.check_layer_ids({f"layer{i}": v for i, v in enumerate(ids)})


def test_one_based_layer_number_is_rejected(monkeypatch):
    """The production bug: layer_number (1..L) used as a 0-based cache id."""
    model = tiny("fleet", seed=0)
    monkeypatch.setattr(patch_fleet, "fleet_layer_id", lambda layer: layer.layer_number)
    with pytest.raises(ValueError, match=r"got \{.*: 3\}"):
        patch_fleet.patch_fleet_model(model)
    # A refused patch leaves the model untouched.
    assert all(isinstance(layer.self_attention.core_attention, DotProductAttention) for layer in model.decoder.layers)


def test_forced_off_by_one_fails_or_diverges(monkeypatch, oracle):
    """Forced past validation, ids 1..L: the last layer has no cache; clamping it collides."""
    model, ref_logits = oracle
    monkeypatch.setattr(patch_fleet, "check_layer_ids", lambda layer_ids: None)

    monkeypatch.setattr(patch_fleet, "fleet_layer_id", lambda layer: layer.layer_number)
    with (
        patch_fleet.patch_fleet_model(model) as handle,
        pytest.raises(ValueError, match="layer_id 3 out of range"),
    ):
        paged_greedy(handle, PROMPTS, NEW_TOKENS)

    # "Fixing" the index error by clamping puts layers 2 and 3 on one cache: they overwrite
    # each other's K/V, and the logits leave the oracle.
    monkeypatch.setattr(patch_fleet, "fleet_layer_id", lambda layer: min(layer.layer_number, 2))
    with patch_fleet.patch_fleet_model(model) as handle:
        _, logits = paged_greedy(handle, PROMPTS, NEW_TOKENS)
    assert max_diff(logits, ref_logits) > 1e-2


def test_one_based_ids_with_oversized_cache_waste_layer_zero(monkeypatch):
    """With a cache one layer too big, the shift is silent: same logits, layer 0 never written."""
    model = tiny("fleet", seed=0)
    monkeypatch.setattr(patch_fleet, "check_layer_ids", lambda layer_ids: None)
    monkeypatch.setattr(patch_fleet, "fleet_layer_id", lambda layer: layer.layer_number)
    prompt = PROMPTS[2]
    md = AttentionMetadata.build([len(prompt)], [0], [[2, 0, 1]], block_size=4)
    kv_cache = PagedKVCache(4, num_blocks=3, block_size=4, num_kv_heads=2, head_dim=16)
    with patch_fleet.patch_fleet_model(model) as handle, paddle.no_grad(), forward_context(md, kv_cache):
        ids = paddle.to_tensor([prompt], dtype="int64")
        logits = handle.compute_logits(ids, md.positions.reshape([1, -1]),
                                       paddle.arange(len(prompt), dtype="int64"))
    np.testing.assert_allclose(logits.numpy(), full_forward_logits(model, prompt), atol=1e-4)
    assert not kv_cache.key_cache(0).numpy().any() and kv_cache.key_cache(3).numpy().any()


class DoubleRopeAttention(patch_fleet.PagedCoreAttention):
    """The other classic mistake: attention that rotates q/k again (the model already did)."""

    def forward(self, query, key, value, attention_mask=None):
        positions = patch_fleet.get_forward_context().metadata.positions.reshape([1, -1])
        cos, sin = rope_cos_sin(positions, query.shape[-1], FleetConfig().rope_theta)
        return super().forward(apply_rotary(query, cos, sin), apply_rotary(key, cos, sin), value)


def test_double_rope_diverges(oracle):
    model, ref_logits = oracle
    with patch_fleet.patch_fleet_model(model) as handle:
        for layer in model.decoder.layers:
            paged = layer.self_attention.core_attention
            layer.self_attention.core_attention = DoubleRopeAttention(paged.layer_id, paged.backend, paged.scale)
        _, logits = paged_greedy(handle, PROMPTS, NEW_TOKENS)
    assert max_diff(logits, ref_logits) > 1e-2


# --- errors with a clear message -------------------------------------------------------------

def test_patched_attention_outside_forward_context_raises():
    model = tiny("fleet", seed=0)
    with (
        patch_fleet.patch_fleet_model(model),
        pytest.raises(RuntimeError, match="outside `fleetlab.forward_context"),
    ):
        model(paddle.to_tensor([[1, 2, 3]], dtype="int64"))


def test_patched_attention_needs_a_packed_batch_of_one():
    model = tiny("fleet", seed=0)
    md = AttentionMetadata.build([3, 3], [0, 0], [[0], [1]], block_size=4)
    kv_cache = PagedKVCache(3, num_blocks=2, block_size=4, num_kv_heads=2, head_dim=16)
    with (
        patch_fleet.patch_fleet_model(model), forward_context(md, kv_cache),
        pytest.raises(ValueError, match="batch 2"),
    ):
        model(paddle.to_tensor([[1, 2, 3], [4, 5, 6]], dtype="int64"))


def test_non_fleet_model_is_refused():
    with pytest.raises(TypeError, match="no Fleet-style layers"):
        patch_fleet.patch_fleet_model(paddle.nn.Linear(2, 2))


def test_unpatched_handle_refuses_to_run_and_steps_run_without_grad():
    # Once unpatched, the model's own attention would mix the packed requests: refuse.
    model = tiny("fleet", seed=0)
    handle = patch_fleet.patch_fleet_model(model)
    md = AttentionMetadata.build([3], [0], [[0]], block_size=4)
    kv_cache = PagedKVCache.for_handle(handle, num_blocks=1, block_size=4)
    ids = paddle.to_tensor([[1, 2, 3]], dtype="int64")
    with forward_context(md, kv_cache):
        logits = handle.compute_logits(ids, md.positions.reshape([1, -1]), paddle.to_tensor([2]))
        assert logits.shape == [1, 128] and logits.stop_gradient
        with pytest.raises(ValueError, match="fleet.*metadata covers 3 tokens"):
            handle.compute_logits(ids[:, :2], md.positions.reshape([1, -1])[:, :2], paddle.to_tensor([1]))
        handle.unpatch()
        with pytest.raises(RuntimeError, match="unpatched"):
            handle.compute_logits(ids, md.positions.reshape([1, -1]), paddle.to_tensor([2]))


def test_backend_may_be_a_name_a_class_or_an_instance():
    from fleetlab.attention.tiled import TiledBackend

    for backend in ("tiled", TiledBackend, TiledBackend()):
        handle = patch_fleet.patch_fleet_model(tiny("fleet", seed=0, num_layers=1), backend=backend)
        assert type(handle.backend) is TiledBackend
    with pytest.raises(TypeError, match="registered name"):
        patch_fleet.patch_fleet_model(tiny("fleet", seed=0, num_layers=1), backend=3)
