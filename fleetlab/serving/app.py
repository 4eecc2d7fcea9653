"""The OpenAI-compatible HTTP app (FastAPI): ``build_app(engine, model_name, api_key=None, cors=None)``.

Endpoints:

- ``GET|HEAD /health``: 200 while the engine loop runs, 503 once it has stopped or while the
  server shuts down;
- ``GET  /v1/models`` and ``GET /v1/models/{id}``: the one served model (404 ``model_not_found``
  for any other id);
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI's request and response
  shapes (:mod:`fleetlab.serving.protocol`), ``stream=true`` answered with server-sent events;
- ``GET  /metrics``: Prometheus text (:mod:`fleetlab.serving.metrics`);
- ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``: vLLM's tokenizer routes
  (:mod:`fleetlab.serving.tokenization`); ``GET /version``: ``{"version": fleetlab's}``.

Any other path is a 404 whose message lists the routes there are.

With ``api_key`` set, every ``/v1`` route and the tokenizer routes want ``Authorization: Bearer
<api_key>`` and answer 401 without it (as vLLM's ``--api-key``); ``/health``, ``/metrics`` and
``/version`` stay open. ``cors``: keywords of Starlette's ``CORSMiddleware`` (``allow_origins``,
``allow_methods``, ``allow_headers``, ``allow_credentials``; ``serve --allowed-origins ...``);
None: no cross-origin headers, so a browser page from elsewhere cannot read the answers.

A request's life: parse the body as JSON and validate it (pydantic, then :meth:`check_supported`:
a field fleetlab would not apply is refused), tokenize here on the asyncio side (so the prompt
length is checked against ``max_model_len`` before anything is queued), queue every prompt of
the request with one ``AsyncLLM.add_requests`` (one engine turn, however many prompts and
choices), then send each step's new text (``RequestOutput.new_text``: the engine's output
processor detokenizes incrementally and cuts at stop strings, :class:`~fleetlab.output.text.TextStream`).
A client that hangs up, mid-stream or while waiting for a whole response, aborts its requests:
their KV blocks are free before the next engine step.

Choices: each of a prompt's ``n`` (or ``best_of``) choices is its own engine request, with the
settings of child ``i`` of :mod:`fleetlab.output.parallel_sampling` (seed ``seed + i``), so
they stream, stop and abort one by one; queued in one engine turn, they are admitted in the
same step and share the prompt's full KV blocks through the prefix cache, as ``LLM``'s own
``n`` does. Choice ``index`` is ``prompt index * n + i``, as in OpenAI's API. With ``best_of >
n`` the ``n`` of highest cumulative logprob are returned once all have finished.

Stopping (:meth:`OpenAIServing.drain`, called by :mod:`fleetlab.serving.shutdown` when the
server is told to stop): new requests are answered 503; those running may finish for up to the
shutdown timeout; then each one left is aborted and ends with an error event and ``data:
[DONE]`` (a whole response: a 503), so no handler is cancelled mid-way.

Errors are OpenAI-shaped (:mod:`fleetlab.serving.errors`): bad JSON, bad types, out-of-range
values, a prompt that does not fit, unsupported fields, more sequences than the server could ever
hold -> 400 naming the field; an unknown model -> 404; a full queue now -> 503. An unexpected
exception is a 500 and is logged; the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import fleetlab
from fleetlab.edge.sampling import check_sampling_params
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.output.parallel_sampling import child_sampling_params, select_best
from fleetlab.serving import protocol as P
from fleetlab.serving import tokenization
from fleetlab.serving.async_llm import AsyncLLM, RequestStream
from fleetlab.serving.chat_template import chat_prompt_ids, encode_text
from fleetlab.serving.errors import (
    BadRequest,
    EngineDead,
    NotFound,
    ServingError,
    ShuttingDown,
    Unauthorized,
    bad_request_from_engine,
    error_body,
)
from fleetlab.serving.metrics import CONTENT_TYPE, ServerMetrics
from fleetlab.serving.openai_logprobs import TokenStrings, chat_logprobs, completion_logprobs

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLM, model_name: str, api_key: str | None = None, cors: dict | None = None) -> FastAPI:
    """A FastAPI app serving ``engine`` under the name ``model_name`` (see the module docstring).

    The app starts the engine thread when it starts; it does not shut the engine down (its
    owner does: ``engine.shutdown()``), so one engine can outlive a server in tests.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield

    app = FastAPI(title="fleetlab", summary="An OpenAI-compatible server on fleetlab's engine", lifespan=lifespan)
    metrics = ServerMetrics(engine, model_name)
    server = OpenAIServing(engine, model_name, metrics)
    app.state.engine, app.state.metrics, app.state.serving = engine, metrics, server
    _add_error_handlers(app, metrics)
    if cors is not None:
        app.add_middleware(CORSMiddleware, **cors)

    @app.head("/health", include_in_schema=False)  # HEAD too (load balancers' probes)
    @app.get("/health")
    async def health():
        if server.draining:
            raise ShuttingDown("the server is shutting down", code="shutting_down")
        if not engine.is_healthy:
            raise EngineDead("the engine loop is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version():
        return {"version": fleetlab.__version__}

    keyed = [Depends(_bearer_check(api_key))] if api_key else []
    app.include_router(_tokenizer_routes(server, keyed))
    v1 = APIRouter(prefix="/v1", dependencies=keyed)

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [server.model_card()]}

    @v1.get("/models/{model_id:path}")  # a served name may hold "/" (a checkpoint path)
    async def model(model_id: str):
        server.check_model(model_id)
        return server.model_card()

    @v1.post("/completions")
    async def completions(raw_request: Request):
        request = P.parse_request(P.CompletionRequest, await raw_request.body())
        return await _cancel_on_disconnect(server.completion(request), raw_request)

    @v1.post("/chat/completions")
    async def chat_completions(raw_request: Request):
        request = P.parse_request(P.ChatCompletionRequest, await raw_request.body())
        return await _cancel_on_disconnect(server.chat(request), raw_request)

    app.include_router(v1)
    return app


