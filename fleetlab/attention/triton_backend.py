"""The ``"triton"`` attention backend: fleetlab's Triton kernels on Paddle GPU tensors.

Each layer call stores the step's K/V into the paged cache by ``slot_mapping``
(:func:`~fleetlab.attention.triton_kernels.store_kv`), then runs the decode kernel
(split-K over the context) on rows ``[0, num_decodes)`` and the prefill kernel on the
rest (:func:`~fleetlab.attention.triton_kernels.paged_attention`). It therefore wants
decode rows first (``requires_reorder=True``).

Triton launches on Paddle tensors through Paddle's PyTorch proxy
(``paddle.compat.enable_torch_proxy(scope={"triton"})``, Paddle >= 3.3): inside the
``triton`` package ``import torch`` resolves to Paddle, which is what Triton's launcher
asks for streams and devices. The kernels module itself imports neither framework.

Status: the kernels are verified and timed on an H200 with torch tensors
(``tests/test_triton_kernels.py``, ``fleetlab/bench/triton_attention.py``). This Paddle
path could not be run where it was written (no GPU build of Paddle there).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

import paddle

from fleetlab.attention.backend import AttentionBackend
from fleetlab.attention.metadata import AttentionMetadata


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    """The Triton backend's per-step metadata: the common fields plus the host-side bounds
    its kernels are planned with (longest decode row, longest context, longest prefill chunk)."""

    max_decode_query_len: int = 0
    max_decode_seq_len: int = 0
    max_prefill_query_len: int = 0


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

    def forward(self, layer_id, query, key, value, kv_cache, metadata, *, scale,
                sliding_window=None, sinks=None):
        """Store this step's K/V with the Triton kernel, then attend over the cache."""
        key_cache, value_cache = kv_cache.key_cache(layer_id), kv_cache.value_cache(layer_id)
        self._kernels.store_kv(key.contiguous(), value.contiguous(), key_cache, value_cache,
                               metadata.slot_mapping)
        return self.attend(query, key_cache, value_cache, metadata, layer_id=layer_id, scale=scale,
                           sliding_window=sliding_window, sinks=sinks)

    def build_metadata(self, common: AttentionMetadata) -> TritonMetadata:
        """The bounds the kernels plan with, from the host arrays (no device-to-host sync)."""
        nd = common.num_decodes
        query_lens, lens = common.query_lens_host, common.seq_lens_kv_host
        return common.extend(
            TritonMetadata,
            max_decode_query_len=int(query_lens[:nd].max()) if nd else 0,
            max_decode_seq_len=int(lens[:nd].max()) if nd else 0,
            max_prefill_query_len=int(query_lens[nd:].max()) if len(query_lens) > nd else 0,
        )

    def attend(self, query, key_cache, value_cache, metadata, *, layer_id, scale, sliding_window=None,
               sinks=None):
        """Decode kernel on rows ``[0, num_decodes)`` (1..R query tokens each), prefill kernel on the rest."""
        if int(key_cache.shape[1]) != metadata.block_size:
            raise ValueError(
                f"cache block size {int(key_cache.shape[1])} differs from metadata.block_size "
                f"{metadata.block_size}"
            )
        if not isinstance(metadata, TritonMetadata):
            metadata = self.build_metadata(metadata)
        return self._kernels.paged_attention(
            query.contiguous(), key_cache, value_cache, metadata.block_tables, metadata.seq_lens_kv,
            metadata.cu_seqlens_q, scale=scale, sliding_window=sliding_window, sinks=sinks,
            num_decodes=metadata.num_decodes, num_decode_tokens=metadata.num_decode_tokens,
            max_decode_query_len=metadata.max_decode_query_len, max_decode_seq_len=metadata.max_decode_seq_len,
            max_query_len=metadata.max_prefill_query_len,
        )
