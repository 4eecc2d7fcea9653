"""What each PaddleFormers family does differently, in one table.

Patching routes every family through the same attention function, but the families
disagree on where a layer's sliding window lives, whether attention has sinks, and what
happens to the logits after the LM head. Each difference below was read from the
family's own modeling code (PaddleFormers 1.2) and is pinned by a parity test against
the family's unpatched forward.

Sliding windows: every family builds its window mask with the library's
``_make_sliding_window_mask``, where a query at position ``p`` sees keys
``[p - w + 1, p]`` -- fleetlab's convention ``(p - w, p]`` with the same ``w``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import paddle

logger = logging.getLogger(__name__)

# How a family says which layers slide and by how much:
#   "none"        -- no sliding-window layers;
#   "module_attr" -- the attention module's ``sliding_window`` (``None`` on full layers);
#   "layer_types" -- ``config.sliding_window`` on layers whose ``config.layer_types`` entry
#                    is ``"sliding_attention"``. Phi3 also passes ``sliding_window=`` to
#                    every layer's attention call, full-attention layers included, and
#                    relies on its mask to tell them apart: that keyword must be ignored.
WINDOW_RULES = ("none", "module_attr", "layer_types")

# RoPE variants whose frequencies depend on the longest position in the forward pass:
# in a packed batch that is another request's length, so logits would change with the
# company a request keeps.
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(slots=True, frozen=True)
class FamilySpec:
    """One PaddleFormers family's quirks.

    name: fleetlab's family name; model_types: ``config.model_type`` values it covers;
    window_rule: one of ``WINDOW_RULES``; has_sinks: attention gets learned sinks
    (``sink=`` keyword, one logit per query head); final_logit_softcapping: the causal-LM
    head applies ``cap * tanh(logits / cap)`` when ``config.final_logit_softcapping`` is set;
    moe_experts: dotted suffix of the MoE experts sub-layers that :func:`apply_fixes` checks.
    """

    name: str
    model_types: tuple[str, ...]
    window_rule: str = "none"
    has_sinks: bool = False
    final_logit_softcapping: bool = False
    moe_experts: str | None = None


FAMILY_SPECS = {
    spec.name: spec
    for spec in (
        FamilySpec("llama", ("llama",)),
        FamilySpec("ernie4_5", ("ernie4_5",)),
        FamilySpec("phi3", ("phi3",), window_rule="layer_types"),
        FamilySpec("gemma3", ("gemma3_text",), window_rule="module_attr", final_logit_softcapping=True),
        FamilySpec("gpt_oss", ("gpt_oss",), window_rule="module_attr", has_sinks=True,
                   moe_experts="mlp.experts"),
    )
}


def family_of(model) -> FamilySpec:
    """The spec of a PaddleFormers model, from ``model.config.model_type``; raise if unknown."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for spec in FAMILY_SPECS.values():
        if model_type in spec.model_types:
            return spec
    known = {t: s.name for s in FAMILY_SPECS.values() for t in s.model_types}
    raise NotImplementedError(
        f"fleetlab cannot patch PaddleFormers model_type {model_type!r} ({type(model).__name__}): "
        f"supported model types are {known}. A new family needs an entry in "
        "fleetlab/patching/families.py and a parity test."
    )


def layer_window(spec: FamilySpec, config, module) -> int | None:
    """The sliding window ``w`` of one attention module (``None``: full attention)."""
    if spec.window_rule == "module_attr":
        window = getattr(module, "sliding_window", None)
    elif spec.window_rule == "layer_types":
        sliding = config.layer_types[module.layer_idx] == "sliding_attention"
        window = config.sliding_window if sliding else None
    else:
        window = None
    # The library's mask treats a window <= 0 as no window at all.
    return int(window) if window is not None and window > 0 else None


def check_supported(spec: FamilySpec, config) -> None:
    """Raise ``NotImplementedError`` naming the family and the feature fleetlab cannot honour."""
    def refuse(feature: str, why: str):
        raise NotImplementedError(f"fleetlab cannot patch {spec.name}: {feature} is not supported ({why})")

    if getattr(config, "tensor_model_parallel_size", 1) > 1:
        refuse("tensor_model_parallel_size > 1", "patching runs one unsharded model")
    if getattr(config, "sequence_parallel", False):
        refuse("sequence_parallel", "the packed batch must stay one [1, T] sequence")
    for rope_type in _rope_types(config):
        if rope_type in SEQUENCE_DEPENDENT_ROPE:
            refuse(f"rope_type {rope_type!r}", "its frequencies depend on the longest sequence in the batch")
    if getattr(config, "apply_rope_fusion", False):
        refuse("apply_rope_fusion", "the fused RoPE kernel ignores position_ids, so packed positions are lost")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        refuse("attn_logit_softcapping", "fleetlab attention has no logit soft-capping")
    if getattr(config, "use_bidirectional_attention", False):
        refuse("use_bidirectional_attention", "fleetlab attention is causal")


