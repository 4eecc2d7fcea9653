"""``AsyncLLM``: the engine loop every serving engine has, around fleetlab's ``LLM``.

``LLM`` is not thread-safe and its ``step()`` blocks, while a web server answers many clients
on an asyncio event loop. So one background **engine thread** owns the ``LLM`` and does
nothing but::

    loop:
        take every command waiting in the inbox (add requests / abort one / stop);
        if requests are unfinished: outputs = llm.step()
                                    hand each output to its request's stream (on its event loop)
        else: sleep until the next command arrives

The asyncio side never touches the ``LLM``: it puts commands into a thread-safe inbox and reads
outputs from one ``asyncio.Queue`` per request (:class:`RequestStream`), filled through
``loop.call_soon_threadsafe``. An abort (``AsyncLLM.abort``, or a stream closed early, or a
client that hung up) is taken at the top of the next loop turn, so the request's KV blocks are
free within one engine step. :meth:`AsyncLLM.add_requests` queues many requests (the prompts of
one HTTP request) as one command, so they all join in one loop turn.

The engine thread also times each request (:class:`StreamTimes`, stamped where the step ran,
as vLLM stamps its engine core's timestamps): when it was queued, first scheduled, and when each
step that gave it tokens ended.

    engine = AsyncLLM(LLM(model, tokenizer))
    async for out in engine.generate(prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=8)):
        print(out.new_token_ids, out.finish_reason)
    engine.shutdown()

Only ``LLM``'s public methods are used: ``add_request``, ``step`` (called in one place,
:meth:`AsyncLLM._step`), ``abort``, ``has_unfinished_requests`` and ``stats``; and, from the
asyncio side, ``llm.structured_outputs.precompile`` (thread-safe): a request's grammar compiles
before the request reaches the engine thread, so a refusal comes back before it is queued.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

from fleetlab.engine.outputs import RequestOutput
from fleetlab.engine.sampling_params import SamplingParams
from fleetlab.serving.engine_stats import IterationTokens, iteration_buckets, snapshot
from fleetlab.serving.errors import EngineDead, Overloaded

logger = logging.getLogger(__name__)

_STOP = "stop"


@dataclass(slots=True)
class _Add:
    streams: list[RequestStream]
    requests: list[dict]  # LLM.add_request keywords, one dict per stream
    future: asyncio.Future


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class StreamTimes:
    """A request's life in ``time.perf_counter`` seconds (vLLM's request timestamps):

    - ``arrival``: ``add_request(s)`` was called (the asyncio side);
    - ``queued``: the engine thread handed it to ``LLM.add_request``;
    - ``scheduled``: the start of the first step that scheduled it;
    - ``first_token`` / ``last_token``: the end of the first / latest step that gave it tokens;
    - ``token_gaps``: the time between consecutive steps that gave it tokens (inter-token
      latencies: one per step, however many tokens a step gave, as with speculative decoding).

    Only the engine thread writes the engine stamps, each before it hands the request the output
    they belong to, so the asyncio side reads them complete.
    """

    arrival: float = field(default_factory=time.perf_counter)
    queued: float | None = None
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    token_gaps: list[float] = field(default_factory=list)

    def tokens_at(self, now: float) -> None:
        """A step that ended at ``now`` gave the request tokens."""
        if self.first_token is None:
            self.first_token = now
        else:
            self.token_gaps.append(now - self.last_token)
        self.last_token = now


class RequestStream:
    """The outputs of one request, as an async iterator of :class:`~fleetlab.RequestOutput`.

    Each item carries the ``new_token_ids`` (and ``new_text``) since the previous item; when the consumer falls
    behind the engine, the outputs waiting are merged into one. The last item has
    ``finish_reason`` set. Closing a stream before it finishes (``abort()``) aborts the request.
    """

    def __init__(self, request_id: str, engine: AsyncLLM, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held: BaseException | None = None  # an error met while merging, raised by the next read
        self.finished = False
        self.finish_reason: str | None = None
        self.num_output_tokens = 0
        self.times = StreamTimes()

    def _put(self, item) -> None:  # on the event loop
        self._queue.put_nowait(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._held is not None:
            out, self._held = self._held, None
        else:
            out = await self._queue.get()
        if isinstance(out, BaseException):
            self.finished = True
            raise out
        while not out.finished and not self._queue.empty():  # merge what piled up
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._held = nxt  # raise it on the next call
                break
            nxt.new_token_ids, nxt.new_text = out.new_token_ids + nxt.new_token_ids, out.new_text + nxt.new_text
            out = nxt
        self.num_output_tokens += len(out.new_token_ids)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
        return out

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent, never blocks)."""
        if not self.finished:
            self.finished = True
            self.finish_reason = "abort"
            self._engine.abort(self.request_id)

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (raised by the next read, after the outputs already
        waiting) and abort the request. Call it on the stream's event loop."""
        if not self.finished:
            self._queue.put_nowait(error)
            self._engine.abort(self.request_id)


