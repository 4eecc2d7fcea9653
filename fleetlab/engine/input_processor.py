"""``InputProcessor``: turns what a user passes ``add_request`` into a validated ``Request``.

Every check runs before anything is queued, and every refusal is a ``ValueError`` that
names the request and the field, so a bad request never reaches a step (where it could
fail mid-batch and take other requests with it).
"""

from __future__ import annotations

import itertools

import numpy as np

from fleetlab.engine.request import Request
from fleetlab.engine.sampling_params import SamplingParams


class InputProcessor:
    """Tokenizes and validates requests for one engine.

    Args:
      tokenizer: anything with ``encode(text)`` (or None: token ids only).
      vocab_size, max_model_len, eos_token_id: the model's.
      block_size, num_blocks: the pool's (a request the whole pool could not hold is refused).
      max_stop_ids: stop ids a batch row keeps.
      num_lookahead_tokens: extra slots a running request may hold (speculative drafts).
      seed: draws the seed of requests that set none.
    """

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int, eos_token_id, block_size: int,
                 num_blocks: int, max_stop_ids: int, num_lookahead_tokens: int = 0, seed: int = 0):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_stop_ids = max_stop_ids
        self.num_lookahead_tokens = num_lookahead_tokens
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._rng = np.random.default_rng(seed)

    def process(self, prompt, sampling_params, prompt_token_ids, request_id, priority: int,
                live_ids) -> Request:
        """A validated ``Request``; ``live_ids``: ids of requests the engine still holds."""
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in live_ids:
            raise ValueError(f"request {rid!r}: request_id is already in use")
        ids = self._tokenize(rid, prompt, prompt_token_ids)
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"request {rid!r}: sampling_params must be a fleetlab.SamplingParams")
        sp.validate(rid)
        self._check_stop_ids(rid, sp)
        self._check_fits(rid, ids, sp)
        seed = sp.seed if sp.seed is not None else int(self._rng.integers(2**62))
        return Request(rid, ids, sp, seed=seed, arrival_order=next(self._arrivals),
                       eos_token_id=self.eos_token_id, priority=priority)

    def _tokenize(self, rid, prompt, prompt_token_ids) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError(f"request {rid!r}: give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError(f"request {rid!r}: prompt is text but the LLM has no tokenizer")
            ids = self.tokenizer.encode(prompt)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        else:
            ids = prompt_token_ids
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        if not ids:
            raise ValueError(f"request {rid!r}: prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {rid!r}: prompt_token_ids {bad[:5]} outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return ids

    def _check_stop_ids(self, rid, sp) -> None:
        """Refuse now what would otherwise fail mid-step: the InputBatch row and the sampler's ban."""
        if len(sp.stop_token_ids) > self.max_stop_ids:
            raise ValueError(f"request {rid!r}: sampling field stop_token_ids holds {len(sp.stop_token_ids)} "
                             f"ids; the engine keeps at most {self.max_stop_ids}")
        bad = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"request {rid!r}: sampling field stop_token_ids {bad[:5]} outside the "
                             f"vocabulary [0, {self.vocab_size})")

    def _check_fits(self, rid, ids, sp) -> None:
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt has {len(ids)} tokens; max_model_len="
                             f"{self.max_model_len} leaves no room to generate")
        slots = min(len(ids) + sp.max_tokens + self.num_lookahead_tokens, self.max_model_len)
        need = -(-slots // self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"request {rid!r}: needs {need} KV blocks but the pool has only "
                             f"{self.num_blocks} (num_blocks is too small for even this one request)")
