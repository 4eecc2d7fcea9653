"""The OpenAI wire format: request models (validated by pydantic) and response/chunk builders.

Requests: :class:`CompletionRequest` (``POST /v1/completions``) and :class:`ChatCompletionRequest`
(``POST /v1/chat/completions``). Ranges follow OpenAI's API (``temperature`` in [0, 2], ``top_p``
in (0, 1], ``max_tokens`` >= 1...); a value out of range fails validation and the app answers
400 naming the field. Fields OpenAI defines but fleetlab does not implement (``n`` > 1,
``logprobs``, penalties, ``logit_bias``, ``echo``, tools...) are refused by
:meth:`_SamplingRequest.check_supported` rather than silently ignored; fields nobody defines are
ignored. Like vLLM, a few engine settings are accepted as extra body fields: ``top_k``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``.

Responses are plain dicts built by the functions below, in the shapes the official client
parses: ``text_completion`` / ``chat.completion`` bodies, and for ``stream=true`` a
server-sent event per chunk (``text_completion`` / ``chat.completion.chunk``), an optional
usage-only chunk (``stream_options.include_usage``: ``choices`` empty, ``usage`` set; every
earlier chunk then carries ``"usage": null``) and a final ``data: [DONE]``.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from fleetlab.serving.errors import BadRequest


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the request's token counts."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat: the model, sampling and stopping settings, streaming."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: OpenAI's default, 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension; 0 or -1: no limit
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # fleetlab (and vLLM) extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        strings = [value] if isinstance(value, str) else (value or [])
        if len(strings) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(strings)}")
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value):
        if value is not None and any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative")
        return value

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when unset)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        """``stream_options.include_usage``: end the stream with a usage-only chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Raise :class:`BadRequest` naming the field for an OpenAI feature fleetlab does not implement."""
        if self.n != 1:
            raise BadRequest(f"n={self.n}: fleetlab returns one choice per prompt (n=1)", "n", "unsupported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise BadRequest(f"{name} is not supported by fleetlab's sampler", name, "unsupported")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by fleetlab's sampler", "logit_bias", "unsupported")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options", "invalid_value")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise BadRequest(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}", "min_tokens",
                             "invalid_value")


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or a
    list of token-id lists (one choice per prompt, ``index`` in prompt order). ``max_tokens``
    defaults to 16, as in OpenAI's API."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequest("prompt is an empty list", "prompt", "invalid_value")
        if any(isinstance(p, list) and not p for p in self.prompts):
            raise BadRequest("prompt holds an empty token list", "prompt", "invalid_value")
        unsupported = {"echo": self.echo, "best_of": self.best_of not in (None, 1),
                       "logprobs": self.logprobs is not None, "suffix": bool(self.suffix)}
        for name, asked in unsupported.items():
            if asked:
                raise BadRequest(f"{name} is not supported by fleetlab", name, "unsupported")

    @property
    def prompts(self) -> list[str | list[int]]:
        """``prompt`` as a list of prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class TextPart(BaseModel):
    """One part of a message's content; fleetlab's models read text only."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: a role and its text (a string or a list of text parts)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. ``messages`` are rendered to a prompt by the chat template
    (:mod:`fleetlab.serving.chat_template`). ``max_completion_tokens`` is the newer name of
    ``max_tokens``; unset, the answer may run to the model's maximum length."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise BadRequest("logprobs is not supported by fleetlab", "logprobs", "unsupported")
        if self.tools:
            raise BadRequest("tools are not supported by fleetlab", "tools", "unsupported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise BadRequest("only response_format type 'text' is supported", "response_format", "unsupported")

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (None: up to the model's length)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----- responses -----
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(response_id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """A whole ``text_completion``; ``choices``: ``{"index", "text", "finish_reason"}`` dicts."""
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{**c, "logprobs": None} for c in choices], "usage": use}


def chat_response(response_id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """A whole ``chat.completion``; ``choices``: ``{"index", "text", "finish_reason"}`` dicts."""
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": None, "finish_reason": c["finish_reason"]} for c in choices],
            "usage": use}


def completion_chunk(response_id: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None, with_usage: bool) -> dict:
    """One streamed ``text_completion`` chunk (``"usage": null`` when the stream ends with usage)."""
    chunk = {"id": response_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(response_id: str, created: int, model: str, index: int, delta: dict,
               finish_reason: str | None, with_usage: bool) -> dict:
    """One streamed ``chat.completion.chunk``; ``delta`` is ``{"role": "assistant", "content": ""}`` in
    the first chunk, ``{"content": text}`` after, ``{}`` in the one that only finishes."""
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(response_id: str, created: int, model: str, obj: str, use: dict) -> dict:
    """The last chunk of a stream with ``include_usage``: no choices, the totals."""
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


SSE_DONE = sse("[DONE]")
