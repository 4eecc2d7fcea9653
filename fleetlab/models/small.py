"""Tiny random-init PaddleFormers models, one per supported family, for tests and notebooks.

Each is a real PaddleFormers ``*ForCausalLM`` with a small config (hidden 64, 3 layers,
4 query heads over 2 KV heads of 16 dims, vocabulary 128), so it builds in milliseconds
on CPU and still exercises its family's quirks: Gemma3, GPT-OSS and Phi3 mix
sliding-window layers (window 8) with full-attention layers, GPT-OSS has attention sinks
and a mixture of experts, Gemma3 scales queries by ``query_pre_attn_scalar``.
"""

from __future__ import annotations

import contextlib
import copy

import paddle
import paddleformers.transformers as pft

from fleetlab.models.random_init import check_dtype, seeded

# Shared by every family. The initializer range is wider than a real model's 0.02 so
# that a random model's logits are peaked: greedy parity tests compare argmaxes, and
# near-uniform logits would make those ties that float noise can flip.
_COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # The fused RMSNorm kernel is GPU-only; the plain one runs everywhere.
    "fuse_rms_norm": False,
    "dtype": "float32",
}
_MIXED = ["sliding_attention", "full_attention", "sliding_attention"]

# family -> (config class name, model class name, family-specific config)
_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {}),
    # Phi3 passes its window to every layer's attention call but masks by layer type;
    # mixing the two types keeps that trap in every test.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": 8, "layer_types": _MIXED}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"sliding_window": 8, "layer_types": _MIXED, "query_pre_attn_scalar": 32}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {"sliding_window": 8, "layer_types": _MIXED, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "intermediate_size": 64,
                 "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 64}}),
}
TINY_FAMILIES = tuple(_FAMILIES)


def tiny_paddleformers(family: str, seed: int = 0, **overrides):
    """A small random-init PaddleFormers causal LM of ``family``, in eval mode.

    Args:
      family: one of ``TINY_FAMILIES`` (``"llama"``, ``"ernie4_5"``, ``"phi3"``,
        ``"gemma3"``, ``"gpt_oss"``).
      seed: the weights are a pure function of ``(family, seed, overrides)``; Paddle's
        global random state is restored afterwards.
      overrides: config fields to change (e.g. ``num_hidden_layers=2``, ``sliding_window=4``);
        ``dtype="bfloat16"`` or ``"float16"`` casts the (float32-initialised) weights. Half
        precision runs on a GPU only: ``LLM`` refuses it on a CPU, naming dtype and device.

    Token ids: pad 0, bos 1, eos 2, all inside the 128-token vocabulary.
    """
    if family not in _FAMILIES:
        raise ValueError(f"unknown tiny PaddleFormers family {family!r}; supported: {list(TINY_FAMILIES)}")
    config_name, model_name, extra = _FAMILIES[family]
    # Copies: configs keep (and PaddleFormers edits in place) the lists and dicts they get.
    kwargs = {**copy.deepcopy({**_COMMON, **extra}), **overrides}
    # Layer types must follow the layer count when a caller changes it.
    if "layer_types" in kwargs and "layer_types" not in overrides:
        n = kwargs["num_hidden_layers"]
        kwargs["layer_types"] = [_MIXED[i % len(_MIXED)] for i in range(n)]
    dtype = check_dtype(kwargs.pop("dtype", "float32"))
    with seeded(seed), _default_dtype("float32"):
        config = getattr(pft, config_name)(**kwargs, dtype=dtype)
        model = getattr(pft, model_name)(config)
    if dtype != "float32":
        model.to(dtype=dtype)  # initialised in float32 (the same weights for every dtype), then cast
    model.eval()
    return model


@contextlib.contextmanager
def _default_dtype(dtype: str):
    previous = paddle.get_default_dtype()
    paddle.set_default_dtype(dtype)
    try:
        yield
    finally:
        paddle.set_default_dtype(previous)
