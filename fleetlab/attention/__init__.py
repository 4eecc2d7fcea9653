"""Paged attention: step metadata, the backend base class and registry, the naive (read first) and tiled backends.

``AttentionMetadata`` (``metadata.py``) is what every layer of a step reads; a backend that needs
more per step adds fields in a subclass (``TiledMetadata``, ``tiled.py``) built with
:meth:`AttentionMetadata.extend`. Both are importable from here (loaded when first named).
"""

from fleetlab.lazy import lazy_getattr

_LAZY = {"AttentionMetadata": "fleetlab.attention.metadata", "TiledMetadata": "fleetlab.attention.tiled",
         "AttentionBackend": "fleetlab.attention.backend", "TiledBackend": "fleetlab.attention.tiled"}
__all__ = sorted(_LAZY)
__getattr__ = lazy_getattr(__name__, _LAZY)
