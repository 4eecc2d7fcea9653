"""``ModelRunner``: one step of the patched model over the persistent InputBatch.

It rebuilds its InputBatch from the step's :class:`SchedulerOutput` alone (new requests
in full, the rest as diffs), condenses it, reorders it decode-first when the attention
backend asks (a proposer's batch follows row for row), builds the attention metadata,
runs the model on the packed tokens under ``forward_context``, computes logits only at the
positions it scores (each row's last token; a verify row's last ``k + 1`` tokens), samples
and verifies drafts, and lets the proposer draft the next ones. Results leave keyed by
request id in a :class:`ModelRunnerOutput`, so the row order never leaks out.

The runner never advances a request's progress: the next message tells it what the
scheduler committed. If anything in a step raises, the engine calls :meth:`reset` and the
scheduler resends every request in full, so no half-applied step survives.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import paddle

from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.context import forward_context
from fleetlab.device import upload
from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.runner_output import ModelRunnerOutput
from fleetlab.engine.sampler import Sampler, SamplingTensors
from fleetlab.engine.scheduler_output import SchedulerOutput
from fleetlab.engine.side_data import chunk_embeds
from fleetlab.spec_decode.proposer import ProposeInput, Proposer


@dataclass(slots=True)
class StepInputs:
    """The packed step: attention metadata, input ids ``[1, T]``, and the scored positions.

    logits_indices: int64 ``[P]`` packed token index of each scored position;
    pos_row: ``[P]`` its batch row; pos_offset: ``[P]`` its index among its row's scored
    positions (0 = the last known token, ``i`` = after ``i`` drafts);
    embeds: None, or ``(packed token indices [m], vectors [m, hidden])`` replacing those
    tokens' embeddings (side data of the rows' requests).
    """

    metadata: AttentionMetadata
    input_ids: paddle.Tensor
    logits_indices: np.ndarray
    pos_row: np.ndarray
    pos_offset: np.ndarray
    embeds: tuple | None = None


class ModelRunner:
    """Runs scheduled steps of a patched model (a ``PatchHandle``) on a paged KV cache.

    Args:
      handle, kv_cache, input_batch: the patched model, its cache, the persistent batch.
      reorder: put decode rows first each step (the backend's ``requires_reorder``).
      decode_threshold: the most query tokens a decode row carries (1, or ``k + 1`` when
        verifying ``k`` drafts).
      proposer: a speculative-decoding :class:`~fleetlab.spec_decode.proposer.Proposer`, or None.
    """

    def __init__(self, handle, kv_cache, input_batch: InputBatch, *, reorder: bool, decode_threshold: int = 1,
                 proposer: Proposer | None = None):
        self.handle = handle
        self.kv_cache = kv_cache
        self.batch = input_batch
        self.reorder = reorder
        self.decode_threshold = decode_threshold
        self.block_size = kv_cache.block_size
        self.sampler = Sampler()
        self.proposer = proposer
        if proposer is not None:
            proposer.bind(input_batch)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step ``so`` plans (at least one request)."""
        t0 = time.perf_counter()
        out = ModelRunnerOutput(reordered=self.reorder)
        out.order_before, out.order_after, out.num_decodes = self._update_batch(so)
        t1 = time.perf_counter()
        inputs = self._prepare_inputs()
        t2 = time.perf_counter()
        logits = self._forward(inputs)
        t3 = time.perf_counter()
        num_computed_after = self._sample(logits, inputs, out)
        t4 = time.perf_counter()
        if self.proposer is not None and out.sampled_token_ids:
            out.spec_token_ids = self.proposer.propose(self.batch, self._propose_input(out, num_computed_after))
        t5 = time.perf_counter()
        out.timings = {"batch_update": t1 - t0, "metadata": t2 - t1, "forward": t3 - t2, "sample": t4 - t3,
                       "propose": t5 - t4}
        return out

    def reset(self) -> None:
        """Drop every row (and the proposer's state): the scheduler will resend them in full."""
        for req_id in [r for r in self.batch.req_ids if r is not None]:
            self.batch.remove_request(req_id)
        self.batch.condense()
        if self.proposer is not None:
            self.proposer.reset()

    # ------------------------------------------------------------------ batch update
    def _update_batch(self, so: SchedulerOutput):
        b = self.batch
        scheduled = so.num_scheduled_tokens
        resent = {new.req_id for new in so.scheduled_new_reqs}
        # Drop rows of requests that finished, were preempted or simply not scheduled this step,
        # and stale rows of requests sent in full (a finished request's id reused at once).
        for req_id in [r for r in b.req_ids if r is not None and (r not in scheduled or r in resent)]:
            b.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            extra = {"prompt_embeds": new.prompt_embeds} if new.prompt_embeds else None
            b.add_request(new.req_id, new.prompt_token_ids, output_token_ids=new.output_token_ids,
                          num_computed_tokens=new.num_computed_tokens, block_ids=new.block_ids,
                          sampling=new.sampling, eos_token_id=new.sampling.eos_token_id, extra=extra)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            b.update_request(req_id, cached.new_token_ids[i], cached.new_block_ids[i], cached.num_computed_tokens[i],
                             cached.num_blocks[i])
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            b.set_spec_tokens(req_id, drafts)
        b.condense()
        b.set_num_scheduled(scheduled)
        order_before = list(b.req_ids[: b.num_reqs])
        num_decodes = 0
        if self.reorder:
            _, num_decodes = b.reorder_split_prefill_and_decode(self.decode_threshold)
        b.sync_to_device()  # one copy per device field, after every row has moved
        return order_before, list(b.req_ids[: b.num_reqs]), num_decodes

    # ------------------------------------------------------------------ inputs and forward
    def _prepare_inputs(self) -> StepInputs:
        b, n = self.batch, self.batch.num_reqs
        q = b.num_scheduled_tokens[:n].astype(np.int64)
        c = b.num_computed_tokens[:n].astype(np.int64)
        max_blocks = max(1, int(b.num_blocks[:n].max()))
        md = AttentionMetadata.build(q, c, b.block_table[:n, :max_blocks], self.block_size, self.decode_threshold,
                                     block_tables_device=b.dev("block_table")[:, :max_blocks])
        row_of_token = np.repeat(np.arange(n), q)
        pos = c[row_of_token] + np.arange(md.num_tokens) - md.cu_seqlens_q_host[:-1][row_of_token]
        input_ids = upload(b.token_ids[row_of_token, pos].reshape(1, -1), np.int64)
        # A row scores its last known token and each draft after it, once its chunk gets there.
        num_scored = np.where(c + q >= b.num_tokens[:n], b.num_spec_tokens[:n] + 1, 0).astype(np.int64)
        pos_row = np.repeat(np.arange(n), num_scored)
        starts = np.concatenate([[0], np.cumsum(num_scored)[:-1]])
        pos_offset = np.arange(len(pos_row)) - starts[pos_row]
        logits_indices = md.cu_seqlens_q_host[1:][pos_row] - num_scored[pos_row] + pos_offset
        return StepInputs(md, input_ids, logits_indices.astype(np.int64), pos_row, pos_offset,
                          self._step_embeds(md, q, c))

    def _step_embeds(self, md: AttentionMetadata, q: np.ndarray, c: np.ndarray) -> tuple | None:
        """The step's embedding replacements, from the rows that carry side data (None if none)."""
        side = self.batch.prompt_embeds[: len(q)]
        parts = [chunk_embeds(side[row], int(md.cu_seqlens_q_host[row]), int(c[row]), int(q[row]))
                 for row in np.flatnonzero(np.not_equal(side, None)).tolist()]
        parts = [p for p in parts if len(p[0])]
        if not parts:
            return None
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _forward(self, inputs: StepInputs) -> paddle.Tensor:
        """Logits ``[P, vocab]`` (float32) at the scored positions; the K/V of every token is written."""
        md = inputs.metadata
        embeds = None
        if inputs.embeds is not None:  # the model's own embeddings, with the side data written over
            index, vectors = inputs.embeds
            own = self.handle.embed(inputs.input_ids)[0]
            embeds = paddle.scatter(own, upload(index), upload(vectors).astype(own.dtype)).unsqueeze(0)
        with paddle.no_grad(), forward_context(md, self.kv_cache):
            logits = self.handle.compute_logits(inputs.input_ids, md.positions.reshape([1, -1]),
                                                upload(inputs.logits_indices), inputs_embeds=embeds)
        return logits.astype("float32") if logits.dtype != paddle.float32 else logits

    # ------------------------------------------------------------------ sampling and verification
    def _sample(self, logits: paddle.Tensor, inputs: StepInputs, out: ModelRunnerOutput) -> np.ndarray:
        """Fill ``out.sampled_token_ids`` / ``out.errors``; returns each row's computed tokens
        after the step (rejected drafts excluded). Accepted tokens are also written after each
        row's known tokens (scratch: the next message appends them for real) for the proposer."""
        b, n = self.batch, self.batch.num_reqs
        num_computed_after = (b.num_computed_tokens[:n] + b.num_scheduled_tokens[:n]).astype(np.int64)
        if len(inputs.pos_row) == 0:
            return num_computed_after
        res = self.sampler.sample(logits, self._sampling_tensors(inputs))
        req_ids = b.req_ids
        starts = np.flatnonzero(inputs.pos_offset == 0)
        for start in starts.tolist():
            row = int(inputs.pos_row[start])
            num_spec = int(b.num_spec_tokens[row])
            span = slice(start, start + num_spec + 1)
            if not res.finite[span].all():
                out.errors[req_ids[row]] = "the model produced non-finite logits"
                continue
            accepted = res.accepted[start : start + num_spec]
            m = num_spec if accepted.all() else int(np.argmin(accepted))
            end = int(b.num_tokens[row])
            tokens = b.token_ids[row, end : end + m].tolist() + [int(res.tokens[start + m])]
            b.token_ids[row, end : end + m + 1] = tokens
            num_computed_after[row] -= num_spec - m
            out.sampled_token_ids[req_ids[row]] = tokens
        return num_computed_after

    def _sampling_tensors(self, inputs: StepInputs) -> SamplingTensors:
        b = self.batch
        rows, offset = inputs.pos_row, inputs.pos_offset
        draw_index = (b.num_tokens[rows] - b.num_prompt_tokens[rows] + offset).astype(np.int64)
        num_spec = b.num_spec_tokens[rows]
        drafts = np.where(offset < num_spec, b.token_ids[rows, np.minimum(b.num_tokens[rows] + offset,
                                                                          b.sizes["max_model_len"] - 1)], -1)
        banned = [[] for _ in range(len(rows))]
        # Only positions short of min_tokens ban anything; find them in one vector op, not a loop.
        for p in np.flatnonzero(draw_index < b.min_tokens[rows]).tolist():
            row = rows[p]
            ids = [int(t) for t in b.stop_token_ids[row] if t >= 0]
            if not b.ignore_eos[row] and b.eos_token_id[row] >= 0:
                ids.append(int(b.eos_token_id[row]))
            banned[p] = ids
        index = upload(rows, np.int64)
        return SamplingTensors(
            greedy=b.temperature[rows] == 0, temperature=paddle.gather(b.dev("temperature"), index),
            top_k=paddle.gather(b.dev("top_k"), index), top_p=paddle.gather(b.dev("top_p"), index),
            seeds=b.seed[rows], draw_index=draw_index, banned=banned, draft_token_ids=drafts.astype(np.int64))

    def _propose_input(self, out: ModelRunnerOutput, num_computed_after: np.ndarray) -> ProposeInput:
        """How far each row got, and how many drafts each row that sampled may take."""
        b, n = self.batch, self.batch.num_reqs
        gained = np.zeros(n, np.int64)
        for req_id, tokens in out.sampled_token_ids.items():
            gained[b.row_of(req_id)] = len(tokens)
        num_tokens = b.num_tokens[:n].astype(np.int64) + gained
        room = np.minimum(b.sizes["max_model_len"] - num_tokens,
                          b.max_tokens[:n] - (num_tokens - b.num_prompt_tokens[:n]) - 1)
        if self.proposer.num_lookahead_tokens:  # the draft writes K/V up to k - 1 slots past the end
            room = np.minimum(room, b.num_blocks[:n].astype(np.int64) * self.block_size - num_tokens + 1)
        max_drafts = np.where(gained > 0, np.clip(room, 0, self.proposer.num_speculative_tokens), 0)
        return ProposeInput(num_tokens, num_computed_after, max_drafts.astype(np.int64))
