"""Attention backends: the base class and the registry that ``backend=name`` looks up.

A backend turns one layer's packed ``query/key/value`` into attention output over the
paged cache. It declares what it needs from the engine as class attributes, so the
engine can honour (or refuse) them before the first step.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import paddle

from fleetlab.attention.metadata import AttentionMetadata

# Built-in backends live in modules that register themselves on import.
_BUILTIN_MODULES = {
    "reference": "fleetlab.attention.reference",
    "triton": "fleetlab.attention.triton_backend",
}
_REGISTRY: dict[str, type[AttentionBackend]] = {}


class AttentionBackend:
    """Base class of attention backends.

    Class attributes a backend sets:
      name: the registry name.
      requires_reorder: the backend wants decode rows first (rows ``[0, num_decodes)``
        schedule at most ``reorder_threshold`` tokens); the runner reorders only then.
      reorder_threshold: the largest query length that still counts as a decode.
      supported_devices: Paddle device kinds it runs on (``"cpu"``, ``"gpu"``).
      supports_sliding_window / supports_sinks: features a model may ask for; patching
        a model that needs a missing one fails with an error naming the feature.
      required_metadata: the ``AttentionMetadata`` fields it reads (checked when the
        backend is registered, so a typo fails at once rather than mid-step).

    Shapes: ``query [T, num_heads, head_dim]``, ``key``/``value`` ``[T, num_kv_heads,
    head_dim]`` for the step's ``T`` packed tokens; output ``[T, num_heads, head_dim]``.
    """

    name: ClassVar[str] = "base"
    requires_reorder: ClassVar[bool] = False
    reorder_threshold: ClassVar[int] = 1
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "gpu")
    supports_sliding_window: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = True
    required_metadata: ClassVar[tuple[str, ...]] = (
        "slot_mapping", "block_tables", "cu_seqlens_q", "seq_lens_kv", "positions")

    def __init__(self) -> None:
        device = current_device_kind()
        if device not in self.supported_devices:
            hint = "" if "cpu" in self.supported_devices else (
                " (on a GPU: install paddlepaddle-gpu, README); use backend='reference' on this machine")
            raise RuntimeError(
                f"attention backend {self.name!r} runs on {list(self.supported_devices)}, "
                f"but Paddle's current device is {paddle.device.get_device()!r}{hint}"
            )

    def forward(
        self,
        layer_id: int,
        query: paddle.Tensor,
        key: paddle.Tensor,
        value: paddle.Tensor,
        kv_cache,
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        sinks: paddle.Tensor | None = None,
    ) -> paddle.Tensor:
        """Store this step's K/V in the cache, then attend over it."""
        kv_cache.write(layer_id, key, value, metadata.slot_mapping)
        return self.attend(
            query,
            kv_cache.key_cache(layer_id),
            kv_cache.value_cache(layer_id),
            metadata,
            scale=scale,
            sliding_window=sliding_window,
            sinks=sinks,
        )

    def attend(self, query, key_cache, value_cache, metadata, *, scale, sliding_window=None, sinks=None):
        """Attention of the packed queries over the paged cache (already holding this step's K/V)."""
        raise NotImplementedError


def current_device_kind() -> str:
    """``"gpu"``, ``"cpu"``, ... for Paddle's current device (``"gpu:0"`` -> ``"gpu"``)."""
    return paddle.device.get_device().split(":")[0]


def register_attention_backend(name: str, cls: type[AttentionBackend]) -> type[AttentionBackend]:
    """Make ``cls`` selectable as ``backend=name`` in ``LLM`` and ``patch_model``."""
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise TypeError(f"backend {name!r} must be a subclass of fleetlab.attention.backend.AttentionBackend")
    if not isinstance(cls.reorder_threshold, int) or cls.reorder_threshold < 1:
        raise ValueError(f"backend {name!r}: reorder_threshold must be an int >= 1")
    provided = set(AttentionMetadata.__dataclass_fields__)
    missing = [f for f in cls.required_metadata if f not in provided]
    if missing:
        raise ValueError(f"backend {name!r} reads metadata {missing} that the engine does not provide; "
                         f"it provides {sorted(provided)}")
    unknown = [d for d in cls.supported_devices if d not in ("cpu", "gpu", "xpu", "npu")]
    if unknown:
        raise ValueError(f"backend {name!r}: unknown device kinds {unknown} in supported_devices")
    _REGISTRY[name] = cls
    return cls


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as ``name`` (built-ins load on first use)."""
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:
        known = sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))
        raise ValueError(f"unknown attention backend {name!r}; registered: {known}")
    return _REGISTRY[name]


def make_attention_backend(backend) -> AttentionBackend:
    """An instance from ``backend``: a registered name, an ``AttentionBackend`` class, or an instance."""
    if isinstance(backend, str):
        return get_attention_backend(backend)()
    if isinstance(backend, type) and issubclass(backend, AttentionBackend):
        return backend()
    if isinstance(backend, AttentionBackend):
        return backend
    raise TypeError(f"backend must be a registered name, an AttentionBackend class or instance; got {backend!r}")


def list_attention_backends() -> list[str]:
    """Names ``backend=`` accepts: registered backends and the built-ins not yet loaded."""
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))
