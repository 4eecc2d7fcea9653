"""Compile ahead: grammars compile on a thread pool, never inside an engine step.

``StructuredOutputManager`` is what the engine talks to:

- ``validate(request_id, params)`` when a request arrives (synchronous, cheap): the params'
  own checks and the backend's (the schema or regex compiles). Raises ``ValueError`` naming
  the request and the field.
- ``submit(request_id, params)`` right after: starts the compile on the pool and returns at
  once. The compile includes the vocabulary check. Requests with the same constraint share one
  compile (cached by the constraint's canonical key; an LRU of ``cache_size`` grammars).
  ``compile(params)`` is the same without the request: the engine keeps the future with the
  request itself (:class:`~fleetlab.structured_output.request.StructuredOutputRequest`).
- ``is_ready(request_id)`` each step, for the scheduler: a constrained request is schedulable
  once its grammar is compiled (or failed: the engine then finishes it with the error).
- ``matcher(request_id, replay=())`` once ready: the request's matcher, or the compile's
  ``ValueError`` for this request (a vocabulary the constraint cannot be spelled with).

``compile_times`` keeps the seconds each distinct constraint took to compile.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from fleetlab.engine.structured_outputs_params import StructuredOutputsParams
from fleetlab.structured_output.backend import CompiledGrammar, GrammarError, GrammarMatcher, make_grammar_backend

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    """Compiles each request's constraint ahead of its steps, caches grammars by constraint.

    backend: a registered backend name (``"guidance"``), class or instance; tokenizer and
    vocab_size: the served model's (ignored when ``backend`` is an instance); max_workers:
    compile threads; cache_size: compiled grammars kept (least recently used dropped first);
    backend_options: for the backend's class (``fill_threads=`` for guidance).
    """

    def __init__(self, backend="guidance", tokenizer=None, vocab_size: int | None = None, *,
                 max_workers: int = 1, cache_size: int = 256, **backend_options):
        self.backend = make_grammar_backend(backend, tokenizer, vocab_size, **backend_options)
        self.cache_size = cache_size
        self.compile_times: dict[tuple, float] = {}
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fleetlab-grammar")
        self._lock = threading.RLock()  # submit holds it around compile
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._requests: dict[str, tuple[Future, StructuredOutputsParams]] = {}

    def validate(self, request_id: str, params) -> StructuredOutputsParams:
        """The checked params (a dict of fields is accepted); ``ValueError`` naming the request
        and the field when the constraint is malformed or cannot compile."""
        checked = StructuredOutputsParams.coerce(params, request_id).validate(request_id)
        try:
            self.backend.validate(checked)
        except GrammarError as exc:
            raise exc.for_request(request_id) from None
        return checked

    def submit(self, request_id: str, params: StructuredOutputsParams) -> Future:
        """Start compiling ``params`` (validated) for ``request_id``; returns at once."""
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} already has a structured-outputs grammar")
            future = self.compile(params)
            self._requests[request_id] = (future, params)
        return future

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compile of ``params`` (validated): the cached one, or a new one started on the
        pool. Returns at once; the future's result is a :class:`CompiledGrammar`, or it raises
        :class:`GrammarError` (e.g. a vocabulary that cannot spell the constraint)."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is None or future.cancelled():
                future = self._pool.submit(self._compile, params)
                self._cache[key] = future
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        return future

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        grammar = self.backend.compile(params)
        self.compile_times[grammar.key] = grammar.compile_time_s
        return grammar

    def is_ready(self, request_id: str) -> bool:
        """Whether ``request_id``'s compile has finished (successfully or not)."""
        return self._future(request_id).done()

    def grammar(self, request_id: str, timeout: float | None = None) -> CompiledGrammar:
        """The compiled grammar (waits up to ``timeout`` seconds; the engine asks once ready).
        A failed compile raises ``ValueError`` naming the request and the field."""
        try:
            return self._future(request_id).result(timeout)
        except GrammarError as exc:
            raise exc.for_request(request_id) from None

    def matcher(self, request_id: str, replay: Sequence[int] = ()) -> GrammarMatcher:
        """A new matcher for the request, advanced by ``replay`` (its output tokens, to rebuild
        it after a preemption or a runner reset)."""
        return self.grammar(request_id).matcher(replay)

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request (its grammar stays cached for others)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def _future(self, request_id: str) -> Future:
        entry = self._requests.get(request_id)
        if entry is None:
            raise KeyError(f"request {request_id!r} has no structured-outputs grammar submitted")
        return entry[0]

    def stats(self) -> dict:
        """``num_requests``, ``num_cached_grammars``, ``compile_time_s`` (per constraint key)."""
        return {"num_requests": len(self._requests), "num_cached_grammars": len(self._cache),
                "compile_time_s": dict(self.compile_times)}

    def close(self) -> None:
        """Stop the compile threads (running compiles finish first)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.backend.close()

    def __enter__(self) -> StructuredOutputManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
