"""``LLM``: the front door. Give it a model, get continuous batching.

    llm = fleetlab.LLM(model, tokenizer, block_size=16, max_num_batched_tokens=256)
    outs = llm.generate(["12+7=", "3+4="], fleetlab.SamplingParams(max_tokens=8))

It is the front door over two pieces, as in vLLM: the **engine core**
(:class:`~fleetlab.engine.core.EngineCore`: every step is three moves, the scheduler plans,
the model runner executes, the scheduler commits) and the **output processor** beside it
(:class:`~fleetlab.output.processor.OutputProcessor`: stop strings, logprobs, parallel-sampling
fan-in, text). Here the user's requests are checked (:mod:`fleetlab.edge`) and a request
with ``n > 1`` (or ``best_of``) is fanned out into child requests
(:mod:`fleetlab.output.parallel_sampling`); the model is patched, a paged KV cache and a block
pool sized, and the scheduler, the model runner and speculative decoding wired together. Logit
bias and penalties are a logits processor the engine always installs
(:mod:`fleetlab.processors.penalties`). Observers see the steps at ``LLM.hooks``
(:class:`~fleetlab.engine.hooks.StepHooks`; ``fleetlab.inspect`` has the built-in ones).
"""

from __future__ import annotations

import concurrent.futures
import weakref
from collections import ChainMap
from collections.abc import Sequence

from tqdm.auto import tqdm

