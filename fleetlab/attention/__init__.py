"""Paged attention: step metadata, the backend base class and registry, the naive (read first) and tiled backends."""
