"""``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``: the served tokenizer over HTTP.

The request and response shapes are vLLM's, so that clients written for it work here
(lm-evaluation-harness's ``tokenizer_backend="remote"`` counts and cuts prompts with them):

- ``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` (a completion prompt) or
  ``{"messages": [...], "add_generation_prompt": true}`` (rendered by the chat template, exactly
  as ``/v1/chat/completions`` renders them); ``return_token_strs`` adds each token's string.
  It answers ``{"count", "max_model_len", "tokens", "token_strs"}``;
- ``/detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}`` (special tokens
  written, as vLLM does);
- ``/tokenizer_info`` answers the tokenizer's settings: its class, its special tokens and the
  chat template the server renders with (the tokenizer's, or the minimal one as Jinja).

Every body is checked like the OpenAI routes' (strict types, unknown fields refused, 400 naming
the field); a token id outside the vocabulary is a 400 naming ``tokens``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from fleetlab.serving import protocol as P
from fleetlab.serving import refused
from fleetlab.serving.chat_template import chat_prompt_ids, chat_template_text, encode_text
from fleetlab.serving.errors import BadRequest


class TokenizeCompletionRequest(BaseModel):
    """``/tokenize`` with a prompt."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    """``/tokenize`` with chat messages (``add_special_tokens``: on top of the template's; vLLM's default, false)."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    messages: list[P.ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    """``/detokenize``."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


_CHAT_REFUSED = {name: refused.CHAT[name] for name in ("chat_template", "chat_template_kwargs", "tools",
                                                       "mm_processor_kwargs")}


def tokenize(tokenizer, body: bytes, max_model_len: int, check_model) -> dict:
    """The ``/tokenize`` answer for ``body`` (``check_model(name)``: 404 for another model)."""
    data = P.read_json(body)
    chat = "messages" in data
    req = P.validate(TokenizeChatRequest if chat else TokenizeCompletionRequest, data)
    check_model(req.model)
    refused.check_fields(req.model_extra or {}, _CHAT_REFUSED if chat else {})
    if chat:
        for i, message in enumerate(req.messages):
            message.check_supported(f"messages[{i}]")
        if req.continue_final_message or req.add_special_tokens:
            param = "continue_final_message" if req.continue_final_message else "add_special_tokens"
            raise BadRequest(f"{param}=True is not supported: the server renders messages as "
                             "/v1/chat/completions does", param, "unsupported")
        try:
            ids = chat_prompt_ids(tokenizer, [{"role": m.role, "content": m.text} for m in req.messages],
                                  req.add_generation_prompt)
        except Exception as e:  # a template that refuses these messages
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from e
    else:
        ids = encode_text(tokenizer, req.prompt, req.add_special_tokens)
    strs = token_strings(tokenizer, ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer, body: bytes, vocab_size: int, check_model) -> dict:
    """The ``/detokenize`` answer for ``body``."""
    req = P.validate(DetokenizeRequest, P.read_json(body))
    check_model(req.model)
    refused.check_fields(req.model_extra or {}, {})
    outside = [t for t in req.tokens if t >= vocab_size]
    if outside:
        raise BadRequest(f"tokens holds ids outside the vocabulary [0, {vocab_size}): {outside[:5]}", "tokens",
                         "invalid_value")
    try:
        return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}
    except Exception as e:  # an id the model has (its padded vocabulary) but the tokenizer does not
        raise BadRequest(f"the tokenizer cannot decode these tokens: {type(e).__name__}: {e}", "tokens",
                         "invalid_value") from e


def token_strings(tokenizer, ids: list[int]) -> list[str]:
    """Each token's own string (the tokenizer's ``convert_ids_to_tokens``, else each decoded alone)."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return list(tokenizer.convert_ids_to_tokens(ids))
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def tokenizer_info(tokenizer) -> dict:
    """``/tokenizer_info``: the tokenizer's init settings (no file paths), class, special tokens
    and chat template."""
    info = {k: _jsonable(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if not k.endswith("_file")}
    for name in ("bos", "eos", "pad", "unk"):
        if info.get(f"{name}_token") is None:
            token = getattr(tokenizer, f"{name}_token", None)
            token_id = getattr(tokenizer, f"{name}_token_id", None)
            if token is None and isinstance(token_id, int):
                token = tokenizer.decode([token_id], skip_special_tokens=False)
            info[f"{name}_token"] = _jsonable(token)
    info["tokenizer_class"] = type(tokenizer).__name__
    info["chat_template"] = chat_template_text(tokenizer)
    return info


def _jsonable(value):
    """A tokenizer setting as JSON: an ``AddedToken`` as its text; anything else not JSON as its ``str``."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
