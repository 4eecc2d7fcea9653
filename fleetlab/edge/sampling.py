"""The request edge's check of ``SamplingParams``: every field bounded, before a request is queued.

What passes holds plain Python values and is bounded to what the batch's buffers hold (``top_k`` by
the vocabulary and ``max_tokens`` by ``max_model_len`` are bounded later, by the
:class:`~fleetlab.edge.input_processor.InputProcessor` that knows the model); seeds by int64.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from fleetlab.engine.structured_outputs_params import StructuredOutputsParams
from fleetlab.errors import FieldTypeError, refuse, short, type_error
from fleetlab.fields import (
    FLOAT32_MAX,
    INT64_MAX,
    bool_field,
    float_field,
    int_field,
    optional,
    stop_strings_field,
    token_ids_field,
)

MIN_TEMPERATURE = 1e-5
"""Temperatures in ``(0, MIN_TEMPERATURE)`` are greedy: ``logits / T`` would overflow float32."""



def check_sampling_params(sp, request_id: str = "?"):
    """A checked copy of ``SamplingParams`` ``sp`` holding plain Python values (ints, floats, a
    tuple of stop ids, a temperature below ``MIN_TEMPERATURE`` as 0, ``top_k`` -1 as 0: "no
    limit", as vLLM spells it); ``sp`` itself is left as it is."""
    where = f"request {request_id!r}: sampling field"
    max_tokens = int_field(where, "max_tokens", sp.max_tokens, 1)
    temperature = float_field(where, "temperature", sp.temperature, 0.0, FLOAT32_MAX,
                              note=f" (0 = greedy; below {MIN_TEMPERATURE:g} counts as greedy)")
    top_p = float_field(where, "top_p", sp.top_p, 0.0, 1.0, low_open=True)
    top_k = int_field(where, "top_k", sp.top_k, -1)
    stop = token_ids_field(where, "stop_token_ids", sp.stop_token_ids)
    refuse([(np.float32(top_p) == 0,  # the sampler's float32 buffer would hold 0: nothing kept
             f"top_p={top_p!r} must be in (0, 1] and stay > 0 as a float32 (>= 1e-45)"),
            (any(t < 0 for t in stop), f"stop_token_ids holds {[t for t in stop if t < 0][:5]}: token ids are >= 0")],
           prefix=f"{where} ")
    temperature = 0.0 if temperature < MIN_TEMPERATURE else temperature
    n, best_of = _num_sequences(where, sp, temperature)
    flags = {name: bool_field(where, name, getattr(sp, name)) for name in ("ignore_eos", "include_stop_str_in_output")}
    return replace(sp, max_tokens=max_tokens, temperature=temperature, top_k=max(top_k, 0), top_p=top_p,
                   # child i of a request draws with seed + i
                   seed=optional(int_field, where, "seed", sp.seed, 0, INT64_MAX - (best_of - 1)),
                   stop_token_ids=tuple(stop), stop=stop_strings_field(where, sp.stop), **flags,
                   min_tokens=int_field(where, "min_tokens", sp.min_tokens, 0, max_tokens), n=n,
                   best_of=None if sp.best_of is None else best_of,
                   **{name: float_field(where, name, getattr(sp, name), low, high, low_open=low_open)
                      for name, (low, high, low_open) in PENALTY_BOUNDS.items()},
                   logit_bias=optional(_logit_bias, where, "logit_bias", sp.logit_bias),
                   **{name: optional(int_field, where, name, getattr(sp, name), -1, MAX_LOGPROBS)  # -1: the vocabulary
                      for name in ("logprobs", "prompt_logprobs")},
                   structured_outputs=optional(_structured_outputs, where, "structured_outputs",
                                               sp.structured_outputs, request_id, flags["ignore_eos"]),
                   extra_args=optional(_extra_args, where, "extra_args", sp.extra_args))


PENALTY_BOUNDS = {"presence_penalty": (-2.0, 2.0, False), "frequency_penalty": (-2.0, 2.0, False),
                  "repetition_penalty": (0.0, FLOAT32_MAX, True)}
"""``(low, high, low_open)`` of each penalty (vLLM's bounds; a repetition penalty divides: > 0)."""


MAX_NUM_SEQUENCES = 16384
"""The most sequences one request may ask for (``n``, ``best_of``): vLLM's ``VLLM_MAX_N_SEQUENCES``."""
MAX_LOGPROBS = 20
"""The most log-probabilities per token (``logprobs``, ``prompt_logprobs``): vLLM's default ``max_logprobs``."""
MAX_LOGIT_BIAS = 100.0
"""Biases are clamped to ``[-100, 100]``, as vLLM and OpenAI do."""


def _num_sequences(where: str, sp, temperature: float) -> tuple[int, int]:
    """``(n, best_of)`` checked: ``1 <= n <= best_of <= MAX_NUM_SEQUENCES`` (best_of None: n)."""
    n = int_field(where, "n", sp.n, 1, MAX_NUM_SEQUENCES)
    best_of = n if sp.best_of is None else int_field(where, "best_of", sp.best_of, 1, MAX_NUM_SEQUENCES)
    refuse([(best_of < n, f"must be >= n={n} (it generates best_of and returns the n best)"),
            (best_of > n and temperature == 0, f"> n={n} needs sampling (temperature > 0): greedy sequences are "
             "identical, there is nothing to choose from")], prefix=f"{where} best_of={best_of} ")
    return n, best_of


def _logit_bias(where: str, name: str, bias) -> dict[int, float] | None:
    """``{token id: bias}`` with int keys >= 0 (numeric strings, as JSON sends them, count as ints)
    and finite biases clamped to ``[-100, 100]``; ``{}``: None."""
    if not isinstance(bias, Mapping):
        raise type_error(where, name, bias, "a dict {token id: bias}")
    out = {}
    for key, value in bias.items():
        # "²" and "١" pass str.isdigit(); JSON's numeric keys are ASCII digits only
        token = int(key) if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit() else key
        token = int_field(where, f"{name} key {key!r}", token, 0)
        value = float_field(where, f"{name}[{key!r}]", value, -FLOAT32_MAX, FLOAT32_MAX)
        out[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
    return out or None


def _extra_args(where: str, name: str, value) -> dict:
    """A copy of a mapping with str keys (free-form: its values are checked where used)."""
    if not isinstance(value, Mapping):
        raise type_error(where, name, value, "a dict {name: value}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise FieldTypeError(f"{where} {name} key {short(bad[0])} must be a str")
    return dict(value)


def _structured_outputs(where: str, name: str, value, request_id: str, ignore_eos: bool):
    """``structured_outputs`` checked: its own fields, and what it cannot go with."""
    if ignore_eos:
        raise ValueError(f"{where} ignore_eos=True cannot go with {name}: a complete output ends with "
                         "EOS, and the grammar allows nothing else after it")
    return StructuredOutputsParams.coerce(value, request_id).validate(request_id)
