"""``StructuredOutputsProcessor``: the engine's side of structured outputs, a logits processor.

**On arrival** (``fleetlab.edge.input_processor.InputProcessor``): :meth:`StructuredOutputsProcessor.start`
checks the constraint with the grammar backend (a ``ValueError`` naming the request and the
field), starts its compile on the manager's thread and returns the request's
:class:`~fleetlab.structured_output.request.StructuredOutputRequest`. The request carries it in
its ``structured_output`` batch field and waits on its compile (``Request.waiting_on``): the
scheduler does not admit it until the grammar is ready, and every other request runs meanwhile.

**Every step** (``__call__``, in the sampler, before temperature, top-k and top-p, for greedy,
sampled and draft-verifying rows alike):

1. find the scored rows whose ``structured_output`` is set; if none, return the logits untouched
   (an unconstrained step pays one comparison over the rows' object field);
2. bring each one's matcher to the row's committed output (``matcher_at``);
3. fill one bitmask row per scored position: the row's next token, and for a row verifying
   ``k`` drafts the ``k`` positions after them (the matcher accepts the drafts the grammar
   allows, fills, and rolls them back: ``fill_bitmask_with_drafts``). A draft the grammar
   refuses is then refused by its own position's mask, so verification rejects it;
4. take out of the masks what the sampler bans (EOS and stop ids before ``min_tokens``) and
   find dead positions (no model token allowed): after a draft, that draft is refused instead;
   at a row's first position, the request stops with an error (``st.row_errors``);
5. write each row's masks into its ``grammar_bitmask`` field (it moves with the row), upload
   the step's masks once, and set every disallowed logit to ``-inf`` (``apply_token_bitmask``
   on the constrained rows only).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import paddle

from fleetlab.device import upload
from fleetlab.engine.batch_fields import Field
from fleetlab.engine.logits_processor import LogitsProcessor
from fleetlab.structured_output.bitmask import apply_token_bitmask, dead_rows
from fleetlab.structured_output.manager import StructuredOutputManager
from fleetlab.structured_output.request import StructuredOutputRequest


class StructuredOutputsProcessor(LogitsProcessor):
    """Masks each constrained row's logits to what its grammar allows (see the module docstring).

    tokenizer, vocab_size, eos_token_id: the served model's; num_speculative_tokens: drafts a
    row may verify (its ``grammar_bitmask`` holds ``k + 1`` mask rows); compile_ahead: False
    compiles on arrival, before ``start`` returns: with tensor parallelism every rank runs its
    own scheduler, and a compile finishing at different steps on different ranks would admit
    the request at different steps (vLLM disables async compiles there for the same reason);
    backend and backend_options: the grammar backend (``"guidance"``), built on the first
    constrained request.
    """

    masks_tokens = True  # the sampler applies it before taking raw logprobs (as vLLM its bitmask)

    def __init__(self, tokenizer, vocab_size: int, *, eos_token_id: int | None = None,
                 num_speculative_tokens: int = 0, compile_ahead: bool = True, backend="guidance",
                 **backend_options):
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self.compile_ahead = compile_ahead
        self.words = -(-vocab_size // 32)
        self.fields = (
            Field("structured_output", (), "object", "host", None,
                  "the request's StructuredOutputRequest (grammar and matcher); None: unconstrained"),
            Field("grammar_bitmask", (num_speculative_tokens + 1, self.words), "int32", "host", -1,
                  "tokens each scored position of the row's last step allowed: bit t % 32 of word t // 32"),
        )
        self._backend, self._options = backend, backend_options
        self._manager: StructuredOutputManager | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ requests
    @property
    def manager(self) -> StructuredOutputManager:
        """The compile-ahead manager, built on first use (``ValueError`` if this tokenizer cannot
        be given to the grammar backend)."""
        with self._lock:
            if self._manager is None:
                if self.tokenizer is None:
                    raise ValueError("the LLM has no tokenizer, and a grammar is written over the tokenizer's tokens")
                try:
                    manager = StructuredOutputManager(self._backend, self.tokenizer, self.vocab_size, **self._options)
                except TypeError as exc:
                    raise ValueError(str(exc)) from None
                eos = manager.backend.eos_token_id
                if self.eos_token_id is not None and eos != self.eos_token_id:
                    manager.close()
                    raise ValueError(f"the tokenizer's EOS token {eos} is not the model's {self.eos_token_id}: a "
                                     "complete output could never stop")
                self._manager = manager
            return self._manager

    def start(self, request_id: str, params) -> StructuredOutputRequest:
        """The state of a new constrained request, its compile started (see the module docstring).
        A refusal already known (this constraint failed to compile before) raises at once."""
        try:
            manager = self.manager
        except ValueError as exc:
            raise ValueError(f"request {request_id!r}: sampling field structured_outputs cannot be served: {exc}") \
                from None
        checked = manager.validate(request_id, params)
        state = StructuredOutputRequest(checked, manager.compile(checked))
        state.check(request_id, timeout=0 if self.compile_ahead else None)
        return state

    def precompile(self, params) -> Future | None:
        """Start (or find) the compile of ``params`` for a front end that can wait for it off the
        engine's thread (``AsyncLLM``), so that a refusal comes back before the request is queued.
        Thread-safe. None when the params are refused before compiling (``start`` says why)."""
        try:
            manager = self.manager
            return manager.compile(manager.validate("?", params))
        except ValueError:
            return None

    def close(self) -> None:
        """Stop the compile threads."""
        if self._manager is not None:
            self._manager.close()

    # ------------------------------------------------------------------ every step
    def __call__(self, logits: paddle.Tensor, st) -> paddle.Tensor:
        if st.batch is None:
            raise RuntimeError("StructuredOutputsProcessor reads its rows from the InputBatch: st.batch is None")
        states = st.batch.np("structured_output")
        constrained = np.flatnonzero(np.not_equal(states, None))
        if len(constrained) == 0:
            return logits
        for row in constrained.tolist():  # a failed compile stops its request at its first step
            if states[row].error is not None:
                st.row_errors[row] = states[row].error
        spans = self._spans(st, states)
        if not spans:
            return logits
        mask, positions = self._fill(st, spans)
        self._ban_and_check(st, spans, mask, positions)
        return self._apply(logits, st, spans, mask, positions)

    def _spans(self, st, states) -> list[tuple[int, int, int]]:
        """``(batch row, first position, end position)`` of every scored constrained row that can go on."""
        num = len(st.pos_row)
        starts = st.row_starts if st.row_starts is not None else np.arange(num)
        ends = np.append(starts[1:], num)
        rows = st.pos_row[starts]
        keep = np.flatnonzero(np.not_equal(states[rows], None))
        return [(int(rows[i]), int(starts[i]), int(ends[i])) for i in keep.tolist()
                if int(rows[i]) not in st.row_errors]

    def _fill(self, st, spans) -> tuple[np.ndarray, list[int]]:
        """The step's masks ``[n, backend width]`` (one per scored position of the spans) and
        the logits row of each. Rows whose output left the grammar go to ``st.row_errors``."""
        backend = self.manager.backend
        batch = st.batch
        mask = backend.allocate_bitmask(sum(end - start for _, start, end in spans))
        positions, single = [], []
        for row, start, end in spans:
            state = batch.np("structured_output")[row]
            output = batch.token_ids[row, batch.num_prompt_tokens[row]: batch.num_tokens[row]]
            try:
                matcher = state.matcher_at(output)
            except ValueError as exc:
                st.row_errors[row] = str(exc)
                continue
            at = len(positions)
            if end - start > 1:  # a verify row: one mask after each draft the grammar allows
                matcher.fill_bitmask_with_drafts(mask, at, st.draft_token_ids[start: end - 1].tolist())
            else:
                single.append((matcher, at))
            positions += range(start, end)
        backend.fill_bitmasks(single, mask)
        return mask[: len(positions)], positions

    def _ban_and_check(self, st, spans, mask: np.ndarray, positions: list[int]) -> None:
        """Clear banned ids from the masks; refuse drafts that lead to a dead position; stop rows
        whose next token has none (the mask of such a row is opened again: its token is dropped)."""
        bits = mask.view(np.uint32)
        for i, p in enumerate(positions):
            for t in st.banned[p]:
                bits[i, t // 32] &= ~np.uint32(1 << (t % 32))
        dead = dead_rows(mask, self.vocab_size)
        at = {p: i for i, p in enumerate(positions)}
        for row, start, end in spans:
            if start not in at:
                continue
            first = at[start]
            for j in range(end - start - 1, 0, -1):  # from the last draft back: refusing one may kill the one before
                if dead[first + j]:
                    draft = int(st.draft_token_ids[start + j - 1])
                    bits[first + j - 1, draft // 32] &= ~np.uint32(1 << (draft % 32))
                    dead[first + j - 1] = dead_rows(mask[first + j - 1: first + j], self.vocab_size)[0]
            if dead[first]:
                state = st.batch.np("structured_output")[row]
                why = f" ({state.matcher.error})" if state.matcher.error else ""
                if st.banned[start]:
                    why += f" once min_tokens bans {st.banned[start]}"
                st.row_errors[row] = (f"structured_outputs field {state.params.kind}: the grammar allows no token the "
                                      f"model has here{why}")
                mask[first: first + end - start] = -1

    def _apply(self, logits, st, spans, mask: np.ndarray, positions: list[int]) -> paddle.Tensor:
        """Keep each row's masks in its ``grammar_bitmask`` field, upload once, mask the logits."""
        field = st.batch.buffer("grammar_bitmask")
        at = {p: i for i, p in enumerate(positions)}
        for row, start, end in spans:
            if start in at:
                field[row] = -1
                field[row, : end - start] = mask[at[start]: at[start] + end - start, : self.words]
        if not positions:
            return logits
        # One upload: the masks and, in a last column, the logits row each belongs to.
        packed = np.empty((len(positions), self.words + 1), dtype=np.int32)
        packed[:, : self.words] = mask[:, : self.words]
        packed[:, self.words] = positions
        device = upload(packed)
        every_row = len(positions) == logits.shape[0]  # positions are in order: all rows, none to gather
        rows = None if every_row else device[:, self.words].astype("int64")
        return apply_token_bitmask(logits, device[:, : self.words], rows)
