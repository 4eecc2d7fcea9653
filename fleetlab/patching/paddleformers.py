"""Route a PaddleFormers model's attention through fleetlab's paged attention.

PaddleFormers looks up each layer's attention function by name in
``AttentionInterface`` (``config._attn_implementation``). Patching registers
:func:`fleetlab_attention` under ``"fleetlab"``, points the model at it, turns the
library's own KV cache off, and tags every attention module with its 0-based layer id,
its sliding window and the backend instance. The model still embeds, applies RoPE,
projects and runs its MLPs itself; only the attention core is fleetlab's, reading the
step's metadata and paged cache from :func:`fleetlab.attention.context.get_forward_context`.

Everything patching changes is recorded, and ``handle.unpatch()`` puts it back.
"""

from __future__ import annotations

import logging

import paddle

from fleetlab.attention.backend import AttentionBackend, make_attention_backend
from fleetlab.attention.context import get_forward_context
from fleetlab.patching.families import (
    FamilySpec,
    apply_fixes,
    check_supported,
    family_of,
    layer_window,
    swap_class,
)
from fleetlab.patching.handle import PatchHandle

logger = logging.getLogger(__name__)

ATTN_NAME = "fleetlab"
# Attributes patching puts on each attention module (and unpatch removes).
LAYER_ID_ATTR = "_fleetlab_layer_id"
BACKEND_ATTR = "_fleetlab_backend"
WINDOW_ATTR = "_fleetlab_window"
FAMILY_ATTR = "_fleetlab_family"


def fleetlab_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                       sliding_window=None, sink=None, **kwargs):
    """The attention function PaddleFormers calls in a patched model.

    Args (as PaddleFormers passes them):
      module: the attention layer, tagged by patching with its layer id, window and backend.
      query: ``[1, num_heads, T, head_dim]``; key, value: ``[1, num_kv_heads, T, head_dim]``,
        RoPE already applied by the model (applying it again here would rotate twice).
      attention_mask: ignored -- the library builds it for one unpacked sequence; the
        paged metadata describes the real per-request causal structure.
      scaling: softmax scale (Gemma3 uses ``query_pre_attn_scalar ** -0.5``).
      dropout: must be 0 (inference).
      sliding_window: ignored -- Phi3 passes it to full-attention layers too; the layer's
        window was resolved at patch time (see ``fleetlab.patching.families``).
      sink: GPT-OSS's learned sinks ``[num_heads]``.
    Returns ``(output [1, T, num_heads * head_dim], None)``.
    """
    layer_id = getattr(module, LAYER_ID_ATTR, None)
    if layer_id is None:
        raise RuntimeError(f"{type(module).__name__} called fleetlab attention but carries no fleetlab "
                           "layer id: patch the model with fleetlab.patch_model first")
    family = getattr(module, FAMILY_ATTR)
    ctx = get_forward_context()
    if query.shape[0] != 1:
        raise ValueError(f"{family}: fleetlab attention takes one packed sequence (batch 1); "
                         f"got batch {query.shape[0]} -- pack requests into [1, T] instead")
    if dropout:
        raise NotImplementedError(f"{family}: attention dropout ({dropout}) is not supported; call model.eval()")
    backend = getattr(module, BACKEND_ATTR)
    if sink is not None and not backend.supports_sinks:
        raise NotImplementedError(f"{family}: attention sinks are not supported by backend {backend.name!r}")
    # [1, heads, T, D] -> [T, heads, D]: the packed layout backends and the cache use.
    q, k, v = (x[0].transpose([1, 0, 2]) for x in (query, key, value))
    scale = float(scaling) if scaling is not None else q.shape[-1] ** -0.5
    out = backend.forward(layer_id, q, k, v, ctx.kv_cache, ctx.attn_metadata(backend), scale=scale,
                          sliding_window=getattr(module, WINDOW_ATTR), sinks=sink)
    return out.reshape([1, out.shape[0], -1]), None


