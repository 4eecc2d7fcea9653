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
steps is never half sent, and cuts the text where one appears. :class:`TextStream` chains the two.

vLLM's meaning of stopping, which the server follows:

- a stop string (``stop``) is cut from the text, or kept at its end with
  ``include_stop_str_in_output``; ``stop_reason`` is the string;
- a stop token (EOS, or one of ``stop_token_ids``) stays in the token ids (and the usage
  count), but its text is not output unless ``include_stop_str_in_output``; ``stop_reason`` is
  the token id, or None for EOS (the engine's ``RequestOutput.stop_reason``).

The search for stop strings is the engine's own, :func:`fleetlab.output.stop.find_stop_string`
(the server detokenizes its streams itself, so it searches each delta with it).
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetlab.output.stop import find_stop_string

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
    ``stopped`` is True, ``reason`` is that string, ``text`` ends just before it (after it with
    ``include``), and later pushes return nothing. ``flush()`` returns the held-back rest (call
    it when the request ends for another reason).
    """

    def __init__(self, stop: Sequence[str] = (), include: bool = False):
        self.stop = [s for s in stop if s]
        self.include = include
        # what must wait: the end that may begin a stop string (nothing when it is kept anyway)
        self.hold = 0 if include else max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False
        self.reason: str | None = None

    def push(self, delta: str) -> str:
        """Add ``delta``; return the text that can be sent now."""
        if self.stopped or not delta:
            return ""
        self.text += delta
        found = find_stop_string(self.text, self.stop, len(delta), self.include)
        if found is not None:
            self.reason, keep = found
            self.text = self.text[:keep]
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

    ``push(new_token_ids, stopped_on_token) -> str`` each step (``stopped_on_token``: the engine
    stopped the request on the last of them, EOS or a stop token: its text is dropped unless
    ``include_stop``); ``finish() -> str`` when the engine says the request is done.
    ``stopped``: a stop string ended it (the server then aborts the request); ``stop_reason``:
    that string. ``num_tokens``: how many output tokens were pushed (the usage count).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 include_stop: bool = False):
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.stops = StopStrings(stop, include_stop)
        self.include_stop = include_stop
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.stops.stopped

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text (None if none did)."""
        return self.stops.reason

    @property
    def text(self) -> str:
        """The text so far (cut at the stop string once one appeared)."""
        return self.stops.text

    def push(self, new_token_ids: Sequence[int], stopped_on_token: bool = False) -> str:
        """One step's new tokens in; the text that can be sent now out."""
        if self.stopped:
            return ""
        self.num_tokens += len(new_token_ids)
        if stopped_on_token and not self.include_stop:
            new_token_ids = list(new_token_ids)[:-1]
        return self.stops.push(self.detokenizer.push(new_token_ids))

    def finish(self) -> str:
        """The request ended: the text still held back."""
        if self.stopped:
            return ""
        out = self.stops.push(self.detokenizer.flush())
        return out + ("" if self.stopped else self.stops.flush())
