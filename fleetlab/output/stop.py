"""Stop strings (``SamplingParams.stop``): the output ends where one of them appears in its text.

vLLM's meaning: the text is searched as it is detokenized, token by token; the first stop
string to appear ends the request with ``finish_reason="stop"`` and ``stop_reason`` that
string, and the text is cut before it (``include_stop_str_in_output=False``, the default) or
after it. The token that completed it stays in ``token_ids``; tokens after it (a verify step
gains several) are dropped. Stop strings are not looked for before ``min_tokens`` tokens exist.

:func:`find_stop_string` is the one search, over text that grows: the output processor calls
it offline (:class:`StopStrings`), and a server that detokenizes its own stream can call it on
each delta.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop_string(text: str, stop: Sequence[str], num_new_chars: int,
                     include_in_output: bool = False) -> tuple[str, int] | None:
    """``(stop string, length of the text to keep)`` for the stop string that appears in
    ``text`` earliest, among those that end in its last ``num_new_chars`` characters (text
    already searched is not searched again); None if none does."""
    hits = [(s, at) for s in stop if (at := text.find(s, max(0, len(text) - num_new_chars - len(s) + 1))) >= 0]
    if not hits:
        return None
    s, at = min(hits, key=lambda hit: hit[1])  # the earliest; of two at one place, the first listed
    return s, at + len(s) if include_in_output else at


class StopStrings:
    """One request's stop strings, checked on each step's new tokens.

    Args:
      tokenizer: what the engine decodes with; sampling_params: the request's checked
        ``SamplingParams`` (``stop``, ``include_stop_str_in_output``, ``min_tokens``).
    """

    def __init__(self, tokenizer, sampling_params):
        self.tokenizer, self.sp = tokenizer, sampling_params
        self.num_chars = 0  # of the text already searched

    def check(self, token_ids: list[int], num_new: int) -> tuple[str, int, str] | None:
        """For output ``token_ids`` whose last ``num_new`` arrived this step: None, or
        ``(stop string, tokens to keep, text to keep)`` for the first token that completes one."""
        for n in range(len(token_ids) - num_new + 1, len(token_ids) + 1):
            text = self.tokenizer.decode(token_ids[:n], skip_special_tokens=True)
            new_chars, self.num_chars = len(text) - self.num_chars, len(text)
            if n < self.sp.min_tokens:
                continue
            found = find_stop_string(text, self.sp.stop, max(new_chars, 0), self.sp.include_stop_str_in_output)
            if found is not None:
                return found[0], n, text[: found[1]]
        return None
