"""``LogitsProcessor``: a pass over a step's scored logits before sampling, and the hook for one.

Penalties, logit biases and grammar masks all change the logits of some rows before the
sampler picks (greedy rows included, before temperature, top-k and top-p). Each is a
``LogitsProcessor`` given to the sampler: its per-request state lives in batch fields it
declares (registered on the InputBatch when the engine is built, filled per request from
``request_values(sampling_params)``), so that state moves with its row like any other field,
and the sampler calls every processor on every step. A processor with nothing to do for a
step (no row uses it) returns the logits as they are. One that only forbids tokens (a
grammar's mask: ``masks_tokens = True``) runs before the raw logprobs are taken, as vLLM applies
its grammar bitmask to the logits before its sampler: no logprob ranks a forbidden token.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import paddle


class LogitsProcessor:
    """Base class: ``fields`` it keeps per request; ``request_values`` fills them; ``__call__``
    changes ``logits [P, vocab]`` (one row per scored position; ``st.pos_row[p]`` is its batch
    row and ``st.batch`` the InputBatch) and returns them."""

    fields: ClassVar[tuple] = ()
    masks_tokens: ClassVar[bool] = False  # only sets logits to -inf: applied before raw logprobs

    def request_values(self, sampling_params) -> dict:
        """This request's values of ``fields`` by name (none: the fields' fills)."""
        return {}

    def __call__(self, logits: paddle.Tensor, st) -> paddle.Tensor:
        raise NotImplementedError(f"logits processor {type(self).__name__} must implement __call__(logits, st)")


def apply_processor(processor, logits, st):
    """``processor(logits, st)``, checked where the sampler receives it.

    A result that is not a tensor of the shape and dtype it was given (``[P, vocab]``: a column
    more would let an id outside the vocabulary out, one less shifts nothing visibly) raises
    ``ValueError`` naming the processor (the step is rolled back). A processor that is not
    fleetlab's own is also checked for NaN: a position it made NaN stops that request with an
    error naming the processor (``st.row_errors``), the others go on. That check costs one
    device-to-host read of ``[P]`` flags per such processor and step.
    """
    out = processor(logits, st)
    name = f"logits processor {type(processor).__name__}"
    if not isinstance(out, paddle.Tensor):
        raise ValueError(f"{name} returned {type(out).__name__}; it must return the logits tensor it was given "
                         f"({list(logits.shape)}), changed")
    if list(out.shape) != list(logits.shape) or out.dtype != logits.dtype:
        raise ValueError(f"{name} returned logits {list(out.shape)} {out.dtype}; it was given {list(logits.shape)} "
                         f"{logits.dtype} ([scored positions, vocab]) and must return that shape and dtype")
    if not type(processor).__module__.startswith("fleetlab.") and out.shape[0]:
        for p in np.flatnonzero(paddle.isnan(out).any(axis=-1).numpy()).tolist():
            row = int(st.pos_row[p]) if st.pos_row is not None else p
            st.row_errors.setdefault(row, f"{name} returned NaN logits for this request")
    return out
