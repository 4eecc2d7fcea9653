"""A small Fleet/Megatron-style decoder: the model whose attention fleetlab patches first.

It mirrors the module tree of Megatron-LM's ``GPTModel`` (which PaddleFleet follows), so
that the names a reader meets here are the names of the real thing::

    FleetForCausalLM
      embedding                       token ids -> hidden states
      decoder.layers[i]               TransformerLayer, layer_number = i + 1 (counted from 1!)
        input_layernorm               RMSNorm
        self_attention
          linear_qkv                  hidden -> [q | k | v]
          core_attention              DotProductAttention: softmax(q k^T) v, causal
          linear_proj                 heads * head_dim -> hidden
        pre_mlp_layernorm             RMSNorm
        mlp.linear_fc1, linear_fc2    SwiGLU
      decoder.final_layernorm         RMSNorm
      output_layer                    hidden -> vocab logits

RoPE is applied in ``self_attention`` *before* ``core_attention``, so ``core_attention``
only sees already-rotated queries and keys: that is what makes it the right seam to swap
for paged attention.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import paddle
import paddle.nn.functional as F
from paddle import nn

from fleetlab.models.random_init import check_dtype, seeded


@dataclass(slots=True)
class FleetConfig:
    """Shape and token ids of a :class:`FleetForCausalLM`."""

    vocab_size: int = 128
    hidden_size: int = 64
    num_layers: int = 3
    num_attention_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention: each K/V head serves heads / kv_heads queries
    head_dim: int = 16
    ffn_hidden_size: int = 128
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    eos_token_id: int = 2
    bos_token_id: int = 1
    pad_token_id: int = 0
    dtype: str = "float32"

    def __post_init__(self):
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE; got {self.head_dim}")


def rope_cos_sin(position_ids: paddle.Tensor, head_dim: int, theta: float):
    """Rotary tables for ``position_ids [b, s]``: ``cos, sin`` each ``[b, s, 1, head_dim]``."""
    inv_freq = 1.0 / theta ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim)
    freqs = position_ids.astype("float32").unsqueeze(-1) * inv_freq  # [b, s, head_dim / 2]
    emb = paddle.concat([freqs, freqs], axis=-1).unsqueeze(2)
    return emb.cos(), emb.sin()


def apply_rotary(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """Rotate ``x [b, s, heads, head_dim]`` by position (the "rotate half" RoPE form)."""
    half = x.shape[-1] // 2
    rotated = paddle.concat([-x[..., half:], x[..., :half]], axis=-1)
    return (x.astype("float32") * cos + rotated.astype("float32") * sin).astype(x.dtype)


class RMSNorm(nn.Layer):
    """``x / rms(x) * weight`` over the last axis, computed in float32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        x32 = x.astype("float32")
        x32 = x32 * paddle.rsqrt(x32.pow(2).mean(axis=-1, keepdim=True) + self.eps)
        return x32.astype(x.dtype) * self.weight


