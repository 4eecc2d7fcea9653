"""Logit bias and the three penalties, as one built-in logits processor.

The formulas are vLLM's (``vllm/model_executor/layers/utils.py::apply_penalties``, which follow
OpenAI's definition), applied in vLLM's order, before temperature, top-k and top-p::

    logits[t] += logit_bias[t]                                   # the request's bias
    if t in prompt or output:                                    # repetition_penalty r
        logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
    logits[t] -= frequency_penalty * count of t in the output
    logits[t] -= presence_penalty * (t in the output)

"The output" is every token generated so far (at a row verifying drafts, position ``i`` also
counts the ``i`` drafts before it). The settings are per-row host fields of the InputBatch,
so they move with their row through condense, reorder and preemption like any other field.
Only the rows that set one of them are touched: a step whose rows set none costs no upload
and no device work. For the rows that do, one pass on the device: their logits are gathered,
the token counts built by a scatter-add from their token ids, every term applied, and the rows
written back; the host uploads one int64 array (positions, output, prompt and bias token ids)
and one float32 array (the settings and bias values).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import paddle

from fleetlab.device import upload
from fleetlab.engine.batch_fields import Field
from fleetlab.engine.logits_processor import LogitsProcessor

NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
"""Each penalty's setting that changes nothing (a row whose settings are all these is left alone)."""


class PenaltiesProcessor(LogitsProcessor):
    """``logit_bias``, ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``
    of :class:`~fleetlab.SamplingParams` (see the module docstring); the LLM always installs it."""

    fields: ClassVar[tuple] = (
        Field("presence_penalty", (), "float32", "host", 0.0, "subtracted once from each generated token's logit"),
        Field("frequency_penalty", (), "float32", "host", 0.0,
              "subtracted from a token's logit once per time it was generated"),
        Field("repetition_penalty", (), "float32", "host", 1.0,
              "divides (multiplies, if negative) the logits of prompt and generated tokens; 1 = off"),
        Field("logit_bias", (), "object", "host", None, "None, or (token ids int64 [m], biases float32 [m])"),
    )

    def request_values(self, sampling_params) -> dict:
        sp = sampling_params
        values = {name: getattr(sp, name) for name, off in NEUTRAL.items() if getattr(sp, name) != off}
        if sp.logit_bias:
            values["logit_bias"] = (np.fromiter(sp.logit_bias, np.int64, len(sp.logit_bias)),
                                    np.fromiter(sp.logit_bias.values(), np.float32, len(sp.logit_bias)))
        return values

    def __call__(self, logits: paddle.Tensor, st) -> paddle.Tensor:
        if not self._any_set(st.batch):  # the common step: nobody asked for any (a few whole-field checks)
            return logits
        settings = np.stack([st.batch.np(name)[st.pos_row] for name in NEUTRAL], axis=1)  # [P, 3], each row's
        biased = np.not_equal(st.batch.np("logit_bias")[st.pos_row], None)
        active = np.flatnonzero(np.not_equal(settings, list(NEUTRAL.values())).any(axis=1) | biased)
        if len(active) == 0:
            return logits
        ints, widths, floats = self._host_arrays(st, active, settings[active], logits.shape[-1])
        return self.apply(logits, upload(ints), widths, upload(floats))

    @staticmethod
    def _any_set(batch) -> bool:
        """Whether any row of the batch sets a penalty or a bias (rows that do not score this step too)."""
        return (any(np.any(batch.np(name) != off) for name, off in NEUTRAL.items())
                or any(x is not None for x in batch.np("logit_bias").tolist()))

    @staticmethod
    def _host_arrays(st, active: np.ndarray, settings: np.ndarray, vocab: int):
        """``(ints, widths, floats)`` for the active positions: ``ints`` int64 ``[A, 1 + Lo + Lp +
        Lb]`` = position, output ids, prompt ids (only if some row has a repetition penalty),
        bias ids, padded with ``vocab``; ``floats`` float32 ``[A, 3 + Lb]`` = settings, bias values."""
        b, rows = st.batch, st.pos_row[active]
        prompt_len = b.num_prompt_tokens[rows].astype(np.int64)
        num_out = st.draw_index[active].astype(np.int64)  # outputs (and drafts) before each position
        biases = b.np("logit_bias")[rows]
        lo = int(num_out.max())
        lp = int(prompt_len.max()) if (settings[:, 2] != 1).any() else 0
        lb = max((len(x[0]) for x in biases if x is not None), default=0)
        ints = np.full((len(active), 1 + lo + lp + lb), vocab, dtype=np.int64)
        floats = np.zeros((len(active), 3 + lb), dtype=np.float32)
        ints[:, 0], floats[:, :3] = active, settings
        for i, row in enumerate(rows.tolist()):
            p, n = prompt_len[i], num_out[i]
            ints[i, 1: 1 + n] = b.token_ids[row, p: p + n]
            if lp and settings[i, 2] != 1:
                ints[i, 1 + lo: 1 + lo + p] = b.token_ids[row, :p]
            if biases[i] is not None:
                ids, values = biases[i]
                ints[i, 1 + lo + lp: 1 + lo + lp + len(ids)] = ids
                floats[i, 3: 3 + len(ids)] = values
        return ints, (lo, lp, lb), floats

    @staticmethod
    def apply(logits: paddle.Tensor, ints: paddle.Tensor, widths: tuple[int, int, int],
              floats: paddle.Tensor) -> paddle.Tensor:
        """The device pass over the active rows (see :meth:`_host_arrays` for the layout)."""
        lo, lp, lb = widths
        vocab = logits.shape[-1]
        index = ints[:, 0]
        sub = paddle.gather(logits, index, axis=0)

        def scatter(ids, values):  # [A, vocab]: values summed per token id; the pad id lands past the end
            zeros = paddle.zeros([sub.shape[0], vocab + 1], dtype="float32")
            return paddle.put_along_axis(zeros, ids, values, axis=1, reduce="add")[:, :vocab]

        if lb:
            sub = sub + scatter(ints[:, 1 + lo + lp:], floats[:, 3:])
        ones = paddle.ones([sub.shape[0], max(lo, lp)], "float32")
        counts = scatter(ints[:, 1: 1 + lo], ones[:, :lo]) if lo else paddle.zeros_like(sub)
        seen = (counts > 0).astype("float32")
        repeated = seen + scatter(ints[:, 1 + lo: 1 + lo + lp], ones[:, :lp]) if lp else seen  # > 0: prompt or output
        r = floats[:, 2:3]
        sub = paddle.where(repeated > 0, paddle.where(sub > 0, sub / r, sub * r), sub)
        sub = sub - floats[:, 1:2] * counts - floats[:, 0:1] * seen
        return paddle.scatter(logits, index, sub, overwrite=True)
