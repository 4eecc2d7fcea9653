"""Turning a growing list of token ids into text deltas, and cutting the text at stop strings.

A stream sends text as tokens arrive, one engine step at a time. Decoding each new token on its
own is wrong for most real tokenizers: a SentencePiece token carries its leading space only in
context, and a byte-level BPE splits one character over several tokens. So
:class:`IncrementalDetokenizer` keeps two offsets into the ids, as serving engines do:

- ``prefix_offset``: where the context window starts (a few tokens already sent);
- ``read_offset``: where the unsent tokens start.

Each push decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``; the new text
is what the second adds to the first. If it ends in U+FFFD (half a character) it is held back
until the next token completes it. Decoding only a window keeps each push O(window), not O(length).

:class:`StopStrings` then holds back the end of the text that could be the start of a stop
string (at most ``len(longest stop) - 1`` characters), so that a stop string split over two
steps is never half sent, and cuts the text where one appears (OpenAI's ``stop``: the stop
string itself is not returned). :class:`TextStream` chains the two.
"""

from __future__ import annotations

from collections.abc import Sequence

# How many prompt tokens seed the window, so the first output token decodes in context.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Text deltas of a growing token list (see the module docstring).

    Args:
      tokenizer: anything with ``decode(ids, skip_special_tokens=...)``.
      prompt_token_ids: the prompt; its last few tokens give the first output token its context
        (they are never part of the output text).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self._ids = [int(t) for t in list(prompt_token_ids)[-_PROMPT_CONTEXT:]]
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.text = ""  # everything emitted so far

    def _decode(self, ids) -> str:
        if not ids or self.tokenizer is None:  # no tokenizer: token ids in, token ids out (usage), no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text they complete (may be ``""`` while a character is incomplete)."""
        self._ids.extend(int(t) for t in new_token_ids)
        before = self._decode(self._ids[self.prefix_offset:self.read_offset])
        after = self._decode(self._ids[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # a special token (nothing to show) or half a character: wait
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back, even an incomplete character."""
        before = self._decode(self._ids[self.prefix_offset:self.read_offset])
        after = self._decode(self._ids[self.prefix_offset:])
        delta = after[len(before):] if len(after) > len(before) else ""
        self.prefix_offset = self.read_offset = len(self._ids)
        self.text += delta
        return delta


class StopStrings:
    """Cut a text stream at the first of ``stop`` and hold back what could begin one.

    ``push(delta)`` returns the text that is safe to send now; once a stop string is seen,
    ``stopped`` is True, ``text`` ends just before it, and later pushes return nothing.
    ``flush()`` returns the held-back rest (call it when the request ends for another reason).
    """

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, delta: str) -> str:
        """Add ``delta``; return the text that can be sent now."""
        if self.stopped or not delta:
            return ""
        start = max(0, len(self.text) - self.hold)  # a new match must end inside delta
        self.text += delta
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
            return self.flush()
        safe = len(self.text) - self._partial_match()
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def _partial_match(self) -> int:
        """Length of the longest end of ``text`` that begins some stop string (what must wait)."""
        for n in range(min(self.hold, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def flush(self) -> str:
        """Everything not sent yet (the request ended without a stop string)."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class TextStream:
    """One choice's text: token ids in, sendable text out, stop strings applied.

    ``push(new_token_ids) -> str`` each step; ``finish() -> str`` when the engine says the
    request is done. ``stopped``: a stop string ended it (the server then aborts the request).
    ``num_tokens``: how many output tokens were pushed (the usage count).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = ()):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stops = StopStrings(stop)
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.stops.stopped

    @property
    def text(self) -> str:
        """The text so far (cut at the stop string once one appeared)."""
        return self.stops.text

    def push(self, new_token_ids: Sequence[int]) -> str:
        """One step's new tokens in; the text that can be sent now out."""
        if self.stopped:
            return ""
        self.num_tokens += len(new_token_ids)
        return self.stops.push(self.detokenizer.push(new_token_ids))

    def finish(self) -> str:
        """The request ended: the text still held back."""
        if self.stopped:
            return ""
        out = self.stops.push(self.detokenizer.flush())
        return out + ("" if self.stopped else self.stops.flush())