class DotProductAttention(nn.Layer):
    """Causal softmax attention on already-rotated q/k (Megatron's ``core_attention``).

    ``forward(query [b, s, heads, head_dim], key/value [b, s, kv_heads, head_dim],
    attention_mask=None) -> [b, s, heads * head_dim]``. ``attention_mask``, if given, is
    an additive float mask broadcastable to ``[b, heads, s, s]``, added on top of the
    causal mask. It has no weights: all its state is ``softmax_scale``.
    """

    def __init__(self, head_dim: int):
        super().__init__()
        self.softmax_scale = head_dim ** -0.5

    def forward(self, query, key, value, attention_mask=None):
        b, s, heads, head_dim = query.shape
        groups = heads // key.shape[2]
        # [b, s, h, d] -> [b, h, s, d]; each K/V head is repeated for its query group.
        q = query.transpose([0, 2, 1, 3])
        k = paddle.repeat_interleave(key, groups, axis=2).transpose([0, 2, 1, 3])
        v = paddle.repeat_interleave(value, groups, axis=2).transpose([0, 2, 1, 3])
        scores = paddle.matmul(q, k, transpose_y=True).astype("float32") * self.softmax_scale
        future = paddle.triu(paddle.ones([s, s], dtype="bool"), diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = F.softmax(scores, axis=-1).astype(v.dtype)
        out = paddle.matmul(probs, v).transpose([0, 2, 1, 3])  # [b, s, h, d]
        return out.reshape([b, s, heads * head_dim])


class SelfAttention(nn.Layer):
    """Project to q/k/v, apply RoPE, call ``core_attention``, project back to hidden."""

    def __init__(self, config: FleetConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.linear_qkv = nn.Linear(config.hidden_size, qkv_size, bias_attr=False)
        self.core_attention = DotProductAttention(config.head_dim)
        self.linear_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias_attr=False)

    def forward(self, hidden, cos, sin):
        b, s, _ = hidden.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = paddle.split(self.linear_qkv(hidden), [q_size, kv_size, kv_size], axis=-1)
        q = apply_rotary(q.reshape([b, s, self.num_heads, self.head_dim]), cos, sin)
        k = apply_rotary(k.reshape([b, s, self.num_kv_heads, self.head_dim]), cos, sin)
        v = v.reshape([b, s, self.num_kv_heads, self.head_dim])
        return self.linear_proj(self.core_attention(q, k, v))


class MLP(nn.Layer):
    """SwiGLU: ``linear_fc2(silu(gate) * up)`` with ``[gate | up] = linear_fc1(x)``."""

    def __init__(self, config: FleetConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias_attr=False)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias_attr=False)

    def forward(self, x):
        gate, up = paddle.chunk(self.linear_fc1(x), 2, axis=-1)
        return self.linear_fc2(F.silu(gate) * up)


class TransformerLayer(nn.Layer):
    """One pre-norm decoder layer. ``layer_number`` counts from 1, as Megatron and Fleet do."""

    def __init__(self, config: FleetConfig, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attention = SelfAttention(config)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden, cos, sin):
        hidden = hidden + self.self_attention(self.input_layernorm(hidden), cos, sin)
        return hidden + self.mlp(self.pre_mlp_layernorm(hidden))


class TransformerBlock(nn.Layer):
    """The stack of layers plus the final norm (Megatron's ``decoder``)."""

    def __init__(self, config: FleetConfig):
        super().__init__()
        self.layers = nn.LayerList([TransformerLayer(config, i + 1) for i in range(config.num_layers)])
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class FleetForCausalLM(nn.Layer):
    """A Fleet/Megatron-style causal LM (see the module docstring for its tree)."""

    def __init__(self, config: FleetConfig):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.decoder = TransformerBlock(config)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias_attr=False)
        if config.dtype != "float32":
            self.to(dtype=config.dtype)

    def hidden_states(self, input_ids: paddle.Tensor, position_ids: paddle.Tensor | None = None,
                      inputs_embeds: paddle.Tensor | None = None):
        """Final-norm hidden states ``[b, s, hidden]`` for ``input_ids [b, s]``.

        ``position_ids [b, s]`` defaults to ``0..s-1`` per row; a packed batch of several
        requests passes each token's position within its own request. ``inputs_embeds``
        ``[b, s, hidden]``, when given, is used instead of embedding ``input_ids``.
        """
        if position_ids is None:
            position_ids = paddle.arange(input_ids.shape[1], dtype="int64").expand(input_ids.shape)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        hidden = self.embedding(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.decoder.layers:
            hidden = layer(hidden, cos, sin)
        return self.decoder.final_layernorm(hidden)

    def forward(self, input_ids: paddle.Tensor, position_ids: paddle.Tensor | None = None):
        """Logits ``[b, s, vocab]`` for ``input_ids [b, s]``."""
        return self.output_layer(self.hidden_states(input_ids, position_ids))


def tiny_fleet(seed: int = 0, **overrides) -> FleetForCausalLM:
    """A small random-init :class:`FleetForCausalLM` in eval mode, the same for the same seed.

    ``overrides`` replace :class:`FleetConfig` fields (an unknown name raises ``TypeError``).
    Paddle's global random state is restored afterwards, as in ``tiny_paddleformers``.
    """
    config = dataclasses.replace(FleetConfig(), **overrides)
    config.dtype = check_dtype(config.dtype)
    with seeded(seed):
        model = FleetForCausalLM(config)
    model.eval()
    return model
