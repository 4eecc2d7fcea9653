"""Parallel sampling: one request, ``n`` sequences (``SamplingParams.n`` and ``best_of``).

fleetlab does it vLLM v1's way: the front door fans a request out into ``best_of`` (default
``n``) **child requests** that the scheduler runs like any others, and fans their outputs back
in. No block table is forked and nothing is copied on write: the children share the prompt's
KV blocks through the prefix cache. They are queued together, so they are admitted in the
same step, and a full block of known tokens enters the prefix cache as soon as the first child
is given it (``KVCacheManager``): the other children hit it and compute only the prompt's last,
partial block (a block written by one child is never seen by another: shared blocks are full
and never written again). The paged-attention paper forks block tables and copies the partial
block on write instead; that would also share the last partial block, but needs a fork
operation and copy-on-write in the block pool and the kernels, for at most ``block_size - 1``
tokens per child. ``tests/test_sampling_parity.py`` measures the prompt tokens computed.

Child ``i`` is request ``f"{i}_{parent id}"`` (vLLM's naming; ``f"{i}_{parent id}_{k}"`` where a
live request already holds that id) with ``n = 1`` and its own seed
stream, ``seed + i`` (a request without a seed gets a drawn seed per child), so seeded children
differ from each other and are reproducible. Its outputs come back under the parent's id with
``index = i``. With ``best_of > n`` nothing is returned until every child has finished; then the
``n`` with the highest cumulative logprob (the sum of their tokens' raw logprobs, as vLLM
ranked ``best_of``) are returned, ``index`` 0 the best.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace

from fleetlab.engine.outputs import RequestOutput
from fleetlab.engine.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int, taken=()) -> str:
    """The engine id of child ``index`` of request ``parent_id``: vLLM's ``f"{index}_{parent_id}"``,
    or, where a live request already holds that id (``taken``: anything with ``in``),
    ``f"{index}_{parent_id}_{k}"`` with the smallest ``k >= 1`` that is free."""
    candidates = itertools.chain([f"{index}_{parent_id}"], (f"{index}_{parent_id}_{k}" for k in itertools.count(1)))
    return next(rid for rid in candidates if rid not in taken)  # taken: a user's own id, or an automatic one


def child_sampling_params(sp: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s settings: one sequence, seed ``seed + index``; with ``best_of > n``
    its logprobs are computed (0 top entries) to rank it."""
    ranked = (sp.best_of or sp.n) > sp.n
    return replace(sp, n=1, best_of=None, seed=None if sp.seed is None else sp.seed + index,
                   logprobs=0 if ranked and sp.logprobs is None else sp.logprobs)


def select_best(items: Sequence, n: int, cumulative_logprob: Callable) -> list:
    """The ``n`` items with the highest ``cumulative_logprob(item)``, best first (ties: first
    come first; None ranks last)."""
    scores = [cumulative_logprob(item) for item in items]
    order = sorted(range(len(items)), key=lambda i: (scores[i] is None, -(scores[i] or 0.0), i))
    return [items[i] for i in order[:n]]


class ParentRequest:
    """One request's children: their ids and settings, and their outputs fanned back in.

    Args:
      request_id: the parent's id (what the user sees); sampling_params: checked, with ``n``
        and ``best_of``; taken: the ids of live requests, which no child id may equal.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams, taken=()):
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.best_of = sampling_params.best_of or sampling_params.n
        self.child_ids = [child_request_id(request_id, i, taken) for i in range(self.best_of)]
        self._index = {cid: i for i, cid in enumerate(self.child_ids)}  # per output, each step: not a list scan
        self._finished: dict[int, RequestOutput] = {}

    @property
    def finished(self) -> bool:
        """Every child has finished."""
        return len(self._finished) == self.best_of

    def process(self, out: RequestOutput) -> list[RequestOutput]:
        """A child's output as the parent's (``request_id`` the parent's, ``index`` the child's);
        with ``best_of > n``: nothing until the last child finishes, then the ``n`` best."""
        i = self._index[out.request_id]
        out.request_id, out.index = self.request_id, i
        if out.finished:
            self._finished[i] = out
        if self.best_of == self.n:
            return [out]
        return self._best() if self.finished else []

    def _best(self) -> list[RequestOutput]:
        outs = [self._finished[i] for i in range(self.best_of)]
        best = select_best(outs, self.n, lambda o: o.cumulative_logprob)
        for index, out in enumerate(best):
            out.index, out.new_token_ids = index, list(out.token_ids)
            if self.sampling_params.logprobs is None:  # computed only to rank them
                out.logprobs = None
        return best
