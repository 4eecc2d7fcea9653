"""The OpenAI wire format: request models (validated by pydantic) and response/chunk builders.

Requests: :class:`CompletionRequest` (``POST /v1/completions``) and :class:`ChatCompletionRequest`
(``POST /v1/chat/completions``), read from the body by :func:`parse_request` (JSON whatever the
``Content-Type`` says, as OpenAI's and vLLM's servers read it). Their fields are the ones fleetlab
applies; ranges follow OpenAI's API (``temperature`` in [0, 2], ``top_p`` in (0, 1], ``max_tokens``
>= 1 -- or 0 with ``echo``, vLLM's scoring idiom: the prompt and its logprobs, nothing generated --,
``presence_penalty`` and ``frequency_penalty`` in [-2, 2], ``logprobs`` / ``top_logprobs`` <= 20...)
and a value out of range is answered 400 naming the field. Types are strict (pydantic's strict
mode): ``max_tokens="4"``, ``max_tokens=true`` or completions' ``logprobs=true`` are refused, not
coerced (an integer is a number, so ``temperature=1`` is fine). Like vLLM, a few engine
settings are accepted as extra body fields: ``top_k`` (0 or -1: no limit), ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``repetition_penalty``, ``best_of`` in
chat too, and
``structured_outputs`` (vLLM's constraint fields), which OpenAI's ``response_format``
(``json_object``, ``json_schema``) is merged into. Every other field is refused by
:meth:`check_supported` unless its value changes nothing (:mod:`fleetlab.serving.refused` says
which, and why).

Responses are plain dicts built by the functions below, in the shapes the official client
parses: ``text_completion`` / ``chat.completion`` bodies, and for ``stream=true`` a
server-sent event per chunk (``text_completion`` / ``chat.completion.chunk``), an optional
usage-only chunk (``stream_options.include_usage``: ``choices`` empty, ``usage`` set; every
earlier chunk then carries ``"usage": null``) and a final ``data: [DONE]``. A choice's
``logprobs`` is null unless asked for (:mod:`fleetlab.serving.openai_logprobs` builds it).
"""

from __future__ import annotations