def _tokenizer_routes(server: OpenAIServing, dependencies: list) -> APIRouter:
    """``/tokenize``, ``/detokenize``, ``/tokenizer_info`` (:mod:`fleetlab.serving.tokenization`)."""
    router, engine = APIRouter(dependencies=dependencies), server.engine

    @router.post("/tokenize")
    async def tokenize(raw_request: Request):
        body = await raw_request.body()
        return tokenization.tokenize(server.tokenizer("prompt"), body, engine.max_model_len, server.check_model)

    @router.post("/detokenize")
    async def detokenize(raw_request: Request):
        body = await raw_request.body()
        return tokenization.detokenize(server.tokenizer("tokens"), body, engine.vocab_size, server.check_model)

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenization.tokenizer_info(server.tokenizer(None))

    return router


def _bearer_check(api_key: str):
    """A FastAPI dependency: 401 unless the request carries ``Authorization: Bearer <api_key>``."""
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization")
        if given is None:
            raise Unauthorized("this server wants an API key: send the header 'Authorization: Bearer <key>'",
                               None, "invalid_api_key")
        if not secrets.compare_digest(given.encode(), expected):  # in constant time
            raise Unauthorized("incorrect API key", None, "invalid_api_key")

    return check


@dataclass(slots=True)
class _Choice:
    """One choice of a request (a prompt, or one of its ``n``): its engine request, stream and text so far.

    ``sampling``: its engine request's settings; ``prompt_index``: which prompt it continues;
    ``want_logprobs``: the client asked for logprobs (a ``best_of`` choice computes them anyway,
    to be ranked); ``echo``: the prompt's text to send before the first token (``echo=true``);
    ``logprobs``: ``(token id, TokenLogprobs or None)`` per position sent so far;
    ``echo_only``: ``echo`` with ``max_tokens=0``: the engine makes one token, which is not sent;
    ``stop_reason``: vLLM's (the stop string or stop token id that ended it, else None).
    """

    index: int
    prompt_ids: list[int]
    sampling: SamplingParams | None = None
    prompt_index: int = 0
    want_logprobs: bool = False
    echo: str | None = None
    echo_only: bool = False
    stream: RequestStream | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_tokens: int = 0  # output tokens (the usage count)
    content: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float | None = None
    text_offset: int = 0
    first_seen: bool = False
    gaps_observed: int = 0  # inter-token gaps already in /metrics
    closed: bool = False


