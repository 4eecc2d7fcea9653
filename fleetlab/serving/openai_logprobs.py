"""The engine's log-probabilities in OpenAI's two shapes.

Each position comes in as ``(token id, TokenLogprobs or None)`` (None: the first prompt token,
which nothing predicts). A token is shown as its own decoded text (``tokenizer.decode([id])``,
as vLLM shows it; ``"token_id:<id>"`` without a tokenizer); a logprob below -9999 is sent as
-9999.0 (JSON has no -inf), as vLLM does.

- ``/v1/completions`` (:func:`completion_logprobs`): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one entry per token; ``top_logprobs[i]`` is a
  ``{token text: logprob}`` dict of the top ``logprobs`` tokens *and* the chosen one (so up to
  ``logprobs + 1`` entries, as OpenAI and vLLM return); ``text_offset[i]`` is where token ``i``'s
  text starts, counted in characters from ``text_offset`` of the first.
- ``/v1/chat/completions`` (:func:`chat_logprobs`): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}...]}]}`` with the top ``top_logprobs`` tokens.
"""

from __future__ import annotations

MIN_LOGPROB = -9999.0


def token_text(tokenizer, token_id: int) -> str:
    """How a token is shown: its decoded text, or ``token_id:<id>`` without a tokenizer."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([int(token_id)], skip_special_tokens=False)


def _value(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def completion_logprobs(tokenizer, positions: list[tuple], text_offset: int = 0) -> dict:
    """The ``logprobs`` object of a completion choice (or of one streamed chunk)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, item in positions:
        text = token_text(tokenizer, token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if item is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(item.logprob))
        top = {token_text(tokenizer, t): _value(v) for t, v in item.top}
        top.setdefault(text, _value(item.logprob))
        out["top_logprobs"].append(top)
    return out


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer, positions: list[tuple]) -> dict:
    """The ``logprobs`` object of a chat choice (or of one streamed chunk)."""
    return {"content": [{**_entry(tokenizer, token_id, item.logprob),
                         "top_logprobs": [_entry(tokenizer, t, v) for t, v in item.top]}
                        for token_id, item in positions]}
