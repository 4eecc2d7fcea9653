"""The ``"ngram"`` proposer: prompt lookup, no model.

For each row it takes the last ``n`` tokens (``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``), finds their most recent earlier occurrence in the request's own
tokens, and proposes the tokens that followed it. Repetitive text (code edits, quoting
the prompt, counting) drafts well; anything else simply drafts nothing.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fleetlab.spec_decode.proposer import Proposer


def ngram_propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens following an earlier occurrence of the longest suffix of ``tokens``
    of length in ``[min_n, max_n]`` (``[]`` when none occurs).

    Of that suffix's occurrences, the most recent one followed by ``k`` tokens wins (recent
    text predicts best); when none is, the earliest (the longest continuation): in a run of
    one repeated token the most recent match would leave a single token to propose.
    """
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[: num - 1], n)  # starts 0..num-1-n: never the suffix itself
        hits = np.flatnonzero((windows == tokens[num - n :]).all(axis=1))
        if len(hits):
            full = hits[hits + n + k <= num]
            start = int(full[-1] if len(full) else hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


class NgramProposer(Proposer):
    """Prompt-lookup drafting over each row's own tokens (``InputBatch.token_ids``)."""

    name = "ngram"

    def propose(self, batch, sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        cfg, req_ids, max_drafts = self.config, batch.req_ids, self.max_drafts(batch, self.gained(batch, sampled))
        drafts = {}
        for row in np.flatnonzero(max_drafts > 0).tolist():
            tokens = np.concatenate([batch.token_ids[row, : batch.num_tokens[row]], sampled[req_ids[row]]])
            proposal = ngram_propose(tokens, int(max_drafts[row]), cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            if proposal:
                drafts[req_ids[row]] = proposal
        return drafts
