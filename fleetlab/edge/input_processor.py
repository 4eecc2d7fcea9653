"""``InputProcessor``: the request edge. Tokenizes what users send, checks it, and builds the ``Request``
the engine core runs; ``generate``'s arguments and ``prompt_embeds`` are read here too.

The engine core trusts what passes here and states its own invariants instead (asserts;
``fleetlab.inspect`` checks its bookkeeping from outside). A refusal is a ``ValueError`` that names
the request and the field (a wrong type: :class:`~fleetlab.errors.FieldTypeError`, a ``TypeError``
that is one too, so code that catches the engine's ``ValueError`` s, such as the OpenAI server's 400
answers, catches it).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fleetlab.edge.sampling import MAX_LOGPROBS, check_sampling_params
from fleetlab.engine.batch_fields import DEFAULT_FIELDS, check_field_value
from fleetlab.engine.request import Request
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.errors import FieldTypeError, refuse, short, type_error
from fleetlab.fields import int_field, is_sequence, optional, token_ids_field

_ONE_PROMPT = (" (one request holds one prompt: call add_request once per prompt, or pass "
               "generate(prompt_token_ids=[[...], [...]]))")


class InputProcessor:
    """Tokenizes and checks requests for one engine; what passes is a ``Request`` that fits.

    Args:
      tokenizer: anything with ``encode(text)`` returning a list of int token ids or a
        mapping with ``"input_ids"`` (or None: token ids only).
      handle: the patched model (its ``vocab_size``, ``eos_token_id``, ``hidden_size``).
      batch: the engine's InputBatch (its ``sizes``: ``max_model_len``, ``max_stop_ids`` stop ids a
        row keeps; its ``fields``: ``extra`` values must name them).
      pool: the block pool (a request the whole pool could not hold is refused).
      processors: the sampler's logits processors (each fills its own fields from a request's
        sampling params).
      num_lookahead_tokens: extra slots a running request may hold (speculative drafts).
      seed: draws the seed of requests that set none.
      structured_outputs: the engine's ``StructuredOutputsProcessor`` (the LLM always has one);
        its ``start(request_id, params)`` checks a constraint with the grammar backend and
        starts its compile.
    """

    def __init__(self, tokenizer, handle, batch, pool, *, processors=(), num_lookahead_tokens: int = 0, seed: int = 0,
                 structured_outputs):
        self.tokenizer, self.structured_outputs = tokenizer, structured_outputs
        self.vocab_size, self.hidden_size = handle.vocab_size, handle.hidden_size
        self.eos_token_id = handle.eos_token_id
        self.sizes, self.batch_fields, self.max_model_len = batch.sizes, batch.fields, batch.sizes["max_model_len"]
        self.block_size, self.num_blocks = pool.block_size, pool.num_blocks
        self.processors, self.num_lookahead_tokens = processors, num_lookahead_tokens
        self._ids, self._arrivals = itertools.count(), itertools.count()
        # The batch fields ``extra`` may set: the user's (``batch_fields``, their own logits processors'), not
        # the engine's nor its built-in processors' (penalties, grammars).
        owned = set(DEFAULT_FIELDS.names()) | {f.name for p in processors for f in p.fields
                                               if type(p).__module__.startswith("fleetlab.")}
        self.user_fields = frozenset(n for n in batch.fields.names() if n not in owned)
        self._rng = np.random.default_rng(seed)

    def process(self, prompt, sampling_params, prompt_token_ids, request_id, live_ids, priority=0,
                prompt_embeds=None, extra=None):
        """A checked ``Request``; ``live_ids``: ids of requests the engine still holds (a
        duplicate is refused; an id the engine picks skips them)."""
        rid = self._request_id(request_id, live_ids)
        priority = int_field(f"request {rid!r}:", "priority", priority)
        ids = self._tokenize(rid, prompt, prompt_token_ids)
        sp = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(sp, SamplingParams):
            raise type_error(f"request {rid!r}:", "sampling_params", sp, "a fleetlab.SamplingParams")
        sp = self._bound(rid, ids, check_sampling_params(sp, rid))
        if sp.stop and self.tokenizer is None:
            raise ValueError(f"request {rid!r}: sampling field stop: stop strings need a tokenizer; the LLM has none")
        extra = self._extra(rid, extra, prompt_embeds, len(ids), sp.extra_args)
        return self._request(rid, ids, sp, priority, extra)

    def child(self, parent, sampling_params, request_id: str):
        """Child ``request_id`` of the parallel-sampling request ``parent`` (a checked
        ``Request``): its prompt, priority and batch-field values, its own settings
        ``sampling_params`` (:func:`fleetlab.output.parallel_sampling.child_sampling_params` of the
        parent's checked and bounded ones: nothing in them to check again)."""
        extra = {k: v for k, v in parent.extra.items() if k in self.user_fields or k == "prompt_embeds"}
        return self._request(request_id, parent.prompt_token_ids, sampling_params, parent.priority, extra)

    def _request(self, rid: str, ids: list[int], sp, priority: int, extra: dict):
        """The ``Request``: processors' field values filled, its grammar's compile started."""
        for processor in self.processors:
            extra.update(processor.request_values(sp))
        constrained = sp.structured_outputs is not None  # the grammar compiles ahead; the request waits for it
        if constrained:
            extra["structured_output"] = self.structured_outputs.start(rid, sp.structured_outputs)
        seed = sp.seed if sp.seed is not None else int(self._rng.integers(2**62))
        return Request(rid, ids, sp, seed=seed, arrival_order=next(self._arrivals), eos_token_id=self.eos_token_id,
                       priority=priority, extra=extra,
                       waiting_on=extra["structured_output"].compiled if constrained else None)

    def _request_id(self, request_id, live_ids) -> str:
        """The user's id (a str, or an int written as one), or the engine's next unused one."""
        if request_id is None:  # an id a user chose is skipped: never a collision
            return next(rid for rid in map(str, self._ids) if rid not in live_ids)
        if isinstance(request_id, (int, np.integer)) and not isinstance(request_id, (bool, np.bool_)):
            request_id = str(int(request_id))
        if not isinstance(request_id, str):
            raise FieldTypeError(f"request_id={request_id!r:.60} must be a str or an int (or None: the engine "
                                 f"picks one), not {type(request_id).__name__}")
        if request_id in live_ids:
            raise ValueError(f"request {request_id!r}: request_id {request_id!r} is already used by a request that "
                             "has not finished (ids must be unique among live requests)")
        return request_id

    def _tokenize(self, rid, prompt, prompt_token_ids) -> list[int]:
        where = f"request {rid!r}:"
        if prompt is not None and prompt_token_ids is not None:
            raise ValueError(f"{where} give exactly one of prompt and prompt_token_ids")
        ids = (self._encode(where, prompt) if prompt_token_ids is None
               else token_ids_field(where, "prompt_token_ids", prompt_token_ids, _ONE_PROMPT))
        bad = [t for t in ids if not 0 <= t < self.vocab_size][:5]
        refuse([(not ids, "prompt is empty"),
                (bad, f"prompt_token_ids {bad} outside the vocabulary [0, {self.vocab_size})"),
                (len(ids) >= self.max_model_len,
                 f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room to generate")],
               prefix=f"{where} ")
        return ids

    def _encode(self, where: str, prompt) -> list[int]:
        if not isinstance(prompt, str):
            raise type_error(where, "prompt", prompt, "a str (text to tokenize; token ids go in prompt_token_ids)")
        if self.tokenizer is None:
            raise ValueError(f"{where} prompt is text but the LLM has no tokenizer")
        try:  # a str may hold half of a surrogate pair (JSON's "\ud800", bytes decoded with surrogateescape)
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} prompt is not valid UTF-8 text: a lone surrogate \\u{ord(prompt[e.start]):04x} "
                             f"at character {e.start}") from None
        out, name = self.tokenizer.encode(prompt), "tokenizer.encode(prompt)"
        if isinstance(out, Mapping):
            if "input_ids" not in out:
                raise ValueError(f"{where} {name} returned a mapping without 'input_ids' (keys "
                                 f"{sorted(map(str, out))[:8]}); expected token ids or a mapping holding them")
            out, name = out["input_ids"], name + "['input_ids']"
        return token_ids_field(where, name, out)

    def _bound(self, rid, ids, sp: SamplingParams) -> SamplingParams:
        """Refuse what the batch row cannot hold; clamp what means the same clamped."""
        vocab, max_tokens = f"outside the vocabulary [0, {self.vocab_size})", min(sp.max_tokens,
                                                                                  self.max_model_len - len(ids))
        need = -(-min(len(ids) + max_tokens + self.num_lookahead_tokens, self.max_model_len) // self.block_size)
        bad_stop, bad_bias = ([t for t in got if t >= self.vocab_size][:5] for got in (sp.stop_token_ids,
                                                                                        sp.logit_bias or {}))
        refuse([(len(sp.stop_token_ids) > self.sizes["max_stop_ids"], f"sampling field stop_token_ids holds "
                 f"{len(sp.stop_token_ids)} ids; the engine keeps at most {self.sizes['max_stop_ids']}"),
                (bad_stop, f"sampling field stop_token_ids {bad_stop} {vocab}"),
                (need > self.num_blocks, f"needs {need} KV blocks but the pool has only {self.num_blocks} "
                 "(num_blocks is too small for even this one request)"),
                (bad_bias, f"sampling field logit_bias has token ids {bad_bias} {vocab}")], prefix=f"request {rid!r}: ")
        lp = {name: optional(self._bound_logprobs, f"request {rid!r}: sampling field", name, getattr(sp, name))
              for name in ("logprobs", "prompt_logprobs")}
        return replace(sp, max_tokens=max_tokens, min_tokens=min(sp.min_tokens, max_tokens),
                       top_k=min(sp.top_k, self.vocab_size), **lp)

    def _bound_logprobs(self, where: str, name: str, value: int) -> int:
        """-1 as the vocabulary size, which must stay within ``MAX_LOGPROBS``."""
        num = self.vocab_size if value == -1 else value
        refuse([(num > self.vocab_size, f"more log-probabilities per token than the vocabulary's {self.vocab_size} "
                 "tokens"), (num > MAX_LOGPROBS, f"{num} log-probabilities per token, more than the {MAX_LOGPROBS} "
                            "allowed (vLLM's default max_logprobs)")],
               prefix=f"{where} {name}={value} asks for ")
        return num

    def _extra(self, rid, extra, prompt_embeds, num_prompt_tokens: int, extra_args=None) -> dict:
        """The request's own batch-field values: ``extra`` (by field name, each value checked by
        the field's dtype and its row's shape), the keys of ``sampling_params.extra_args`` that
        name such a field, and side data ``prompt_embeds``. Only fields the user added are open
        to ``extra``: the engine's own (``temperature``, ``token_ids``...) and its built-in
        processors' are set from the sampling params, within their bounds."""
        where = f"request {rid!r}: extra"
        if extra is not None and not isinstance(extra, Mapping):
            raise type_error(f"request {rid!r}:", "extra", extra, "a dict {field name: value}")
        values = {k: v for k, v in (extra_args or {}).items() if k in self.user_fields}
        values.update(extra or {})
        out = {}
        for name, value in values.items():
            if not isinstance(name, str):
                raise FieldTypeError(f"{where} field name {short(name)} must be a str")
            if name not in self.user_fields:
                why = (f"; {name!r} is the engine's own (set it through SamplingParams or add_request's arguments, "
                       "within their bounds)" if name in DEFAULT_FIELDS or name in self.batch_fields else
                       f" (pass LLM(..., batch_fields=[Field({name!r}, ...)]) to add it)")
                raise ValueError(f"{where} field {name!r} is not one of this LLM's own batch fields "
                                 f"{sorted(self.user_fields)}{why}")
            out[name] = check_field_value(self.batch_fields[name], f"{where} field", value, self.sizes)
        if prompt_embeds is not None:
            out["prompt_embeds"] = normalize_prompt_embeds(rid, prompt_embeds, num_prompt_tokens, self.hidden_size)
        return out


def normalize_prompt_embeds(request_id: str, prompt_embeds, num_prompt_tokens: int, hidden_size: int):
    """``(positions int64 [m], embeddings float32 [m, hidden_size])`` from what a user passes.

    Accepts ``{prompt position: vector [hidden_size]}`` or an array ``[num_prompt_tokens,
    hidden_size]`` (every position replaced). Raises ``ValueError`` naming the request and
    ``prompt_embeds`` for a position outside the prompt, a wrong width, or a non-finite value.
    """
    where = f"request {request_id!r}: prompt_embeds "
    if isinstance(prompt_embeds, dict):
        refuse([(not prompt_embeds, "is an empty dict")], prefix=where)
        try:  # (keys of mixed types do not even sort)
            items = sorted(prompt_embeds.items())
            positions = np.array([int(p) for p, _ in items], dtype=np.int64)
            values = np.stack([np.asarray(v, dtype=np.float32) for _, v in items])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}must map int positions to vectors of {hidden_size} floats ({exc})") from None
    else:
        values = np.asarray(prompt_embeds, dtype=np.float32)
        refuse([(values.ndim != 2 or values.shape[0] != num_prompt_tokens, f"as an array must be [num_prompt_tokens="
                 f"{num_prompt_tokens}, {hidden_size}]; got {list(values.shape)}")], prefix=where)
        positions = np.arange(num_prompt_tokens, dtype=np.int64)
    refuse([(values.ndim != 2 or values.shape[1] != hidden_size,
             f"vectors must have the model's hidden size {hidden_size}; got shape {list(values.shape)}"),
            (positions.min() < 0 or positions.max() >= num_prompt_tokens,
             f"positions {positions.tolist()[:5]} must lie in the prompt [0, {num_prompt_tokens})"),
            (not np.isfinite(values).all(), "holds non-finite values")], prefix=where)
    return positions, values


def generate_items(prompts, prompt_token_ids, sampling_params, extra=None) -> list[tuple]:
    """``generate``'s arguments as ``(prompt, prompt_token_ids, sampling_params, extra)`` per
    request (``extra``: None, one mapping for all, or a list of one per prompt)."""
    if (prompts is None) == (prompt_token_ids is None):
        raise ValueError("generate: give exactly one of prompts and prompt_token_ids")
    if prompts is not None:
        if not isinstance(prompts, str) and not is_sequence(prompts):
            raise type_error("generate:", "prompts", prompts, "a str or a list of str")
        items = [(p, None) for p in ([prompts] if isinstance(prompts, str) else list(prompts))]
    else:
        seqs = prompt_token_ids
        if not is_sequence(seqs):
            raise type_error("generate:", "prompt_token_ids", seqs,
                             "a list of token-id lists (or one list of token ids)")
        # One flat prompt ([5, 17, 3]) or a list of prompts: a first entry that is not itself a
        # sequence means one prompt (the InputProcessor refuses floats, strings, bools in it).
        items = [(None, s) for s in ([seqs] if len(seqs) and not is_sequence(seqs[0]) else seqs)]
    sps, extras = (list(v) if isinstance(v, (list, tuple)) else [v] * len(items) for v in (sampling_params, extra))
    refuse([(len(sps) != len(items), f"{len(sps)} sampling_params for {len(items)} prompts"),
            (len(extras) != len(items), f"{len(extras)} extra dicts for {len(items)} prompts")], prefix="generate: ")
    return [(p, ids, sp, e) for (p, ids), sp, e in zip(items, sps, extras)]
