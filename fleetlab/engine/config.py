"""``EngineConfig``: every knob of the engine in one validated dataclass."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from fleetlab.engine.checks import INT32_MAX, INT64_MAX, FieldTypeError, bool_field, int_field

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    """Engine settings (``LLM(model, **config)`` takes these as keywords).

    block_size: tokens per KV block.
    num_blocks: KV blocks in the pool; None sizes it from ``kv_cache_memory_bytes`` or,
      failing that, to hold ``max_num_seqs`` sequences of ``max_model_len`` tokens.
    max_num_seqs: the most requests running at once (rows of the InputBatch).
    max_num_batched_tokens: the token budget of one step (decodes + prefill chunks).
    max_model_len: the longest sequence (prompt + output); None = the model's limit. A value
      above the model's limit is served at the model's limit, with a WARNING naming both.
    enable_prefix_caching: reuse cached full blocks of identical prefixes.
    enable_chunked_prefill: split long prompts over several steps.
    reorder: None = the attention backend decides; True/False forces decode-first reorder.
    backend: attention backend name (``fleetlab.attention.backend`` registry).
    scheduling_policy: which waiting request runs next and who gets preempted.
    seed: seeds the per-request seeds of requests that do not set one.
    record_traces: keep a ``StepTrace`` of every step in ``LLM.traces``.
    speculative_config: None, or ``{"method": "ngram" | "draft", "num_speculative_tokens": k,
      ...}`` (see :class:`fleetlab.spec_decode.config.SpeculativeConfig`).
    tensor_parallel_size: ranks the model is split over (Megatron-style heads and MLP
      columns); > 1 needs a program started by ``python -m paddle.distributed.launch
      --nproc_per_node N`` (see ``fleetlab.distributed``).

    Bounds (checked by ``validate``; a refusal names the field): ``block_size``,
    ``max_num_seqs``, ``max_num_batched_tokens``, ``tensor_parallel_size``, ``num_blocks`` and
    ``max_model_len`` are ints in ``[1, 2**31 - 1]`` (the int32 block tables and counters);
    ``kv_cache_memory_bytes`` an int in ``[1, 2**63 - 1]``; ``seed`` an int in ``[0, 2**63 - 1]``;
    ``enable_prefix_caching``, ``enable_chunked_prefill`` and ``record_traces`` are
    ``True``/``False`` and ``reorder`` None/True/False (no other value counts as true);
    ``backend`` is a str (a registered name). numpy scalars count as the numbers they
    hold (and are stored as Python ints); a ``bool`` is not an int.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    reorder: bool | None = None
    backend: str = "tiled"
    scheduling_policy: str = "fcfs"
    kv_cache_memory_bytes: int | None = None
    seed: int = 0
    record_traces: bool = False
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine config field(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ``ValueError`` (``TypeError`` for a wrong type) naming the field when a setting
        is out of range; numpy scalars are stored back as the Python values they hold."""
        where = "engine config:"
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            setattr(self, name, int_field(where, name, getattr(self, name), 1, INT32_MAX))
        for name, high in (("num_blocks", INT32_MAX), ("max_model_len", INT32_MAX),
                           ("kv_cache_memory_bytes", INT64_MAX)):
            if getattr(self, name) is not None:
                setattr(self, name, int_field(where, name, getattr(self, name), 1, high))
        self.seed = int_field(where, "seed", self.seed, 0, INT64_MAX)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "record_traces"):
            setattr(self, name, bool_field(where, name, getattr(self, name)))
        if self.reorder is not None:
            self.reorder = bool_field(where, "reorder", self.reorder)  # None: the backend decides
        if not isinstance(self.backend, str):  # scheduling_policy may be a name or a policy instance
            raise FieldTypeError(f"{where} backend={self.backend!r:.60} must be a str (a registered backend name)")

    def resolve_max_model_len(self, model_max_len: int) -> int:
        """The engine's ``max_model_len``: this config's, or the model's when unset or larger.
        Asking for more than the model has positions for is logged at WARNING level, naming
        both numbers, and served at the model's length."""
        if self.max_model_len is None:
            return model_max_len
        if self.max_model_len > model_max_len:
            logger.warning("engine config: max_model_len=%d exceeds the model's %d positions; serving at most "
                           "%d tokens per sequence", self.max_model_len, model_max_len, model_max_len)
            return model_max_len
        return self.max_model_len
