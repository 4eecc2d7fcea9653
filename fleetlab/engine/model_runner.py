"""``ModelRunner``: one step of the patched model over the persistent InputBatch.

It applies the step's :class:`SchedulerOutput` to its InputBatch (new requests in full, the
rest as diffs), condenses it, reorders it decode-first when the attention backend asks (a
proposer's fields move with the rows), builds the attention metadata, runs the model on the
packed tokens under ``forward_context``, computes logits only at the positions it scores
(each row's last token; a row verifying ``k`` drafts scores ``k + 1``), samples, and lets a
speculative proposer draft the next tokens. Results leave keyed by request id in a
:class:`ModelRunnerOutput`, so the row order never leaks out.

A step is two halves: :meth:`ModelRunner.prepare` (the host's: the batch updated, the inputs
and sampling settings built) and :meth:`ModelRunner.run` (the model's: forward, sample, draft);
``execute`` runs one after the other, and the overlapped loop (:mod:`fleetlab.overlap`) runs
``run`` on a thread of its own while the host prepares the next step.

The runner reports what it computed and never advances a request's progress: the next
message tells it what the scheduler committed. If anything in a step raises, the engine
calls :meth:`reset` and the scheduler resends every request in full, so no half-applied step
survives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import paddle

from fleetlab.attention.context import forward_context
from fleetlab.attention.metadata import AttentionMetadata
from fleetlab.device import upload, upload_packed
from fleetlab.engine.hooks import StepHooks
from fleetlab.engine.input_batch import InputBatch
from fleetlab.engine.messages import ModelRunnerOutput, SchedulerOutput
from fleetlab.engine.sampler import Sampler, SamplingTensors
from fleetlab.engine.side_data import chunk_embeds
from fleetlab.errors import FieldTypeError, refuse
from fleetlab.fields import token_ids_field
from fleetlab.kv_transfer.base import NULL_CONNECTOR, checked_finished, connector_call


@dataclass(slots=True)
class StepInputs:
    """The packed step: attention metadata, input ids ``[1, T]``, and the scored positions.

    logits_indices: int64 device ``[P + Q]`` packed token index of each of the ``P`` scored
      positions (where a row's logits are taken), then of the ``Q`` prompt positions whose
      logprobs are asked for (none unless a request wants them);
    pos_row: ``[P]`` each scored position's batch row; pos_offset: ``[P]`` its index among its
    row's scored positions (0 = the last known token, ``i`` = after ``i`` drafts);
    embeds: None, or ``(packed token indices [m], vectors [m, hidden])`` replacing those
    tokens' embeddings (side data of the rows' requests);
    prompt_rows, prompt_positions: int64 ``[Q]``: the batch row and prompt position of each of
      the ``Q`` extra positions.
    """

    metadata: AttentionMetadata
    input_ids: paddle.Tensor
    logits_indices: paddle.Tensor
    pos_row: np.ndarray
    pos_offset: np.ndarray
    embeds: tuple | None = None
    prompt_rows: np.ndarray | None = None
    prompt_positions: np.ndarray | None = None


@dataclass(slots=True)
class PreparedStep:
    """One step made ready on the host (:meth:`ModelRunner.prepare`) for :meth:`ModelRunner.run`.

    so: the plan; out: the runner's message, filled by ``run``; inputs: the packed step;
    sampling: the scored positions' settings (None: no position samples or scores a prompt; ``run``
    reads these and the batch they point at, not the live one, which an overlapped loop changes
    meanwhile for the next step);
    placeholders: ``(request id, row, position, packed index)`` of each token this step reads
    that the step before has not sampled yet (none in the synchronous loop).
    """

    so: SchedulerOutput
    out: ModelRunnerOutput
    inputs: StepInputs
    sampling: SamplingTensors | None
    placeholders: list


class ModelRunner:
    """Runs scheduled steps of a patched model (a ``PatchHandle``) on a paged KV cache.

    Args:
      handle, kv_cache, input_batch: the patched model, its cache, the persistent batch.
      reorder: put decode rows first each step (the backend's ``requires_reorder``).
      decode_threshold: the most query tokens a decode row carries (1, or ``k + 1`` when
        verifying ``k`` drafts).
      sampler: turns scored logits into each row's tokens (default :class:`Sampler`; with
        speculation, :class:`~fleetlab.spec_decode.rejection.RejectionSampler`).
      proposer: drafts the next step's tokens (a :class:`~fleetlab.spec_decode.proposer.Proposer`), or None.
      hooks: where observers see inside the step (:class:`~fleetlab.engine.hooks.StepHooks`).
      kv_connector: loads K/V from outside before and during the forward, saves it per layer
        (:class:`~fleetlab.kv_transfer.KVConnector`; default: the null connector).
    """

    def __init__(self, handle, kv_cache, input_batch: InputBatch, *, reorder: bool, decode_threshold: int = 1,
                 sampler: Sampler | None = None, proposer=None, hooks: StepHooks | None = None,
                 kv_connector=NULL_CONNECTOR):
        self.handle = handle
        self.kv_cache = kv_cache
        self.batch = input_batch
        self.reorder = reorder
        self.decode_threshold = decode_threshold
        self.sampler = sampler or Sampler()
        self.proposer = proposer
        self.hooks = hooks or StepHooks()
        self.kv_connector = kv_connector
        if proposer is not None:
            proposer.bind(input_batch)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step ``so`` plans (at least one request); each part is a phase observers may time."""
        return self.run(self.prepare(so))

    def prepare(self, so: SchedulerOutput) -> PreparedStep:
        """The host's half of a step: apply the plan to the batch, build its inputs and sampling settings."""
        with self.hooks.phase("batch_update"):
            out = self.update_batch(so)
        with self.hooks.phase("metadata"):
            inputs = self.prepare_inputs()
            inputs.metadata.kv_copies = self.kv_cache.copy_plan(so.kv_copies)  # each layer copies after its write
            sampling = self.sampling_tensors(inputs)
        return PreparedStep(so, out, inputs, sampling, self._placeholder_slots(inputs))

    def run(self, p: PreparedStep) -> ModelRunnerOutput:
        """The model's half: forward and sample ``p``, and draft the next tokens. Until the proposer
        drafts it reads only ``p`` (an overlapped loop freezes the batch state ``p`` points at:
        :mod:`fleetlab.overlap.frozen`) and the KV cache."""
        phase, so, out = self.hooks.phase, p.so, p.out
        with phase("forward"):
            self.kv_connector.start_load_kv(so.kv_connector_metadata, self.kv_cache)
            logits = self.forward(p.inputs)  # each attention layer: wait_for_layer_load, write, copies, save_kv_layer
            self.kv_connector.wait_for_save()
            out.finished_sending, out.kv_load_failed_block_ids = checked_finished(
                self.kv_connector, connector_call(self.kv_connector, "get_finished", so.finished_req_ids),
                self.kv_cache.num_blocks)
        with phase("sample"):
            self.sample(logits, p.inputs, out, p.sampling)
        if self.proposer is not None:
            with phase("propose"):
                self.proposer.set_copies(so.kv_copies)  # its own cache shares the block ids: same copies
                drafts = self.proposer.propose(self.batch, out.sampled_token_ids)
                out.spec_token_ids = check_drafts(self.proposer, drafts, self.batch.req_ids, self.handle.vocab_size)
        return out

    def reset(self) -> None:
        """Drop every row (and the proposer's state): the scheduler will resend them in full."""
        for req_id in [r for r in self.batch.req_ids if r is not None]:
            self.batch.remove_request(req_id)
        self.batch.condense()
        if self.proposer is not None:
            self.proposer.reset()

    # ------------------------------------------------------------------ batch update
    def update_batch(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the message to the batch, condense, reorder (observers see the rows before it)."""
        b = self.batch
        scheduled = so.num_scheduled_tokens
        resent = {new.req_id for new in so.scheduled_new_reqs}
        self._retract_placeholders()  # the tokens they stood for come in this message
        # Drop rows of requests that finished, were preempted or simply not scheduled this step,
        # and stale rows of requests sent in full (a finished request's id reused at once).
        for req_id in [r for r in b.req_ids if r is not None and (r not in scheduled or r in resent)]:
            b.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            b.add_request(new.req_id, new.prompt_token_ids, output_token_ids=new.output_token_ids,
                          num_computed_tokens=new.num_computed_tokens, block_ids=new.block_ids,
                          sampling=new.sampling_params, seed=new.seed, eos_token_id=new.eos_token_id, extra=new.extra)
        cached = so.scheduled_cached_reqs
        b.update_requests(cached.req_ids, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens,
                          cached.num_blocks)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            b.set_spec_tokens(req_id, drafts)
        self._mark_placeholders(scheduled)
        b.condense()
        b.set_num_scheduled(scheduled)
        self.hooks.batch_order(b.req_ids)
        if self.reorder:
            b.reorder_split_prefill_and_decode(self.decode_threshold)
        b.sync_to_device()  # at most one copy per device field, after every row has moved
        return ModelRunnerOutput()

    def _mark_placeholders(self, scheduled: dict) -> None:
        """A row scheduled past its known tokens (only the overlapped loop plans that: the step in
        flight has not sampled them yet) gets placeholder tokens there, filled before its forward
        (:func:`fleetlab.overlap.placeholders.fill`); none in the synchronous loop."""
        b = self.batch
        rows = np.fromiter((b.req_id_to_row[r] for r in scheduled), np.int64, len(scheduled))
        short = (b.num_computed_tokens[rows] + np.fromiter(scheduled.values(), np.int64, len(scheduled))
                 - b.num_tokens[rows] - b.num_spec_tokens[rows])
        rows, counts = rows[short > 0], short[short > 0]
        if len(rows):  # one append for every such row; 0: any valid id (a wasted slot's forward reads it)
            b.append(rows, [[0] * k for k in counts.tolist()])
            b.num_placeholders[rows] = counts

    def _retract_placeholders(self) -> None:
        """Take the placeholders off the rows again: the message carries the tokens they stood for
        (a row removed since has none: its fields were cleared)."""
        b = self.batch
        b.num_tokens[:] -= b.num_placeholders  # views of rows [0, num_rows)
        b.num_placeholders[:] = 0

    def _placeholder_slots(self, inputs: StepInputs) -> list[tuple[str, int, int, int]]:
        """``(request id, row, position, packed index)`` of each placeholder this step reads (they
        are its rows' last scheduled tokens)."""
        b, cu, req_ids = self.batch, inputs.metadata.cu_seqlens_q_host, self.batch.req_ids
        slots = []
        for row in np.flatnonzero(b.num_placeholders > 0).tolist():
            k, end = int(b.num_placeholders[row]), int(b.num_tokens[row])
            slots += [(req_ids[row], row, end - k + j, int(cu[row + 1]) - k + j) for j in range(k)]
        return slots

    # ------------------------------------------------------------------ inputs and forward
    def prepare_inputs(self) -> StepInputs:
        b, n = self.batch, self.batch.num_reqs
        q = b.num_scheduled_tokens[:n].astype(np.int64)
        c = b.num_computed_tokens[:n].astype(np.int64)
        md = AttentionMetadata.from_batch(b, self.kv_cache.block_size, self.decode_threshold)  # one copy per dtype
        md = self.handle.backend.build_metadata(md)  # the backend's plan, here where the host prepares the step
        token_rows, positions = md.token_rows_host, md.positions_host
        # A row scores its last known token and each draft after it, once its chunk gets there.
        num_scored = np.where(c + q >= b.num_tokens[:n], b.num_spec_tokens[:n] + 1, 0).astype(np.int64)
        pos_row = np.repeat(np.arange(n), num_scored)
        starts = np.concatenate([[0], np.cumsum(num_scored)[:-1]])
        pos_offset = np.arange(len(pos_row)) - starts[pos_row]
        logits_indices = md.cu_seqlens_q_host[1:][pos_row] - num_scored[pos_row] + pos_offset
        # The prompt positions whose logprobs are asked for: position j (before the prompt's last, which
        # is scored anyway) predicts prompt token j + 1.
        extra = np.flatnonzero((b.num_prompt_logprobs[token_rows] >= 0)
                               & (positions < b.num_prompt_tokens[token_rows] - 1))
        input_ids, logits_indices = upload_packed(  # and one for these
            b.token_ids[token_rows, positions].reshape(1, -1).astype(np.int64, copy=False),
            np.concatenate([logits_indices, extra]))
        prompt = (token_rows[extra], positions[extra]) if len(extra) else (None, None)
        return StepInputs(md, input_ids, logits_indices, pos_row, pos_offset, self._step_embeds(md, q, c), *prompt)

    def _step_embeds(self, md: AttentionMetadata, q: np.ndarray, c: np.ndarray) -> tuple | None:
        """The step's embedding replacements, from the rows that carry side data (None if none)."""
        side = self.batch.prompt_embeds[: len(q)]
        parts = [chunk_embeds(side[row], int(md.cu_seqlens_q_host[row]), int(c[row]), int(q[row]))
                 for row in np.flatnonzero(np.not_equal(side, None)).tolist()]
        parts = [p for p in parts if len(p[0])]
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])) if parts else None

    def forward(self, inputs: StepInputs) -> paddle.Tensor:
        """Logits ``[P, vocab]`` (float32) at the scored positions; the K/V of every token is written."""
        md = inputs.metadata
        embeds = None
        if inputs.embeds is not None:  # the model's own embeddings, with the side data written over
            index, vectors = inputs.embeds
            own = self.handle.embed(inputs.input_ids)[0]
            embeds = paddle.scatter(own, upload(index), upload(vectors).astype(own.dtype)).unsqueeze(0)
        with paddle.no_grad(), forward_context(md, self.kv_cache, self.kv_connector, built_by=self.handle.backend):
            logits = self.handle.compute_logits(inputs.input_ids, md.positions.reshape([1, -1]),
                                                inputs.logits_indices, inputs_embeds=embeds)
        return logits.astype("float32") if logits.dtype != paddle.float32 else logits

    # ------------------------------------------------------------------ sampling
    def sample(self, logits: paddle.Tensor, inputs: StepInputs, out: ModelRunnerOutput,
               st: SamplingTensors | None) -> None:
        """Fill ``out`` for the rows that scored: the tokens they gained, their errors, and the
        logprobs asked for (of sampled tokens, and of this chunk's prompt tokens).

        ``st``: the settings :meth:`sampling_tensors` took from the batch (None: nothing to sample);
        the rows' request ids are read from ``st.batch``, the batch as prepared (an overlapped loop's
        frozen copy), not the live one."""
        if st is None:
            return
        starts, req_ids = st.row_starts, st.batch.req_ids
        rows = inputs.pos_row[starts].tolist()
        tokens, res = self.sampler.sample_rows(logits, st)
        out.sampled_token_ids = {req_ids[r]: t for r, t in zip(rows, tokens) if t is not None}
        out.errors = {req_ids[r]: "the model produced non-finite logits" for r, t in zip(rows, tokens) if t is None}
        out.errors.update({req_ids[r]: why for r, why in st.row_errors.items()})  # a logits processor stopped them
        if res.logprobs is not None:
            out.logprobs = {req_ids[r]: res.logprobs[p: p + len(t)]  # one per token gained (accepted drafts too)
                            for r, p, t in zip(rows, starts.tolist(), tokens)
                            if t is not None and res.logprobs[p] is not None}
        if res.prompt_logprobs is not None:
            for r in np.unique(inputs.prompt_rows).tolist():
                mine = np.flatnonzero(inputs.prompt_rows == r)
                out.prompt_logprobs[req_ids[r]] = (int(inputs.prompt_positions[mine[0]]),
                                                   [res.prompt_logprobs[i] for i in mine.tolist()])

    def sampling_tensors(self, inputs: StepInputs) -> SamplingTensors | None:
        """Each scored position's settings: its row's (device fields, gathered by the sampler
        only for positions that sample), its draw index, banned ids and the draft it verifies;
        None when no position samples or scores a prompt."""
        starts = np.flatnonzero(inputs.pos_offset == 0)  # each scored row's first position
        if len(starts) == 0 and inputs.prompt_rows is None:
            return None
        b = self.batch
        rows, offset = inputs.pos_row, inputs.pos_offset
        draw_index = (b.num_tokens[rows] - b.num_prompt_tokens[rows] + offset).astype(np.int64)
        drafts = np.where(offset < b.num_spec_tokens[rows],
                          b.token_ids[rows, np.minimum(b.num_tokens[rows] + offset, b.sizes["max_model_len"] - 1)], -1)
        banned = [[] for _ in range(len(rows))]
        # Only positions short of min_tokens ban anything; find them in one vector op, not a loop.
        for p in np.flatnonzero(draw_index < b.min_tokens[rows]).tolist():
            row = rows[p]
            eos = [int(b.eos_token_id[row])] if not b.ignore_eos[row] and b.eos_token_id[row] >= 0 else []
            banned[p] = [int(t) for t in b.stop_token_ids[row] if t >= 0] + eos
        st = SamplingTensors(
            greedy=b.temperature[rows] == 0, temperature=b.dev("temperature"), top_k=b.dev("top_k"),
            top_p=b.dev("top_p"), seeds=b.seed[rows], draw_index=draw_index, banned=banned,
            draft_token_ids=drafts.astype(np.int64), row_starts=starts, pos_row=rows, batch=b,
            num_logprobs=b.num_logprobs[rows] if (b.num_logprobs[rows] >= 0).any() else None)
        if inputs.prompt_rows is not None:
            st.prompt_targets = b.token_ids[inputs.prompt_rows, inputs.prompt_positions + 1]
            st.prompt_num_logprobs = b.num_prompt_logprobs[inputs.prompt_rows]
        return st


