"""``InputProcessor``: turns what a user passes ``add_request`` into a validated ``Request``.

Every check runs before anything is queued, and every refusal is a ``ValueError`` (a
``FieldTypeError``, also a ``TypeError``, for a value of the wrong type) that names the
request and the field, so a bad request never reaches a step (where it could fail
mid-batch and take other requests with it). What passes is bounded to what the batch's
buffers hold: ``max_tokens``/``min_tokens`` by ``max_model_len``, ``top_k`` by the
vocabulary, the seed by int64, stop ids by the vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fleetlab.engine.checks import FieldTypeError, int_field, token_ids_field
from fleetlab.engine.request import Request
from fleetlab.engine.sampling_params import SamplingParams

_ONE_PROMPT = (" (one request holds one prompt: call add_request once per prompt, or pass "
               "generate(prompt_token_ids=[[...], [...]]))")


class InputProcessor:
    """Tokenizes and validates requests for one engine.

    Args:
      tokenizer: anything with ``encode(text)`` returning a list of int token ids or a
        mapping with ``"input_ids"`` (or None: token ids only).
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
        """A validated ``Request``; ``live_ids``: ids of requests the engine still holds
        (a duplicate is refused; an id the engine picks skips them)."""
        rid = self._request_id(request_id, live_ids)
        priority = int_field(f"request {rid!r}:", "priority", priority)
        ids = self._tokenize(rid, prompt, prompt_token_ids)
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise FieldTypeError(f"request {rid!r}: sampling_params must be a fleetlab.SamplingParams, "
                                 f"not {type(sp).__name__}")
        sp = self._bound(rid, ids, sp.validate(rid))
        self._check_fits(rid, ids, sp)
        seed = sp.seed if sp.seed is not None else int(self._rng.integers(2**62))
        return Request(rid, ids, sp, seed=seed, arrival_order=next(self._arrivals),
                       eos_token_id=self.eos_token_id, priority=priority)

    def _request_id(self, request_id, live_ids) -> str:
        """The user's id (a str, or an int written as one), or the engine's next unused one."""
        if request_id is None:
            rid = str(next(self._ids))
            while rid in live_ids:  # a user chose it: skip it, never collide
                rid = str(next(self._ids))
            return rid
        if isinstance(request_id, str):
            rid = request_id
        elif isinstance(request_id, (int, np.integer)) and not isinstance(request_id, (bool, np.bool_)):
            rid = str(int(request_id))
        else:
            raise FieldTypeError(f"request_id={request_id!r:.60} must be a str or an int (or None: the engine "
                                 f"picks one), not {type(request_id).__name__}")
        if rid in live_ids:
            raise ValueError(f"request {rid!r}: request_id {rid!r} is already used by a request that has "
                             "not finished (ids must be unique among live requests)")
        return rid

    def _tokenize(self, rid, prompt, prompt_token_ids) -> list[int]:
        where = f"request {rid!r}:"
        if prompt is not None and prompt_token_ids is not None:
            raise ValueError(f"{where} give exactly one of prompt and prompt_token_ids")
        if prompt_token_ids is not None:
            ids = token_ids_field(where, "prompt_token_ids", prompt_token_ids, _ONE_PROMPT)
        else:
            ids = self._encode(rid, prompt)
        if not ids:
            raise ValueError(f"{where} prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where} prompt_token_ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _encode(self, rid, prompt) -> list[int]:
        where = f"request {rid!r}:"
        if not isinstance(prompt, str):
            raise FieldTypeError(f"{where} prompt={prompt!r:.60} must be a str (text to tokenize), not "
                                 f"{type(prompt).__name__}; token ids go in prompt_token_ids")
        if self.tokenizer is None:
            raise ValueError(f"{where} prompt is text but the LLM has no tokenizer")
        out, name = self.tokenizer.encode(prompt), "tokenizer.encode(prompt)"
        if isinstance(out, Mapping):
            if "input_ids" not in out:
                raise ValueError(f"{where} {name} returned a mapping without 'input_ids' (keys "
                                 f"{sorted(map(str, out))[:8]}); expected token ids or a mapping holding them")
            out, name = out["input_ids"], name + "['input_ids']"
        return token_ids_field(where, name, out)

    def _bound(self, rid, ids, sp: SamplingParams) -> SamplingParams:
        """Refuse what the batch row cannot hold; clamp what means the same clamped."""
        if len(sp.stop_token_ids) > self.max_stop_ids:
            raise ValueError(f"request {rid!r}: sampling field stop_token_ids holds {len(sp.stop_token_ids)} "
                             f"ids; the engine keeps at most {self.max_stop_ids}")
        bad = [t for t in sp.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"request {rid!r}: sampling field stop_token_ids {bad[:5]} outside the "
                             f"vocabulary [0, {self.vocab_size})")
        max_tokens = max(1, min(sp.max_tokens, self.max_model_len - len(ids)))  # a too-long prompt: _check_fits
        return replace(sp, max_tokens=max_tokens, min_tokens=min(sp.min_tokens, max_tokens),
                       top_k=min(sp.top_k, self.vocab_size))

    def _check_fits(self, rid, ids, sp) -> None:
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt has {len(ids)} tokens; max_model_len="
                             f"{self.max_model_len} leaves no room to generate")
        slots = min(len(ids) + sp.max_tokens + self.num_lookahead_tokens, self.max_model_len)
        need = -(-slots // self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"request {rid!r}: needs {need} KV blocks but the pool has only "
                             f"{self.num_blocks} (num_blocks is too small for even this one request)")
