"""``LLM``: the front door. Give it a model, get continuous batching.

    llm = fleetlab.LLM(model, tokenizer, block_size=16, max_num_batched_tokens=256)
    outs = llm.generate(["12+7=", "3+4="], fleetlab.SamplingParams(max_tokens=8))

Under the hood: the model is patched (``patch_model``), a paged KV cache and a block
pool are sized, and every ``step()`` is three moves: the scheduler plans
(``SchedulerOutput``), the model runner executes (``ModelRunnerOutput``), the scheduler
commits. A step applies entirely or not at all: if the runner raises, the scheduler rolls
the plan back and the runner is reset.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence

from fleetlab.attention.backend import get_attention_backend
from fleetlab.device import check_model_dtype_runs
from fleetlab.engine.checks import FieldTypeError, is_sequence
from fleetlab.engine.config import EngineConfig
from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.input_processor import InputProcessor
from fleetlab.engine.model_runner import ModelRunner
from fleetlab.engine.outputs import RequestOutput, StepTrace
from fleetlab.engine.request import Request
from fleetlab.engine.runner_output import ModelRunnerOutput
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.engine.scheduler import Scheduler
from fleetlab.engine.side_data import normalize_prompt_embeds
from fleetlab.engine.tracing import build_step_trace, rows_before
from fleetlab.kv.block_pool import BlockPool
from fleetlab.kv.manager import KVCacheManager
from fleetlab.kv.paged_cache import PagedKVCache
from fleetlab.patching.handle import PatchHandle
from fleetlab.spec_decode.config import SpeculativeConfig
from fleetlab.spec_decode.proposer import ProposerContext, get_proposer

logger = logging.getLogger(__name__)


class LLM:
    """Serve many requests on one model with continuous batching over a paged KV cache.

    Args:
      model: a PaddleFormers causal LM, a Fleet-style model, or an existing ``PatchHandle``.
      tokenizer: optional; anything with ``encode(text)`` and ``decode(ids)``.
      **config: fields of :class:`~fleetlab.EngineConfig` (``speculative_config={...}``
        turns speculative decoding on: see :class:`~fleetlab.spec_decode.config.SpeculativeConfig`).
    """

    def __init__(self, model, tokenizer=None, **config):
        self.config = cfg = EngineConfig.from_kwargs(**config)
        self.tokenizer = tokenizer
        self.spec_config = SpeculativeConfig.from_dict(cfg.speculative_config) if cfg.speculative_config else None
        self.tensor_parallel = None  # this rank's TensorParallelState; every rank runs the scheduler
        if cfg.tensor_parallel_size > 1:
            from fleetlab.distributed.engine import TensorParallelState

            self.tensor_parallel = TensorParallelState.prepare(model, cfg.tensor_parallel_size)
        self._owns_handle = not isinstance(model, PatchHandle)
        if not self._owns_handle:
            self.handle = model
        else:
            from fleetlab.patching import patch_model

            _check_backend_needs(get_attention_backend(cfg.backend), cfg)
            self.handle = patch_model(model, backend=cfg.backend)
        self.proposer = None
        # Closing happens once, on close() or when the LLM is garbage-collected (a notebook
        # cell re-run drops the old LLM): either way its share of the patch is released.
        self._closables: list = []  # the proposer, once built
        self._finalizer = weakref.finalize(self, _release, self.handle if self._owns_handle else None,
                                           self._closables)
        try:
            self._build(cfg)
        except Exception:
            self.close()  # a failed construction leaves the models as they were
            raise

    def _build(self, cfg: EngineConfig) -> None:
        check_model_dtype_runs(self.handle.dtype)
        backend_cls = type(self.handle.backend)
        _check_backend_needs(backend_cls, cfg)
        if self.tensor_parallel is not None:
            self.tensor_parallel.adapt_handle(self.handle)  # this rank's KV heads size the cache
        self.max_model_len = cfg.resolve_max_model_len(self.handle.max_model_len)
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"engine config: without chunked prefill, max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} must be >= max_model_len={self.max_model_len}")
        num_blocks = self._num_blocks()
        self.kv_cache = PagedKVCache.for_handle(self.handle, num_blocks, cfg.block_size)
        self.pool = BlockPool(num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        # A verify row carries k + 1 query tokens: still a decode for the reorder and the kernels.
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        decode_threshold = max(backend_cls.reorder_threshold, k + 1)
        if self.spec_config:
            context = ProposerContext(self.handle.backend, num_blocks, cfg.block_size, self.max_model_len,
                                      self.handle.vocab_size, decode_threshold)
            self.proposer = get_proposer(self.spec_config.method)(self.spec_config, context)
            self._closables.append(self.proposer)
        lookahead = self.proposer.num_lookahead_tokens if self.proposer else 0
        self.scheduler = Scheduler(
            KVCacheManager(self.pool), max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
            enable_chunked_prefill=cfg.enable_chunked_prefill, policy=cfg.scheduling_policy,
            num_lookahead_tokens=lookahead)
        reorder = backend_cls.requires_reorder if cfg.reorder is None else cfg.reorder
        batch = InputBatch(max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
                           max_blocks_per_seq=-(-self.max_model_len // cfg.block_size))
        self.runner = ModelRunner(self.handle, self.kv_cache, batch, reorder=reorder,
                                  decode_threshold=decode_threshold, proposer=self.proposer)
        if self.tensor_parallel is not None:
            self.runner = self.tensor_parallel.wrap_runner(self.runner)
        self.processor = InputProcessor(
            self.tokenizer, vocab_size=self.handle.vocab_size, max_model_len=self.max_model_len,
            eos_token_id=self.handle.eos_token_id, block_size=cfg.block_size, num_blocks=num_blocks,
            max_stop_ids=batch.sizes["max_stop_ids"], num_lookahead_tokens=lookahead, seed=cfg.seed)
        self.traces: list[StepTrace] = []
        self._num_generated = 0

    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_memory_bytes is not None:
            h = self.handle
            return PagedKVCache.num_blocks_for_budget(cfg.kv_cache_memory_bytes, h.num_layers, h.num_kv_heads,
                                                      h.head_dim, cfg.block_size, h.dtype or "float32")
        return cfg.max_num_seqs * -(-self.max_model_len // cfg.block_size)

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
                    priority: int = 0, prompt_embeds=None) -> str:
        """Queue one request; returns its id. Raises ``ValueError`` naming the request and
        the bad field before anything is queued.

        ``prompt_embeds``: side data such as image features, ``{prompt position: vector
        [hidden_size]}`` (or ``[num_prompt_tokens, hidden_size]``) used instead of those
        tokens' own embeddings (see :mod:`fleetlab.engine.side_data`).
        """
        req = self.processor.process(prompt, sampling_params, prompt_token_ids, request_id, priority,
                                     self.scheduler.requests)
        if prompt_embeds is not None:
            req.prompt_embeds = normalize_prompt_embeds(req.request_id, prompt_embeds, req.num_prompt_tokens,
                                                        self.handle.hidden_size)
        self.scheduler.add_request(req)
        return req.request_id

    # ----- the loop -----
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, trace: bool = False, stream: bool = False):
        """Run one engine step. Returns the outputs of requests that finished in it (with
        ``stream=True``: of every request that gained tokens or finished, each carrying the
        step's ``new_token_ids``), or ``(outputs, StepTrace)`` with ``trace=True``."""
        tracing = trace or self.config.record_traces
        self.handle.check_live()  # before planning: a stale LLM must not touch its queues
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        before = rows_before(sched, self.scheduler) if tracing else {}
        reqs = {rid: self.scheduler.requests[rid] for rid in sched.num_scheduled_tokens}
        num_out_before = {rid: len(r.output_token_ids) for rid, r in reqs.items()}
        result = self._execute(sched)
        t2 = time.perf_counter()
        finished = self.scheduler.update(sched, result, t2)
        t3 = time.perf_counter()
        kept = {rid: r.output_token_ids[num_out_before[rid]:] for rid, r in reqs.items()
                if len(r.output_token_ids) > num_out_before[rid]}
        self._num_generated += sum(len(t) for t in kept.values())
        if stream:
            outputs = [self._output(r, num_out_before[rid]) for rid, r in reqs.items()
                       if rid in kept or r.is_finished]
        else:
            outputs = [self._output(r) for r in finished]
        record = None
        if tracing:
            record = build_step_trace(sched, result, before, kept, [r.request_id for r in finished],
                                      self.pool.num_free_blocks, self.pool.num_blocks,
                                      {"schedule": t1 - t0, "update": t3 - t2, **result.timings})
            if self.config.record_traces:
                self.traces.append(record)
        return (outputs, record) if trace else outputs

    def _execute(self, sched) -> ModelRunnerOutput:
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

    def abort(self, request_ids) -> list[RequestOutput]:
        """Stop the named requests now (``str`` or an iterable of ids); their blocks are freed
        at once. Returns their final outputs (``finish_reason="abort"``); ids that are
        unknown or already finished are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = self.scheduler.abort(ids)
        now = time.perf_counter()
        for req in aborted:
            req.finish_time = now
        return [self._output(r) for r in aborted]

    def _output(self, req: Request, num_reported: int = 0) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                   "finish_time": req.finish_time, "num_preemptions": req.num_preemptions,
                   "token_times": list(req.token_times)}
        return RequestOutput(req.request_id, list(req.prompt_token_ids), list(req.output_token_ids), text,
                             req.finish_reason, req.error, metrics, list(req.output_token_ids[num_reported:]))

    def generate(self, prompts=None, sampling_params=None, prompt_token_ids=None, use_tqdm: bool = True):
        """Run every prompt to completion; returns ``RequestOutput`` s in input order.

        ``prompts``: a string or a list of strings (needs a tokenizer); or
        ``prompt_token_ids``: a list of token-id lists. ``sampling_params``: one
        ``SamplingParams`` for all, or one per prompt. Every request is validated before
        any runs, so a bad one raises ``ValueError`` and nothing is queued. If the loop is
        interrupted (an exception, Ctrl-C), this call's requests are aborted first.
        """
        items = self._pair(prompts, prompt_token_ids, sampling_params)
        live = dict(self.scheduler.requests)
        reqs = []
        for p, ids, sp in items:
            reqs.append(self.processor.process(p, sp, ids, None, 0, live))
            live[reqs[-1].request_id] = reqs[-1]
        for req in reqs:
            self.scheduler.add_request(req)
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(reqs), use_tqdm)
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    done[out.request_id] = out
                    bar.update(1)
        except BaseException:
            self.abort([r.request_id for r in reqs])
            raise
        finally:
            bar.close()
        return [done[r.request_id] if r.request_id in done else self._output(r) for r in reqs]

    @staticmethod
    def _pair(prompts, prompt_token_ids, sampling_params):
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("generate: give exactly one of prompts and prompt_token_ids")
        if prompts is not None:
            if not isinstance(prompts, str) and not is_sequence(prompts):
                raise FieldTypeError(f"generate: prompts={prompts!r:.60} must be a str or a list of str, "
                                     f"not {type(prompts).__name__}")
            items = [(p, None) for p in ([prompts] if isinstance(prompts, str) else list(prompts))]
        else:
            seqs = prompt_token_ids
            if not is_sequence(seqs):
                raise FieldTypeError(f"generate: prompt_token_ids={seqs!r:.60} must be a list of token-id lists "
                                     f"(or one list of token ids), not {type(seqs).__name__}")
            # One flat prompt ([5, 17, 3]) or a list of prompts: a first entry that is not itself a
            # sequence means one prompt (the InputProcessor refuses floats, strings, bools in it).
            if len(seqs) and not is_sequence(seqs[0]):
                seqs = [seqs]
            items = [(None, s) for s in seqs]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(items):
                raise ValueError(f"generate: {len(sampling_params)} sampling_params for {len(items)} prompts")
            sps = list(sampling_params)
        else:
            sps = [sampling_params] * len(items)
        return [(p, ids, sp) for (p, ids), sp in zip(items, sps)]

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
        the drafts verified and accepted (accepted means the target agreed, as vLLM counts it;
        a draft accepted after a stop token is counted, though the request keeps nothing past
        the stop)."""
        s = self.pool.stats()
        used = s.num_blocks - s.num_free_blocks
        tokens_held = sum(r.num_computed_tokens for r in self.scheduler.running)
        stats = {
            "num_blocks": s.num_blocks,
            "num_free_blocks": s.num_free_blocks,
            "prefix_cache_hit_rate": s.hit_rate,
            "prefix_cache_queries": s.queries,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_utilization": used / s.num_blocks,
            "kv_token_fill": tokens_held / max(1, used * self.pool.block_size),
            "num_generated_tokens": self._num_generated,
            "num_steps": self.scheduler.step_count,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
        }
        if self.spec_config:
            spec = self.scheduler.spec_stats
            stats.update(num_draft_tokens=spec.num_draft_tokens, num_accepted_tokens=spec.num_accepted_tokens,
                         spec_acceptance_rate=spec.acceptance_rate,
                         spec_mean_acceptance_length=(spec.num_accepted_tokens + spec.num_drafts)
                         / max(1, spec.num_drafts),
                         spec_acceptance_by_position=[a / d for a, d in zip(spec.accepted_per_position,
                                                                            spec.drafted_per_position)])
        return stats


def _release(handle, proposers) -> None:
    """What closing an LLM undoes (kept apart from the LLM so a finalizer can run it)."""
    for proposer in proposers:
        proposer.close()
    if handle is not None:
        handle.unpatch()


def _check_backend_needs(backend_cls, cfg: EngineConfig) -> None:
    """Refuse, before any work, a backend whose declared needs this engine config cannot meet."""
    if backend_cls.requires_reorder and cfg.reorder is False:
        raise ValueError(f"engine config: reorder=False, but attention backend {backend_cls.name!r} "
                         "requires decode-first rows (requires_reorder=True)")
    if backend_cls.reorder_threshold > cfg.max_num_batched_tokens:
        raise ValueError(f"attention backend {backend_cls.name!r}: reorder_threshold="
                         f"{backend_cls.reorder_threshold} exceeds max_num_batched_tokens={cfg.max_num_batched_tokens}")


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc="requests", unit="req")
