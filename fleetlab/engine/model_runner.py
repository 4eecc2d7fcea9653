"""``ModelRunner``: one step of the patched model over the persistent InputBatch.

It keeps the InputBatch equal to the step's scheduled set, condenses it, reorders it
decode-first when the attention backend asks, builds the attention metadata, runs the
model on the packed tokens under ``forward_context``, computes logits only at each
row's last scheduled token, and samples. Results leave keyed by request id, so the
row order never leaks out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import paddle

from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.context import forward_context
from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.request import Request
from fleetlab.engine.sampler import Sampler, SamplingTensors
from fleetlab.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class RunnerOutput:
    """What one step produced, keyed by request id.

    sampled: request id -> new token (rows whose chunk reached their last known token).
    errors: request id -> message (e.g. non-finite logits); those requests stop.
    order_before / order_after: request ids by row before and after the reorder.
    """

    sampled: dict[str, int]
    errors: dict[str, str]
    order_before: list[str]
    order_after: list[str]
    num_decodes: int
    reordered: bool
    timings: dict[str, float] = field(default_factory=dict)


class ModelRunner:
    """Runs scheduled steps of a patched model (a ``PatchHandle``) on a paged KV cache."""

    def __init__(self, handle, kv_cache, input_batch: InputBatch, *, reorder: bool, decode_threshold: int = 1):
        self.handle = handle
        self.kv_cache = kv_cache
        self.batch = input_batch
        self.reorder = reorder
        self.decode_threshold = decode_threshold
        self.block_size = kv_cache.block_size
        self.sampler = Sampler()

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run the step ``out`` plans (at least one request): batch update, forward, sampling."""
        t0 = time.perf_counter()
        order_before, order_after, num_decodes = self._update_batch(out)
        t1 = time.perf_counter()
        md, input_ids, logits_rows = self._prepare_inputs()
        t2 = time.perf_counter()
        with paddle.no_grad(), forward_context(md, self.kv_cache):
            logits = self.handle.compute_logits(input_ids, md.positions.reshape([1, -1]), logits_rows)
        if logits.dtype != paddle.float32:
            logits = logits.astype("float32")
        t3 = time.perf_counter()
        sampled, errors = self._sample(logits)
        t4 = time.perf_counter()
        timings = {"batch_update": t1 - t0, "metadata": t2 - t1, "forward": t3 - t2, "sample": t4 - t3}
        return RunnerOutput(sampled, errors, order_before, order_after, num_decodes, self.reorder, timings)

    def _update_batch(self, out: SchedulerOutput):
        b = self.batch
        scheduled = out.num_scheduled_tokens
        for req_id in [r for r in b.req_ids if r is not None and r not in scheduled]:
            b.remove_request(req_id)  # finished, preempted or simply not scheduled this step
        for req in out.scheduled:
            row = b.req_id_to_row.get(req.request_id)
            if row is None:
                self._add(req)
            else:
                held = int(b.num_blocks[row])
                if len(req.block_ids) > held:
                    b.append_block_ids(row, req.block_ids[held:])
        b.condense()
        b.set_num_scheduled(scheduled)
        order_before = list(b.req_ids[: b.num_reqs])
        num_decodes = 0
        if self.reorder:
            _, num_decodes = b.reorder_split_prefill_and_decode(self.decode_threshold)
        b.sync_to_device()  # one copy per device field, after every row has moved
        return order_before, list(b.req_ids[: b.num_reqs]), num_decodes

    def _add(self, req: Request) -> None:
        sp = req.sampling_params
        self.batch.add_request(
            req.request_id, req.prompt_token_ids, output_token_ids=req.output_token_ids,
            num_computed_tokens=req.num_computed_tokens, block_ids=req.block_ids,
            sampling=_RowSampling(sp.temperature, sp.top_k, sp.top_p, req.seed, sp.max_tokens,
                                  sp.min_tokens, sp.ignore_eos, tuple(sp.stop_token_ids)),
            eos_token_id=req.eos_token_id)

    def _prepare_inputs(self):
        """Metadata, packed input ids ``[1, T]`` and the row index of each row's last token."""
        b, n = self.batch, self.batch.num_reqs
        q = b.num_scheduled_tokens[:n].astype(np.int64)
        c = b.num_computed_tokens[:n].astype(np.int64)
        max_blocks = max(1, int(b.num_blocks[:n].max()))
        md = AttentionMetadata.build(q, c, b.block_table[:n, :max_blocks], self.block_size,
                                     self.decode_threshold,
                                     block_tables_device=b.dev("block_table")[:, :max_blocks])
        row_of_token = np.repeat(np.arange(n), q)
        pos = c[row_of_token] + np.arange(md.num_tokens) - md.cu_seqlens_q_host[:-1][row_of_token]
        input_ids = paddle.to_tensor(b.token_ids[row_of_token, pos].reshape(1, -1), dtype="int64")
        logits_rows = paddle.to_tensor(md.cu_seqlens_q_host[1:].astype(np.int64) - 1)
        return md, input_ids, logits_rows

    def _sample(self, logits: paddle.Tensor):
        b, n = self.batch, self.batch.num_reqs
        q = b.num_scheduled_tokens[:n]
        b.num_computed_tokens[:n] += q
        done = b.num_computed_tokens[:n] == b.num_tokens[:n]  # chunk reached the last known token
        finite = paddle.isfinite(logits).all(axis=-1).numpy()
        if not finite.all():  # rare: zero the bad rows so the sampler stays well defined
            logits = paddle.where(paddle.isfinite(logits), logits, paddle.zeros_like(logits))
        tokens = self.sampler(logits, self._sampling_tensors(n))
        sampled, errors = {}, {}
        req_ids = b.req_ids  # a fresh list per access: read it once, not once per row
        for row in np.flatnonzero(done).tolist():
            req_id = req_ids[row]
            if not finite[row]:
                errors[req_id] = "the model produced non-finite logits"
                continue
            token = int(tokens[row])
            sampled[req_id] = token
            b.append_token(row, token)
        return sampled, errors

    def _sampling_tensors(self, n: int) -> SamplingTensors:
        b = self.batch
        n_out = b.num_tokens[:n] - b.num_prompt_tokens[:n]
        banned = [[] for _ in range(n)]
        # Only rows short of min_tokens ban anything; find them in one vector op, not a row loop.
        for row in np.flatnonzero(n_out < b.min_tokens[:n]).tolist():
            ids = [int(t) for t in b.stop_token_ids[row] if t >= 0]
            if not b.ignore_eos[row] and b.eos_token_id[row] >= 0:
                ids.append(int(b.eos_token_id[row]))
            banned[row] = ids
        return SamplingTensors(
            greedy=b.temperature[:n] == 0, temperature=b.dev("temperature"), top_k=b.dev("top_k"),
            top_p=b.dev("top_p"), seeds=b.seed[:n], draw_index=n_out, banned=banned)


@dataclass(slots=True)
class _RowSampling:
    """The per-row sampling fields the InputBatch stores (seed resolved by the engine)."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: tuple
