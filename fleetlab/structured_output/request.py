"""``StructuredOutputRequest``: one request's grammar state, the object its batch row holds.

It is made when the request arrives (``StructuredOutputsProcessor.start``) and travels with
the request: the scheduler's ``Request.extra`` holds it, the runner copies that reference into
the row's ``structured_output`` field, and condense, reorder, a preemption (the request is
resent in full, with the same object) or a runner reset move the reference, never the state.

The matcher inside is advanced only by **committed** tokens: before each step that scores
the row, :meth:`matcher_at` brings it to the row's output as the scheduler committed it
(accepting the tokens gained since, or rolling back with the library's ``rollback`` if it is
ahead). A draft the target rejected, or a step that failed and was rolled back, never enters it.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from fleetlab.engine.structured_outputs_params import StructuredOutputsParams
from fleetlab.structured_output.backend import GrammarError, GrammarMatcher


@dataclass(eq=False, slots=True)
class StructuredOutputRequest:
    """One constrained request (vLLM keeps the same in ``StructuredOutputRequest``).

    params: the checked constraint. compiled: the future of its ``CompiledGrammar`` (shared by
    every request with the same constraint; the scheduler does not admit the request before it
    is done: ``Request.waiting_on``). matcher: the request's own matcher, made on first use.
    """

    params: StructuredOutputsParams
    compiled: Future
    matcher: GrammarMatcher | None = None

    @property
    def error(self) -> str | None:
        """Why the constraint cannot be served (a failed compile, e.g. a vocabulary that cannot
        spell it), once compiled; else None."""
        if not self.compiled.done() or self.compiled.exception() is None:
            return None
        return str(self.compiled.exception())

    def check(self, request_id: str, timeout: float | None = 0) -> None:
        """Raise ``ValueError`` naming the request and the field if the compile failed; wait up
        to ``timeout`` seconds for it (None: as long as it takes; 0: only if already done)."""
        if timeout == 0 and not self.compiled.done():
            return
        exc = self.compiled.exception(timeout)
        if isinstance(exc, GrammarError):
            raise exc.for_request(request_id) from None
        if exc is not None:
            raise exc

    def matcher_at(self, output_token_ids: Sequence[int]) -> GrammarMatcher:
        """The matcher after exactly ``output_token_ids`` (the committed output): made on first
        use, then caught up or rolled back. ``ValueError`` if the output leaves the grammar."""
        if self.matcher is None:
            self.matcher = self.compiled.result().matcher()
        m, n = self.matcher, len(output_token_ids)
        if m.num_accepted_tokens > n:  # left ahead by a step that failed mid-way
            m.rollback(m.num_accepted_tokens - n)
        elif m.num_accepted_tokens < n:
            new = [int(t) for t in output_token_ids[m.num_accepted_tokens:]]
            try:
                accepted = m.accept_tokens(new)
            except ValueError as exc:  # the library gave up (a parser limit): this request stops, named
                raise ValueError(f"structured_outputs field {self.params.kind}: {exc}") from None
            if not accepted:
                raise ValueError(f"structured_outputs field {self.params.kind}: output tokens {new} leave the grammar")
        return m
