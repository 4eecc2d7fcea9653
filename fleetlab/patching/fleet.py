"""Module surgery for Fleet/Megatron-style models: swap each layer's ``core_attention``.

In a Fleet-style model RoPE is applied in ``self_attention`` before ``core_attention``
(see :mod:`fleetlab.models.fleet`), so ``core_attention`` receives rotated q/k/v and
does nothing but attention. Replacing that one sub-layer with :class:`PagedCoreAttention`
routes the model's attention through fleetlab's paged KV cache; everything else (the
projections, RoPE, norms, MLP) stays the model's own code.
"""

from __future__ import annotations

import logging

import paddle
from paddle import nn

from fleetlab.attention.backend import AttentionBackend, make_attention_backend
from fleetlab.attention.context import get_forward_context
from fleetlab.patching.handle import PatchHandle

logger = logging.getLogger(__name__)

_ATTENTION_NAMES = ("self_attention", "self_attn")  # Megatron spelling, then the HF-style one


class PagedCoreAttention(nn.Layer):
    """Drop-in ``core_attention`` that attends over the paged KV cache of the current step.

    ``forward(query [1, T, heads, head_dim], key/value [1, T, kv_heads, head_dim])
    -> [1, T, heads * head_dim]``, with ``T`` the step's packed tokens and q/k already
    rotated. It writes this layer's K/V into ``kv_cache`` under ``layer_id`` and attends
    through the block tables of the step's metadata (both from ``get_forward_context()``).
    """

    def __init__(self, layer_id: int, backend: AttentionBackend, scale: float):
        super().__init__()
        self.layer_id = layer_id
        self.backend = backend
        self.scale = scale

    def forward(self, query, key, value, attention_mask=None):
        ctx = get_forward_context()  # raises a clear RuntimeError outside forward_context
        if attention_mask is not None:
            raise ValueError("PagedCoreAttention takes no attention_mask: visibility comes from the "
                             "step's metadata (cu_seqlens_q, seq_lens_kv, block_tables)")
        batch, num_tokens, num_heads, head_dim = query.shape
        if batch != 1:
            raise ValueError(f"PagedCoreAttention runs packed steps of batch 1 ([1, T, ...]); got batch {batch}")
        if num_tokens != ctx.metadata.num_tokens:
            raise ValueError(f"query holds {num_tokens} tokens but the step's metadata schedules "
                             f"{ctx.metadata.num_tokens}")
        out = self.backend.forward(
            self.layer_id, query[0], key[0], value[0], ctx.kv_cache, ctx.attn_metadata(self.backend), scale=self.scale
        )
        return out.reshape([1, num_tokens, num_heads * head_dim])


class FleetPatchHandle(PatchHandle):
    """:class:`PatchHandle` of a patched Fleet-style model (see :func:`patch_fleet_model`)."""

    def embed(self, input_ids):
        with paddle.no_grad():
            return self.model.embedding(input_ids)

    def compute_logits(self, input_ids, positions, logits_indices, inputs_embeds=None):
        """Logits ``[B, vocab]`` at ``logits_indices [B]`` of the packed step ``input_ids [1, T]``.

        ``positions`` int64 ``[1, T]``; must run inside ``forward_context``. The output
        layer runs on the selected rows only: the other ``T - B`` tokens are prompt tokens
        whose logits no one samples from.
        """
        self._check_step(input_ids, positions, logits_indices)
        with paddle.no_grad():
            hidden = self.model.hidden_states(input_ids, position_ids=positions, inputs_embeds=inputs_embeds)
            rows = paddle.gather(hidden[0], logits_indices.astype("int64"), axis=0)  # [B, hidden]
            return self.model.output_layer(rows)


def fleet_layer_id(layer) -> int:
    """The 0-based KV-cache id of a decoder layer.

    Megatron and Fleet number their layers from 1 (``layer_number``); a paged KV cache
    is indexed from 0. The production engine's first Fleet backend used ``layer_number``
    directly as the cache index: off by one. With a cache of ``L`` layers the last layer
    indexes past the end (``PagedKVCache`` raises; an unchecked device index reads memory
    that is not its own). With a cache sized ``max(id) + 1`` the shift is silent and
    wastes one layer of cache. And any collision (say, clamping the id to silence the
    error) makes two layers overwrite each other's K/V and changes the logits. Hence
    ``- 1``, and :func:`check_layer_ids` before anything runs.
    """
    return layer.layer_number - 1


def check_layer_ids(layer_ids: dict[str, int]) -> None:
    """Raise ``ValueError`` unless the ids are exactly ``0..L-1``, each used once."""
    ids = sorted(layer_ids.values())
    if ids != list(range(len(ids))):
        raise ValueError(
            f"Fleet layer ids must be 0..{len(ids) - 1}, each once; got {layer_ids}. "
            "Is a 1-based layer_number used as a 0-based cache id?"
        )


def find_fleet_attentions(model) -> list[tuple[str, nn.Layer, nn.Layer]]:
    """``[(name, layer, attention)]`` for each sub-layer that has a ``layer_number`` and an
    attention child (``self_attention`` or ``self_attn``) holding ``core_attention``."""
    found = []
    for name, layer in model.named_sublayers():
        if not hasattr(layer, "layer_number"):
            continue
        for attr in _ATTENTION_NAMES:
            attention = getattr(layer, attr, None)
            if attention is not None and hasattr(attention, "core_attention"):
                found.append((f"{name}.{attr}.core_attention", layer, attention))
                break
    return found


def patch_fleet_model(model, backend="tiled") -> FleetPatchHandle:
    """Route every ``core_attention`` of a Fleet-style model through paged attention.

    ``backend``: a registered backend name, class or instance. Returns a handle whose
    ``compute_logits`` runs packed steps under ``forward_context`` and whose
    ``unpatch()`` puts the original ``core_attention`` objects back.
    """
    found = find_fleet_attentions(model)
    if not found:
        raise TypeError(f"{type(model).__name__} has no Fleet-style layers "
                        "(a `layer_number` and a `self_attention.core_attention`)")
    if any(isinstance(attention.core_attention, PagedCoreAttention) for _, _, attention in found):
        raise ValueError("model is already patched: call unpatch() on its handle first")
    layer_ids = {name: fleet_layer_id(layer) for name, layer, _ in found}
    check_layer_ids(layer_ids)
    backend = make_attention_backend(backend)

    undo = []
    for name, _, attention in found:
        original = attention.core_attention
        scale = getattr(original, "softmax_scale", None) or model.config.head_dim ** -0.5
        attention.core_attention = PagedCoreAttention(layer_ids[name], backend, scale)
        undo.append(lambda attention=attention, original=original: setattr(attention, "core_attention", original))
    logger.debug("patched %d Fleet core_attention layers -> %s", len(found), type(backend).__name__)

    config = model.config
    return FleetPatchHandle(
        model, "fleet", backend, layer_ids, undo,
        num_layers=len(found), num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        vocab_size=config.vocab_size, max_model_len=config.max_position_embeddings,
        dtype=config.dtype, sliding_windows={}, eos_token_id=config.eos_token_id,
    )
