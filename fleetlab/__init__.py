"""fleetlab: learn how an LLM inference engine serves many requests at once.

Four composable pieces, each driven by a notebook:

1. attention patching (:func:`patch_model`, :func:`forward_context`);
2. a paged KV cache (:class:`BlockPool`, :class:`PagedKVCache`);
3. a persistent batch with decode-first reordering (:class:`InputBatch`);
4. a decode loop (:class:`Scheduler`, :class:`LLM`).

The extension points are exported here too: :class:`AttentionBackend` (and the default
:class:`TiledBackend` to subclass), :class:`SchedulingPolicy` (and :class:`PriorityPolicy`; a
policy sees :class:`Request` s), :class:`Proposer`, :class:`KVConnector` and their ``register_*``
functions (one :class:`Registry` rule set), batch fields (:class:`Field`, :data:`DEFAULT_FIELDS`),
:class:`LogitsProcessor` (called with the step's :class:`SamplingTensors`), step observers
(:class:`StepRecorder`), and the correctness oracle, :func:`reference_greedy` (the unpatched
model's own full forward).

Names are imported lazily so that ``import fleetlab`` stays cheap and the
pieces that need Paddle only load it when used. Importing fleetlab changes no process state
(environment, warning filters, import hooks, loggers): the lab (:mod:`fleetlab.lab`, which
notebooks import) and the command line turn on the quiet mode that keeps Paddle's and
PaddleFormers' import-time notices out of sight (:mod:`fleetlab.lab.quiet`).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "LLM": "fleetlab.llm",
    "AsyncLLM": "fleetlab.serving.async_llm",
    "SamplingParams": "fleetlab.engine.sampling_params",
    "StructuredOutputsParams": "fleetlab.engine.structured_outputs_params",
    "RequestOutput": "fleetlab.engine.outputs",
    "EngineConfig": "fleetlab.engine.config",
    "Scheduler": "fleetlab.engine.scheduler",
    "InputBatch": "fleetlab.engine.input_batch",
    "patch_model": "fleetlab.patching",
    "forward_context": "fleetlab.attention.context",
    "AttentionMetadata": "fleetlab.attention.metadata",
    "BlockPool": "fleetlab.kv.block_pool",
    "PagedKVCache": "fleetlab.kv.paged_cache",
    "register_attention_backend": "fleetlab.attention.backend",
    "get_attention_backend": "fleetlab.attention.backend",
    "AttentionBackend": "fleetlab.attention.backend",
    "SchedulingPolicy": "fleetlab.engine.policies",
    "PriorityPolicy": "fleetlab.engine.policies",
    "Request": "fleetlab.engine.request",
    "LogitsProcessor": "fleetlab.engine.logits_processor",
    "SamplingTensors": "fleetlab.engine.sampler",
    "TiledBackend": "fleetlab.attention.tiled",
    "TiledMetadata": "fleetlab.attention.tiled",
    "reference_greedy": "fleetlab.patching.parity",
    "register_policy": "fleetlab.engine.policies",
    "Proposer": "fleetlab.spec_decode.proposer",
    "register_proposer": "fleetlab.spec_decode.proposer",
    "PrefixCache": "fleetlab.prefix_cache",
    "register_prefix_cache": "fleetlab.prefix_cache",
    "Registry": "fleetlab.registry",
    "Field": "fleetlab.engine.batch_fields",
    "FieldRegistry": "fleetlab.engine.batch_fields",
    "DEFAULT_FIELDS": "fleetlab.engine.batch_fields",
    "unpermute": "fleetlab.lab.lessons.row_moves",
    "StepRecorder": "fleetlab.inspect.recorder",
    "KVConnector": "fleetlab.kv_transfer",
    "KVTransferConfig": "fleetlab.kv_transfer",
    "register_kv_connector": "fleetlab.kv_transfer",
    "BlockStoreConnector": "fleetlab.kv_transfer",
    "LoadError": "fleetlab.kv_transfer",
}
# name -> module; the lab's viz, bench and lessons are reachable here too (their home is fleetlab.lab).
_SUBMODULES = {name: f"fleetlab.{name}" for name in (
    "models", "attention", "patching", "engine", "kv", "serving", "spec_decode", "structured_output", "prefix_cache",
    "inspect", "output", "kv_transfer", "lab")} | {name: f"fleetlab.lab.{name}" for name in ("viz", "bench", "lessons")}

__all__ = sorted(_LAZY) + sorted(_SUBMODULES)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(_SUBMODULES[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module 'fleetlab' has no attribute {name!r}")


def __dir__():
    return __all__