class AsyncLLM:
    """Serve an ``LLM`` to many asyncio tasks at once (see the module docstring).

    Args:
      llm: a ``fleetlab.LLM``. From now on only the engine thread calls it.
      max_queue_len: how many requests may wait beyond the ``max_num_seqs`` that run; a request
        arriving when ``max_num_seqs + max_queue_len`` are unfinished raises
        :class:`~fleetlab.serving.errors.Overloaded` at once. None: no limit.

    The engine thread starts with the first request (or :meth:`start`) and stops with
    :meth:`shutdown`, which aborts what is still running. Usable as a (sync) context manager.
    """

    def __init__(self, llm, *, max_queue_len: int | None = None):
        if max_queue_len is not None and (not isinstance(max_queue_len, int) or max_queue_len < 0):
            raise ValueError(f"AsyncLLM: max_queue_len={max_queue_len!r} must be None or an int >= 0")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.vocab_size = llm.handle.vocab_size
        self.max_queue_len = max_queue_len
        self._capacity = None if max_queue_len is None else llm.config.max_num_seqs + max_queue_len
        self._iteration_tokens = IterationTokens(iteration_buckets(llm.config.max_num_batched_tokens))
        llm.observers.append(self._iteration_tokens)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._num_unfinished = 0  # accepted by add_request, not finished yet (guarded by _lock)
        self._thread: threading.Thread | None = None
        self._stats = snapshot(self.llm, self._iteration_tokens)
        self.error: BaseException | None = None  # what killed the engine loop, if anything
        self._closed = False

    # ----- asyncio side -----
    async def add_request(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                          prompt_token_ids=None, request_id: str | None = None) -> RequestStream:
        """Queue a request and return its :class:`RequestStream` (see :meth:`add_requests`)."""
        (stream,) = await self.add_requests([{"prompt": prompt, "sampling_params": sampling_params,
                                              "prompt_token_ids": prompt_token_ids, "request_id": request_id}])
        return stream

    async def add_requests(self, requests: list[dict]) -> list[RequestStream]:
        """Queue several requests in one engine loop turn; one :class:`RequestStream` each.

        ``requests``: one dict of ``LLM.add_request`` keywords per request (``prompt`` or
        ``prompt_token_ids``, ``sampling_params`` with ``n = 1``, ``request_id``). All or none: if one raises
        ``ValueError`` (it names the request and the field), none stays queued. Raises
        :class:`Overloaded` when they do not all fit in the queue, and :class:`EngineDead` when
        the engine loop has stopped.
        """
        self._check_alive()
        for kw in requests:
            sp = kw.get("sampling_params")
            if getattr(sp, "n", 1) != 1 or (getattr(sp, "best_of", None) or 1) > 1:
                raise ValueError(f"request {kw.get('request_id')!r}: sampling field n={sp.n} (best_of={sp.best_of}): "
                                 "a stream carries one sequence; queue one request per sequence with "
                                 "fleetlab.output.parallel_sampling.child_sampling_params(sp, i), as the server does")
        n = len(requests)
        if not n:
            return []
        await self._grammars_compiled(requests)
        with self._lock:
            if self._capacity is not None and self._num_unfinished + n > self._capacity:
                raise Overloaded(f"the server holds {self._num_unfinished} requests; {n} more would exceed "
                                 f"max_num_seqs + max_queue_len={self._capacity}; retry later", code="queue_full")
            self._num_unfinished += n
        self.start()
        loop = asyncio.get_running_loop()
        requests = [{**kw, "request_id": str(kw["request_id"]) if kw.get("request_id") is not None
                     else f"req-{next(self._ids)}"} for kw in requests]
        streams = [RequestStream(kw["request_id"], self, loop) for kw in requests]
        future = loop.create_future()
        self._inbox.put(_Add(streams, requests, future))
        if self.error is not None:  # the loop died while this was being queued
            _settle(future, EngineDead(f"the engine loop stopped: {self.error}"))
        try:
            await future  # the engine thread called LLM.add_request for each (or one raised)
        except BaseException:
            for s in streams:  # cancelled while queued: drop what got in (unknown ids are ignored)
                self.abort(s.request_id)
            raise
        return streams

    async def _grammars_compiled(self, requests: list[dict]) -> None:
        """Wait here, on the event loop, for the grammars these requests need: the engine thread
        then finds them compiled (or their refusal, which ``LLM.add_request`` raises at once).
        The grammar manager is the one part of the ``LLM`` safe to use from another thread."""
        compiler = getattr(self.llm, "structured_outputs", None)
        if compiler is None:
            return
        futures = [compiler.precompile(sp.structured_outputs) for sp in (kw.get("sampling_params") for kw in requests)
                   if sp is not None and getattr(sp, "structured_outputs", None) is not None]
        futures = [asyncio.wrap_future(f) for f in futures if f is not None]
        if futures:
            await asyncio.gather(*futures, return_exceptions=True)  # a refusal is raised by add_request

    async def generate(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
                       prompt_token_ids=None, request_id: str | None = None):
        """Add a request and yield its outputs; leaving the loop early aborts the request."""
        stream = await self.add_request(prompt, sampling_params, prompt_token_ids=prompt_token_ids,
                                        request_id=request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread: its blocks are freed before the next engine step."""
        self._inbox.put(_Abort(str(request_id)))

    def stats(self) -> dict:
        """``LLM.stats()`` as of the engine thread's last loop turn, and the counts ``/metrics``
        needs beyond it (a snapshot; any thread; :mod:`fleetlab.serving.engine_stats`)."""
        return dict(self._stats)

    @property
    def capacity(self) -> int | None:
        """The most requests it holds at once, ``max_num_seqs + max_queue_len`` (None: no limit)."""
        return self._capacity

    @property
    def num_unfinished_requests(self) -> int:
        """Requests accepted and not finished yet (as the asyncio side counts them)."""
        return self._num_unfinished

    @property
    def is_running(self) -> bool:
        """The engine thread is alive and no step has failed."""
        return self.error is None and not self._closed and self._thread is not None and self._thread.is_alive()

    @property
    def is_healthy(self) -> bool:
        """Neither shut down nor stopped by a failed step (the thread may not have started yet)."""
        return self.error is None and not self._closed

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDead("the engine was shut down")
        if self.error is not None:
            raise EngineDead(f"the engine loop stopped: {type(self.error).__name__}: {self.error}")

    # ----- lifecycle -----
    def start(self) -> None:
        """Start the engine thread (no-op when it runs)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleetlab-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Abort every unfinished request and stop the engine thread; later requests raise ``EngineDead``."""
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(_STOP)
            self._thread.join(timeout)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()

    # ----- engine thread -----
    def _run(self) -> None:
        streams: dict[str, RequestStream] = {}
        try:
            while True:
                idle = not self.llm.has_unfinished_requests()
                if not self._take_commands(streams, block=idle):
                    break
                if self.llm.has_unfinished_requests():
                    self.llm.wait_until_runnable()  # nothing runnable (a grammar compiling): wait a little
                    self._step(streams)
                self._stats = snapshot(self.llm, self._iteration_tokens)
        except Exception as e:  # a bug in a step: fail every request, keep the server answering
            logger.exception("fleetlab engine loop stopped")
            self.error = e
            dead = EngineDead(f"the engine loop stopped: {type(e).__name__}: {e}")
            self._deliver({s: [dead] for s in streams.values()})
            streams.clear()
            self._fail_queued(dead)
        finally:
            self._abort_all(streams)
            self._fail_queued(EngineDead("the engine was shut down"))

    def _take_commands(self, streams: dict, block: bool) -> bool:
        """Apply every waiting command (waiting for one when ``block``); False on stop."""
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        aborts = []
        for cmd in commands:
            if cmd is _STOP:
                return False
            if isinstance(cmd, _Add):
                self._add(cmd, streams)
            elif cmd.request_id in streams:
                aborts.append(cmd.request_id)
        if aborts:
            self._route(streams, self._abort(aborts))
        return True

    def _abort(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = self.llm.abort(request_ids)
        for out in outputs:  # every token was already handed out by the step that made it
            out.new_token_ids = []
        return outputs

    def _add(self, cmd: _Add, streams: dict) -> None:
        loop = cmd.streams[0]._loop
        added = []
        try:
            for kwargs in cmd.requests:
                added.append(self.llm.add_request(**kwargs))
        except Exception as e:  # ValueError for bad input; anything else is a bug, still the caller's answer
            if added:
                self.llm.abort(added)  # all or none
            self._finished(len(cmd.streams))
            loop.call_soon_threadsafe(_settle, cmd.future, e)
            return
        now = time.perf_counter()
        for stream in cmd.streams:
            stream.times.queued = now
            streams[stream.request_id] = stream
        loop.call_soon_threadsafe(_settle, cmd.future, None)

    def _step(self, streams: dict) -> None:
        """One engine step; its outputs go to their streams, stamped with the step's times."""
        outputs = self.llm.step()
        ended = time.perf_counter()
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                stream.times.scheduled = out.metrics["first_scheduled_time"]
                if out.new_token_ids:
                    stream.times.tokens_at(ended)
        self._route(streams, outputs)

    def _route(self, streams: dict, outputs: list[RequestOutput]) -> None:
        by_stream = defaultdict(list)
        done = 0
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                continue
            by_stream[stream].append(out)
            if out.finished:
                del streams[out.request_id]
                done += 1
        self._finished(done)
        self._deliver(by_stream)

    @staticmethod
    def _deliver(by_stream: dict) -> None:
        """Hand outputs to their streams: one wake-up per event loop per step."""
        by_loop = defaultdict(list)
        for stream, items in by_stream.items():
            by_loop[stream._loop].append((stream, items))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _finished(self, n: int) -> None:
        if n:
            with self._lock:
                self._num_unfinished -= n

    def _fail_queued(self, error: BaseException) -> None:
        """Answer the adds still in the inbox (the loop will not take them)."""
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._finished(len(cmd.streams))
                cmd.streams[0]._loop.call_soon_threadsafe(_settle, cmd.future, error)

    def _abort_all(self, streams: dict) -> None:
        try:
            if streams:
                self._route(streams, self._abort(list(streams)))
            self._stats = snapshot(self.llm, self._iteration_tokens)
        except Exception:
            logger.exception("fleetlab engine: aborting the remaining requests failed")


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _put_all(batch) -> None:
    for stream, items in batch:
        for item in items:
            stream._put(item)
