"""Incremental detokenization: a growing list of token ids in, text deltas out.

Decoding each new token on its own is wrong for real tokenizers: a byte-level BPE splits one
character over several tokens (``"日"`` is the bytes ``e6 97 a5``; a token may hold ``e6 97``
and the next ``a5``), and a SentencePiece token carries its leading space only in context. So a
stream decodes each new token *in the context of the tokens before it* and holds text back while
it ends in half a character (U+FFFD, the replacement character, is what a decoder writes for
the incomplete bytes); the next token completes it, and the whole character goes out at once.

Two implementations of :class:`IncrementalDetokenizer`, picked by :func:`incremental_detokenizer`:

- :class:`FastIncrementalDetokenizer`, for a fast (Rust) tokenizer (``tokenizer.backend_tokenizer``
  is a ``tokenizers.Tokenizer``: PaddleFormers' and Hugging Face's fast tokenizers): the
  ``tokenizers`` library's own ``decoders.DecodeStream``, as vLLM's fast path uses it. It keeps
  the two offsets below in Rust and returns None while the text ends in half a character.
- :class:`SlowIncrementalDetokenizer`, for any other tokenizer with ``decode(ids)`` (fleetlab's
  ``CharTokenizer``): the same offsets kept here, as vLLM's fallback does:

  - ``prefix_offset``: where the context window starts (a few tokens whose text was sent);
  - ``read_offset``: where the tokens whose text was not sent yet start.

  Each push decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``; the new text
  is what the second adds to the first, held back while it ends in U+FFFD.

Both are primed with a few prompt tokens (the shortest suffix of 4 to 23 that decodes with no
U+FFFD, as vLLM picks it; none if the prompt ends in half a character), so the first output
token decodes in context but the output never takes bytes from the prompt. The promise, tested
over random token sequences (``tests/test_detokenizer.py``): the deltas joined are, at every
step, the full decode of the output ids less a tail that ends in U+FFFD (half a character, held
back), and after :meth:`~IncrementalDetokenizer.flush` exactly the full decode
(``tokenizer.decode(ids, skip_special_tokens=True)``; for a fast tokenizer the Rust decoder's
text, without the Python-side ``clean_up_tokenization_spaces``, as in vLLM). That holds for a
byte-level BPE; a tokenizer whose decode depends on context gives what the output adds to the
prompt's text instead (as vLLM's: a SentencePiece token keeps its leading space).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

logger = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""

_CONTEXT = (4, 24)  # prompt suffix lengths tried for the context, shortest first (vLLM's)
_WINDOW = 6  # tokens of context the slow path and flush decode before the unsent ones


class IncrementalDetokenizer(ABC):
    """One sequence's text as its tokens arrive.

    ``push(ids) -> str``: add tokens, get the text they complete (``""`` while a character is
    incomplete, or for a special token); ``flush() -> str``: at the end, whatever is still held
    back, even half a character (as U+FFFD, as a full decode writes it). ``text``: all of it so far.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self._ids = _context(self._decode, [int(t) for t in prompt_token_ids])
        self.prefix_offset = max(0, len(self._ids) - _WINDOW)
        self.read_offset = len(self._ids)  # the first id whose text was not emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if ids else ""

    @abstractmethod
    def _step(self, token_id: int) -> str | None:
        """The text ``token_id`` completes (with any held back before it), None to hold back."""

    def push(self, new_token_ids: Sequence[int]) -> str:
        delta = ""
        for t in new_token_ids:
            self._ids.append(int(t))
            piece = self._step(int(t))
            if piece:
                delta += piece
                self.prefix_offset, self.read_offset = max(0, len(self._ids) - _WINDOW), len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        before = self._decode(self._ids[self.prefix_offset:self.read_offset])
        after = self._decode(self._ids[self.prefix_offset:])
        delta = after[len(before):] if len(after) > len(before) else ""
        self.prefix_offset = self.read_offset = len(self._ids)
        self.text += delta
        return delta


def _context(decode, prompt: list[int]) -> list[int]:
    """The prompt tokens that give the first output token its context (see the module docstring)."""
    for n in range(_CONTEXT[0], min(len(prompt), _CONTEXT[1] - 1) + 1):
        if REPLACEMENT not in decode(prompt[-n:]):
            return prompt[-n:]
    short = prompt[-_CONTEXT[0]:]
    return short if short and REPLACEMENT not in decode(short) else []


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """Prefix and read offsets over ``tokenizer.decode`` (see the module docstring)."""

    def _step(self, token_id: int) -> str | None:
        before = self._decode(self._ids[self.prefix_offset:self.read_offset])
        after = self._decode(self._ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return None  # a special token (nothing to show), or half a character: wait
        return after[len(before):]


class FastIncrementalDetokenizer(IncrementalDetokenizer):
    """``tokenizers.decoders.DecodeStream`` over the fast tokenizer's Rust tokenizer."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = ()):
        from tokenizers.decoders import DecodeStream

        self._backend = tokenizer.backend_tokenizer
        self._new_stream = lambda: DecodeStream(skip_special_tokens=True)
        self._stream = self._new_stream()
        super().__init__(tokenizer, prompt_token_ids)
        for t in self._ids:  # prime it with the context
            self._step(t)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=True) if ids else ""

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except Exception as e:  # the decoder rewrote text it had already given (vLLM restarts the stream too)
            if "Invalid prefix encountered" not in str(e):
                raise
            logger.debug("DecodeStream restarted at token %d: %s", token_id, e)
            self._stream = self._new_stream()
            return self._stream.step(self._backend, token_id)


def is_fast_tokenizer(tokenizer) -> bool:
    """Whether ``tokenizer`` wraps a ``tokenizers.Tokenizer`` (``backend_tokenizer``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return type(backend).__module__.startswith("tokenizers") and hasattr(backend, "decode")


def incremental_detokenizer(tokenizer, prompt_token_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
    """The detokenizer for ``tokenizer``: the ``DecodeStream`` one for a fast tokenizer, else the offsets one."""
    cls = FastIncrementalDetokenizer if is_fast_tokenizer(tokenizer) else SlowIncrementalDetokenizer
    return cls(tokenizer, prompt_token_ids)
