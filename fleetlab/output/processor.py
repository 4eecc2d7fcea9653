"""``OutputProcessor``: what happens to a step's outputs after the engine core (vLLM's split).

The core's step returns each request's progress as token ids (``RequestOutput`` s from
``Scheduler.update``) and the runner's message. The front door (``LLM``) hands both here, and
this turns them into what the user gets, in order:

1. **text and stop strings** (:class:`~fleetlab.output.text.TextStream`, one per sequence, when
   the engine has a tokenizer): the step's new tokens are detokenized incrementally into
   ``new_text`` (and ``text``, all of it so far); an output whose text now holds a stop string is
   cut there and finished (``finish_reason="stop"``, ``stop_reason`` the string); its id is
   returned so that the front door aborts it in the scheduler. As in vLLM, the text of the stop
   token that ended a request (EOS, or one of ``stop_token_ids``) is left out unless
   ``include_stop_str_in_output`` (the token stays in ``token_ids``);
2. **logprobs** (:class:`~fleetlab.output.logprobs.LogprobsCollector`): each request's lists,
   kept across steps, put on its outputs;
3. **stop reasons**: a request stopped by one of its ``stop_token_ids`` names it;
4. **parallel-sampling fan-in** (:mod:`fleetlab.output.parallel_sampling`): a child's output
   becomes its parent's, with ``index``; with ``best_of``, the best ``n`` at the end.
"""

from __future__ import annotations

import time

from fleetlab.engine.outputs import RequestOutput
from fleetlab.output.logprobs import LogprobsCollector
from fleetlab.output.parallel_sampling import ParentRequest
from fleetlab.output.text import TextStream


class OutputProcessor:
    """The output side of one engine (see the module docstring).

    Args:
      tokenizer: decodes the text (None: outputs carry token ids only);
      eos_token_id: the model's EOS token (a stop at EOS has no ``stop_reason``).
    """

    def __init__(self, tokenizer, eos_token_id: int | None):
        self.tokenizer, self.eos_token_id = tokenizer, eos_token_id
        self.logprobs = LogprobsCollector()
        self.parents: dict[str, ParentRequest] = {}  # parent id -> parent, while a child runs
        self._parent_of: dict[str, ParentRequest] = {}  # child request id -> its parent
        self._requests: dict[str, object] = {}  # request id -> its SamplingParams, while it runs
        self._texts: dict[str, TextStream] = {}

    def add(self, request, parent: ParentRequest | None = None) -> None:
        """Follow ``request`` (a checked scheduler ``Request``; ``parent``: the request it is a child of)."""
        rid, sp = request.request_id, request.sampling_params
        if parent is not None:
            self.parents[parent.request_id] = parent
            self._parent_of[rid] = parent
        if self.tokenizer is not None:
            self._texts[rid] = TextStream(self.tokenizer, request.prompt_token_ids, sp.stop,
                                          sp.include_stop_str_in_output, sp.min_tokens)
        self._requests[rid] = sp
        self.logprobs.add(request)

    def process(self, outputs: list[RequestOutput], result=None) -> tuple[list[RequestOutput], list[str]]:
        """The user's outputs of a step (``result``: its ``ModelRunnerOutput``; None for aborts),
        and the ids of the requests a stop string ended (still running in the scheduler)."""
        stopped = [out.request_id for out in outputs if self._add_text(out)]
        self.logprobs.collect(outputs, result)
        for out in outputs:
            if out.finished:
                self._finish(out)
        return self._fan_in(outputs), stopped

    def _add_text(self, out: RequestOutput) -> bool:
        """``out``'s new text; cut at a stop string its new tokens complete. True if that
        ended a request the scheduler still runs."""
        stream = self._texts.get(out.request_id)
        if stream is None:
            return False
        running = not out.finished
        # the tokens the stream has not seen: this step's new ones, and any of a step a caller drove
        # through the scheduler itself (notebook 12 does), so the text always covers all of token_ids.
        # The scheduler's "stop" is always its last token's (EOS or a stop token).
        unseen = out.token_ids[stream.num_tokens:]
        out.new_text = stream.push(unseen, stopped_on_token=out.finish_reason == "stop")
        if out.finished or stream.stopped:
            out.new_text += stream.finish()
        out.text = stream.text[:stream.sent]
        if not stream.stopped or out.finish_reason in ("abort", "error"):  # an abort or an error stays what it is
            return False
        drop = len(out.token_ids) - stream.num_kept_tokens
        if drop:
            del out.new_token_ids[max(0, len(out.new_token_ids) - drop):]
            del out.token_ids[stream.num_kept_tokens:]
        out.finish_reason, out.stop_reason, out.error = "stop", stream.stop_reason, None
        if running:
            out.metrics["finish_time"] = time.perf_counter()
        return running

    def _finish(self, out: RequestOutput) -> None:
        """Its stop reason; the request is forgotten."""
        sp = self._requests.pop(out.request_id, None)
        stream = self._texts.pop(out.request_id, None)
        if stream is not None and stream.stopped:
            return  # a stop string ended it: its stop reason is set already
        last = out.token_ids[-1] if out.token_ids else None
        by_token = out.finish_reason == "stop" and sp is not None
        if by_token and last in sp.stop_token_ids and (last != self.eos_token_id or sp.ignore_eos):
            out.stop_reason = last

    def _fan_in(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs as their parents'."""
        fanned_in = []
        for out in outputs:  # a finished child is forgotten; so is its parent once every child finished
            parent = (self._parent_of.pop if out.finished else self._parent_of.get)(out.request_id, None)
            fanned_in += [out] if parent is None else parent.process(out)
            if parent is not None and parent.finished:
                del self.parents[parent.request_id]
        return fanned_in
