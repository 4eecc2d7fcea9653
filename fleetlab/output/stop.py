"""Stop strings (``SamplingParams.stop``): the output ends where one of them appears in its text.

vLLM's meaning: the text is searched as it is detokenized, token by token; the first stop
string to appear ends the request with ``finish_reason="stop"`` and ``stop_reason`` that
string, and the text is cut before it (``include_stop_str_in_output=False``, the default) or
after it. The token that completed it stays in ``token_ids``; tokens after it (a verify step
gains several) are dropped. Stop strings are not looked for before ``min_tokens`` tokens exist.
A stop string may end inside a token (``"\\n\\n"`` inside a token ``"\\n\\n\\n"``, or a
character whose bytes two tokens share): the text is still cut exactly at it.

:func:`find_stop_string` is the one search, over text that grows (each request's
:class:`~fleetlab.output.text.TextStream` calls it on what each token adds), and
:func:`partial_stop_length` says how much of the end to hold back while it may begin one.
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


def partial_stop_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins some stop string but is not one: what a
    stream holds back, so that a stop string split over two steps is never half sent."""
    if not text:
        return 0
    last, best = text[-1], 0
    for s in stop:  # such an end is a prefix s[:k + 1] of a stop string with s[k] == text's last character
        k = s.find(last, best, len(s) - 1)
        while k >= 0:
            if text.endswith(s[:k + 1]):
                best = k + 1
            k = s.find(last, k + 1, len(s) - 1)
    return best
