"""Move a trained PaddleFormers Llama into fleetlab's Fleet-style model (same function, other layout).

Both are pre-norm decoders with RMSNorm, rotate-half RoPE, grouped-query attention and a SwiGLU
MLP; only the module tree and the packing of the weights differ:

    Llama (PaddleFormers)                          Fleet-style (Megatron names)
    model.embed_tokens            [vocab, hidden]  embedding
    layers.i.self_attn.{q,k,v}_proj [hidden, *]    decoder.layers.i.self_attention.linear_qkv  [hidden, q|k|v]
    layers.i.self_attn.o_proj                      ...self_attention.linear_proj
    layers.i.mlp.{gate,up}_proj   [hidden, ffn]    ...mlp.linear_fc1                            [hidden, gate|up]
    layers.i.mlp.down_proj                         ...mlp.linear_fc2
    layers.i.input_layernorm / post_attention_layernorm -> input_layernorm / pre_mlp_layernorm
    model.norm                                     decoder.final_layernorm
    lm_head                       [vocab, hidden]  output_layer                                 [hidden, vocab]

So ``python -m fleetlab serve --model tiny --model-impl fleet`` serves the shipped trained
weights through the Fleet-style model (its ``core_attention`` is what gets patched), and gives
the same tokens as the PaddleFormers model.
"""

from __future__ import annotations

import numpy as np

from fleetlab.models.fleet import FleetConfig, FleetForCausalLM


def fleet_from_llama(model) -> FleetForCausalLM:
    """A :class:`FleetForCausalLM` (eval mode) computing what the PaddleFormers Llama ``model`` computes.

    Raises ``ValueError`` for a Llama this layout cannot hold: biases, RoPE scaling, an
    activation other than SiLU.
    """
    cfg = model.config
    if getattr(cfg, "model_type", None) != "llama":
        raise ValueError(f"fleet_from_llama: a Llama is needed, got model_type={getattr(cfg, 'model_type', None)!r}")
    rope_scaling = getattr(cfg, "rope_scaling", None)
    problems = [name for name, bad in (("attention_bias", getattr(cfg, "attention_bias", False)),
                                       ("mlp_bias", getattr(cfg, "mlp_bias", False)),
                                       ("rope_scaling", rope_scaling not in (None, {}) and
                                        rope_scaling.get("rope_type", "default") != "default"),
                                       ("hidden_act", getattr(cfg, "hidden_act", "silu") != "silu")) if bad]
    if problems:
        raise ValueError(f"fleet_from_llama: the Fleet-style model has no room for {problems}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else cfg.eos_token_id
    config = FleetConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
        ffn_hidden_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=float(getattr(cfg, "rope_theta", 10000.0)), rms_norm_eps=cfg.rms_norm_eps,
        eos_token_id=eos, bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id or 0, dtype="float32")
    fleet = FleetForCausalLM(config)
    src = {k: v.numpy() for k, v in model.state_dict().items()}
    state = {"embedding.weight": src["model.embed_tokens.weight"],
             "decoder.final_layernorm.weight": src["model.norm.weight"],
             # lm_head keeps [vocab, hidden]; a Linear keeps [in, out]. Tied models have no lm_head.
             "output_layer.weight": src.get("lm_head.weight", src["model.embed_tokens.weight"]).T}
    for i in range(cfg.num_hidden_layers):
        a, b = f"model.layers.{i}.", f"decoder.layers.{i}."
        state[b + "input_layernorm.weight"] = src[a + "input_layernorm.weight"]
        state[b + "pre_mlp_layernorm.weight"] = src[a + "post_attention_layernorm.weight"]
        state[b + "self_attention.linear_qkv.weight"] = np.concatenate(
            [src[a + f"self_attn.{p}_proj.weight"] for p in "qkv"], axis=1)
        state[b + "self_attention.linear_proj.weight"] = src[a + "self_attn.o_proj.weight"]
        state[b + "mlp.linear_fc1.weight"] = np.concatenate(
            [src[a + "mlp.gate_proj.weight"], src[a + "mlp.up_proj.weight"]], axis=1)
        state[b + "mlp.linear_fc2.weight"] = src[a + "mlp.down_proj.weight"]
    expected = fleet.state_dict()
    if set(state) != set(expected):
        raise RuntimeError(f"fleet_from_llama: key mismatch {sorted(set(state) ^ set(expected))}")
    for key, array in state.items():
        if tuple(array.shape) != tuple(expected[key].shape):
            raise ValueError(f"fleet_from_llama: {key} would be {array.shape}, the model wants {expected[key].shape}")
    fleet.set_state_dict({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items()})
    fleet.eval()
    return fleet
