"""The ``"triton"`` attention backend: fleetlab's Triton kernels on Paddle GPU tensors.

Plan once per step, launch per layer. ``build_metadata`` (once per step) turns the step's
batch into a :class:`~fleetlab.attention.triton_kernels.StepPlans`: for each layer
geometry the model has shown so far, the kernels' knobs, context splits, grids and
scratch buffers, decided from host arrays alone. Each layer call then only launches:
it stores the step's K/V into the paged cache by ``slot_mapping``, runs the decode
kernel (split-K over the context) on rows ``[0, num_decodes)`` and the prefill kernel on
the rest, each a compiled kernel called with arguments bound at plan time. It therefore
wants decode rows first (``requires_reorder=True``).

Triton launches on Paddle tensors through Paddle's PyTorch proxy
(``paddle.compat.enable_torch_proxy(scope={"triton"})``, Paddle >= 3.3): inside the
``triton`` package ``import torch`` resolves to Paddle, which is what Triton's launcher
asks for streams and devices. The kernels module itself imports neither framework.

Status: the kernels and their plans are verified and timed on an H200 with torch tensors
(``tests/test_triton_kernels.py``, ``fleetlab/lab/bench/triton_attention.py``). This Paddle
path could not be run where it was written (no GPU build of Paddle there).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

import paddle

from fleetlab.attention.backend import AttentionBackend
from fleetlab.attention.context import current_kv_connector
from fleetlab.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    """The Triton backend's per-step metadata: the common fields plus the step's plans
    (``triton_kernels.StepPlans``), one per layer geometry."""

    plans: Any = None


def load_triton_kernels():
    """Import ``fleetlab.attention.triton_kernels`` with Triton running on Paddle tensors.

    Raises RuntimeError naming what is missing: Paddle's torch proxy or ``triton``.
    """
    compat = getattr(paddle, "compat", None)
    if compat is None or not hasattr(compat, "enable_torch_proxy"):
        raise RuntimeError(
            "attention backend 'triton' needs paddle.compat.enable_torch_proxy (PaddlePaddle >= 3.3); "
            f"this Paddle is {paddle.__version__}"
        )
    # Scoped to triton so that the rest of the process keeps whatever `torch` it has.
    compat.enable_torch_proxy(scope={"triton"}, silent=True)
    try:
        return importlib.import_module("fleetlab.attention.triton_kernels")
    except ImportError as exc:
        raise RuntimeError(
            "attention backend 'triton' needs the `triton` package (pip install triton) next to "
            f"paddlepaddle-gpu; importing it failed: {exc}"
        ) from exc


class TritonBackend(AttentionBackend):
    """Paged attention with Triton kernels: GPU only, decode rows first, windows and sinks.

    Shapes as :class:`AttentionBackend`: ``query [T, Hq, D]``, ``key``/``value``
    ``[T, Hkv, D]``, caches ``[num_blocks, block_size, Hkv, D]`` in the query's dtype
    (float16, bfloat16 or float32); output ``[T, Hq, D]``.
    """

    name: ClassVar[str] = "triton"
    requires_reorder: ClassVar[bool] = True
    reorder_threshold: ClassVar[int] = 1
    supported_devices: ClassVar[tuple[str, ...]] = ("gpu",)
    supports_sliding_window: ClassVar[bool] = True
    supports_sinks: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()  # refuses a machine without a GPU, pointing to backend='tiled'
        self._kernels = load_triton_kernels()
        # Layer geometries seen so far (layer key -> geometry): each step plans them up front.
        self._geometries: dict = {}

    def build_metadata(self, common: AttentionMetadata) -> TritonMetadata:
        """The step's plans, from the host arrays (no device-to-host sync)."""
        tk = self._kernels
        batch = tk.PagedBatch.from_host(
            common.block_tables, common.seq_lens_kv, common.cu_seqlens_q, common.slot_mapping,
            block_size=common.block_size, num_decodes=common.num_decodes,
            cu_seqlens_q_host=common.cu_seqlens_q_host, seq_lens_kv_host=common.seq_lens_kv_host)
        return common.extend(TritonMetadata, plans=tk.StepPlans(batch, like=common.seq_lens_kv,
                                                                known=self._geometries))

    def forward(self, layer_id, query, key, value, kv_cache, metadata, *, scale,
                sliding_window=None, sinks=None):
        """Store this step's K/V with the Triton kernel, then attend over the cache (one plan lookup)."""
        key_cache, value_cache = kv_cache.key_cache(layer_id), kv_cache.value_cache(layer_id)
        query = query.contiguous()
        plan = self._plan(query, key_cache, metadata, sliding_window, sinks)
        connector = current_kv_connector()  # GPU path: written, unrun here (no Paddle GPU)
        connector.wait_for_layer_load(layer_id)
        plan.store_kv(key.contiguous(), value.contiguous(), key_cache, value_cache)
        kv_cache.apply_copies(layer_id, metadata.kv_copies)  # (after the write, as in AttentionBackend.forward)
        connector.save_kv_layer(layer_id, kv_cache, metadata)
        return plan.run(query, key_cache, value_cache, scale=scale, sinks=sinks)

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None,
               sinks=None):
        """Decode kernel on rows ``[0, num_decodes)`` (1..R query tokens each), prefill kernel on the rest."""
        query = query.contiguous()
        plan = self._plan(query, key_cache, metadata, sliding_window, sinks)
        return plan.run(query, key_cache, value_cache, scale=scale, sinks=sinks)

    def _plan(self, query, key_cache, metadata, sliding_window, sinks):
        if not isinstance(metadata, TritonMetadata):
            metadata = self.build_metadata(metadata)
        return metadata.plans.for_layer(query, key_cache, sliding_window, sinks)
