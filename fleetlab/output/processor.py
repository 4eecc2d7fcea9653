"""``OutputProcessor``: what happens to a step's outputs after the engine core (vLLM's split).

The core's step returns each request's progress as token ids (``RequestOutput`` s from
``Scheduler.update``) and the runner's message. The front door (``LLM``) hands both here, and
this turns them into what the user gets, in order:

1. **stop strings** (:mod:`fleetlab.output.stop`): an output whose text now holds one is cut
   there and finished (``finish_reason="stop"``, ``stop_reason`` the string); its id is
   returned so that the front door aborts it in the scheduler;
2. **logprobs** (:class:`~fleetlab.output.logprobs.LogprobsCollector`): each request's lists,
   kept across steps, put on its outputs;
3. **stop reasons**: a request stopped by one of its ``stop_token_ids`` names it;
4. **parallel-sampling fan-in** (:mod:`fleetlab.output.parallel_sampling`): a child's output
   becomes its parent's, with ``index``; with ``best_of``, the best ``n`` at the end;
5. **text**: a finished output is detokenized (a stream decodes its own deltas); as in vLLM,
   the text of the stop token that ended it (EOS, or one of ``stop_token_ids``) is left out
   unless ``include_stop_str_in_output`` (the token stays in ``token_ids``).
"""

from __future__ import annotations

import time

from fleetlab.engine.outputs import RequestOutput
from fleetlab.output.logprobs import LogprobsCollector
from fleetlab.output.parallel_sampling import ParentRequest
from fleetlab.output.stop import StopStrings


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
        self._stops: dict[str, StopStrings] = {}

    def add(self, request, parent: ParentRequest | None = None) -> None:
        """Follow ``request`` (a checked scheduler ``Request``; ``parent``: the request it is a child of)."""
        rid, sp = request.request_id, request.sampling_params
        if parent is not None:
            self.parents[parent.request_id] = parent
            self._parent_of[rid] = parent
        if sp.stop:
            self._stops[rid] = StopStrings(self.tokenizer, sp)
        self._requests[rid] = sp
        self.logprobs.add(request)

    def process(self, outputs: list[RequestOutput], result=None) -> tuple[list[RequestOutput], list[str]]:
        """The user's outputs of a step (``result``: its ``ModelRunnerOutput``; None for aborts),
        and the ids of the requests a stop string ended (still running in the scheduler)."""
        stopped = [out.request_id for out in outputs if self._apply_stop_strings(out)]
        self.logprobs.collect(outputs, result)
        for out in outputs:
            if out.finished:
                self._finish(out)
        return self._fan_in(outputs), stopped

    def _apply_stop_strings(self, out: RequestOutput) -> bool:
        """Cut ``out`` at a stop string its new tokens complete; True if the scheduler still runs it."""
        stops = self._stops.get(out.request_id)
        found = stops.check(out.token_ids, len(out.new_token_ids)) if stops is not None else None
        if found is None:
            return False
        running = not out.finished
        stop, num_tokens, text = found
        del out.new_token_ids[len(out.new_token_ids) - (len(out.token_ids) - num_tokens):]
        del out.token_ids[num_tokens:]
        out.finish_reason, out.stop_reason, out.text, out.error = "stop", stop, text, None
        if running:
            out.metrics["finish_time"] = time.perf_counter()
        return running

    def _finish(self, out: RequestOutput) -> None:
        """Its stop reason and text; the request is forgotten."""
        sp = self._requests.pop(out.request_id, None)
        if self._stops.pop(out.request_id, None) is not None and out.stop_reason is not None:
            return  # a stop string ended it: its text and stop reason are set already
        last = out.token_ids[-1] if out.token_ids else None
        # The scheduler's "stop" is its last token's (EOS or a stop token); a stop string returned above.
        by_token = out.finish_reason == "stop" and sp is not None
        if by_token and last in sp.stop_token_ids and (last != self.eos_token_id or sp.ignore_eos):
            out.stop_reason = last
        if self.tokenizer is not None:  # as vLLM: a stop token's text is not output unless asked for
            ids = out.token_ids[:-1] if by_token and not sp.include_stop_str_in_output else out.token_ids
            out.text = self.tokenizer.decode(ids, skip_special_tokens=True)

    def _fan_in(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs as their parents'."""
        fanned_in = []
        for out in outputs:  # a finished child is forgotten; so is its parent once every child finished
            parent = (self._parent_of.pop if out.finished else self._parent_of.get)(out.request_id, None)
            fanned_in += [out] if parent is None else parent.process(out)
            if parent is not None and parent.finished:
                del self.parents[parent.request_id]
        return fanned_in
