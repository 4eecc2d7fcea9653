"""``SamplingParams``: how one request picks its tokens and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetlab.engine.structured_outputs_params import StructuredOutputsParams


@dataclass(slots=True)
class SamplingParams:
    """Per-request decoding settings.

    max_tokens: the most new tokens to generate (an int >= 1). The engine clamps it to what
      the request can hold, ``max_model_len - len(prompt)`` (a larger value means "until
      the model's length"), so it always fits the batch's int32 buffer.
    temperature: 0 means greedy; otherwise logits are divided by it before sampling. A
      number in ``[0, float32 max]`` (inf and NaN are refused). Temperatures below
      ``MIN_TEMPERATURE`` (1e-5) are greedy, the limit of sampling as T goes to 0: dividing
      float32 logits by a smaller T overflows them to inf and makes the draw meaningless.
    top_k: keep the k most likely tokens (0 or -1 = no limit, -1 being vLLM's spelling); an
      int >= -1, clamped by the engine to the vocabulary size (a k beyond it keeps every
      token, as 0 does).
    top_p: keep the smallest set of tokens whose probability reaches top_p (1.0 = all); a
      number in ``(0, 1]``, and > 0 still once rounded to float32.
    seed: None or an int in ``[0, 2**63)`` (the batch's int64 buffer); the same seed gives
      the same tokens whatever else shares the batch (each draw uses the seed and the
      token's index, not a shared generator).
    stop_token_ids: token ids (a sequence of ints >= 0, inside the vocabulary; at most the
      batch's ``max_stop_ids``): generation stops after emitting one (it stays in token_ids;
      its text, as EOS's, is left out of ``text`` unless ``include_stop_str_in_output``, as vLLM).
    stop: strings that end the output where one appears in its text (a string or a list of
      non-empty strings; needs a tokenizer): ``finish_reason="stop"`` and ``stop_reason`` the
      string; the text is cut before it (see :mod:`fleetlab.output.stop`).
    include_stop_str_in_output: keep the stop string (or the stop token's text) at the end of the
      text (True or False).
    ignore_eos: keep going past the model's EOS token (True or False).
    min_tokens: EOS and stop tokens are masked out until this many tokens exist; an int in
      ``[0, max_tokens]`` (clamped with ``max_tokens``).
    n: how many sequences to generate from the prompt (an int >= 1). The engine fans the
      request out into ``n`` child requests (:mod:`fleetlab.output.parallel_sampling`) that
      share the prompt's full KV blocks through the prefix cache; child ``i`` draws with
      seed ``seed + i`` (reproducible) and its outputs carry ``index = i``.
    best_of: None (= ``n``) or an int >= ``n``: generate ``best_of`` sequences and return the
      ``n`` with the highest cumulative log-probability (sampling only; not streamed).
    presence_penalty, frequency_penalty: numbers in ``[-2, 2]`` subtracted from the logit of
      every token already generated (presence: once; frequency: once per occurrence).
    repetition_penalty: a number > 0; the logit of every token in the prompt or the output
      is divided by it when positive and multiplied by it when negative (1 = off).
    logit_bias: None or ``{token id: bias}``, added to those logits (biases clamped to
      ``[-100, 100]``, as vLLM does). Bias, then penalties, then temperature, top-k, top-p.
    logprobs: None, or how many top log-probabilities to return per output token (0..20;
      -1 = the whole vocabulary where it is no larger), besides the chosen token's own.
      They come from the raw model output, before bias, penalties and temperature (vLLM's
      default ``logprobs_mode="raw_logprobs"``).
    prompt_logprobs: None, or the same for every prompt token after the first; a request
      that asks for them skips reading the prefix cache (as vLLM does), so that every prompt
      position is computed.
    structured_outputs: None, or the constraint the output must follow: a
      :class:`~fleetlab.structured_output.StructuredOutputsParams` or a dict of its fields
      (vLLM's: ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``; see
      :mod:`fleetlab.structured_output`). Not with ``ignore_eos`` (the grammar ends the output).
    extra_args: None or a dict with str keys, free-form (vLLM's ``extra_args``): a key that
      names one of the engine's own batch fields (``LLM(..., batch_fields=[Field("lora_id")])``)
      sets that field for the request, checked like ``add_request(extra=...)``; other keys are
      left for logits processors to read in ``request_values(sampling_params)``.

    numpy scalars count as the numbers they hold (``temperature=np.float32(0.7)``); a
    ``bool`` is not an int, and nothing else is converted: a wrong type raises
    ``TypeError`` (``fleetlab.errors.FieldTypeError``, also a ``ValueError``). The engine
    checks them when a request is added (``fleetlab.edge.sampling.check_sampling_params``).

    fleetlab defaults to greedy decoding (temperature 0) so that every output can be
    checked against the model's own forward pass.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] | list[str] | str | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    extra_args: dict | None = None
