"""``LogprobsCollector``: each request's log-probabilities, kept across the steps that compute them.

The model runner computes them in the step's one device read (:mod:`fleetlab.engine.logprobs`:
which logits, what a position gets); this keeps the lists and puts them on the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Lists:
    sample: list | None  # TokenLogprobs per output token, None unless asked for
    prompt: list | None  # per prompt token: None for the first, then TokenLogprobs
    cumulative: float = 0.0


class LogprobsCollector:
    """Each request's logprobs as steps add to them, attached to its ``RequestOutput`` s.

    ``add(request)`` registers a request that asked for ``logprobs`` or ``prompt_logprobs``;
    ``collect(outputs, runner_output)`` stores what the step computed (prompt logprobs of a
    chunk arrive in steps that give no token; a preempted request that recomputes its prompt
    writes the same values again) and sets ``logprobs``, ``prompt_logprobs`` and
    ``cumulative_logprob`` on the outputs. A finished request is forgotten.
    """

    def __init__(self):
        self._lists: dict[str, _Lists] = {}

    def add(self, request) -> None:
        sp = request.sampling_params
        if sp.logprobs is not None or sp.prompt_logprobs is not None:
            self._lists[request.request_id] = _Lists(
                [] if sp.logprobs is not None else None,
                [None] * request.num_prompt_tokens if sp.prompt_logprobs is not None else None)

    def collect(self, outputs: list, result=None) -> None:
        if not self._lists:
            return
        for rid, (start, lps) in (result.prompt_logprobs.items() if result is not None else ()):
            lists = self._lists.get(rid)
            if lists is not None and lists.prompt is not None:
                lists.prompt[start + 1: start + 1 + len(lps)] = lps
        for out in outputs:
            lists = self._lists.get(out.request_id)
            if lists is None:
                continue
            if lists.sample is not None:
                # (cut to the tokens kept: those past a stop were dropped)
                new = (result.logprobs.get(out.request_id, []) if result is not None else [])[: len(out.new_token_ids)]
                lists.sample += new
                lists.cumulative += sum(lp.logprob for lp in new)
                out.logprobs, out.cumulative_logprob = list(lists.sample), lists.cumulative
            if lists.prompt is not None:
                out.prompt_logprobs = list(lists.prompt)
            if out.finished:
                del self._lists[out.request_id]
