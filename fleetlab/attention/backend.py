"""Attention backends: the base class, and the registry that ``backend=name`` looks up.

A backend turns one layer's packed ``query/key/value`` into attention output over the
paged cache. It declares what it needs from the engine as class attributes, so the
engine can honour (or refuse) them before the first step, and it owns its per-step
metadata: :meth:`AttentionBackend.build_metadata` turns the step's common
:class:`AttentionMetadata` into whatever its kernels want, once per step, and every
layer of the step gets that object.
"""

from __future__ import annotations

from typing import ClassVar

import paddle

from fleetlab.attention.context import current_kv_connector
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.errors import refuse
from fleetlab.registry import Registry


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

    Shapes: ``query [T, num_heads, head_dim]``, ``key``/``value`` ``[T, num_kv_heads,
    head_dim]`` for the step's ``T`` packed tokens; output ``[T, num_heads, head_dim]``.
    """

    name: ClassVar[str] = "base"
    requires_reorder: ClassVar[bool] = False
    reorder_threshold: ClassVar[int] = 1
    supported_devices: ClassVar[tuple[str, ...]] = ("cpu", "gpu")
    supports_sliding_window: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = True

    def __init__(self) -> None:
        supported, hint = list(self.supported_devices), "" if "cpu" in self.supported_devices else (
            " (on a GPU: install paddlepaddle-gpu, README); use backend='tiled' on this machine")
        refuse([(current_device_kind() not in supported, f"attention backend {self.name!r} runs on {supported}, "
                 f"but Paddle's current device is {paddle.device.get_device()!r}{hint}")], RuntimeError)

    def build_metadata(self, common: AttentionMetadata) -> AttentionMetadata:
        """This backend's metadata for one step, built once (by the step's first attention
        call) and passed to every layer. Default: the common metadata as it is; a backend
        with a plan of its own returns ``common.extend(MyMetadata, plan=...)``."""
        return common

    def forward(self, layer_id: int, query: paddle.Tensor, key: paddle.Tensor, value: paddle.Tensor, kv_cache,
                metadata: AttentionMetadata, *, scale: float, sliding_window: int | None = None,
                sinks: paddle.Tensor | None = None) -> paddle.Tensor:
        """Store this step's K/V in the cache, then attend over it (every layer writes before it
        reads, so a row can read a block another row of the same step fills). A KV connector's
        loads for the layer land first; the step's copies of partial prefix hits follow the write,
        and the connector's save of the layer follows them."""
        connector = current_kv_connector()
        connector.wait_for_layer_load(layer_id)
        kv_cache.write(layer_id, key, value, metadata.slot_mapping, metadata.slot_index)
        kv_cache.apply_copies(layer_id, metadata.kv_copies)
        connector.save_kv_layer(layer_id, kv_cache, metadata)
        out = self.attend(query, kv_cache.key_cache(layer_id), kv_cache.value_cache(layer_id), metadata,
                          layer_id=layer_id, scale=scale, sliding_window=sliding_window, sinks=sinks)
        if out.shape != query.shape:
            raise ValueError(f"attention backend {self.name!r}: attend returned shape {list(out.shape)} "
                             f"for query {list(query.shape)}; it must return [T, num_heads, head_dim] like the query")
        return out

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None, sinks=None):
        """Attention of the packed queries over one layer's paged cache (already holding this
        step's K/V): ``query [T, Hq, D]`` -> ``[T, Hq, D]``. ``layer_id`` (0-based) names the layer."""
        raise NotImplementedError(f"attention backend {self.name!r} ({type(self).__name__}) must implement "
                                  "attend(query, key_cache, value_cache, metadata, *, layer_id, scale, "
                                  "sliding_window=None, sinks=None)")


def current_device_kind() -> str:
    """``"gpu"``, ``"cpu"``, ... for Paddle's current device (``"gpu:0"`` -> ``"gpu"``)."""
    return paddle.device.get_device().split(":")[0]


ATTENTION_BACKENDS = Registry("attention backend", AttentionBackend, {
    "naive": "fleetlab.attention.naive:NaiveBackend",  # the one to read first
    "tiled": "fleetlab.attention.tiled:TiledBackend",  # the default: rows batched into tiles
    "triton": "fleetlab.attention.triton_backend:TritonBackend",  # GPU kernels
})
register_attention_backend = ATTENTION_BACKENDS.register
get_attention_backend = ATTENTION_BACKENDS.get
make_attention_backend = ATTENTION_BACKENDS.make
