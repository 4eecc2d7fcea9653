"""``EngineConfig``: every knob of the engine in one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class EngineConfig:
    """Engine settings (``LLM(model, **config)`` takes these as keywords).

    block_size: tokens per KV block.
    num_blocks: KV blocks in the pool; None sizes it from ``kv_cache_memory_bytes`` or,
      failing that, to hold ``max_num_seqs`` sequences of ``max_model_len`` tokens.
    max_num_seqs: the most requests running at once (rows of the InputBatch).
    max_num_batched_tokens: the token budget of one step (decodes + prefill chunks).
    max_model_len: the longest sequence (prompt + output); None = the model's limit.
    enable_prefix_caching: reuse cached full blocks of identical prefixes.
    enable_chunked_prefill: split long prompts over several steps.
    reorder: None = the attention backend decides; True/False forces decode-first reorder.
    backend: attention backend name (``fleetlab.attention.backend`` registry).
    scheduling_policy: which waiting request runs next and who gets preempted.
    seed: seeds the per-request seeds of requests that do not set one.
    record_traces: keep a ``StepTrace`` of every step in ``LLM.traces``.
    speculative_config: None, or ``{"method": "ngram" | "draft", "num_speculative_tokens": k,
      ...}`` (see :class:`fleetlab.spec.config.SpeculativeConfig`).
    tensor_parallel_size: ranks the model is split over (Megatron-style heads and MLP
      columns); > 1 needs a program started by ``python -m paddle.distributed.launch
      --nproc_per_node N`` (see ``fleetlab.distributed``).
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    reorder: bool | None = None
    backend: str = "reference"
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
        """Raise ``ValueError`` naming the field when a setting is out of range."""
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"engine config: {name}={value!r} must be an int >= 1")
        for name in ("num_blocks", "max_model_len", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"engine config: {name}={value!r} must be None or an int >= 1")
        if self.reorder not in (None, True, False):
            raise ValueError(f"engine config: reorder={self.reorder!r} must be None, True or False")
