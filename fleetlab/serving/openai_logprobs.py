"""The engine's log-probabilities in OpenAI's two shapes.

Each position comes in as ``(token id, TokenLogprobs or None)`` (None: the first prompt token,
which nothing predicts). A token is shown by :class:`TokenStrings`: as its own decoded text
(``tokenizer.decode([id])``, as vLLM shows it: a token that holds a piece of a character shows as
U+FFFD; ``"token_id:<id>"`` without a tokenizer), and in the chat shape with its own **bytes**, as
OpenAI means them (joined, a split character's tokens give its UTF-8 back): for a fast tokenizer the
token's bytes as llguidance reads them from the tokenizer, else the UTF-8 of its text. A logprob
below -9999 is sent as -9999.0 (JSON has no -inf), as vLLM does.

- ``/v1/completions`` (:func:`completion_logprobs`): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one entry per token; ``top_logprobs[i]`` is a
  ``{token text: logprob}`` dict of the top ``logprobs`` tokens *and* the chosen one (so up to
  ``logprobs + 1`` entries, as OpenAI and vLLM return); ``text_offset[i]`` is where token ``i``'s
  text starts, counted in characters from ``text_offset`` of the first.
- ``/v1/chat/completions`` (:func:`chat_logprobs`): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [{"token", "logprob", "bytes"}...]}]}`` with the top ``top_logprobs`` tokens.
"""

from __future__ import annotations

from fleetlab.output.detokenizer import is_fast_tokenizer

MIN_LOGPROB = -9999.0


class TokenStrings:
    """How one server shows tokens: ``text(id)`` and ``bytes(id)`` (see the module docstring).

    ``vocab_size``: the model's (ids past the tokenizer's own decode to nothing)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._read_bytes = None  # built on first use: llguidance reads the whole vocabulary (~0.1 s)

    def text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        if self.tokenizer is None or not is_fast_tokenizer(self.tokenizer):
            return list(self.text(token_id).encode("utf-8"))
        if self._read_bytes is None:
            from fleetlab.structured_output.guidance import token_bytes_reader

            self._read_bytes = token_bytes_reader(self.tokenizer, max(self.vocab_size, len(self.tokenizer)))
        return list(self._read_bytes(token_id))


def _value(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def completion_logprobs(tokens: TokenStrings, positions: list[tuple], text_offset: int = 0) -> dict:
    """The ``logprobs`` object of a completion choice (or of one streamed chunk)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, item in positions:
        text = tokens.text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if item is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_value(item.logprob))
        top = {tokens.text(t): _value(v) for t, v in item.top}
        top.setdefault(text, _value(item.logprob))
        out["top_logprobs"].append(top)
    return out


def _entry(tokens: TokenStrings, token_id: int, logprob: float) -> dict:
    return {"token": tokens.text(token_id), "logprob": _value(logprob), "bytes": tokens.bytes(token_id)}


def chat_logprobs(tokens: TokenStrings, positions: list[tuple]) -> dict:
    """The ``logprobs`` object of a chat choice (or of one streamed chunk)."""
    return {"content": [{**_entry(tokens, token_id, item.logprob),
                         "top_logprobs": [_entry(tokens, t, v) for t, v in item.top]}
                        for token_id, item in positions]}