from fleetlab.device import check_model_dtype_runs
from fleetlab.distributed.engine import TensorParallelState
from fleetlab.edge.input_processor import InputProcessor, generate_items
from fleetlab.engine.batch_fields import DEFAULT_FIELDS
from fleetlab.engine.config import check_backend_fits, engine_config, resolve_max_model_len
from fleetlab.engine.core import EngineCore
from fleetlab.engine.hooks import StepHooks
from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.model_runner import ModelRunner
from fleetlab.engine.outputs import RequestOutput
from fleetlab.engine.sampler import Sampler
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.engine.scheduler import Scheduler
from fleetlab.errors import ObserverError
from fleetlab.inspect.recorder import StepRecorder, StepTrace
from fleetlab.inspect.spec_stats import SpecDecodingStats
from fleetlab.inspect.stats import engine_stats
from fleetlab.kv.block_pool import BlockPool
from fleetlab.kv.manager import KVCacheManager
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.kv_sizing import size_kv_cache
from fleetlab.kv_transfer.config import make_kv_connector
from fleetlab.output.parallel_sampling import ParentRequest, child_sampling_params
from fleetlab.output.processor import OutputProcessor
from fleetlab.overlap import OverlapEngineCore, RefusedStructuredOutputs
from fleetlab.overlap.refusals import check_async_scheduling
from fleetlab.patching import patch_model
from fleetlab.patching.handle import PatchHandle
from fleetlab.prefix_cache import build_prefix_cache
from fleetlab.processors.penalties import PenaltiesProcessor
from fleetlab.spec_decode.config import check_speculative_config
from fleetlab.spec_decode.proposer import PROPOSERS, ProposerContext
from fleetlab.spec_decode.rejection import RejectionSampler
from fleetlab.structured_output.processor import StructuredOutputsProcessor


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
        if cfg.async_scheduling:
            check_async_scheduling(cfg)
        self.tokenizer = tokenizer
        self.spec_config = check_speculative_config(cfg.speculative_config) if cfg.speculative_config else None
        # This rank's TensorParallelState (every rank runs the scheduler), None on one device.
        self.tensor_parallel = (TensorParallelState.prepare(model, cfg.tensor_parallel_size)
                                if cfg.tensor_parallel_size > 1 else None)
        self.hooks = StepHooks()  # where observers see the steps
        self.observers = self.hooks.observers  # anything with on_step(scheduler_output, runner_output, outputs)
        # a committed step's outputs, held while an observer's error is raised
        self._undelivered: list[RequestOutput] = []
        # requests a stop string ended, still running in the scheduler until aborted there
        self._stopped: list[str] = []
        self._owns_handle = not isinstance(model, PatchHandle)
        self.handle = patch_model(model, backend=cfg.backend) if self._owns_handle else model
        # Closing happens once, on close() or when the LLM is garbage-collected (a notebook
        # cell re-run drops the old LLM): either way its share of the patch is released.
        self._closables: list = []  # the proposer, once built
        self._finalizer = weakref.finalize(self, _close_all, self.handle if self._owns_handle else None,
                                           self._closables)
        try:
            self._build(cfg, list(batch_fields), [PenaltiesProcessor(), *logits_processors])
        except Exception:
            self.close()  # a failed construction leaves the models as they were
            raise

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
        self.proposer = self._build_proposer(cfg, num_blocks, decode_threshold)
        lookahead = 0 if self.proposer is None else self.proposer.num_lookahead_tokens
        self.kv_connector = make_kv_connector(cfg.kv_transfer_config, self.kv_cache)  # the null one by default
        self._closables.append(self.kv_connector)
        self.scheduler = Scheduler(
            KVCacheManager(self.pool), max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
            enable_chunked_prefill=cfg.enable_chunked_prefill, policy=cfg.scheduling_policy,
            num_lookahead_tokens=lookahead, kv_connector=self.kv_connector)
        processors, batch = self._build_batch(cfg, k, batch_fields, processors)
        self.runner = self._build_runner(cfg, backend_cls, batch, processors, decode_threshold)
        self._build_edges(cfg, batch, processors, lookahead)

    def _build_runner(self, cfg, backend_cls, batch: InputBatch, processors: list, decode_threshold: int):
        """The model runner over ``batch``: its sampler, its reorder, the proposer (a rank's own wrapper with
        tensor parallelism)."""
        reorder = cfg.reorder
        if reorder is None:  # the backend decides
            reorder = backend_cls.requires_reorder
        if self.proposer is None:
            sampler = Sampler(processors)
        else:  # drafts to verify
            sampler = RejectionSampler(processors)
        runner = ModelRunner(self.handle, self.kv_cache, batch, reorder=reorder, decode_threshold=decode_threshold,
                             sampler=sampler, proposer=self.proposer, hooks=self.hooks, kv_connector=self.kv_connector)
        if self.tensor_parallel is not None:
            runner = self.tensor_parallel.wrap_runner(runner)
        return runner

    def _build_proposer(self, cfg, num_blocks: int, decode_threshold: int):
        """Speculative decoding's proposer, with what it needs to know of the engine (None: no speculation)."""
        if self.spec_config is None:
            return None
        ctx = ProposerContext(self.handle.backend, num_blocks, cfg.block_size, self.max_model_len,
                              self.handle.vocab_size, decode_threshold)
        proposer = PROPOSERS.make(self.spec_config.method, self.spec_config, ctx, **self.spec_config.options)
        self._closables.append(proposer)
        return proposer

    def _build_batch(self, cfg, k: int, batch_fields: list, processors: list) -> tuple[list, InputBatch]:
        """The sampler's processors and the persistent batch, with every processor's fields."""
        # Grammar masks come first, before any other processor changes the logits (built lazily:
        # an engine that never sees a constraint never loads the grammar library).
        self.structured_outputs = StructuredOutputsProcessor(
            self.tokenizer, self.handle.vocab_size, eos_token_id=self.handle.eos_token_id, num_speculative_tokens=k,
            compile_ahead=self.tensor_parallel is None)  # ranks must admit a request at the same step
        self._closables.append(self.structured_outputs)
        processors = [self.structured_outputs, *processors]
        fields = DEFAULT_FIELDS.copy()
        for field in batch_fields:
            fields.register(field, owner="LLM(batch_fields=...)")
        for processor in processors:
            for field in processor.fields:
                fields.register(field, owner=f"logits processor {type(processor).__name__}")
        if self.proposer is not None:
            for field in self.proposer.fields:
                fields.register(field, owner=f"proposer {type(self.proposer).__name__}")
        return processors, InputBatch(max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
                                      max_blocks_per_seq=-(-self.max_model_len // cfg.block_size), fields=fields)

    def _build_edges(self, cfg, batch: InputBatch, processors: list, lookahead: int) -> None:
        """The checks in front of the core, the core's step, the output side and the observers."""
        grammars = RefusedStructuredOutputs() if cfg.async_scheduling else self.structured_outputs
        self.processor = InputProcessor(self.tokenizer, self.handle, batch, self.pool, processors=processors,
                                        num_lookahead_tokens=lookahead, seed=cfg.seed, structured_outputs=grammars)
        if cfg.async_scheduling:  # the host plans step N+1 while the model runs step N
            self.core = OverlapEngineCore(self.scheduler, self.runner, self.hooks)
        else:
            self.core = EngineCore(self.scheduler, self.runner, self.hooks)
        if cfg.async_scheduling:
            self._closables.insert(0, self.core)  # its model thread stops before anything it reads is closed
        self.output_processor = OutputProcessor(self.tokenizer, self.handle.eos_token_id)
        self.spec_stats = SpecDecodingStats() if self.proposer else None
        self.recorder = StepRecorder(self) if cfg.record_traces else None
        for observer in (self.spec_stats, self.recorder):
            if observer is not None:
                self.hooks.attach(observer)

    def close(self) -> None:
        """Let go of the model's patch (and the draft model's): once every ``LLM`` on a model
        is closed (or garbage-collected), the model is exactly as before. Also what
        ``with LLM(...) as llm:`` does."""
        self._finalizer()

    def __repr__(self) -> str:
        """``print(llm)``: the model and backend, the pool, the batch's limits and the requests now."""
        handle, cfg = getattr(self, "handle", None), self.config
        model = type(getattr(handle, "model", None)).__name__ if handle is not None else "?"
        backend = type(handle.backend).__name__ if handle is not None else "?"
        pool = getattr(self, "pool", None)
        sched = getattr(self, "scheduler", None)
        now = f"; {len(sched.running)} running, {len(sched.waiting)} waiting" if sched is not None else ""
        return (f"LLM({model}, backend {backend}, {pool!r}, max_num_seqs={cfg.max_num_seqs}, "
                f"max_num_batched_tokens={cfg.max_num_batched_tokens}, max_model_len="
                f"{getattr(self, 'max_model_len', '?')}, async_scheduling={cfg.async_scheduling}{now})")

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
        live = ChainMap(self.scheduler.requests, self.output_processor.parents)  # the ids it may not take
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
        parent = ParentRequest(req.request_id, sp, live)
        return parent, [self.processor.child(req, child_sampling_params(sp, i), child_id)
                        for i, child_id in enumerate(parent.child_ids)]

    def _queue(self, parent: ParentRequest | None, reqs: list) -> None:
        self.handle.check_live()  # a stale LLM (its model closed or re-patched) queues nothing
        for req in reqs:
            self.output_processor.add(req, parent)
            self.scheduler.add_request(req)

    # ----- the loop -----
    def has_unfinished_requests(self) -> bool:
        """True while a request waits or runs, or a committed step's outputs wait for the next
        ``step`` (an observer raised)."""
        return self.scheduler.has_unfinished_requests() or bool(self._undelivered)

    def step(self) -> list[RequestOutput]:
        """One engine step: the core plans, runs and commits it (:meth:`EngineCore.step`), the output
        processor makes its outputs the user's. Returns a ``RequestOutput`` for every request that
        gained tokens or finished in it (``new_token_ids`` holds what it gained).

        If the step fails it is rolled back (the exception names the extension that raised) and the
        same requests carry on with the next call. If only an observer raised
        (:class:`~fleetlab.errors.ObserverError`), or the KV connector raised while the requests a stop
        string ended were aborted, the step stands: its outputs come with the next call (which
        aborts those requests first)."""
        self._abort_stopped()  # left over from a step whose abort raised: before they run again
        try:
            outputs, result = self.core.step()
        except ObserverError as exc:
            self._undelivered += self._deliver(exc.outputs, exc.runner_output)
            raise
        self._undelivered += self._deliver(outputs, result)
        self._abort_stopped()
        outputs, self._undelivered = self._undelivered, []
        return outputs

    def _deliver(self, outputs: list[RequestOutput], result) -> list[RequestOutput]:
        """The core's outputs made the user's (the output processor); the requests a stop string
        ended are noted, for :meth:`_abort_stopped`."""
        outputs, stopped = self.output_processor.process(outputs, result)
        self._stopped += stopped
        return outputs

    def _abort_stopped(self) -> None:
        """Abort in the scheduler the requests a stop string ended (their blocks are freed now). If
        the KV connector's ``request_finished`` raises, nothing is aborted and they stay noted."""
        if self._stopped:
            self.scheduler.abort(self._stopped)
            self._stopped = []

    def wait_until_runnable(self, timeout: float = 0.05) -> None:
        """Between steps: if every request waits on something (its grammar's compile, its K/V
        arriving, on a thread), or the last step ran nothing while some do (the others cannot be
        admitted: the pool is held by requests whose K/V is arriving), block on those futures up
        to ``timeout`` seconds rather than spin through empty steps (a loop over ``step`` calls
        this; the step itself never waits)."""
        reqs = self.scheduler.running + self.scheduler.waiting
        pending = [r.waiting_on for r in reqs if not r.is_ready]
        last = self.scheduler.planned
        ran = last is None or last.num_scheduled_tokens or last.preempted_req_ids or last.finished_req_ids
        if not pending or (ran and len(pending) < len(reqs)):
            return  # (a ready request that could not run last step, the pool full of arriving ones: wait too)
        concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def abort(self, request_ids) -> list[RequestOutput]:
        """Stop the named requests now (``str`` or an iterable of ids; a parallel-sampling
        request's id stops all its sequences); their blocks are freed at once. Returns their
        final outputs (``finish_reason="abort"``); ids that are unknown or already finished
        are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        parents = self.output_processor.parents
        ids = [cid for rid in ids for cid in (parents[rid].child_ids if rid in parents else [rid])]
        aborted = self.scheduler.abort(ids)
        return self.output_processor.process([RequestOutput.from_request(req, []) for req in aborted])[0]

    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm: bool = True,
                 extra=None):
        """Run every prompt to completion; returns ``RequestOutput`` s in input order (with
        ``n > 1``: the prompt's ``n`` sequences in ``index`` order, then the next prompt's).

        ``prompts``: a string or a list of strings (needs a tokenizer); or
        ``prompt_token_ids``: a list of token-id lists. ``sampling_params``: one
        ``SamplingParams`` for all, or one per prompt. Every request is validated before
        any runs, so a bad one raises ``ValueError`` and nothing is queued. If the loop is
        interrupted (an exception, Ctrl-C), this call's requests are aborted first. ``extra``:
        batch-field values as in ``add_request``, one dict for all prompts or one per prompt.
        """
        live = set(self.scheduler.requests) | set(self.output_processor.parents)
        queued = []
        for prompt, ids, sp, values in generate_items(prompts, prompt_token_ids, sampling_params, extra):
            req = self.processor.process(prompt, sp, ids, None, live, extra=values)
            parent, reqs = self._fan_out(req, live)
            live |= {req.request_id, *(r.request_id for r in reqs)}
            queued.append((req.request_id, req.sampling_params.n, parent, reqs))
        # A constraint the model cannot spell is refused here, before anything runs.
        for req in (r for *_, reqs in queued for r in reqs if "structured_output" in r.extra):
            req.extra["structured_output"].check(req.request_id, timeout=None)
        for _, _, parent, reqs in queued:
            self._queue(parent, reqs)
        done: dict[tuple[str, int], RequestOutput] = {}
        bar = tqdm(total=sum(n for _, n, _, _ in queued), disable=not use_tqdm, desc="requests", unit="req")
        try:
            while self.has_unfinished_requests():
                self.wait_until_runnable()
                for out in self.step():
                    if out.finished:
                        done[out.request_id, out.index] = out
                        out.new_token_ids, out.new_text = list(out.token_ids), out.text or ""
                        bar.update(1)
        except BaseException:
            ids = {rid for rid, _, _, _ in queued}
            self.abort(list(ids))
            self._undelivered = [o for o in self._undelivered if o.request_id not in ids]  # generate's own, gone
            raise
        finally:
            bar.close()
        return [done[rid, i] for rid, n, _, _ in queued for i in range(n)]

    # ----- looking inside -----
    @property
    def traces(self) -> list[StepTrace]:
        """A ``StepTrace`` of every step so far (``record_traces=True``; else empty)."""
        return self.recorder.traces if self.recorder is not None else []

    def block_tables(self) -> dict[str, list[int]]:
        """``{request id: block ids}`` of every running request (for drawing the pool)."""
        return {r.request_id: self.scheduler.kv.get_block_ids(r.request_id) for r in self.scheduler.running}

    def stats(self) -> dict:
        """Pool and cache figures (:func:`fleetlab.inspect.stats.engine_stats`: blocks, hit rate,
        preemptions, steps, requests running and waiting; drafts accepted with speculation)."""
        return engine_stats(self)


def _close_all(handle, closables) -> None:
    """What closing an LLM undoes: everything it built that holds something (the proposer and its
    draft model's patch, the KV connector, the grammar compiler), then its own patch of the model
    (kept apart from the LLM so a finalizer can run it)."""
    for closable in closables:
        closable.close()
    if handle is not None:
        handle.unpatch()
