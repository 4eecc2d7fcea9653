"""Paged attention: step metadata, the reference backend and the backend registry."""
