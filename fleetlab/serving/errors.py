"""Errors the server answers with, in OpenAI's shape.

Every error the server sends has the body OpenAI's API (and its official client) expects::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}

``param`` names the request field at fault (``None`` when no single field is), so a client
can point at it. User input never gives a 500: bad input is a :class:`BadRequest` (400), an
unknown model a :class:`NotFound` (404), a missing or wrong API key an :class:`Unauthorized`
(401), a full queue an :class:`Overloaded` (503, with ``Retry-After``), a request cut off by
the server stopping a :class:`ShuttingDown` (503). The statuses and ``code`` values are
OpenAI's (``model_not_found``, ``invalid_api_key``...), which its official client maps to
``NotFoundError``, ``AuthenticationError``...
"""

from __future__ import annotations

import re
from http import HTTPStatus


class ServingError(Exception):
    """An error with an HTTP status and an OpenAI-style body (see the module docstring)."""

    status_code = HTTPStatus.INTERNAL_SERVER_ERROR
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.message, self.error_type, self.param, self.code)


class BadRequest(ServingError):
    """400: the request is malformed or asks for something out of range (``param`` names the field)."""

    status_code = HTTPStatus.BAD_REQUEST
    error_type = "invalid_request_error"


class NotFound(ServingError):
    """404: the request names something this server does not have (OpenAI's ``model_not_found``)."""

    status_code = HTTPStatus.NOT_FOUND
    error_type = "invalid_request_error"


class Unauthorized(ServingError):
    """401: the server was started with ``--api-key`` and the request did not carry that key."""

    status_code = HTTPStatus.UNAUTHORIZED
    error_type = "invalid_request_error"


class Overloaded(ServingError):
    """503: the server holds as many requests as it was told to (``--max-queue-len``); retry later."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "server_overloaded"


class EngineDead(ServingError):
    """503: the engine loop stopped (an engine step raised); the server cannot generate any more."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "engine_dead"


class ShuttingDown(ServingError):
    """503: the server is stopping; a new request is refused, an unfinished one is cut off."""

    status_code = HTTPStatus.SERVICE_UNAVAILABLE
    error_type = "server_shutting_down"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# Fields named in fleetlab's own ValueErrors ("request 'x': sampling field top_p=2 must be ...",
# "request 'x': prompt has 300 tokens; max_model_len=128 ...") and the request field they come from.
_ENGINE_FIELDS = {
    "stop_token_ids": "stop_token_ids", "max_tokens": "max_tokens", "temperature": "temperature",
    "top_k": "top_k", "top_p": "top_p", "seed": "seed", "min_tokens": "min_tokens",
    "prompt_token_ids": "prompt", "prompt": "prompt", "KV blocks": "max_tokens",
}


def bad_request_from_engine(error: ValueError, prompt_field: str = "prompt") -> BadRequest:
    """Map a ``ValueError`` raised by ``LLM.add_request`` to a :class:`BadRequest` naming the field.

    fleetlab's engine errors start with ``request '<id>':`` and name the field; the request id
    is the server's own, so it is cut from the message. ``prompt_field`` is what the prompt is
    called in this endpoint (``"messages"`` for chat).
    """
    text = re.sub(r"^request '[^']*': ", "", str(error))
    field = re.match(r"sampling field (\w+)", text)
    param = field.group(1) if field else next((p for k, p in _ENGINE_FIELDS.items() if k in text), None)
    if param == "prompt":
        param = prompt_field
    return BadRequest(text, param=param, code="invalid_value")