import json
import re
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fleetlab.serving import refused
from fleetlab.serving.errors import BadRequest


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the request's token counts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's; refused when true


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's ``name``, ``description``, ``schema``, ``strict``
    (the output always follows the schema here; ``strict`` changes nothing)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any
    JSON object) or ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat: the model, sampling and stopping settings, streaming."""

    model_config = ConfigDict(extra="allow", strict=True)  # extras kept in model_extra for check_supported to refuse
    REFUSED: ClassVar[dict[str, refused.Refusal]] = {}  # per endpoint: refused.COMPLETION or refused.CHAT

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=0)  # 0: only with echo (completions)
    temperature: float | None = Field(None, ge=0, le=2)  # None: OpenAI's default, 1.0
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # extension; 0 or -1: no limit
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the client's records; it changes no answer
    n: int = Field(1, ge=1)  # choices per prompt (index = prompt's index * n + choice)
    best_of: int | None = Field(None, ge=1)  # generate best_of, return the n of highest cumulative logprob
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # {token id (a string): bias}, read into int keys
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension
    response_format: ResponseFormat | None = None
    # fleetlab (and vLLM) extensions
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text)
    structured_outputs: dict | None = None  # vLLM's StructuredOutputsParams fields

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        strings = [value] if isinstance(value, str) else (value or [])
        if len(strings) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(strings)}")
        if any(s == "" for s in strings):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value):
        """JSON keys are strings: each must spell a token id in ASCII digits (``"²"`` passes ``isdigit``)."""
        for key in value or {}:
            if not re.fullmatch(r"\s*[0-9]+\s*", key):
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer in ASCII digits)")
        return None if value is None else {int(k): v for k, v in value.items()}

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

    def structured_outputs_fields(self) -> tuple[dict | None, str]:
        """The request's constraint as ``StructuredOutputsParams`` fields (None: none), and the
        request field it came from (what a 400 names). As in vLLM, ``response_format`` is merged
        into ``structured_outputs`` (which may then carry only options, such as
        ``disable_any_whitespace``)."""
        fields = None if self.structured_outputs is None else dict(self.structured_outputs)
        rf = self.response_format
        if rf is None or rf.type == "text":
            return fields, "structured_outputs"
        if rf.type == "json_object":
            return {**(fields or {}), "json_object": True}, "response_format"
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise BadRequest("response_format of type json_schema needs json_schema.schema",
                             "response_format.json_schema", "invalid_value")
        return {**(fields or {}), "json": rf.json_schema.json_schema}, "response_format.json_schema.schema"

    def check_supported(self) -> None:
        """Raise :class:`BadRequest` naming the field for anything fleetlab would not apply."""
        refused.check_fields(self.model_extra or {}, self.REFUSED)
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise BadRequest("stream_options.continuous_usage_stats=True is not supported: usage comes in one "
                             "last chunk (include_usage)", "stream_options.continuous_usage_stats", "unsupported")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", "stream_options", "invalid_value")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise BadRequest(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}", "min_tokens",
                             "invalid_value")
        if self.stream and (self.best_of or self.n) > self.n:
            raise BadRequest(f"best_of={self.best_of} > n={self.n} cannot be streamed: the best are known only "
                             "once every sequence has finished (as in OpenAI's API)", "best_of", "invalid_value")

    @property
    def num_logprobs(self) -> int | None:
        """Top log-probabilities per output token (None: no logprobs)."""
        raise NotImplementedError


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids, or a
    list of token-id lists (one choice per prompt, ``index`` in prompt order). ``max_tokens``
    defaults to 16, as in OpenAI's API."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)  # top logprobs per token, besides the chosen one's
    echo: bool = False  # the prompt before the completion (with its logprobs when logprobs is set)
    REFUSED: ClassVar[dict[str, refused.Refusal]] = refused.COMPLETION

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise BadRequest("max_tokens=0 generates nothing: it is only allowed with echo=true (the prompt and, "
                             "with logprobs, its logprobs: vLLM's way to score a text)", "max_tokens", "invalid_value")
        if self.max_tokens == 0 and (self.best_of or self.n) > self.n:
            raise BadRequest("best_of ranks generated sequences; max_tokens=0 generates none", "best_of",
                             "invalid_value")
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequest("prompt is an empty list", "prompt", "invalid_value")
        if any(isinstance(p, list) and not p for p in self.prompts):
            raise BadRequest("prompt holds an empty token list", "prompt", "invalid_value")

    @property
    def prompts(self) -> list[str | list[int]]:
        """``prompt`` as a list of prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    """One part of a message's content: ``{"type": "text", "text": ...}``; other types
    (``image_url``, ``input_audio``...) are refused by :meth:`ChatMessage.check_supported`."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One chat message: a role and its text (a string or a list of text parts)."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def check_supported(self, where: str) -> None:
        """Refuse what the chat template would drop: non-text parts, names, tool calls."""
        refused.check_fields(self.model_extra or {}, refused.MESSAGE, f"{where}.")
        for j, part in enumerate(self.content if isinstance(self.content, list) else []):
            param = f"{where}.content[{j}]"
            if part.type != "text":
                raise BadRequest(f"{param}: only text parts are supported; got {part.type!r}", param, "unsupported")
            if part.text is None:
                raise BadRequest(f"{param}: a text part needs its 'text'", param, "invalid_value")
            refused.check_fields(part.model_extra or {}, {}, f"{param}.")

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
    logprobs: bool = False  # the chosen tokens' logprobs
    top_logprobs: int | None = Field(None, ge=0, le=20)  # with logprobs: the top tokens at each position
    REFUSED: ClassVar[dict[str, refused.Refusal]] = refused.CHAT

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0:
            raise BadRequest("max_tokens=0 generates nothing (completions take it with echo=true)", "max_tokens",
                             "invalid_value")
        for i, message in enumerate(self.messages):
            message.check_supported(f"messages[{i}]")
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs", "invalid_value")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens`` (None: up to the model's length)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(cls: type[BaseModel], body: bytes) -> BaseModel:
    """The request in ``body``: UTF-8 JSON, whatever the ``Content-Type`` header says (``curl -d``
    sends ``application/x-www-form-urlencoded``); :class:`BadRequest` naming what is wrong."""
    return validate(cls, read_json(body))


def read_json(body: bytes) -> dict:
    """``body`` as a JSON object (:class:`BadRequest` when it is empty, not UTF-8, not JSON or not an object)."""
    if not body.strip():
        raise BadRequest("the body is empty: send a JSON object", None, "missing_body")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8 text: byte {body[e.start]:#04x} at position {e.start}", None,
                         "invalid_encoding") from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested deeper than Python's stack
        raise BadRequest(f"the body is not valid JSON: {e}", None, "json_invalid") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, not a JSON {type(data).__name__}", None, "invalid_type")
    if "\\ud" in text.lower():  # only a \uD800-\uDFFF escape makes a lone surrogate (a pair is joined)
        _refuse_lone_surrogates(data)
    return data


def _refuse_lone_surrogates(data: dict) -> None:
    """400 naming the first string (key or value) that holds half of a UTF-16 surrogate pair: it
    is not text, so no tokenizer can encode it (and nothing could write it back as UTF-8)."""
    todo: list[tuple[str, object]] = [("", data)]
    while todo:
        path, value = todo.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
            for text in (key, item):
                if isinstance(text, str) and (i := _surrogate_at(text)) is not None:
                    raise BadRequest(f"{where} is not valid UTF-8 text: a lone surrogate \\u{ord(text[i]):04x} at "
                                     f"character {i}", where, "invalid_encoding")
            todo.append((where, item))


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def validate(cls: type[BaseModel], data: dict) -> BaseModel:
    """``cls`` validated from ``data``; pydantic's first error as a :class:`BadRequest`."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def validation_error(errors) -> BadRequest:
    """pydantic's errors as one :class:`BadRequest`: the first error, its field as ``param``."""
    if not errors:
        return BadRequest("invalid request", None, "invalid_value")
    e = errors[0]
    param = field_path([x for x in e.get("loc", ()) if x != "body"])
    msg = e.get("msg", "invalid value")
    if e.get("type") == "missing":
        return BadRequest(f"{param}: field required", param or None, "missing_field")
    if not param:
        return BadRequest(f"the body must be a JSON object: {msg}", None, "invalid_type")
    shown = e.get("input")
    shown = repr(shown)[:80] if not isinstance(shown, dict) else "an object"
    return BadRequest(f"{param}: {msg} (got {shown})", param, "invalid_value")


