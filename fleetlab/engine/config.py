"""``EngineConfig``: every knob of the engine in one dataclass, checked where it is built."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from fleetlab.engine.policies import POLICIES
from fleetlab.errors import FieldTypeError, refuse
from fleetlab.fields import INT32_MAX, INT64_MAX, bool_field, float_field, int_field, optional
from fleetlab.kv_transfer.config import check_kv_transfer_config
from fleetlab.prefix_cache import PREFIX_CACHES

if TYPE_CHECKING:
    from fleetlab.attention.backend import AttentionBackend
    from fleetlab.engine.policies import SchedulingPolicy
    from fleetlab.kv_transfer.config import KVTransferConfig
    from fleetlab.prefix_cache import PrefixCache

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    """Engine settings (``LLM(model, **config)`` takes these as keywords).

    block_size: tokens per KV block.
    num_blocks: KV blocks in the pool; None sizes it from ``kv_cache_memory_bytes``, from
      ``memory_utilization``, or failing both to hold ``max_num_seqs // 2`` sequences of
      ``max_model_len`` tokens (a pool that preempts under load: :mod:`fleetlab.kv_sizing`).
    max_num_seqs: the most requests running at once (rows of the InputBatch).
    max_num_batched_tokens: the token budget of one step (decodes + prefill chunks).
    max_model_len: the longest sequence (prompt + output); None = the model's limit. A value
      above the model's limit is served at the model's limit, with a WARNING naming both.
    enable_prefix_caching: reuse cached full blocks of identical prefixes (False = ``prefix_cache=None``).
    prefix_cache: the prefix-cache design: ``"hash"`` (vLLM's hash chain), ``"radix"`` (SGLang's
      radix tree), None, or a registered name / ``PrefixCache`` subclass or instance
      (:mod:`fleetlab.prefix_cache`).
    memory_utilization: with ``num_blocks`` None, size the pool from memory: this share of
      the device's memory (on a CPU: the machine's available memory and the loaded weights),
      less the weights and the peak of a profiled forward at ``max_num_batched_tokens``, goes
      to KV blocks (:mod:`fleetlab.kv_sizing`).
    memory_budget_bytes: the memory ``memory_utilization`` shares out, overriding the default
      (on a GPU its total memory; on a CPU what psutil reports available, plus the weights).
    enable_chunked_prefill: split long prompts over several steps.
    reorder: None = the attention backend decides; True/False forces decode-first reorder.
    backend: the attention backend: a registered name (``fleetlab.attention.backend``), an
      ``AttentionBackend`` subclass or instance.
    scheduling_policy: which waiting request runs next and who gets preempted: a registered
      name, a ``SchedulingPolicy`` subclass or instance.
    seed: seeds the per-request seeds of requests that do not set one.
    record_traces: keep a ``StepTrace`` of every step in ``LLM.traces``.
    speculative_config: None, or ``{"method": "ngram" | "draft", "num_speculative_tokens": k,
      ...}`` (see :class:`fleetlab.spec_decode.config.SpeculativeConfig`).
    tensor_parallel_size: ranks the model is split over (Megatron-style heads and MLP
      columns); > 1 needs a program started by ``python -m paddle.distributed.launch
      --nproc_per_node N`` (see ``fleetlab.distributed``).
    kv_transfer_config: None, or ``{"connector": NAME, "role": "producer" | "consumer" | "both",
      ...options}``: KV loaded from / saved outside the engine (see :mod:`fleetlab.kv_transfer`).
    async_scheduling: overlap the host's scheduling and preparing of step N+1 with step N's
      forward (:mod:`fleetlab.overlap`); not with speculative decoding, tensor parallelism,
      ``kv_transfer_config``, ``record_traces`` or requests with ``structured_outputs``.

    Bounds (checked when one is built, in ``__post_init__``; a refusal names the field): ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``tensor_parallel_size``, ``num_blocks`` and
    ``max_model_len`` are ints in ``[1, 2**31 - 1]`` (the int32 block tables and counters);
    ``kv_cache_memory_bytes`` and ``memory_budget_bytes`` ints in ``[1, 2**63 - 1]``; ``memory_utilization``
    a number in ``(0, 1]``, not with ``num_blocks`` or ``kv_cache_memory_bytes``; ``seed`` an int in ``[0, 2**63 - 1]``;
    ``enable_prefix_caching``, ``enable_chunked_prefill``, ``record_traces`` and ``async_scheduling`` are
    ``True``/``False`` and ``reorder`` None/True/False (no other value counts as true).
    numpy scalars count as the numbers they hold (and are stored as Python ints); a ``bool``
    is not an int.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    reorder: bool | None = None
    backend: str | type[AttentionBackend] | AttentionBackend = "tiled"
    scheduling_policy: str | type[SchedulingPolicy] | SchedulingPolicy = "fcfs"
    kv_cache_memory_bytes: int | None = None
    prefix_cache: str | type[PrefixCache] | PrefixCache | None = "hash"
    memory_utilization: float | None = None
    memory_budget_bytes: int | None = None
    seed: int = 0
    record_traces: bool = False
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1
    kv_transfer_config: dict | KVTransferConfig | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        """Check every field (numpy scalars stored as the Python values they hold); the bounds are the
        class docstring's. ``async_scheduling``'s clashes are the overlapped loop's to refuse
        (:func:`fleetlab.overlap.refusals.check_async_scheduling`), the speculative config the
        proposers' (:func:`fleetlab.spec_decode.config.check_speculative_config`)."""
        where = "engine config:"
        self._check_numbers(where)
        self._check_choices(where)

    def _check_numbers(self, where: str) -> None:
        """The sizes, seed and switches: ints, numbers and bools within their bounds."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            setattr(self, name, int_field(where, name, getattr(self, name), 1, INT32_MAX))
        for name, high in (("num_blocks", INT32_MAX), ("max_model_len", INT32_MAX),  # None: sized by the engine
                           ("kv_cache_memory_bytes", INT64_MAX), ("memory_budget_bytes", INT64_MAX)):
            setattr(self, name, optional(int_field, where, name, getattr(self, name), 1, high))
        self.seed = int_field(where, "seed", self.seed, 0, INT64_MAX)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "record_traces", "async_scheduling"):
            setattr(self, name, bool_field(where, name, getattr(self, name)))
        self.reorder = optional(bool_field, where, "reorder", self.reorder)  # None: the backend decides
        self.memory_utilization = optional(float_field, where, "memory_utilization", self.memory_utilization, 0.0, 1.0,
                                                  low_open=True)
        sized = [name for name in ("num_blocks", "kv_cache_memory_bytes") if getattr(self, name) is not None]
        refuse([(self.memory_utilization is not None and sized,
                 f"memory_utilization sizes the pool, and so does {(sized or [''])[0]}: give one"),
                (self.memory_utilization is None and self.memory_budget_bytes is not None,
                 "memory_budget_bytes is the memory memory_utilization shares out; it needs memory_utilization"),
                (not self.enable_prefix_caching and self.prefix_cache not in (None, "hash"),
                 f"enable_prefix_caching=False contradicts prefix_cache={self.prefix_cache!r:.60}")],
               prefix=f"{where} ")

    def _check_choices(self, where: str) -> None:
        """What is chosen by name from a registry (backend, policy, prefix cache), and the KV connector."""
        from fleetlab.attention.backend import ATTENTION_BACKENDS  # (Paddle: only once a config is built)

        if self.prefix_cache is None or not self.enable_prefix_caching:  # one spelling of "no prefix cache"
            self.prefix_cache, self.enable_prefix_caching = None, False
        for name, registry in (("backend", ATTENTION_BACKENDS), ("scheduling_policy", POLICIES),
                               ("prefix_cache", PREFIX_CACHES)):
            try:  # a registry refuses with a FieldTypeError: a TypeError and a ValueError at once
                if getattr(self, name) is not None:
                    registry.resolve(getattr(self, name))
            except TypeError as exc:
                raise FieldTypeError(f"{where} {name}={getattr(self, name)!r:.60}: {exc}") from None
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = check_kv_transfer_config(self.kv_transfer_config)
            if self.tensor_parallel_size > 1:
                raise ValueError(f"{where} kv_transfer_config with tensor_parallel_size > 1 is not supported")


def engine_config(**kwargs) -> EngineConfig:
    """A checked ``EngineConfig`` from keywords; an unknown keyword is refused with the known ones."""
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unknown engine config field(s) {unknown}; known: {sorted(known)}")
    return EngineConfig(**kwargs)


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
