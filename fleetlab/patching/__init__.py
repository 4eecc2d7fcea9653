"""Attention patching: run a model library's own model on fleetlab's paged attention.

:func:`patch_model` takes a PaddleFormers causal LM (Llama, ERNIE-4.5, Phi3, Gemma3 text,
GPT-OSS) or a Fleet/Megatron-style model whose decoder layers hold a ``core_attention``
sub-layer, swaps its attention core for a fleetlab backend, and returns a
:class:`PatchHandle` that runs packed steps and undoes the patch.
"""

from __future__ import annotations

from fleetlab.attention.backend import AttentionBackend, get_attention_backend, make_attention_backend
from fleetlab.patching.fleet import patch_fleet_model
from fleetlab.patching.handle import PATCH_ATTR, PatchHandle, has_core_attention
from fleetlab.patching.paddleformers import patch_paddleformers_model

__all__ = ["PatchHandle", "patch_model"]


def patch_model(model, backend="tiled") -> PatchHandle:
    """Route ``model``'s attention through a fleetlab attention backend.

    ``backend``: a registered name (``"tiled"``, ``"naive"``, ``"triton"``), an ``AttentionBackend``
    subclass, or an instance (shared by every patched layer).

    Fleet-style models (a ``core_attention`` sub-layer in their decoder layers) get
    their ``core_attention`` replaced; PaddleFormers models get fleetlab's function
    registered in their attention interface. Either way the model must then run inside
    ``fleetlab.forward_context(metadata, kv_cache)``, through
    ``handle.compute_logits(input_ids [1, T], positions [1, T], logits_indices [B])``.
    A feature the backend or fleetlab cannot honour raises an error naming the model
    family and the feature. ``handle.unpatch()`` restores the model exactly.

    Patching a model that is already patched is fine: with the same backend (the same
    name or class, or the same instance) the new handle shares the live patch, so earlier
    handles (and the ``LLM`` s built on them) keep working -- attention reads everything
    else from the step's forward context; with another backend the model is re-patched and
    earlier handles refuse to run, saying so.
    """
    root = model.__dict__.get(PATCH_ATTR)
    if root is not None:
        if _same_backend(root.first.backend, backend):
            return root.share()
        new = make_attention_backend(backend)
        root.first.retire(f"backend {new.name!r} ({type(new).__name__})")
        backend = new
    if has_core_attention(model):
        return patch_fleet_model(model, backend=backend)
    return patch_paddleformers_model(model, backend=backend)


def _same_backend(current, requested) -> bool:
    """Whether ``requested`` (a name, a class or an instance) names the live patch's backend."""
    if isinstance(requested, AttentionBackend):
        return requested is current
    cls = get_attention_backend(requested) if isinstance(requested, str) else requested
    return type(current) is cls
