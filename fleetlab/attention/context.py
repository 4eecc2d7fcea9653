"""``forward_context``: how attention layers deep inside a model get the step's state.

The model library calls our attention function with only ``(module, query, key, value,
...)``; the paged cache and the step's metadata cannot travel through its signature.
The runner opens a context around the forward pass, and attention reads it here.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.kv_transfer.base import NULL_CONNECTOR


@dataclass(slots=True)
class ForwardContext:
    """The state of one forward pass: the step's metadata, the paged KV cache and the KV
    connector attention calls around each layer's write (the null one unless the engine has one).

    ``attn_metadata(backend)`` is the backend's own metadata for the step
    (``backend.build_metadata(metadata)``), built by the first layer that asks and shared by
    every later layer: per-step planning runs once per step, not once per layer. ``built_by``:
    the backend that already built ``metadata`` (the runner does, where it prepares the step).
    """

    metadata: AttentionMetadata
    kv_cache: Any  # fleetlab.PagedKVCache
    kv_connector: Any = NULL_CONNECTOR  # fleetlab.kv_transfer.KVConnector
    built_by: Any = None
    _built: dict = field(default_factory=dict)

    def attn_metadata(self, backend) -> Any:
        if backend is self.built_by:
            return self.metadata
        key = id(backend)
        if key not in self._built:
            self._built[key] = (backend, backend.build_metadata(self.metadata))  # keeps backend alive
        return self._built[key][1]


class _Stack(threading.local):
    """Each thread's open contexts: an overlapped loop's model thread runs forwards while
    another thread (a second engine, a notebook cell) may run its own."""

    def __init__(self):
        self.contexts: list[ForwardContext] = []


_LOCAL = _Stack()


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata, kv_cache, kv_connector=NULL_CONNECTOR,
                    built_by=None) -> Iterator[ForwardContext]:
    """Make ``metadata`` and ``kv_cache`` visible to patched attention for one forward
    (``built_by``: the backend whose ``build_metadata`` made ``metadata``, if one did).

    Example::

        with fleetlab.forward_context(metadata, kv_cache):
            logits = handle.compute_logits(input_ids, positions, logits_indices)
    """
    ctx = ForwardContext(metadata=metadata, kv_cache=kv_cache, kv_connector=kv_connector, built_by=built_by)
    _LOCAL.contexts.append(ctx)
    try:
        yield ctx
    finally:
        _LOCAL.contexts.pop()


def current_kv_connector():
    """The innermost context's KV connector (the null one outside any context)."""
    stack = _LOCAL.contexts
    return stack[-1].kv_connector if stack else NULL_CONNECTOR


def get_forward_context() -> ForwardContext:
    """Return the innermost open context; raise if attention runs outside one."""
    stack = _LOCAL.contexts
    if not stack:
        raise RuntimeError(
            "fleetlab attention was called outside `fleetlab.forward_context(metadata, kv_cache)`: "
            "a patched model needs the step's metadata and paged KV cache. Run it through "
            "fleetlab.LLM, or open the context yourself; call handle.unpatch() to get the "
            "original attention back."
        )
    return stack[-1]
