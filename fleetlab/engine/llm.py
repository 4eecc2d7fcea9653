"""``LLM``: the front door. Give it a model, get continuous batching.

    llm = fleetlab.LLM(model, tokenizer, block_size=16, max_num_batched_tokens=256)
    outs = llm.generate(["12+7=", "3+4="], fleetlab.SamplingParams(max_tokens=8))

Under the hood: the model is patched (``patch_model``), a paged KV cache and a block
pool are sized, and every ``step()`` runs scheduler -> InputBatch -> metadata ->
patched forward -> sampler -> scheduler update.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import numpy as np

from fleetlab.attention.backend import get_attention_backend
from fleetlab.block_pool import BlockPool
from fleetlab.engine.config import EngineConfig
from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.kv_manager import KVCacheManager
from fleetlab.engine.model_runner import ModelRunner
from fleetlab.engine.outputs import RequestOutput, RowTrace, StepTrace
from fleetlab.engine.request import Request
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.engine.scheduler import Scheduler
from fleetlab.kv_cache import PagedKVCache
from fleetlab.patching.handle import PatchHandle

logger = logging.getLogger(__name__)


class LLM:
    """Serve many requests on one model with continuous batching over a paged KV cache.

    Args:
      model: a PaddleFormers causal LM, a Fleet-style model, or an existing ``PatchHandle``.
      tokenizer: optional; anything with ``encode(text)`` and ``decode(ids)``.
      **config: fields of :class:`~fleetlab.EngineConfig`.
    """

    def __init__(self, model, tokenizer=None, **config):
        self.config = cfg = EngineConfig.from_kwargs(**config)
        self.tokenizer = tokenizer
        self.tensor_parallel = None  # this rank's TensorParallelState; every rank runs the scheduler
        if cfg.tensor_parallel_size > 1:
            from fleetlab.distributed.engine import TensorParallelState

            self.tensor_parallel = TensorParallelState.prepare(model, cfg.tensor_parallel_size)
        if isinstance(model, PatchHandle):
            self.handle = model
        else:
            from fleetlab.patching import patch_model

            _check_backend_needs(get_attention_backend(cfg.backend), cfg)
            self.handle = patch_model(model, backend=cfg.backend)
        try:
            self._build(cfg)
        except Exception:
            if self.handle is not model:  # a failed construction leaves the model as it was
                self.handle.unpatch()
            raise

    def _build(self, cfg: EngineConfig) -> None:
        backend_cls = type(self.handle.backend)
        _check_backend_needs(backend_cls, cfg)
        if self.tensor_parallel is not None:
            self.tensor_parallel.adapt_handle(self.handle)  # this rank's KV heads size the cache
        self.max_model_len = min(cfg.max_model_len or self.handle.max_model_len, self.handle.max_model_len)
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"engine config: without chunked prefill, max_num_batched_tokens="
                f"{cfg.max_num_batched_tokens} must be >= max_model_len={self.max_model_len}")
        num_blocks = self._num_blocks()
        self.kv_cache = PagedKVCache.for_handle(self.handle, num_blocks, cfg.block_size)
        self.pool = BlockPool(num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            KVCacheManager(self.pool), max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.enable_prefix_caching, policy=cfg.scheduling_policy)
        reorder = backend_cls.requires_reorder if cfg.reorder is None else cfg.reorder
        batch = InputBatch(max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
                           max_blocks_per_seq=-(-self.max_model_len // cfg.block_size))
        self.runner = ModelRunner(self.handle, self.kv_cache, batch, reorder=reorder,
                                  decode_threshold=backend_cls.reorder_threshold)
        if self.tensor_parallel is not None:
            self.runner = self.tensor_parallel.wrap_runner(self.runner)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._rng = np.random.default_rng(cfg.seed)
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

    # ----- requests in -----
    def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: Sequence[int] | None = None, request_id: str | None = None,
                    priority: int = 0) -> str:
        """Queue one request; returns its id. Raises ``ValueError`` naming the request and
        the bad field before anything is queued."""
        req = self._make_request(prompt, sampling_params, prompt_token_ids, request_id, priority)
        self._requests[req.request_id] = req
        self.scheduler.add_request(req)
        return req.request_id

    def _make_request(self, prompt, sampling_params, prompt_token_ids, request_id, priority) -> Request:
        rid = str(next(self._ids)) if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"request {rid!r}: request_id is already in use")
        ids = self._tokenize(rid, prompt, prompt_token_ids)
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"request {rid!r}: sampling_params must be a fleetlab.SamplingParams")
        sp.validate(rid)
        self._check_stop_ids(rid, sp)
        self._check_fits(rid, ids, sp)
        seed = sp.seed if sp.seed is not None else int(self._rng.integers(2**62))
        return Request(rid, ids, sp, seed=seed, arrival_order=next(self._arrivals),
                       eos_token_id=self.handle.eos_token_id, priority=priority)

    def _tokenize(self, rid, prompt, prompt_token_ids) -> list[int]:
        if (prompt is None) == (prompt_token_ids is None):
            raise ValueError(f"request {rid!r}: give exactly one of prompt and prompt_token_ids")
        if prompt is not None:
            if self.tokenizer is None:
                raise ValueError(f"request {rid!r}: prompt is text but the LLM has no tokenizer")
            ids = self.tokenizer.encode(prompt)
            ids = ids["input_ids"] if isinstance(ids, dict) else ids
        else:
            ids = prompt_token_ids
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        if not ids:
            raise ValueError(f"request {rid!r}: prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.handle.vocab_size]
        if bad:
            raise ValueError(f"request {rid!r}: prompt_token_ids {bad[:5]} outside the vocabulary "
                             f"[0, {self.handle.vocab_size})")
        return ids

    def _check_stop_ids(self, rid, sp) -> None:
        """Refuse now what would otherwise fail mid-step: the InputBatch row and the sampler's ban."""
        cap = self.runner.batch.sizes["max_stop_ids"]
        if len(sp.stop_token_ids) > cap:
            raise ValueError(f"request {rid!r}: sampling field stop_token_ids holds {len(sp.stop_token_ids)} "
                             f"ids; the engine keeps at most {cap}")
        bad = [t for t in sp.stop_token_ids if t >= self.handle.vocab_size]
        if bad:
            raise ValueError(f"request {rid!r}: sampling field stop_token_ids {bad[:5]} outside the "
                             f"vocabulary [0, {self.handle.vocab_size})")

    def _check_fits(self, rid, ids, sp) -> None:
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {rid!r}: prompt has {len(ids)} tokens; max_model_len="
                             f"{self.max_model_len} leaves no room to generate")
        need = -(-min(len(ids) + sp.max_tokens, self.max_model_len) // self.pool.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"request {rid!r}: needs {need} KV blocks but the pool has only "
                             f"{self.pool.num_blocks} (num_blocks is too small for even this one request)")

    # ----- the loop -----
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, trace: bool = False, stream: bool = False):
        """Run one engine step. Returns the outputs of requests that finished in it (with
        ``stream=True``: of every request that gained tokens or finished, each carrying the
        step's ``new_token_ids``), or ``(outputs, StepTrace)`` with ``trace=True``."""
        tracing = trace or self.config.record_traces
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        rows_before = {r.request_id: (r.num_computed_tokens, r.num_tokens, list(r.block_ids))
                       for r in sched.scheduled} if tracing else {}  # copied only when a trace needs them
        num_out_before = {r.request_id: len(r.output_token_ids) for r in sched.scheduled}
        ran = self.runner.execute(sched) if sched.scheduled else None
        t2 = time.perf_counter()
        finished = self.scheduler.update(sched, ran.sampled if ran else {}, ran.errors if ran else {}, t2)
        t3 = time.perf_counter()
        self._num_generated += len(ran.sampled) if ran else 0
        for req in finished:
            self._requests.pop(req.request_id, None)
        if stream:
            changed = [r for r in sched.scheduled
                       if r.is_finished or len(r.output_token_ids) > num_out_before[r.request_id]]
            outputs = [self._output(r, num_out_before[r.request_id]) for r in changed]
        else:
            outputs = [self._output(r) for r in finished]
        record = None
        if tracing:
            record = self._trace(sched, ran, finished, rows_before, {"schedule": t1 - t0, "update": t3 - t2})
            if self.config.record_traces:
                self.traces.append(record)
        return (outputs, record) if trace else outputs

    def abort(self, request_ids) -> list[RequestOutput]:
        """Stop the named requests now (``str`` or an iterable of ids); their blocks are freed
        at once. Returns their final outputs (``finish_reason="abort"``); ids that are
        unknown or already finished are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = self.scheduler.abort(ids)
        now = time.perf_counter()
        for req in aborted:
            req.finish_time = now
            self._requests.pop(req.request_id, None)
        return [self._output(r) for r in aborted]

    def _trace(self, sched, ran, finished, rows_before, timings) -> StepTrace:
        rows = []
        order = ran.order_after if ran else []
        by_id = {r.request_id: r for r in sched.scheduled}
        for rid in order:
            n = sched.num_scheduled_tokens[rid]
            computed, num_tokens, blocks = rows_before[rid]
            # A decode runs the last sampled token; anything else fills the cache with the prompt
            # (even a single token after a prefix-cache hit) or recomputes after a preemption.
            decode = computed == num_tokens - 1 and computed >= by_id[rid].num_prompt_tokens
            phase = "decode" if decode else "prefill"
            rows.append(RowTrace(rid, phase, n, computed, by_id[rid].num_prompt_tokens, blocks))
        return StepTrace(
            step=sched.step, rows=rows, order_before=ran.order_before if ran else [], order_after=order,
            num_decodes=ran.num_decodes if ran else 0, reordered=bool(ran and ran.reordered),
            tokens=dict(ran.sampled) if ran else {}, preempted=[r.request_id for r in sched.preempted],
            finished=[r.request_id for r in finished], num_free_blocks=self.pool.num_free_blocks,
            num_blocks=self.pool.num_blocks, num_batched_tokens=sched.total_num_scheduled_tokens,
            timings={**timings, **(ran.timings if ran else {})})

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
        any runs, so a bad one raises ``ValueError`` and nothing is queued.
        """
        items = self._pair(prompts, prompt_token_ids, sampling_params)
        reqs = [self._make_request(p, sp, ids, None, 0) for p, ids, sp in items]
        for req in reqs:
            self._requests[req.request_id] = req
            self.scheduler.add_request(req)
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(reqs), use_tqdm)
        while self.has_unfinished_requests():
            for out in self.step():
                done[out.request_id] = out
                bar.update(1)
        bar.close()
        return [done[r.request_id] if r.request_id in done else self._output(r) for r in reqs]

    @staticmethod
    def _pair(prompts, prompt_token_ids, sampling_params):
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("generate: give exactly one of prompts and prompt_token_ids")
        if prompts is not None:
            items = [(p, None) for p in ([prompts] if isinstance(prompts, str) else list(prompts))]
        else:
            seqs = list(prompt_token_ids)
            if seqs and isinstance(seqs[0], (int, np.integer)):
                seqs = [seqs]
            items = [(None, s) for s in seqs]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(items):
                raise ValueError(f"generate: {len(sampling_params)} sampling_params for {len(items)} prompts")
            sps = list(sampling_params)
        else:
            sps = [sampling_params] * len(items)
        return [(p, ids, sp) for (p, ids), sp in zip(items, sps)]

    def stats(self) -> dict:
        """Pool and cache figures: blocks, free blocks, hit rate, preemptions, utilization,
        steps, generated tokens, and the requests running and waiting now."""
        s = self.pool.stats()
        used = s.num_blocks - s.num_free_blocks
        tokens_held = sum(r.num_computed_tokens for r in self.scheduler.running)
        return {
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
