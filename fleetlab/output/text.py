"""``TextStream``: one sequence's text as its tokens arrive, cut at its stop strings.

It chains the two pieces every engine needs between token ids and what a user sees:

1. an :class:`~fleetlab.output.detokenizer.IncrementalDetokenizer` (text deltas; half a
   character is held back until the token that completes it);
2. the stop-string search (:func:`~fleetlab.output.stop.find_stop_string`), token by token, so
   that with several tokens in a step (speculation) the request ends at the token whose text
   completed the string, and the text is cut exactly at the string even when it ends inside a
   token; while the end of the text may begin a stop string it is held back
   (:func:`~fleetlab.output.stop.partial_stop_length`), so a stream never sends half of one.

The output processor keeps one per sequence (offline, and the server's streams read the same
text). Stopping follows vLLM:

- a stop string is cut from the text, or kept at its end with ``include_stop``; ``stop_reason``
  is the string; the tokens kept are those up to the one that completed it;
- a stop token (EOS, or one of ``stop_token_ids``) stays in the token ids, but its text is not
  output unless ``include_stop`` (``push(..., stopped_on_token=True)``).
"""

from __future__ import annotations

from collections.abc import Sequence

from fleetlab.output.detokenizer import incremental_detokenizer
from fleetlab.output.stop import find_stop_string, partial_stop_length


class TextStream:
    """One sequence's text (see the module docstring).

    Args:
      tokenizer: what the engine decodes with; prompt_token_ids: the prompt (a few of its last
        tokens give the first output token its context); stop, include_stop, min_tokens:
        ``SamplingParams.stop``, ``include_stop_str_in_output`` and ``min_tokens`` (stop strings
        are not looked for before that many tokens exist).

    ``push(new_token_ids, stopped_on_token=False) -> str`` each step: the text that can be sent
    now; ``finish() -> str`` when the sequence ends: the rest. ``text``: the text so far (cut at
    the stop string once one appeared; with what is held back); ``sent``: how much of it was
    returned; ``num_tokens``: tokens pushed; ``num_kept_tokens``: with a stop string, the
    tokens up to the one that completed it.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (),
                 include_stop: bool = False, min_tokens: int = 0):
        self.detokenizer = incremental_detokenizer(tokenizer, prompt_token_ids)
        self.stop, self.include_stop, self.min_tokens = tuple(stop), include_stop, min_tokens
        self.text, self.sent = "", 0
        self.num_tokens = 0
        self.num_kept_tokens: int | None = None
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.stop_reason is not None

    def push(self, new_token_ids: Sequence[int], stopped_on_token: bool = False) -> str:
        """One step's new tokens in (``stopped_on_token``: the last is the EOS or stop token that
        ended the sequence); the text that can be sent now out."""
        if self.stopped:
            return ""
        ids = list(new_token_ids)
        first = self.num_tokens
        self.num_tokens += len(ids)
        if stopped_on_token and not self.include_stop:
            ids = ids[:-1]
        for i, token_id in enumerate(ids):
            if self._add(self.detokenizer.push([token_id]), first + i + 1):
                return self._send(len(self.text))
        hold = 0 if self.include_stop else partial_stop_length(self.text, self.stop)
        return self._send(len(self.text) - hold)

    def finish(self) -> str:
        """The sequence ended: the text still held back (half a character is written as U+FFFD,
        as a full decode writes it)."""
        if not self.stopped:
            self._add(self.detokenizer.flush(), self.num_tokens)
        return self._send(len(self.text))

    def _add(self, delta: str, num_tokens: int) -> bool:
        """Append a token's text; True when it completes a stop string (the text is then cut)."""
        self.text += delta
        if not (delta and self.stop) or num_tokens < self.min_tokens:
            return False
        found = find_stop_string(self.text, self.stop, len(delta), self.include_stop)
        if found is None:
            return False
        self.stop_reason, keep = found
        self.text, self.num_kept_tokens = self.text[:keep], num_tokens
        return True

    def _send(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out
