"""Paged attention: step metadata, the backend base class and registry, the naive (read first) and tiled backends.

``AttentionMetadata`` (``metadata.py``) is what every layer of a step reads; a backend that needs
more per step adds fields in a subclass (``TiledMetadata``, ``tiled.py``) built with
:meth:`AttentionMetadata.extend`. Both are importable from here (loaded when first named).
"""

_LAZY = {"AttentionMetadata": "fleetlab.attention.metadata", "TiledMetadata": "fleetlab.attention.tiled",
         "AttentionBackend": "fleetlab.attention.backend", "TiledBackend": "fleetlab.attention.tiled"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fleetlab.attention' has no attribute {name!r}")
