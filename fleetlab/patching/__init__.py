"""Attention patching: run a model library's own model on fleetlab's paged attention.

:func:`patch_model` takes a PaddleFormers causal LM (Llama, ERNIE-4.5, Phi3, Gemma3 text,
GPT-OSS) or a Fleet/Megatron-style model whose decoder layers hold a ``core_attention``
sub-layer, swaps its attention core for a fleetlab backend, and returns a
:class:`PatchHandle` that runs packed steps and undoes the patch.
"""

from __future__ import annotations

from fleetlab.patching.handle import PatchHandle, has_core_attention

__all__ = ["PatchHandle", "patch_model"]


def patch_model(model, backend="reference") -> PatchHandle:
    """Route ``model``'s attention through a fleetlab attention backend.

    ``backend``: a registered name (``"reference"``, ``"triton"``), an ``AttentionBackend``
    subclass, or an instance (shared by every patched layer).

    Fleet-style models (a ``core_attention`` sub-layer in their decoder layers) get
    their ``core_attention`` replaced; PaddleFormers models get fleetlab's function
    registered in their attention interface. Either way the model must then run inside
    ``fleetlab.forward_context(metadata, kv_cache)``, through
    ``handle.compute_logits(input_ids [1, T], positions [1, T], logits_indices [B])``.
    A feature the backend or fleetlab cannot honour raises an error naming the model
    family and the feature. ``handle.unpatch()`` restores the model exactly.
    """
    if has_core_attention(model):
        from fleetlab.patching.fleet import patch_fleet_model

        return patch_fleet_model(model, backend=backend)
    from fleetlab.patching.paddleformers import patch_paddleformers_model

    return patch_paddleformers_model(model, backend=backend)