def _rope_types(config) -> list[str]:
    """``rope_type`` of the config's RoPE parameters (flat or nested per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [params.get("rope_type", params.get("type"))]
    return [p.get("rope_type", p.get("type")) for p in params.values() if isinstance(p, dict)]


# ---------------------------------------------------------------------------------------
# Fixes of library bugs that would make a packed batch wrong.


def swap_class(module, mixin: type, undo: list) -> None:
    """Give one module the class ``(mixin, type(module))``; ``undo`` gets the way back.

    Only this instance changes: other models of the same class are untouched.
    """
    cls = type(module)
    key = (cls, mixin)
    if key not in _SWAPPED:
        _SWAPPED[key] = type(f"Fleetlab{cls.__name__}", (mixin, cls), {"__module__": cls.__module__})
    # object.__setattr__: class assignment, bypassing nn.Layer's attribute bookkeeping.
    object.__setattr__(module, "__class__", _SWAPPED[key])
    undo.append(lambda: object.__setattr__(module, "__class__", cls))


_SWAPPED: dict[tuple[type, type], type] = {}


class ExpertMajorRoutingWeights:
    """Mixin fixing PaddleFormers 1.2's GPT-OSS experts in eval mode.

    Its inference path weights the expert outputs ``[E, N, H]`` with
    ``routing_weights.transpose([0, 1]).reshape((E, batch, -1))``; in Paddle that
    transpose is the identity, so token ``n``'s weights are read from other tokens' rows
    unless ``N == 1``. A token's output then depends on which tokens share its forward --
    in a packed batch, on other requests. Handing the layer its weights already in
    expert-major order makes the reshape read the right numbers.
    """

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        if not self.training and routing_weights is not None:
            routing_weights = routing_weights.transpose([1, 0]).reshape(routing_weights.shape)
        return super().forward(hidden_states, router_indices=router_indices, routing_weights=routing_weights)


def experts_mix_tokens(experts) -> bool:
    """Probe an experts layer in eval mode: does token 0's output change when token 1 joins?"""
    num_experts = int(experts.num_experts)
    if num_experts < 2:
        return False
    hidden = int(experts.hidden_size)
    dtype = experts.down_proj_bias.dtype
    x = paddle.linspace(-1.0, 1.0, 2 * hidden).reshape([1, 2, hidden]).astype(dtype)
    # Distinct weights everywhere, so that reading them in the wrong order shows.
    weights = paddle.linspace(0.1, 0.9, 2 * num_experts).reshape([2, num_experts]).astype(dtype)
    indices = paddle.to_tensor([[0], [num_experts - 1]], dtype="int64")  # unused by the eval path
    was_training = experts.training
    experts.training = False
    try:
        with paddle.no_grad():
            together = experts(x, router_indices=indices, routing_weights=weights)
            alone = paddle.concat([experts(x[:, i:i + 1], router_indices=indices[i:i + 1],
                                           routing_weights=weights[i:i + 1]) for i in range(2)], axis=1)
    finally:
        experts.training = was_training
    return not bool(paddle.allclose(together, alone, rtol=1e-4, atol=1e-5))


def apply_fixes(spec: FamilySpec, model, undo: list) -> None:
    """Repair known library bugs that make one token's output depend on its batch-mates.

    Each fix is applied only where a probe shows the bug, and must make the probe pass.
    """
    if spec.moe_experts is None:
        return
    experts = [m for name, m in model.named_sublayers() if name.endswith(spec.moe_experts)]
    if not experts or not experts_mix_tokens(experts[0]):
        return
    for module in experts:
        swap_class(module, ExpertMajorRoutingWeights, undo)
    if experts_mix_tokens(experts[0]):
        raise NotImplementedError(f"fleetlab cannot patch {spec.name}: its MoE experts mix tokens of a "
                                  "batch and fleetlab's fix does not repair this PaddleFormers version")
    logger.info("%s: fixed MoE routing weights read across tokens in %d experts layers", spec.name, len(experts))


@contextlib.contextmanager
def library_fixes(model):
    """Apply :func:`apply_fixes` to an unpatched model for the block (e.g. to build an oracle).

    A model fleetlab does not know is left as it is.
    """
    undo: list = []
    try:
        spec = family_of(model)
    except NotImplementedError:
        spec = None
    if spec is not None:
        apply_fixes(spec, model, undo)
    try:
        yield model
    finally:
        for step in reversed(undo):
            step()
