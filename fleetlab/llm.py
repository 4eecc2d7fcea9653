"""``LLM``: the front door. Give it a model, get continuous batching.

    llm = fleetlab.LLM(model, tokenizer, block_size=16, max_num_batched_tokens=256)
    outs = llm.generate(["12+7=", "3+4="], fleetlab.SamplingParams(max_tokens=8))

It sits above the engine core (``fleetlab/engine/``, ``kv/``, ``attention/``): it checks what
users send (:mod:`fleetlab.validation`), patches the model, sizes a paged KV cache and a block
pool, wires the scheduler, the model runner and speculative decoding together, and turns
token ids into text. Every :meth:`LLM.step` is three moves: the scheduler plans
(``SchedulerOutput``), the model runner executes (``ModelRunnerOutput``), the scheduler
commits and returns the step's outputs. A step applies entirely or not at all: if the runner
raises, the scheduler rolls the plan back and the runner is reset.

Two things happen here rather than in the core: a request with ``n > 1`` (or ``best_of``) is
fanned out into child requests and their outputs fanned back in
(:mod:`fleetlab.engine.parallel_sampling`), and each request's log-probabilities are kept
across steps (:class:`~fleetlab.engine.logprobs.LogprobsCollector`). Logit bias and penalties
are a logits processor the engine always installs (:mod:`fleetlab.engine.penalties`).
"""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import time
import weakref
from collections.abc import Sequence

from tqdm.auto import tqdm

from fleetlab.device import check_model_dtype_runs
from fleetlab.distributed.engine import TensorParallelState
from fleetlab.engine.batch_fields import DEFAULT_FIELDS
from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.logprobs import LogprobsCollector
from fleetlab.engine.messages import ModelRunnerOutput, SchedulerOutput
from fleetlab.engine.model_runner import ModelRunner
from fleetlab.engine.observe import StepRecorder, StepTrace
from fleetlab.engine.outputs import RequestOutput
from fleetlab.engine.parallel_sampling import ParentRequest
from fleetlab.engine.penalties import PenaltiesProcessor
from fleetlab.engine.sampler import Sampler
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.engine.scheduler import Scheduler
from fleetlab.kv.block_pool import BlockPool
from fleetlab.kv.manager import KVCacheManager
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.kv_sizing import size_kv_cache
from fleetlab.patching import patch_model
from fleetlab.patching.handle import PatchHandle
from fleetlab.prefix_cache import build_prefix_cache
from fleetlab.spec_decode.proposer import PROPOSERS, ProposerContext
from fleetlab.spec_decode.rejection import RejectionSampler
from fleetlab.spec_decode.stats import SpecDecodingStats
from fleetlab.structured_output.processor import StructuredOutputsProcessor
from fleetlab.validation import (
    InputProcessor,
    check_backend_fits,
    check_speculative_config,
    engine_config,
    generate_items,
    resolve_max_model_len,
)

logger = logging.getLogger(__name__)