class PaddleFormersHandle(PatchHandle):
    """A patched PaddleFormers causal LM (see :class:`PatchHandle` for the attributes)."""

    def __init__(self, model, spec: FamilySpec, *args, **kwargs):
        super().__init__(model, spec.name, *args, **kwargs)
        self.spec = spec

    def embed(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        with paddle.no_grad():
            return self.model.get_input_embeddings()(input_ids)

    def compute_logits(self, input_ids: paddle.Tensor, positions: paddle.Tensor,
                       logits_indices: paddle.Tensor, inputs_embeds: paddle.Tensor | None = None) -> paddle.Tensor:
        """Run one packed step; logits ``[B, vocab]`` at ``logits_indices`` only.

        input_ids, positions: int64 ``[1, T]``; logits_indices: int64 ``[B]``. Must run
        inside ``fleetlab.forward_context(metadata, kv_cache)`` with ``metadata`` built for
        these ``T`` tokens. The LM head (and Gemma3's final soft-capping) runs on the
        ``B`` gathered rows only.
        """
        self._check_step(input_ids, positions, logits_indices)
        with paddle.no_grad():
            ids = {"input_ids": input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
            hidden = self.model.model(**ids, position_ids=positions, use_cache=False, return_dict=True)[0]
            rows = paddle.gather(hidden[0], logits_indices.astype("int64"), axis=0)
            logits = self.model.lm_head(rows.unsqueeze(0))[0]
            cap = getattr(self.model.config, "final_logit_softcapping", None)
            if self.spec.final_logit_softcapping and cap is not None:
                logits = paddle.tanh(logits / cap) * cap
        return logits

    def _check_step(self, input_ids, positions, logits_indices) -> None:
        super()._check_step(input_ids, positions, logits_indices)
        if self.model.training:
            raise NotImplementedError(f"{self.family}: training mode (dropout) is not supported; call model.eval()")


def patch_paddleformers_model(model, backend="tiled") -> PaddleFormersHandle:
    """Patch a PaddleFormers causal LM in place; see :func:`fleetlab.patch_model`."""
    spec = family_of(model)
    config = model.config
    check_supported(spec, config)
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):
        raise TypeError(f"{spec.name}: expected a *ForCausalLM with .model and .lm_head; got {type(model).__name__}")
    modules = _attention_modules(model, spec)
    backend_obj = make_attention_backend(backend)
    windows = {module.layer_idx: layer_window(spec, config, module) for _, module in modules}
    _check_backend(spec, backend_obj, windows, modules)
    _register_attention()

    # Validation is over; from here on every change is recorded for unpatch.
    undo: list = []
    try:
        _apply_patch(model, spec, modules, backend_obj, windows, undo)
    except BaseException:
        for step in reversed(undo):
            step()
        raise

    first = modules[0][1]
    head_dim = getattr(first, "head_dim", None) or config.hidden_size // config.num_attention_heads
    logger.info("patched %s: %d attention layers -> %s", spec.name, len(modules), type(backend_obj).__name__)
    return PaddleFormersHandle(
        model, spec, backend_obj, {name: m.layer_idx for name, m in modules}, undo,
        num_layers=len(modules), num_kv_heads=int(config.num_key_value_heads), head_dim=int(head_dim),
        vocab_size=int(config.vocab_size), max_model_len=int(config.max_position_embeddings),
        dtype=str(model.lm_head.weight.dtype).removeprefix("paddle."),
        sliding_windows={i: w for i, w in windows.items() if w is not None},
        eos_token_id=getattr(config, "eos_token_id", None),
    )


def _apply_patch(model, spec, modules, backend_obj, windows, undo: list) -> None:
    """Make every change of patching, appending to ``undo`` how to revert each."""
    configs = [model.config] + [getattr(m, "config", model.config) for _, m in modules]
    for cfg in {id(c): c for c in configs}.values():
        _set_restorably(cfg, "_attn_implementation", ATTN_NAME, undo)
        # fleetlab owns the KV cache; the library's would grow with every step.
        _set_restorably(cfg, "use_cache", False, undo)
    for _, module in modules:
        for name, value in ((LAYER_ID_ATTR, module.layer_idx), (BACKEND_ATTR, backend_obj),
                            (WINDOW_ATTR, windows[module.layer_idx]), (FAMILY_ATTR, spec.name)):
            _set_restorably(module, name, value, undo)
        if "attn_implementation" in module.__dict__:
            swap_class(module, PinnedAttnImplementation, undo)
    apply_fixes(spec, model, undo)


def _attention_modules(model, spec: FamilySpec) -> list[tuple[str, paddle.nn.Layer]]:
    """``(qualified name, module)`` of every ``self_attn``, checked to carry layer ids 0..L-1."""
    modules = [(name, sub) for name, sub in model.named_sublayers()
               if name.split(".")[-1] == "self_attn" and hasattr(sub, "layer_idx")]
    if not modules:
        raise ValueError(f"{spec.name}: found no `self_attn` sub-layer with a `layer_idx` in {type(model).__name__}")
    if any(getattr(m, LAYER_ID_ATTR, None) is not None for _, m in modules):
        raise RuntimeError(f"{spec.name}: model is already patched by fleetlab; call handle.unpatch() first")
    ids = [m.layer_idx for _, m in modules]
    expected = list(range(int(model.config.num_hidden_layers)))
    if sorted(i if isinstance(i, int) else -1 for i in ids) != expected:
        found = {name: i for (name, _), i in zip(modules, ids)}
        raise ValueError(f"{spec.name}: attention layer ids must be 0..{expected[-1]}, each once "
                         f"(they index the paged KV cache); found {found}")
    return modules


def _check_backend(spec: FamilySpec, backend: AttentionBackend, windows: dict, modules) -> None:
    """Refuse a model whose features the backend lacks, naming family, feature and backend."""
    if any(w is not None for w in windows.values()) and not backend.supports_sliding_window:
        raise NotImplementedError(f"{spec.name}: sliding-window attention is not supported by backend "
                                  f"{backend.name!r} (windows {windows})")
    has_sinks = spec.has_sinks or any(hasattr(m, "sinks") for _, m in modules)
    if has_sinks and not backend.supports_sinks:
        raise NotImplementedError(f"{spec.name}: attention sinks are not supported by backend {backend.name!r}")


def _register_attention() -> None:
    """Make ``"fleetlab"`` a PaddleFormers attention implementation (class-wide; registering
    again only writes the same entry)."""
    # Imported here, where a PaddleFormers model is being patched (so PaddleFormers is loaded
    # already): ``fleetlab.patching`` must not import it for a Fleet-style model.
    from paddleformers.nn.attention.interface import AttentionInterface

    AttentionInterface.register(ATTN_NAME, fleetlab_attention)


_MISSING = object()


def _set_restorably(obj, name: str, value, undo: list) -> None:
    """``setattr(obj, name, value)``, recording how to restore (or delete) the old value."""
    old = obj.__dict__.get(name, _MISSING) if hasattr(obj, "__dict__") else getattr(obj, name, _MISSING)
    setattr(obj, name, value)
    if old is _MISSING:
        undo.append(lambda: delattr(obj, name) if name in obj.__dict__ else None)
    else:
        undo.append(lambda: setattr(obj, name, old))


class _ReadsFleetlab:
    """Data descriptor: reads ``"fleetlab"``, ignores writes (see :class:`PinnedAttnImplementation`)."""

    def __get__(self, obj, objtype=None):
        return ATTN_NAME if obj is not None else self

    def __set__(self, obj, value):
        pass


class PinnedAttnImplementation:
    """Mixin that makes a module's ``attn_implementation`` read ``"fleetlab"`` while patched.

    ERNIE-4.5 and Gemma3 copy ``config._attn_implementation`` into the module when it
    is built, so changing the config later does not reach them. Gemma3 also rewrites it
    to ``"sdpa"`` whenever a layer gets no mask -- which is every full-attention layer
    once the implementation is not ``"eager"``. A data descriptor on the class wins over
    the instance attribute for reads and swallows that write.
    """

    attn_implementation = _ReadsFleetlab()
