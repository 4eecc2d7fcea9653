"""``RequestOutput``: what the engine hands back for one request, every step it makes progress."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """One request's result so far.

    token_ids: the generated ids (a final EOS or stop token is included).
    new_token_ids: the ids this step added (what a stream sends); all of ``token_ids`` in
      the outputs ``generate`` returns.
    text: when the engine has a tokenizer: the text so far (``token_ids`` decoded without special
      tokens, incrementally: see :mod:`fleetlab.output.text`), less what is held back for now (half a
      character; the end of the text while it may begin a stop string); once finished, all of it
      (cut at a stop string; without the text of the stop token that ended it). None without a tokenizer.
    new_text: what this step added to ``text`` (what a stream sends; ``""`` when the new tokens
      complete no character yet); all of ``text`` in the outputs ``generate`` returns.
    finish_reason: ``"stop"`` (EOS, a stop token or a stop string), ``"length"`` (max_tokens or the
      model's maximum length), ``"abort"`` (``LLM.abort``), ``"error"`` (see ``error``),
      or None while unfinished.
    stop_reason: what stopped it with ``"stop"``: the stop string, or the stop token id
      (``stop_token_ids``); None at EOS (vLLM's meaning).
    metrics: arrival / first-scheduled / first-token / finish times (``time.perf_counter``
      seconds) and ``num_preemptions``.
    index: which of the request's ``n`` sequences this is (``SamplingParams.n``; 0 when n = 1).
    logprobs: with ``SamplingParams.logprobs``: a :class:`~fleetlab.engine.logprobs.TokenLogprobs`
      per token of ``token_ids``; ``cumulative_logprob`` their sum (also set for ``best_of``).
    prompt_logprobs: with ``SamplingParams.prompt_logprobs``: per prompt token, None for the
      first, then its ``TokenLogprobs``.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    new_token_ids: list[int] = field(default_factory=list)
    index: int = 0
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None
    new_text: str = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def from_request(cls, req, new_token_ids: list[int]) -> RequestOutput:
        """The output of the scheduler's ``Request`` ``req`` after a step that added ``new_token_ids``."""
        metrics = {"arrival_time": req.arrival_time, "first_scheduled_time": req.first_scheduled_time,
                   "first_token_time": req.first_token_time, "finish_time": req.finish_time,
                   "num_preemptions": req.num_preemptions}
        return cls(req.request_id, req.prompt_token_ids, list(req.output_token_ids), None, req.finish_reason,
                   req.error, metrics, new_token_ids)