def check_drafts(proposer, drafts, req_ids, vocab_size: int) -> dict[str, list[int]]:
    """What ``proposer.propose`` returned, checked where the runner receives it: a dict from
    ids of the batch's requests (``req_ids``) to at most ``k`` int token ids in
    ``[0, vocab_size)``. Anything else raises ``ValueError`` naming the proposer and the
    request (the step is rolled back)."""
    name = f"proposer {getattr(proposer, 'name', '?')!r} ({type(proposer).__name__})"
    if not isinstance(drafts, Mapping):
        raise FieldTypeError(f"{name}: propose returned {type(drafts).__name__}; it must return a dict "
                             "{request id: [draft token ids]}")
    live, k = set(req_ids) - {None}, proposer.num_speculative_tokens
    out = {}
    for rid, ids in drafts.items():
        if rid not in live:
            raise ValueError(f"{name}: propose returned drafts for request {rid!r:.60}, which is not in the batch")
        ids = token_ids_field(f"{name}: request {rid!r}:", "drafts", ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        refuse([(len(ids) > k, f"{len(ids)} drafts, more than num_speculative_tokens={k}"),
                (bad, f"draft ids {bad[:5]} outside the vocabulary [0, {vocab_size})")],
               prefix=f"{name}: request {rid!r}: ")
        out[rid] = ids
    return out
