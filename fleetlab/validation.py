"""The edge: every check of what users send, in one place, before anything is queued.

The engine core trusts what passes here and states its own invariants instead (asserts;
``fleetlab.inspect`` checks its bookkeeping from outside). A refusal is a
``ValueError`` that names the request (or the config) and the field; a value of the wrong
type raises :class:`FieldTypeError`, which is a ``TypeError`` and a ``ValueError`` at once
(so code that catches the engine's ``ValueError`` s, such as the OpenAI server's 400 answers,
catches it too). Nothing is coerced silently: numpy scalars and 0-d arrays count as the
numbers they hold, but a ``bool`` is not an int, a float is not an int, and a numeric string
is not a number. What passes is bounded to what the batch's buffers hold: ``max_tokens`` /
``min_tokens`` by ``max_model_len``, ``top_k`` by the vocabulary, seeds by int64.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import numbers
import operator
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace

import numpy as np

from fleetlab.attention.backend import ATTENTION_BACKENDS
from fleetlab.engine.batch_fields import DEFAULT_FIELDS
from fleetlab.engine.config import EngineConfig
from fleetlab.engine.policies import POLICIES
from fleetlab.engine.request import Request
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.errors import FieldTypeError, refuse, short, type_error
from fleetlab.prefix_cache import PREFIX_CACHES
from fleetlab.spec_decode.config import SpeculativeConfig
from fleetlab.spec_decode.proposer import PROPOSERS
from fleetlab.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
MIN_TEMPERATURE = 1e-5
"""Temperatures in ``(0, MIN_TEMPERATURE)`` are greedy: ``logits / T`` would overflow float32."""


# ----------------------------------------------------------------------------- one value
def _scalar(value):
    """A 0-d numpy array as the numpy scalar it holds; anything else unchanged."""
    return value[()] if isinstance(value, np.ndarray) and value.ndim == 0 else value


def _interval(low, high, low_open: bool = False) -> str:
    def num(x):
        return f"{x:g}" if isinstance(x, float) else str(x)

    if high is None:  # (every bounded caller gives a low bound)
        return "" if low is None else f" {'>' if low_open else '>='} {num(low)}"
    return f" in {'(' if low_open else '['}{num(low)}, {num(high)}]"


def int_field(where: str, name: str, value, low: int | None = None, high: int | None = None) -> int:
    """``value`` as a Python int within ``[low, high]`` (None: unbounded on that side)."""
    value = _scalar(value)
    rule = "an int" + _interval(low, high)
    if isinstance(value, (bool, np.bool_)):
        raise FieldTypeError(f"{where} {name}={value!r} must be {rule} (a bool is not an int here)")
    try:
        number = operator.index(value)
    except TypeError:
        raise type_error(where, name, value, rule) from None
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{where} {name}={number} must be {rule}")
    return int(number)


def float_field(where: str, name: str, value, low: float, high: float, *, low_open: bool = False,
                note: str = "") -> float:
    """``value`` (an int or float, numpy's included) as a Python float in ``[low, high]``
    (``(low, high]`` with ``low_open``); NaN is always refused. ``note`` ends the message."""
    value = _scalar(value)
    rule = "a number" + _interval(low, high, low_open) + note
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise type_error(where, name, value, rule)
    number = float(value)
    if not (low < number if low_open else low <= number) or not number <= high:  # NaN fails both
        raise ValueError(f"{where} {name}={value!r} must be {rule}")
    return number


def optional(check, where: str, name: str, value, *args, **kwargs):
    """None (the setting is unset) as it is; any other value checked by ``check(where, name, value, ...)``."""
    return None if value is None else check(where, name, value, *args, **kwargs)


def bool_field(where: str, name: str, value) -> bool:
    """``value`` (``True``/``False`` or a numpy bool) as a Python bool; nothing else is truthy here."""
    value = _scalar(value)
    if not isinstance(value, (bool, np.bool_)):
        raise type_error(where, name, value, "True or False")
    return bool(value)


def stop_strings_field(where: str, value) -> tuple[str, ...]:
    """``SamplingParams.stop`` as a tuple of non-empty strings (None: none; a str: that one)."""
    items = () if value is None else (value,) if isinstance(value, str) else value
    if not is_sequence(items) or not all(isinstance(s, str) for s in items):
        raise FieldTypeError(f"{where} stop={short(value)} must be a string or a list of strings")
    if not all(items):
        raise ValueError(f"{where} stop={short(value)}: a stop string cannot be empty")
    return tuple(items)


def is_sequence(value) -> bool:
    """A list-like of items: a list, tuple, range or numpy array of >= 1 dimension (a str is
    text, a mapping is keyed, a 0-d array is a scalar)."""
    if isinstance(value, np.ndarray):
        return value.ndim > 0
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def token_ids_field(where: str, name: str, value, hint: str = "") -> list[int]:
    """A flat sequence of int token ids (a list, tuple, range or 1-D integer numpy array) as a
    list of Python ints (their range is the caller's to check); ``hint`` ends the message
    for a nested list."""
    if isinstance(value, np.ndarray):
        if value.ndim == 1 and value.dtype.kind in "iu":
            return value.tolist()  # exact Python ints, whatever the integer dtype
        raise FieldTypeError(f"{where} {name} must be a flat sequence of int token ids; got a numpy array "
                             f"of shape {value.shape} and dtype {value.dtype}{hint}")
    if not is_sequence(value):
        raise type_error(where, name, value, "a sequence of int token ids (e.g. [5, 17])")
    ids = []
    for i, t in enumerate(value):
        if type(t) is not int:  # the common case stays fast
            if is_sequence(t):
                raise FieldTypeError(f"{where} {name}[{i}]={short(t)} is a {type(t).__name__}, but {name} is "
                                     f"a flat sequence of int token ids{hint}")
            t = int_field(where, f"{name}[{i}]", t)
        ids.append(t)
    return ids


# ----------------------------------------------------------------------------- configs
def check_sampling_params(sp, request_id: str = "?"):
    """A checked copy of ``SamplingParams`` ``sp`` holding plain Python values (ints, floats, a
    tuple of stop ids, a temperature below ``MIN_TEMPERATURE`` as 0, ``top_k`` -1 as 0: "no
    limit", as vLLM spells it); ``sp`` itself is left as it is."""
    where = f"request {request_id!r}: sampling field"
    max_tokens = int_field(where, "max_tokens", sp.max_tokens, 1)
    temperature = float_field(where, "temperature", sp.temperature, 0.0, FLOAT32_MAX,
                              note=f" (0 = greedy; below {MIN_TEMPERATURE:g} counts as greedy)")
    top_p = float_field(where, "top_p", sp.top_p, 0.0, 1.0, low_open=True)
    top_k = int_field(where, "top_k", sp.top_k, -1)
    stop = token_ids_field(where, "stop_token_ids", sp.stop_token_ids)
    refuse([(np.float32(top_p) == 0,  # the sampler's float32 buffer would hold 0: nothing kept
             f"top_p={top_p!r} must be in (0, 1] and stay > 0 as a float32 (>= 1e-45)"),
            (any(t < 0 for t in stop), f"stop_token_ids holds {[t for t in stop if t < 0][:5]}: token ids are >= 0")],
           prefix=f"{where} ")
    temperature = 0.0 if temperature < MIN_TEMPERATURE else temperature
    n, best_of = _num_sequences(where, sp, temperature)
    flags = {name: bool_field(where, name, getattr(sp, name)) for name in ("ignore_eos", "include_stop_str_in_output")}
    return replace(sp, max_tokens=max_tokens, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
                   # child i of a request draws with seed + i
                   seed=optional(int_field, where, "seed", sp.seed, 0, INT64_MAX - (best_of - 1)),
                   stop_token_ids=tuple(stop), stop=stop_strings_field(where, sp.stop), **flags,
                   min_tokens=int_field(where, "min_tokens", sp.min_tokens, 0, max_tokens), n=n,
                   best_of=None if sp.best_of is None else best_of,
                   **{name: float_field(where, name, getattr(sp, name), low, high, low_open=low_open)
                      for name, (low, high, low_open) in PENALTY_BOUNDS.items()},
                   logit_bias=optional(_logit_bias, where, "logit_bias", sp.logit_bias),
                   **{name: optional(int_field, where, name, getattr(sp, name), -1, MAX_LOGPROBS)  # -1: the vocabulary
                      for name in ("logprobs", "prompt_logprobs")},
                   structured_outputs=optional(_structured_outputs, where, "structured_outputs",
                                               sp.structured_outputs, request_id, flags["ignore_eos"]),
                   extra_args=optional(_extra_args, where, "extra_args", sp.extra_args))


PENALTY_BOUNDS = {"presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
                  "repetition_penalty": (0.0, FLOAT32_MAX, True)}
"""``(low, high, low_open)`` of each penalty (vLLM's bounds; a repetition penalty divides: > 0)."""


MAX_NUM_SEQUENCES = 16384
"""The most sequences one request may ask for (``n``, ``best_of``): vLLM's ``VLLM_MAX_N_SEQUENCES``."""
MAX_LOGPROBS = 20
"""The most log-probabilities per token (``logprobs``, ``prompt_logprobs``): vLLM's default ``max_logprobs``."""
MAX_LOGIT_BIAS = 100.0
"""Biases are clamped to ``[-100, 100]``, as vLLM and OpenAI do."""


def _num_sequences(where: str, sp, temperature: float) -> tuple[int, int]:
    """``(n, best_of)`` checked: ``1 <= n <= best_of <= MAX_NUM_SEQUENCES`` (best_of None: n)."""
    n = int_field(where, "n", sp.n, 1, MAX_NUM_SEQUENCES)
    best_of = n if sp.best_of is None else int_field(where, "best_of", sp.best_of, 1, MAX_NUM_SEQUENCES)
    refuse([(best_of < n, f"must be >= n={n} (it generates best_of and returns the n best)"),
            (best_of > n and temperature == 0, f"> n={n} needs sampling (temperature > 0): greedy sequences are "
             "identical, there is nothing to choose from")], prefix=f"{where} best_of={best_of} ")
    return n, best_of


def _logit_bias(where: str, name: str, bias) -> dict[int, float] | None:
    """``{token id: bias}`` with int keys >= 0 (numeric strings, as JSON sends them, count as ints)
    and finite biases clamped to ``[-100, 100]``; ``{}``: None."""
    if not isinstance(bias, Mapping):
        raise type_error(where, name, bias, "a dict {token id: bias}")
    out = {}
    for key, value in bias.items():
        # "²" and "١" pass str.isdigit(); JSON's numeric keys are ASCII digits only
        token = int(key) if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit() else key
        token = int_field(where, f"{name} key {key!r}", token, 0)
        value = float_field(where, f"{name}[{key!r}]", value, -FLOAT32_MAX, FLOAT32_MAX)
        out[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
    return out or None


def _extra_args(where: str, name: str, value) -> dict:
    """A copy of a mapping with str keys (free-form: its values are checked where used)."""
    if not isinstance(value, Mapping):
        raise type_error(where, name, value, "a dict {name: value}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise FieldTypeError(f"{where} {name} key {short(bad[0])} must be a str")
    return dict(value)


def _structured_outputs(where: str, name: str, value, request_id: str, ignore_eos: bool):
    """``structured_outputs`` checked: its own fields, and what it cannot go with."""
    if ignore_eos:
        raise ValueError(f"{where} ignore_eos=True cannot go with {name}: a complete output ends with "
                         "EOS, and the grammar allows nothing else after it")
    return StructuredOutputsParams.coerce(value, request_id).validate(request_id)


def engine_config(**kwargs) -> EngineConfig:
    """A checked ``EngineConfig`` from keywords (numpy scalars stored as the Python values they
    hold); see its docstring for the bounds."""
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown engine config field(s) {unknown}; known: {sorted(known)}")
    cfg = EngineConfig(**kwargs)
    where = "engine config:"
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
        setattr(cfg, name, int_field(where, name, getattr(cfg, name), 1, INT32_MAX))
    for name, high in (("num_blocks", INT32_MAX), ("max_model_len", INT32_MAX), ("kv_cache_memory_bytes", INT64_MAX),
                       ("memory_budget_bytes", INT64_MAX)):  # None: sized by the engine
        setattr(cfg, name, optional(int_field, where, name, getattr(cfg, name), 1, high))
    cfg.seed = int_field(where, "seed", cfg.seed, 0, INT64_MAX)
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "record_traces", "async_scheduling"):
        setattr(cfg, name, bool_field(where, name, getattr(cfg, name)))
    cfg.reorder = optional(bool_field, where, "reorder", cfg.reorder)  # None: the backend decides
    cfg.memory_utilization = optional(float_field, where, "memory_utilization", cfg.memory_utilization, 0.0, 1.0,
                                      low_open=True)
    sized = [name for name in ("num_blocks", "kv_cache_memory_bytes") if getattr(cfg, name) is not None]
    refuse([(cfg.memory_utilization is not None and sized,
             f"memory_utilization sizes the pool, and so does {(sized or [''])[0]}: give one"),
            (cfg.memory_utilization is None and cfg.memory_budget_bytes is not None,
             "memory_budget_bytes is the memory memory_utilization shares out; it needs memory_utilization"),
            (not cfg.enable_prefix_caching and cfg.prefix_cache not in (None, "hash"),
             f"enable_prefix_caching=False contradicts prefix_cache={cfg.prefix_cache!r:.60}")], prefix=f"{where} ")
    if cfg.prefix_cache is None or not cfg.enable_prefix_caching:  # one spelling of "no prefix cache"
        cfg.prefix_cache, cfg.enable_prefix_caching = None, False
    for name, registry in (("backend", ATTENTION_BACKENDS), ("scheduling_policy", POLICIES),
                           ("prefix_cache", PREFIX_CACHES)):
        try:  # a registry refuses with a FieldTypeError: a TypeError and a ValueError at once
            if getattr(cfg, name) is not None:
                registry.resolve(getattr(cfg, name))
        except TypeError as exc:
            raise FieldTypeError(f"{where} {name}={getattr(cfg, name)!r:.60}: {exc}") from None
    if cfg.kv_transfer_config is not None:
        from fleetlab.kv_transfer.config import check_kv_transfer_config

        cfg.kv_transfer_config = check_kv_transfer_config(cfg.kv_transfer_config)
        if cfg.tensor_parallel_size > 1:
            raise ValueError(f"{where} kv_transfer_config with tensor_parallel_size > 1 is not supported")
    if cfg.async_scheduling:
        from fleetlab.overlap.refusals import check_async_scheduling

        check_async_scheduling(cfg)
    return cfg


def check_backend_fits(cfg: EngineConfig, backend_cls) -> None:
    """Refuse, before any step, an attention backend whose declared needs the config cannot meet."""
    name, threshold = backend_cls.name, backend_cls.reorder_threshold
    refuse([(not isinstance(threshold, int) or threshold < 1,
             f"attention backend {name!r}: reorder_threshold must be an int >= 1"),
            (backend_cls.requires_reorder and cfg.reorder is False, f"engine config: reorder=False, but attention "
             f"backend {name!r} requires decode-first rows (requires_reorder=True)"),
            (isinstance(threshold, int) and threshold > cfg.max_num_batched_tokens, f"attention backend {name!r}: "
             f"reorder_threshold={threshold} exceeds max_num_batched_tokens={cfg.max_num_batched_tokens}")])


def resolve_max_model_len(cfg: EngineConfig, model_max_len: int) -> int:
    """The engine's ``max_model_len``: the config's, or the model's when unset or larger (asking
    for more than the model has positions for is logged at WARNING level, naming both)."""
    if cfg.max_model_len is not None and cfg.max_model_len > model_max_len:
        logger.warning("engine config: max_model_len=%d exceeds the model's %d positions; serving at most %d "
                       "tokens per sequence", cfg.max_model_len, model_max_len, model_max_len)
    max_model_len = model_max_len if cfg.max_model_len is None else min(cfg.max_model_len, model_max_len)
    if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < max_model_len:
        raise ValueError(f"engine config: without chunked prefill, max_num_batched_tokens="
                         f"{cfg.max_num_batched_tokens} must be >= max_model_len={max_model_len}")
    return max_model_len


def check_speculative_config(config):
    """A checked ``SpeculativeConfig`` from a dict (or one passed through); see its docstring.

    ``method`` is a registered name, a ``Proposer`` subclass or an instance (as everywhere a
    registry's kind is taken). Keys that are not ``SpeculativeConfig`` fields are the
    proposer's own options: accepted when its class takes them as keyword arguments of its
    ``__init__`` (kept in ``options``), refused by name otherwise."""
    if not isinstance(config, SpeculativeConfig):
        if not isinstance(config, dict):
            raise FieldTypeError(f"speculative_config must be a dict; got {type(config).__name__}")
        missing = [name for name in ("method", "num_speculative_tokens") if name not in config]
        if missing:
            raise ValueError(f"speculative_config: field {missing[0]!r} is required")
        known = {f.name for f in fields(SpeculativeConfig)} - {"options"}
        options = {k: v for k, v in config.items() if k not in known}
        config = SpeculativeConfig(**{k: v for k, v in config.items() if k in known}, options=options)
    try:  # the registry refuses with a FieldTypeError (a TypeError), an unknown name included
        cls = PROPOSERS.resolve(config.method)
    except TypeError:
        raise FieldTypeError(f"speculative_config: method={config.method!r:.60} must be a registered proposer "
                             f"({PROPOSERS.names()}), a Proposer subclass or an instance of one") from None
    # Its own options: the keyword-only parameters of its __init__.
    own = {p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY}
    unknown, known = sorted(set(config.options) - own), sorted(f.name for f in fields(SpeculativeConfig))
    refuse([(unknown, f"unknown field(s) {unknown}; known: {[n for n in known if n != 'options']} and "
                      f"{cls.__name__}'s own options {sorted(own)}"),
            (isinstance(config.method, PROPOSERS.base) and config.options, f"options {sorted(config.options)} "
             "cannot reach a proposer instance (it is built already): pass its class, or build it with them")],
           prefix="speculative_config: ")
    for name, high in (("num_speculative_tokens", 16), ("prompt_lookup_min", 64), ("prompt_lookup_max", 64)):
        setattr(config, name, int_field("speculative_config: field", name, getattr(config, name), 1, high))
    k = getattr(config.method, "num_speculative_tokens", config.num_speculative_tokens)
    refuse([(config.prompt_lookup_min > config.prompt_lookup_max, f"prompt_lookup_min={config.prompt_lookup_min} "
             f"exceeds prompt_lookup_max={config.prompt_lookup_max}"),
            (config.method == "draft" and config.model is None,
             "method='draft' needs field 'model' (e.g. fleetlab.models.load_tiny_draft()[0])"),
            (k != config.num_speculative_tokens, f"num_speculative_tokens={config.num_speculative_tokens}, but the "
             f"proposer instance drafts {k!r}")], prefix="speculative_config: ")
    return config


def check_draft_vocab(draft_vocab_size: int, target_vocab_size: int) -> None:
    """A draft model must share the target's tokenizer: the same vocabulary."""
    if draft_vocab_size != target_vocab_size:
        raise ValueError(f"speculative_config: field 'model' has vocabulary {draft_vocab_size}, the target "
                         f"{target_vocab_size}: a draft must share the target's tokenizer")


# ----------------------------------------------------------------------------- requests
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


def check_field_value(field, where: str, value, sizes: Mapping[str, int]):
    """``value`` as one row of batch ``field``: a numpy value of its dtype and exactly its row's
    shape (``sizes`` resolves named dimensions; a scalar is never broadcast over a row); an object
    field takes anything. Otherwise ``ValueError`` naming the field: a value of another kind (text
    for a number, a float for an int) or out of the dtype's range is never coerced."""
    if field.dtype == "object":
        return value
    try:
        raw = np.asarray(value)
    except ValueError:  # a ragged nesting ([None, []]) is no array: it fits no field
        raw = np.empty((), object)
    kinds = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}.get(np.dtype(field.dtype).kind, "")
    with np.errstate(over="ignore", invalid="ignore"):
        cast = raw.astype(field.dtype) if raw.dtype.kind in kinds else None
    # A float may round (to float32), but never overflow; an int must stay the same int.
    same = cast is not None and (np.isfinite(cast) | ~np.isfinite(raw) if cast.dtype.kind == "f"
                                 else cast == raw).all()
    if not same or raw.ndim != len(field.per_row_shape):
        raise ValueError(f"{where} {field.name}={value!r:.60} does not fit the field: {field.dtype} values of "
                         f"shape {field.per_row_shape} per row")
    shape = field.resolve_shape(sizes)
    if tuple(cast.shape) != shape:
        raise ValueError(f"{where} {field.name} has shape {list(cast.shape)}; the field holds "
                         f"{field.dtype} values of shape {list(shape)} per row")
    return cast


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


# ----------------------------------------------------------------------------- what extensions return
# A prototype's own code (a logits processor, a proposer, a scheduling policy) is checked where
# the engine receives what it returns: a mistake there is named after the extension, never left
# to fail later in Paddle (or in the embedding: a draft id of 10**9 crashed the process).
def apply_processor(processor, logits, st):
    """``processor(logits, st)``, checked where the sampler receives it.

    A result that is not a tensor of the shape and dtype it was given (``[P, vocab]``: a column
    more would let an id outside the vocabulary out, one less shifts nothing visibly) raises
    ``ValueError`` naming the processor (the step is rolled back). A processor that is not
    fleetlab's own is also checked for NaN: a position it made NaN stops that request with an
    error naming the processor (``st.row_errors``), the others go on. That check costs one
    device-to-host read of ``[P]`` flags per such processor and step.
    """
    import paddle

    out = processor(logits, st)
    name = f"logits processor {type(processor).__name__}"
    if not isinstance(out, paddle.Tensor):
        raise ValueError(f"{name} returned {type(out).__name__}; it must return the logits tensor it was given "
                         f"({list(logits.shape)}), changed")
    if list(out.shape) != list(logits.shape) or out.dtype != logits.dtype:
        raise ValueError(f"{name} returned logits {list(out.shape)} {out.dtype}; it was given {list(logits.shape)} "
                         f"{logits.dtype} ([scored positions, vocab]) and must return that shape and dtype")
    if not type(processor).__module__.startswith("fleetlab.") and out.shape[0]:
        for p in np.flatnonzero(paddle.isnan(out).any(axis=-1).numpy()).tolist():
            row = int(st.pos_row[p]) if st.pos_row is not None else p
            st.row_errors.setdefault(row, f"{name} returned NaN logits for this request")
    return out


def check_drafts(proposer, drafts, req_ids, vocab_size: int) -> dict[str, list[int]]:
    """What ``proposer.propose`` returned, checked where the runner receives it: a dict from
    ids of the batch's requests (``req_ids``) to at most ``k`` int token ids in
    ``[0, vocab_size)``. Anything else raises ``ValueError`` naming the proposer and the
    request (the step is rolled back)."""
    name = f"proposer {getattr(proposer, 'name', '?')!r} ({type(proposer).__name__})"
    if not isinstance(drafts, Mapping):
        raise FieldTypeError(f"{name}: propose returned {type(drafts).__name__}; it must return a dict "
                             "{request id: [draft token ids]}")
    live, k = set(req_ids) - {None}, proposer.num_speculative_tokens
    out = {}
    for rid, ids in drafts.items():
        if rid not in live:
            raise ValueError(f"{name}: propose returned drafts for request {rid!r:.60}, which is not in the batch")
        ids = token_ids_field(f"{name}: request {rid!r}:", "drafts", ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        refuse([(len(ids) > k, f"{len(ids)} drafts, more than num_speculative_tokens={k}"),
                (bad, f"draft ids {bad[:5]} outside the vocabulary [0, {vocab_size})")],
               prefix=f"{name}: request {rid!r}: ")
        out[rid] = ids
    return out


def check_victim(policy, victim, running: list):
    """What ``policy.pick_victim(running)`` returned, checked where the scheduler receives it:
    one of the ``running`` requests themselves (not an id, a copy or None), else a
    ``TypeError`` / ``ValueError`` naming the policy (raised before anything is preempted)."""
    if any(victim is r for r in running):
        return victim
    name = f"scheduling policy {getattr(policy, 'name', '?')!r} ({type(policy).__name__})"
    if not isinstance(victim, Request):
        raise FieldTypeError(f"{name}: pick_victim returned {short(victim)} ({type(victim).__name__}); it must "
                             "return one of the Request objects in the list it is given")
    raise ValueError(f"{name}: pick_victim returned request {victim.request_id!r}, which is not running; it must "
                     "return one of the requests in the list it is given")