class LLM:
    """Serve many requests on one model with continuous batching over a paged KV cache.

    Args:
      model: a PaddleFormers causal LM, a Fleet-style model, or an existing ``PatchHandle``.
      tokenizer: optional; anything with ``encode(text)`` and ``decode(ids)``.
      batch_fields: extra :class:`~fleetlab.Field` s of the InputBatch (per-request state of a
        prototype, e.g. a LoRA id): set per request with ``add_request(..., extra={...})``,
        moved with its row, and readable by the attention backend (``metadata.batch``).
      logits_processors: :class:`~fleetlab.engine.logits_processor.LogitsProcessor` s the
        sampler applies to every step's logits, after the built-in logit bias and penalties
        (their fields join the batch's).
      **config: fields of :class:`~fleetlab.EngineConfig` (``speculative_config={...}``
        turns speculative decoding on: see :class:`~fleetlab.spec_decode.config.SpeculativeConfig`).
    """

    def __init__(self, model, tokenizer=None, *, batch_fields: Sequence = (), logits_processors: Sequence = (),
                 **config):
        self.config = cfg = engine_config(**config)
        self.tokenizer = tokenizer
        self.spec_config = check_speculative_config(cfg.speculative_config) if cfg.speculative_config else None
        self.tensor_parallel = None  # this rank's TensorParallelState; every rank runs the scheduler
        if cfg.tensor_parallel_size > 1:
            self.tensor_parallel = TensorParallelState.prepare(model, cfg.tensor_parallel_size)
        self._parents: dict[str, ParentRequest] = {}  # parallel sampling: child request id -> its parent
        self._parent_ids: dict[str, ParentRequest] = {}  # parent id -> parent, while a child runs
        self._logprobs = LogprobsCollector()
        self._owns_handle = not isinstance(model, PatchHandle)
        self.handle = patch_model(model, backend=cfg.backend) if self._owns_handle else model
        # Closing happens once, on close() or when the LLM is garbage-collected (a notebook
        # cell re-run drops the old LLM): either way its share of the patch is released.
        self._closables: list = []  # the proposer, once built
        self._finalizer = weakref.finalize(self, _release, self.handle if self._owns_handle else None,
                                           self._closables)
        try:
            self._build(cfg, list(batch_fields), [PenaltiesProcessor(), *logits_processors])
        except Exception:
            self.close()  # a failed construction leaves the models as they were
            raise
        # What exists now (the model, its cache, the engine) lives as long as the engine: move it out of
        # the garbage collector's sight, so that a full collection during a step walks only what steps
        # made (vLLM's engine core freezes its startup heap for the same reason: pause times).
        gc.collect()
        gc.freeze()

    def _build(self, cfg, batch_fields: list, processors: list) -> None:
        check_model_dtype_runs(self.handle.dtype)
        backend_cls = type(self.handle.backend)
        if self.tensor_parallel is not None:
            self.tensor_parallel.adapt_handle(self.handle)  # this rank's KV heads size the cache
        check_backend_fits(cfg, backend_cls)
        self.max_model_len = resolve_max_model_len(cfg, self.handle.max_model_len)
        self.kv_sizing = size_kv_cache(self.handle, cfg, self.max_model_len)
        num_blocks = self.kv_sizing.num_blocks
        self.kv_cache = PagedKVCache.for_handle(self.handle, num_blocks, cfg.block_size)
        self.pool = BlockPool(num_blocks, cfg.block_size, build_prefix_cache(cfg.prefix_cache, cfg.block_size))
        # A verify row carries k + 1 query tokens: still a decode for the reorder and the kernels.
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        decode_threshold = max(backend_cls.reorder_threshold, k + 1)
        self.proposer = None
        if self.spec_config:
            context = ProposerContext(self.handle.backend, num_blocks, cfg.block_size, self.max_model_len,
                                      self.handle.vocab_size, decode_threshold)
            self.proposer = PROPOSERS.get(self.spec_config.method)(self.spec_config, context)
            self._closables.append(self.proposer)
        lookahead = self.proposer.num_lookahead_tokens if self.proposer else 0
        self.scheduler = Scheduler(
            KVCacheManager(self.pool), max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
            enable_chunked_prefill=cfg.enable_chunked_prefill, policy=cfg.scheduling_policy,
            num_lookahead_tokens=lookahead)
        # Grammar masks come first, before any other processor changes the logits (built lazily:
        # an engine that never sees a constraint never loads the grammar library).
        self.structured_outputs = StructuredOutputsProcessor(
            self.tokenizer, self.handle.vocab_size, eos_token_id=self.handle.eos_token_id, num_speculative_tokens=k,
            compile_ahead=self.tensor_parallel is None)  # ranks must admit a request at the same step
        self._closables.append(self.structured_outputs)
        processors = [self.structured_outputs, *processors]
        fields = DEFAULT_FIELDS.copy()
        for field in batch_fields + [f for p in processors for f in p.fields]:
            fields.register(field)
        batch = InputBatch(max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
                           max_blocks_per_seq=-(-self.max_model_len // cfg.block_size), fields=fields)
        self.runner = ModelRunner(self.handle, self.kv_cache, batch, reorder=backend_cls.requires_reorder
                                  if cfg.reorder is None else cfg.reorder, decode_threshold=decode_threshold,
                                  sampler=(RejectionSampler if self.proposer else Sampler)(processors),
                                  proposer=self.proposer)
        if self.tensor_parallel is not None:
            self.runner = self.tensor_parallel.wrap_runner(self.runner)
        self.processor = InputProcessor(
            self.tokenizer, vocab_size=self.handle.vocab_size, max_model_len=self.max_model_len,
            eos_token_id=self.handle.eos_token_id, hidden_size=self.handle.hidden_size, block_size=cfg.block_size,
            num_blocks=num_blocks, max_stop_ids=batch.sizes["max_stop_ids"], batch_fields=batch.fields,
            processors=processors, num_lookahead_tokens=lookahead,
            seed=cfg.seed, structured_outputs=self.structured_outputs)
        self.observers: list = []  # anything with on_step(scheduler_output, runner_output, outputs)
        self.spec_stats = SpecDecodingStats() if self.proposer else None
        self.recorder = StepRecorder(self) if cfg.record_traces else None
        self.observers += [o for o in (self.spec_stats, self.recorder) if o is not None]

    def close(self) -> None:
        """Let go of the model's patch (and the draft model's): once every ``LLM`` on a model
        is closed (or garbage-collected), the model is exactly as before. Also what
        ``with LLM(...) as llm:`` does."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----- requests in -----
    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: Sequence[int] | None = None, request_id: str | None = None,
                    priority: int = 0, prompt_embeds=None, extra: dict | None = None) -> str:
        """Queue one request; returns its id. Raises ``ValueError`` naming the request and
        the bad field before anything is queued. With ``sampling_params.n > 1`` its ``n``
        sequences come back as outputs with this id and ``index`` 0 to n - 1.

        ``prompt_embeds``: side data such as image features, ``{prompt position: vector
        [hidden_size]}`` (or ``[num_prompt_tokens, hidden_size]``) used instead of those
        tokens' own embeddings (see :mod:`fleetlab.engine.side_data`). ``extra``: values of
        the engine's extra batch fields (``LLM(..., batch_fields=...)``) by name.

        A request with ``sampling_params.structured_outputs`` waits until its grammar is compiled
        (on a thread; the others run). A constraint that compiles but cannot be spelled by the
        model's vocabulary ends the request with ``finish_reason="error"`` once it runs
        (``generate`` and the server refuse it before anything is queued).
        """
        live = _LiveIds(self.scheduler.requests, self._parent_ids)
        req = self.processor.process(prompt, sampling_params, prompt_token_ids, request_id, live, priority,
                                     prompt_embeds, extra)
        self._queue(*self._fan_out(req, live))
        return req.request_id

    def _fan_out(self, req, live) -> tuple[ParentRequest | None, list]:
        """``(None, [req])``, or for ``n > 1`` / ``best_of``: its parent and its checked children
        (``live``: the ids they may not take)."""
        sp = req.sampling_params
        if sp.n == 1 and (sp.best_of or 1) == 1:
            return None, [req]
        parent = ParentRequest(req.request_id, sp)
        return parent, [self.processor.process(None, parent.child_params(i), req.prompt_token_ids, cid, live,
                                               req.priority, None, dict(req.extra))
                        for i, cid in enumerate(parent.child_ids)]

    def _queue(self, parent: ParentRequest | None, reqs: list) -> None:
        if parent is not None:
            self._parent_ids[parent.request_id] = parent
        for req in reqs:
            if parent is not None:
                self._parents[req.request_id] = parent
            self._logprobs.add(req)
            self.scheduler.add_request(req)

    # ----- the loop -----
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step: plan, run, commit. Returns a ``RequestOutput`` for every request
        that gained tokens or finished in it (``new_token_ids`` holds what it gained)."""
        self.handle.check_live()  # before planning: a stale LLM must not touch its queues
        sched = self.scheduler.schedule()
        if not sched.num_scheduled_tokens:
            self._wait_for_waiting()
        result = self._execute(sched)
        outputs = self.scheduler.update(sched, result)
        for observer in self.observers:
            observer.on_step(sched, result, outputs)
        return self._finish_outputs(outputs, result)

    def _finish_outputs(self, outputs: list[RequestOutput], result: ModelRunnerOutput | None) -> list[RequestOutput]:
        """Logprobs attached, children's outputs as their parent's, finished ones given their text."""
        self._logprobs.collect(outputs, result)
        if self._parents:
            fanned_in = []
            for out in outputs:
                parent = self._parents.get(out.request_id)
                if parent is None:
                    fanned_in.append(out)
                    continue
                if out.finished:
                    del self._parents[out.request_id]
                fanned_in += parent.process(out)
                if parent.finished:
                    del self._parent_ids[parent.request_id]
            outputs = fanned_in
        return self._detokenize(outputs)

    def _wait_for_waiting(self, timeout: float = 0.05) -> None:
        """Nothing could run: if requests wait on something (a grammar's compile), give it up to
        ``timeout`` seconds rather than spin through empty steps."""
        pending = [r.waiting_on for r in self.scheduler.waiting if not r.is_ready]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run the plan; on any exception undo it (scheduler rollback, runner reset) and re-raise."""
        if not sched.num_scheduled_tokens:
            return ModelRunnerOutput()
        try:
            return self.runner.execute(sched)
        except BaseException:
            logger.debug("step %d failed: rolling it back", sched.step)
            self.scheduler.rollback(sched)
            self.runner.reset()
            raise

    def _detokenize(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Give finished outputs their text (a stream decodes its deltas itself)."""
        if self.tokenizer is not None:
            for out in outputs:
                if out.finished:
                    out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        return outputs

    def abort(self, request_ids) -> list[RequestOutput]:
        """Stop the named requests now (``str`` or an iterable of ids; a parallel-sampling
        request's id stops all its sequences); their blocks are freed at once. Returns their
        final outputs (``finish_reason="abort"``); ids that are unknown or already finished
        are ignored."""
        now = time.perf_counter()
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [cid for rid in ids for cid in (self._parent_ids[rid].child_ids if rid in self._parent_ids else [rid])]
        aborted = self.scheduler.abort(ids)
        for req in aborted:
            req.finish_time = now
        return self._finish_outputs([RequestOutput.from_request(req, []) for req in aborted], None)

    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm: bool = True):
        """Run every prompt to completion; returns ``RequestOutput`` s in input order (with
        ``n > 1``: the prompt's ``n`` sequences in ``index`` order, then the next prompt's).

        ``prompts``: a string or a list of strings (needs a tokenizer); or
        ``prompt_token_ids``: a list of token-id lists. ``sampling_params``: one
        ``SamplingParams`` for all, or one per prompt. Every request is validated before
        any runs, so a bad one raises ``ValueError`` and nothing is queued. If the loop is
        interrupted (an exception, Ctrl-C), this call's requests are aborted first.
        """
        live = set(self.scheduler.requests) | set(self._parent_ids)
        queued = []
        for prompt, ids, sp in generate_items(prompts, prompt_token_ids, sampling_params):
            req = self.processor.process(prompt, sp, ids, None, live)
            parent, reqs = self._fan_out(req, live)
            live |= {req.request_id, *(r.request_id for r in reqs)}
            queued.append((req.request_id, req.sampling_params.n, parent, reqs))
        for _, _, _, reqs in queued:  # a constraint the model cannot spell is refused here, before anything runs
            for req in reqs:
                if "structured_output" in req.extra:
                    req.extra["structured_output"].check(req.request_id, timeout=None)
        for _, _, parent, reqs in queued:
            self._queue(parent, reqs)
        done: dict[tuple[str, int], RequestOutput] = {}
        bar = tqdm(total=sum(n for _, n, _, _ in queued), disable=not use_tqdm, desc="requests", unit="req")
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    if out.finished:
                        done[out.request_id, out.index] = out
                        out.new_token_ids = list(out.token_ids)
                        bar.update(1)
        except BaseException:
            self.abort([rid for rid, _, _, _ in queued])
            raise
        finally:
            bar.close()
        return [done[rid, i] for rid, n, _, _ in queued for i in range(n)]

    # ----- looking inside -----
    @property
    def traces(self) -> list[StepTrace]:
        """A ``StepTrace`` of every step so far (``record_traces=True``; else empty)."""
        return self.recorder.traces if self.recorder is not None else []

    def batch_snapshot(self) -> list:
        """The model runner's persistent batch, one ``RowRecord`` per row, as the last step left
        it (rows of requests that finished in it leave at the next step)."""
        return self.runner.batch.snapshot(self.runner.decode_threshold)

    def block_tables(self) -> dict[str, list[int]]:
        """``{request id: block ids}`` of every running request (for drawing the pool)."""
        return {r.request_id: self.scheduler.kv.get_block_ids(r.request_id) for r in self.scheduler.running}

    def stats(self) -> dict:
        """Pool and cache figures: blocks, free blocks, hit rate, preemptions, utilization,
        steps, generated tokens, the requests running and waiting now, and with speculation
        the drafts verified and accepted (see :class:`~fleetlab.spec_decode.stats.SpecDecodingStats`)."""
        s = self.pool.stats()
        used = s.num_blocks - s.num_free_blocks
        tokens_held = sum(r.num_computed_tokens for r in self.scheduler.running)
        stats = {
            "num_blocks": s.num_blocks,
            "kv_bytes_per_block": self.kv_sizing.bytes_per_block,
            "num_free_blocks": s.num_free_blocks,
            "prefix_cache_hit_rate": s.hit_rate,
            "prefix_cache_queries": s.queries,
            "prefix_cache_query_tokens": s.query_tokens,
            "prefix_cache_hit_tokens": s.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_utilization": used / s.num_blocks,
            "kv_token_fill": tokens_held / max(1, used * self.pool.block_size),
            "num_generated_tokens": self.scheduler.num_generated_tokens,
            "num_steps": self.scheduler.step_count,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
        }
        return stats if self.spec_stats is None else {**stats, **self.spec_stats.as_dict()}


class _LiveIds:
    """The ids a new request may not take (``in`` only): the engine's requests, and the
    parallel-sampling parents still running."""

    def __init__(self, requests, parent_ids):
        self.requests, self.parent_ids = requests, parent_ids

    def __contains__(self, request_id) -> bool:
        return request_id in self.requests or request_id in self.parent_ids


def _release(handle, proposers) -> None:
    """What closing an LLM undoes (kept apart from the LLM so a finalizer can run it)."""
    for proposer in proposers:
        proposer.close()
    if handle is not None:
        handle.unpatch()
