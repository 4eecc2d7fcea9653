"""``EngineConfig``: every knob of the engine in one dataclass (checked by ``fleetlab.validation``)."""

from __future__ import annotations

from dataclasses import dataclass


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

    Bounds (checked by ``fleetlab.validation.engine_config``; a refusal names the field): ``block_size``,
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
    backend: object = "tiled"
    scheduling_policy: object = "fcfs"
    kv_cache_memory_bytes: int | None = None
    prefix_cache: object = "hash"
    memory_utilization: float | None = None
    memory_budget_bytes: int | None = None
    seed: int = 0
    record_traces: bool = False
    speculative_config: dict | None = None
    tensor_parallel_size: int = 1
    kv_transfer_config: object = None
    async_scheduling: bool = False