_TYPE_WORDS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-plain",
               "literal", "model"}


def field_path(loc) -> str:
    """``("messages", 0, "content")`` -> ``"messages[0].content"``; union-member tags are dropped."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif not out and isinstance(item, str):  # the top-level field ("model" is one, not a union tag)
            out = item
        elif isinstance(item, str) and item.isidentifier() and item.lower() not in _TYPE_WORDS:
            out += f".{item}" if out else item
        elif out:
            break  # a union member's tag ("list[int]"...): the field is already named
    return out


# ----- responses -----
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(response_id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """A whole ``text_completion``; ``choices``: ``{"index", "text", "finish_reason", "stop_reason"}``
    dicts (and ``"logprobs"`` where asked for)."""
    return {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{**c, "stop_reason": c.get("stop_reason"), "logprobs": c.get("logprobs")} for c in choices],
            "usage": use}


def chat_response(response_id: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """A whole ``chat.completion``; ``choices``: ``{"index", "text", "finish_reason"}`` dicts (and
    ``"logprobs"`` where asked for)."""
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                         "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"],
                         "stop_reason": c.get("stop_reason")} for c in choices],
            "usage": use}


def completion_chunk(response_id: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None, with_usage: bool, logprobs: dict | None = None,
                     stop_reason: int | str | None = None) -> dict:
    """One streamed ``text_completion`` chunk (``"usage": null`` when the stream ends with usage)."""
    chunk = {"id": response_id, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(response_id: str, created: int, model: str, index: int, delta: dict,
               finish_reason: str | None, with_usage: bool, logprobs: dict | None = None,
               stop_reason: int | str | None = None) -> dict:
    """One streamed ``chat.completion.chunk``; ``delta`` is ``{"role": "assistant", "content": ""}`` in
    the first chunk, ``{"content": text}`` after, ``{}`` in the one that only finishes."""
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                          "stop_reason": stop_reason}]}
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