class OpenAIServing:
    """What the endpoints do, apart from HTTP: requests in, responses or SSE events out."""

    def __init__(self, engine: AsyncLLM, model_name: str, metrics: ServerMetrics):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.created = int(time.time())
        self.live: set[RequestStream] = set()  # the engine requests of unfinished HTTP requests
        self.draining = False  # stopping: new requests are refused (503)
        self.closing = False  # stopped waiting: what still runs is ended with an error
        self.tokens = TokenStrings(engine.tokenizer, engine.vocab_size)  # how logprobs show tokens

    def model_card(self) -> dict:
        """The served model, as ``/v1/models`` lists it."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "fleetlab",
                "max_model_len": self.engine.max_model_len}

    def tokenizer(self, param: str | None):
        """The engine's tokenizer (400 naming ``param`` when the server has none)."""
        if self.engine.tokenizer is None:
            raise BadRequest("this server has no tokenizer", param, "unsupported")
        return self.engine.tokenizer

    def check_model(self, name: str | None) -> None:
        """404 ``model_not_found`` unless ``name`` is the served model (None: the served model)."""
        if name is not None and name != self.model_name:
            raise NotFound(f"the model {name!r} does not exist; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    # ----- endpoints -----
    async def completion(self, req: P.CompletionRequest):
        """``POST /v1/completions``: one engine request per choice; a JSON body or an SSE stream."""
        self._check_common(req)
        prompts = [p if isinstance(p, list) else self._encode(p) for p in req.prompts]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        choices = [self._choice(i, ids, req, "prompt") for i, ids in enumerate(prompts)]
        # max_tokens=0 (with echo): the prompt's logprobs need a forward, so one token is made and not sent
        sp = self._sampling_params(req, max(max_tokens, 1), choices, "prompt")
        if req.echo:
            for c, p in zip(choices, req.prompts):
                c.echo = p if isinstance(p, str) else self._decode(c.prompt_ids)
                c.echo_only = max_tokens == 0
        return await self._run(req, "cmpl", "text_completion", self._fan_out(choices, sp, req), sp, "prompt")

    async def chat(self, req: P.ChatCompletionRequest):
        """``POST /v1/chat/completions``: the messages through the chat template, then as a completion."""
        self._check_common(req)
        messages = [{"role": m.role, "content": m.text} for m in req.messages]
        try:
            ids = chat_prompt_ids(self.engine.tokenizer, messages)
        except Exception as e:  # a template that refuses these messages (e.g. roles out of order)
            raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from e
        choice = self._choice(0, ids, req, "messages")
        max_tokens = req.max_new_tokens
        if max_tokens is None:
            max_tokens = self.engine.max_model_len - len(ids)
        sp = self._sampling_params(req, max_tokens, [choice], "messages")
        return await self._run(req, "chatcmpl", "chat.completion", self._fan_out([choice], sp, req), sp, "messages")

    def _fan_out(self, prompts: list[_Choice], sp: SamplingParams, req) -> list[_Choice]:
        """Each prompt's ``best_of`` (default ``n``) choices, child ``i`` with its own settings."""
        best_of = sp.best_of or sp.n
        return [_Choice(p.index * best_of + i, p.prompt_ids, sampling=child_sampling_params(sp, i),
                        prompt_index=p.index, want_logprobs=req.num_logprobs is not None, echo=p.echo,
                        echo_only=p.echo_only)
                for p in prompts for i in range(best_of)]

    # ----- request checks -----
    def _check_common(self, req) -> None:
        self.check_model(req.model)
        req.check_supported()
        if self.engine.tokenizer is None and not isinstance(req, P.CompletionRequest):
            raise BadRequest("this server has no tokenizer: send prompt token ids to /v1/completions", "messages")

    def _encode(self, text: str) -> list[int]:
        if self.engine.tokenizer is None:
            raise BadRequest("this server has no tokenizer: send the prompt as token ids", "prompt")
        return encode_text(self.engine.tokenizer, text)

    def _decode(self, ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)

    def _choice(self, index: int, ids: list[int], req, prompt_field: str) -> _Choice:
        limit = self.engine.max_model_len
        if not ids:
            raise BadRequest(f"{prompt_field} is empty", prompt_field, "invalid_value")
        outside = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if outside:  # checked here too: echo decodes the prompt before the engine sees it
            raise BadRequest(f"{prompt_field} holds token ids outside the vocabulary [0, {self.engine.vocab_size}): "
                             f"{outside[:5]}", prompt_field, "invalid_value")
        if len(ids) >= limit:
            raise BadRequest(f"this model's maximum context length is {limit} tokens; the {prompt_field} has "
                             f"{len(ids)} tokens, which leaves no room for an answer", prompt_field,
                             "context_length_exceeded")
        return _Choice(index, ids)  # a prompt: _fan_out makes its choices

    def _sampling_params(self, req, max_tokens: int, choices: list[_Choice], prompt_field: str) -> SamplingParams:
        limit = self.engine.max_model_len
        longest = max(len(c.prompt_ids) for c in choices)
        if longest + max_tokens > limit:
            raise BadRequest(f"this model's maximum context length is {limit} tokens; you asked for {longest} "
                             f"{prompt_field} tokens + max_tokens={max_tokens} output tokens", "max_tokens",
                             "context_length_exceeded")
        echo_logprobs = getattr(req, "echo", False) and req.num_logprobs is not None
        constraint, _ = req.structured_outputs_fields()
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p,
                            top_k=0 if req.top_k in (None, -1) else req.top_k, seed=req.seed,
                            stop=req.stop_strings, include_stop_str_in_output=req.include_stop_str_in_output,
                            stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                            min_tokens=req.min_tokens, n=req.n, best_of=req.best_of,
                            presence_penalty=req.presence_penalty or 0.0,
                            frequency_penalty=req.frequency_penalty or 0.0,
                            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                            logit_bias=req.logit_bias, logprobs=req.num_logprobs,
                            prompt_logprobs=req.num_logprobs if echo_logprobs else None,
                            structured_outputs=constraint)
        try:  # once, before any of the request's prompts is queued: a 400 for all of it, never half of it queued
            return check_sampling_params(sp, "-")
        except ValueError as e:
            raise self._bad_request(e, prompt_field, req) from e

    def _bad_request(self, error: ValueError, prompt_field: str, req) -> BadRequest:
        """An engine refusal as a 400. A refusal of the constraint names the request field it came
        from (``response_format...`` or ``structured_outputs``); a vocabulary that cannot spell it
        is ``unsupported`` (this model cannot serve it; another might)."""
        text = re.sub(r"^request '[^']*': ", "", str(error))
        constraint, where = req.structured_outputs_fields()
        refusal = bad_request_from_engine(error, prompt_field)
        if not text.startswith("structured_outputs") and (refusal.param is not None or constraint is None):
            return refusal
        # a grammar library's own message names no field: the constraint is the field it refused
        if "cannot be spelled" in text:
            return BadRequest(f"{where}: the served model cannot write these structured outputs: {text}", where,
                              "unsupported")
        return BadRequest(text if text.startswith(where) else f"{where}: {text}", where, "invalid_value")

    # ----- running -----
    async def _run(self, req, prefix: str, obj: str, choices: list[_Choice], sp: SamplingParams, prompt_field: str):
        if self.draining:
            raise ShuttingDown("the server is shutting down; it takes no new requests", code="shutting_down")
        self._check_fits(choices, req, prompt_field)
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        requests = [{"sampling_params": c.sampling, "prompt_token_ids": c.prompt_ids,
                     "request_id": response_id if len(choices) == 1 else f"{response_id}-{c.index}"}
                    for c in choices]
        try:  # every prompt in one engine turn
            streams = await self.engine.add_requests(requests)
        except ValueError as e:
            raise self._bad_request(e, prompt_field, req) from e
        self._attach(choices, streams, sp)
        if self.closing:  # queued while the server stopped waiting for requests to finish
            self._close(choices)
            raise ShuttingDown("the server is shutting down; it takes no new requests", code="shutting_down")
        created = int(time.time())
        logger.debug("%s: %d prompt(s), %s", response_id, len(choices), sp)
        if req.stream:
            events = self._events(response_id, created, obj, choices, req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for _ in self._step_texts(choices):
                pass
        finally:
            self._close(choices)
        errors = [c for c in choices if c.finish_reason == "error"]
        if errors:
            raise ServingError(f"the engine failed request {response_id}", code="engine_error")
        chat = obj == "chat.completion"
        choices = self._best(choices, sp.n)
        body = [{"index": c.index, "text": "".join(c.content), "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason,
                 "logprobs": None if not c.want_logprobs else chat_logprobs(self.tokens, c.logprobs) if chat
                 else completion_logprobs(self.tokens, c.logprobs)} for c in choices]
        use = self._usage(choices)
        build = P.chat_response if chat else P.completion_response
        return JSONResponse(build(response_id, created, self.model_name, body, use))

    def _attach(self, choices: list[_Choice], streams: list[RequestStream], sp: SamplingParams) -> None:
        """The queued requests' streams on their choices, and each prompt's parameters in ``/metrics``."""
        for c, stream in zip(choices, streams):
            c.stream = stream
            self.live.add(stream)
        for _ in {c.prompt_index for c in choices}:
            self.metrics.observe_params(sp.n, 0 if choices[0].echo_only else sp.max_tokens)

    def _check_fits(self, choices: list[_Choice], req, prompt_field: str) -> None:
        """400 for a request that could never be queued, however long it waited (a full queue
        now is a 503: retry later)."""
        capacity = self.engine.capacity
        if capacity is None or len(choices) <= capacity:
            return
        per_prompt = len(choices) // (1 + max(c.prompt_index for c in choices))
        param = prompt_field if per_prompt <= capacity else "best_of" if req.best_of else "n"
        raise BadRequest(f"this request needs {len(choices)} sequences ({len(choices) // per_prompt} prompt(s) x "
                         f"{per_prompt}); the server holds at most {capacity} at once (max_num_seqs + "
                         f"max_queue_len), so it can never be served: send fewer {param}", param, "invalid_value")

    @staticmethod
    def _best(choices: list[_Choice], n: int) -> list[_Choice]:
        """With ``best_of > n``: each prompt's ``n`` choices of highest cumulative logprob, renumbered."""
        if len(choices) == n * (1 + max(c.prompt_index for c in choices)):
            return choices
        best = []
        for p in sorted({c.prompt_index for c in choices}):
            group = select_best([c for c in choices if c.prompt_index == p], n, lambda c: c.cumulative_logprob)
            for i, c in enumerate(group):
                c.index = p * n + i
            best += group
        return best

    async def _events(self, response_id: str, created: int, obj: str, choices: list[_Choice], include_usage: bool):
        """The SSE body of a streamed request."""
        chat = obj == "chat.completion"
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(c: _Choice, text: str, finish: str | None, positions: list) -> str:
            if chat:
                delta = {"content": text} if text or not finish else {}
                logprobs = chat_logprobs(self.tokens, positions) if c.want_logprobs else None
                return P.sse(P.chat_chunk(response_id, created, self.model_name, c.index, delta, finish, include_usage,
                                          logprobs, c.stop_reason))
            logprobs = None
            if c.want_logprobs:
                logprobs = completion_logprobs(self.tokens, positions, c.text_offset)
                c.text_offset += sum(len(t) for t in logprobs["tokens"])
            return P.sse(P.completion_chunk(response_id, created, self.model_name, c.index, text, finish,
                                            include_usage, logprobs, c.stop_reason))

        try:
            if chat:  # the role first, as OpenAI does
                for c in choices:
                    yield P.sse(P.chat_chunk(response_id, created, self.model_name, c.index,
                                             {"role": "assistant", "content": ""}, None, include_usage))
            async for c, text, positions in self._step_texts(choices):
                if c.finish_reason == "error":
                    yield P.sse(error_body(f"the engine failed request {response_id}", "internal_error",
                                           None, "engine_error"))
                    break
                # a chunk per step that made tokens, even when they add no text yet (half a
                # character, a special token, a possible stop string held back), as vLLM does
                yield chunk(c, text, c.finish_reason, positions)
            else:
                if include_usage:
                    yield P.sse(P.usage_chunk(response_id, created, self.model_name, chunk_obj, self._usage(choices)))
            yield P.SSE_DONE
        except ServingError as e:  # the engine died, or the server is stopping: say so, then end the stream
            yield P.sse(e.body())
            yield P.SSE_DONE
        finally:  # also on a client that hung up (the task is cancelled): abort what still runs
            self._close(choices)

    async def _step_texts(self, choices: list[_Choice]):
        """Yield ``(choice, new text, new positions)`` as outputs arrive, until every choice is
        finished; ``new positions``: ``(token id, TokenLogprobs or None)`` of the tokens the
        output added (after the prompt's, with echo), when the client asked for logprobs.

        Sets ``finish_reason`` and ``stop_reason`` on the choice whose output finished it (the
        engine's: ``"stop"`` with the stop string, the stop token's id, or None at EOS).
        """
        async for c, out in _merge(choices):
            if c.finish_reason is not None:
                continue
            text = "" if c.echo_only else out.new_text
            c.num_tokens = 0 if c.echo_only else len(out.token_ids)
            positions = self._new_positions(c, out)
            if c.echo is not None:
                text, c.echo = c.echo + text, None
            if out.new_token_ids and not c.first_seen:
                c.first_seen = True
                self.metrics.observe_first_token(c.stream.times)
            c.gaps_observed = self.metrics.observe_token_gaps(c.stream.times, c.gaps_observed)
            if out.finished:
                c.finish_reason = "length" if c.echo_only else out.finish_reason
                c.stop_reason = None if c.echo_only else out.stop_reason
            c.content.append(text)
            yield c, text, positions
            if all(x.finish_reason is not None for x in choices):
                return

    @staticmethod
    def _new_positions(c: _Choice, out) -> list:
        """The logprob positions ``out`` adds to choice ``c`` (its prompt's first, with echo)."""
        c.cumulative_logprob = out.cumulative_logprob
        if not c.want_logprobs:
            return []
        new = [] if c.echo_only else out.new_token_ids
        items = (out.logprobs or [])[len(out.logprobs or []) - len(new):] if new else []
        positions = list(zip(new, items))
        if c.echo is not None:
            positions = list(zip(c.prompt_ids, out.prompt_logprobs or [None] * len(c.prompt_ids))) + positions
        c.logprobs += positions
        return positions

    def _usage(self, choices: list[_Choice]) -> dict:
        """Each prompt's tokens once, however many choices continue it; every choice's output tokens."""
        prompts = {c.prompt_index: len(c.prompt_ids) for c in choices}
        return P.usage(sum(prompts.values()), sum(c.num_tokens for c in choices))

    def _close(self, choices: list[_Choice]) -> None:
        """Abort unfinished engine requests and record every choice's metrics (once)."""
        for c in choices:
            if c.stream is None or c.closed:
                continue
            c.closed = True
            self.live.discard(c.stream)
            if not c.stream.finished:
                c.stream.abort()
            if c.finish_reason is None:
                c.finish_reason = "abort"
            c.gaps_observed = self.metrics.observe_token_gaps(c.stream.times, c.gaps_observed)
            self.metrics.observe_finished(c.stream.times, len(c.prompt_ids), c.num_tokens, c.finish_reason)

    # ----- stopping -----
    async def drain(self, timeout: float, forced: Callable[[], bool] = lambda: False) -> None:
        """Stop taking requests; wait up to ``timeout`` seconds (or until ``forced()``) for those
        running to finish; then end each one left with a :class:`ShuttingDown` error."""
        self.draining = True
        deadline = time.monotonic() + timeout
        if self.live and timeout > 0:
            logger.info("shutdown: waiting up to %.1f s for %d requests to finish", timeout, len(self.live))
        while self.live and time.monotonic() < deadline and not forced():
            await asyncio.sleep(0.05)
        self.closing = True
        if self.live:
            logger.info("shutdown: stopping %d unfinished requests", len(self.live))
        for stream in list(self.live):
            stream.fail(ShuttingDown("the server is shutting down: this request was stopped before it finished",
                                     code="shutting_down"))


async def _merge(choices: list[_Choice]):
    """Yield ``(choice, output)`` from every choice's stream as outputs arrive."""
    if len(choices) == 1:
        c = choices[0]
        async for out in c.stream:
            yield c, out
        return
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(c: _Choice):
        try:
            async for out in c.stream:
                inbox.put_nowait((c, out))
        except Exception as e:
            inbox.put_nowait((c, e))
        finally:
            inbox.put_nowait((c, None))

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        live = len(tasks)
        while live:
            c, item = await inbox.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()


async def _cancel_on_disconnect(work, request: Request):
    """Run the endpoint's coroutine, cancelling it if the client hangs up first.

    A non-streamed request holds its engine requests until the whole answer is ready; without
    this, a client that gave up would keep them running (and their KV blocks held) to the end.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return Response(status_code=499)  # nobody reads it: the client is gone


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ----- errors -----
def _routes(app: FastAPI) -> str:
    """``"GET /health, POST /v1/completions, ..."``: the app's routes, as its OpenAPI schema lists them."""
    paths = app.openapi()["paths"]  # built once, then cached by FastAPI
    return ", ".join(f"{'|'.join(m.upper() for m in methods)} {path}" for path, methods in paths.items())


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """OpenAI-shaped error bodies; ``request_errors_total`` counts the refusals of the API's own
    routes (an unknown path or method is nobody's request to the model: not counted)."""

    def answer(status: int, body: dict, headers: dict | None = None, count: bool = True) -> JSONResponse:
        if count:
            metrics.observe_error(status)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ServingError)
    async def serving_error(request, exc: ServingError):
        expected = isinstance(exc, (EngineDead, ShuttingDown)) or exc.code == "queue_full"
        if int(exc.status_code) >= 500 and not expected:
            logger.error("%s %s: %s", request.method, request.url.path, exc.message)
        headers = {"Retry-After": "1"} if exc.code == "queue_full" else None
        if isinstance(exc, Unauthorized):
            headers = {"WWW-Authenticate": "Bearer"}
        return answer(int(exc.status_code), exc.body(), headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        return answer(400, P.validation_error(exc.errors()).body())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):  # 404 route, 405 method...
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = str(exc.detail)
        if exc.status_code in (404, 405):
            message = f"{message}: {request.method} {request.url.path}; this server answers {_routes(app)}"
        return answer(exc.status_code, error_body(message, kind), getattr(exc, "headers", None), count=False)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return answer(500, error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"))
