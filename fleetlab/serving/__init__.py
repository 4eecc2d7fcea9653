"""Serving: fleetlab's engine behind an OpenAI-compatible HTTP API.

One concept per module:

- :mod:`~fleetlab.serving.async_llm`: ``AsyncLLM``, the engine thread and per-request streams;
- :mod:`~fleetlab.serving.engine_stats`: what ``/metrics`` reads of the engine beyond ``LLM.stats()``;
- :mod:`~fleetlab.serving.protocol`: OpenAI's request models and response / chunk shapes;
- :mod:`~fleetlab.serving.refused`: the fields the server knows but does not apply, and why;
- :mod:`~fleetlab.serving.chat_template`: chat messages -> prompt token ids;
- :mod:`~fleetlab.serving.tokenization`: ``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (vLLM's shapes);
- :mod:`~fleetlab.serving.errors`: OpenAI-style error bodies (400 / 401 / 404 / 503);
- :mod:`~fleetlab.serving.metrics`: ``/metrics`` in Prometheus' format;
- :mod:`~fleetlab.serving.app`: the FastAPI app (``build_app``);
- :mod:`~fleetlab.serving.shutdown`: how the server stops (drain, then end each request with an error);
- :mod:`~fleetlab.serving.loader` and :mod:`~fleetlab.serving.cli`: ``python -m fleetlab serve``;
- :mod:`~fleetlab.serving.launch`: a server in a background thread or process.

``AsyncLLM`` needs nothing beyond fleetlab; the HTTP parts need the ``serve`` extra
(``pip install fleetlab[serve]``: FastAPI, uvicorn, prometheus_client, httpx).
"""

from __future__ import annotations

from fleetlab.lazy import lazy_getattr

_LAZY = {
    "AsyncLLM": "fleetlab.serving.async_llm",
    "RequestStream": "fleetlab.serving.async_llm",
    "build_app": "fleetlab.serving.app",
    "ServerThread": "fleetlab.serving.launch",
    "ServerProcess": "fleetlab.serving.launch",
    "load_model": "fleetlab.serving.loader",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__():
    return __all__
