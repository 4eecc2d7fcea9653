"""PagedKVCache: shapes, slot writes (skipping -1), in-place updates, memory arithmetic, errors."""

from types import SimpleNamespace

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.lab.lessons.kv_memory import bytes_for_tokens


def _cache(**kw):
    args = {"num_layers": 2, "num_blocks": 5, "block_size": 4, "num_kv_heads": 2, "head_dim": 3}
    args.update(kw)
    return PagedKVCache(**args)


def _kv(num_tokens, heads=2, dim=3, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((num_tokens, heads, dim)).astype("float32")
    v = rng.standard_normal((num_tokens, heads, dim)).astype("float32")
    return k, v


def test_shapes_and_dtype():
    cache = _cache(dtype=paddle.bfloat16)
    assert cache.dtype == "bfloat16"
    for layer in range(2):
        for t in (cache.key_cache(layer), cache.value_cache(layer)):
            assert list(t.shape) == [5, 4, 2, 3]
            assert t.dtype == paddle.bfloat16
    assert _cache(dtype="float16").key_cache(0).dtype == paddle.float16


def test_write_lands_in_slot_and_skips_minus_one():
    cache = _cache()
    k_before = cache.key_cache(1)  # must see the write: the update is in place
    k, v = _kv(4)
    slots = paddle.to_tensor([9, -1, 0, 19], dtype="int64")
    cache.write(1, paddle.to_tensor(k), paddle.to_tensor(v), slots)
    kc, vc = k_before.numpy(), cache.value_cache(1).numpy()
    expected_k = np.zeros_like(kc)
    expected_v = np.zeros_like(vc)
    for t, slot in enumerate([9, -1, 0, 19]):
        if slot >= 0:
            expected_k[slot // 4, slot % 4] = k[t]
            expected_v[slot // 4, slot % 4] = v[t]
    np.testing.assert_array_equal(kc, expected_k)
    np.testing.assert_array_equal(vc, expected_v)
    # The other layer is untouched.
    assert not cache.key_cache(0).numpy().any()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(-1, 19), min_size=1, max_size=12), st.sampled_from(["float32", "float16"]))
def test_write_matches_numpy_scatter(raw_slots, dtype):
    # Distinct real slots, any number of -1s, in any order.
    seen, slots = set(), []
    for s in raw_slots:
        slots.append(s if s == -1 or s not in seen else -1)
        seen.add(s)
    cache = _cache(dtype=dtype)
    k, v = _kv(len(slots), seed=len(slots))
    expected = np.zeros((2, 5, 4, 2, 3), dtype)
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[0, slot // 4, slot % 4], expected[1, slot // 4, slot % 4] = k[t], v[t]
    cache.write(1, paddle.to_tensor(k), paddle.to_tensor(v), paddle.to_tensor(slots, dtype="int64"))
    np.testing.assert_array_equal(cache.key_cache(1).numpy(), expected[0])
    np.testing.assert_array_equal(cache.value_cache(1).numpy(), expected[1])


def test_write_all_skipped_and_overwrite():
    cache = _cache()
    k, v = _kv(2)
    cache.write(0, paddle.to_tensor(k), paddle.to_tensor(v), paddle.to_tensor([-1, -1], dtype="int64"))
    assert not cache.key_cache(0).numpy().any()
    cache.write(0, paddle.to_tensor(k[:1]), paddle.to_tensor(v[:1]), paddle.to_tensor([6], dtype="int64"))
    k2, v2 = _kv(1, seed=1)
    cache.write(0, paddle.to_tensor(k2), paddle.to_tensor(v2), paddle.to_tensor([6], dtype="int32"))
    np.testing.assert_array_equal(cache.key_cache(0).numpy()[1, 2], k2[0])
    np.testing.assert_array_equal(cache.value_cache(0).numpy()[1, 2], v2[0])


def test_skipped_tokens_leave_slot_zero_alone():
    cache = _cache()
    k, v = _kv(3)
    cache.write(0, paddle.to_tensor(k[:1]), paddle.to_tensor(v[:1]), paddle.to_tensor([0], dtype="int64"))
    for slots in ([-1, -1, -1], [-1, 5, -1], [7, -1, 2]):
        before_k, before_v = cache.key_cache(0).numpy(), cache.value_cache(0).numpy()
        k2, v2 = _kv(3, seed=len(str(slots)))
        cache.write(0, paddle.to_tensor(k2), paddle.to_tensor(v2), paddle.to_tensor(slots, dtype="int64"))
        for t, slot in enumerate(slots):
            if slot >= 0:
                before_k[slot // 4, slot % 4], before_v[slot // 4, slot % 4] = k2[t], v2[t]
        np.testing.assert_array_equal(cache.key_cache(0).numpy(), before_k)
        np.testing.assert_array_equal(cache.value_cache(0).numpy(), before_v)
    np.testing.assert_array_equal(cache.key_cache(0).numpy()[0, 0], k[0])


def test_write_casts_to_cache_dtype():
    cache = _cache(dtype="bfloat16")
    k, v = _kv(1)
    cache.write(0, paddle.to_tensor(k), paddle.to_tensor(v), paddle.to_tensor([3], dtype="int64"))
    got = cache.key_cache(0).astype("float32").numpy()[0, 3]
    np.testing.assert_allclose(got, k[0], rtol=1e-2)


@pytest.mark.parametrize(
    "layer, k_shape, v_shape, n_slots, match",
    [
        (2, (1, 2, 3), (1, 2, 3), 1, "layer_id"),
        (-1, (1, 2, 3), (1, 2, 3), 1, "layer_id"),
        (0, (1, 3, 3), (1, 2, 3), 1, "key"),
        (0, (1, 2, 3), (1, 2, 4), 1, "value"),
        (0, (2, 2, 3), (2, 2, 3), 1, "slot_mapping"),
        (0, (2, 2, 3), (1, 2, 3), 2, "slot_mapping"),
    ],
)
def test_write_errors(layer, k_shape, v_shape, n_slots, match):
    cache = _cache()
    with pytest.raises(ValueError, match=match):
        cache.write(layer, paddle.zeros(k_shape), paddle.zeros(v_shape), paddle.zeros([n_slots], dtype="int64"))


def test_bad_layer_in_getters_and_bad_args():
    cache = _cache()
    with pytest.raises(ValueError, match="layer_id"):
        cache.key_cache(5)
    with pytest.raises(ValueError, match="layer_id"):
        cache.value_cache("0")
    with pytest.raises(ValueError, match="num_blocks"):
        _cache(num_blocks=0)
    with pytest.raises(TypeError, match="int8"):
        _cache(dtype="int8")


def test_memory_accounting():
    cache = _cache(dtype="bfloat16")
    per_token = 2 * 2 * 2 * 3 * 2  # K+V x layers x heads x dim x bytes
    assert bytes_for_tokens(cache, 0) == 0
    assert bytes_for_tokens(cache, 7) == 7 * per_token
    assert cache.bytes_allocated == 5 * 4 * per_token
    real = sum(t.numel().item() * t.element_size()
               for layer in range(2) for t in (cache.key_cache(layer), cache.value_cache(layer)))
    assert cache.bytes_allocated == real
    with pytest.raises(ValueError, match="num_tokens"):
        bytes_for_tokens(cache, -1)


def test_num_blocks_for_budget():
    per_block = 2 * 3 * 4 * 2 * 8 * 4  # K+V x layers x block x heads x dim x fp32
    args = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 8, "block_size": 4}
    assert PagedKVCache.num_blocks_for_budget(per_block * 10 + per_block - 1, **args) == 10
    assert PagedKVCache.num_blocks_for_budget(per_block, **args, dtype="float16") == 2
    with pytest.raises(ValueError, match="budget"):
        PagedKVCache.num_blocks_for_budget(per_block - 1, **args)


def test_for_handle():
    handle = SimpleNamespace(num_layers=3, num_kv_heads=1, head_dim=4, dtype="float16")
    cache = PagedKVCache.for_handle(handle, num_blocks=6, block_size=2)
    assert (cache.num_layers, cache.num_blocks, cache.block_size) == (3, 6, 2)
    assert (cache.num_kv_heads, cache.head_dim, cache.dtype) == (1, 4, "float16")
    assert list(cache.key_cache(2).shape) == [6, 2, 1, 4]
    handle.dtype = None  # a handle that does not know its dtype gets float32
    assert PagedKVCache.for_handle(handle, num_blocks=1, block_size=2).dtype == "float32"
