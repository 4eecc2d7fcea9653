"""Can the model's vocabulary spell any output of a constraint? Refuse it at once if not.

A character vocabulary without ``{`` cannot write JSON. Left to run, a constrained request on
it would find no allowed token at once, or worse, be allowed only whitespace forever and run
to ``max_tokens``. So a backend whose vocabulary cannot spell every byte checks each
constraint when it compiles it, by searching its grammar for a complete output made of the
model's own tokens (a complete output: one after which the grammar allows EOS):

1. **breadth-first**, shortest outputs first, states that allow several tokens told apart by
   their token mask (the characters of a JSON string all lead to the same mask, so one stands
   for all). Fast, and finds an output for almost every grammar; but two states with the same
   mask may still differ (``(ab|c)d`` and ``(ab|c)e``-like branches), so it proves nothing.
2. if that finds none, **depth-first over every path** (no merging), which proves that no
   output exists when it runs out of paths before its budgets.

A dead end is a state whose mask allows no model token; the stand-in tokens it allows (ids past
the model's vocabulary, see ``fleetlab.structured_output.guidance``) are the characters the
vocabulary lacks. JSON is searched with no whitespace between tokens (it is never needed, and
would let the search run in circles); a regular expression is searched intersected with the
vocabulary's alphabet, so its first mask already says whether any output exists.

What is left undecided within the budgets (a grammar that can loop for ever before it needs
a missing character) is admitted and logged at INFO; the engine still stops a request whose
row allows no token (:func:`fleetlab.structured_output.bitmask.dead_rows`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fleetlab.structured_output.backend import GrammarBackend, GrammarError, GrammarMatcher

logger = logging.getLogger(__name__)

MAX_NODES = 1000
"""Token masks one search may compute before it gives up (about 40 us each here, walking included)."""
MAX_DEPTH = 128
"""Tokens along one depth-first path before that path is given up as undecided."""
NO_OUTPUT = ("matches no output at all (an unsatisfiable regex, or a schema no value satisfies, such as a $ref "
             "that only refers to itself)")
"""The refusal of a constraint that no text satisfies, whatever the vocabulary."""


@dataclass(slots=True)
class SearchResult:
    """What a search found.

    path: the token ids of a complete output, or None. exhausted: every path was tried (with
    ``path`` None: a proof that no output exists). lacking: characters the dead ends wanted
    that the vocabulary lacks. nodes: masks computed.
    """

    path: list[int] | None = None
    exhausted: bool = True
    lacking: set[str] = field(default_factory=set)
    nodes: int = 0


class _Walker:
    """One matcher moved between token paths by rollback and accept, computing masks."""

    def __init__(self, backend: GrammarBackend, matcher: GrammarMatcher, limit: int, result: SearchResult):
        self.backend, self.matcher, self.limit, self.result = backend, matcher, limit, result
        self.path: list[int] = []
        self.row = backend.allocate_bitmask(1)

    def goto(self, path: list[int]) -> None:
        common = 0
        for a, b in zip(path, self.path):
            if a != b:
                break
            common += 1
        self.matcher.rollback(len(self.path) - common)
        if not self.matcher.accept_tokens(path[common:]):
            raise RuntimeError(f"the matcher refused tokens its own mask allowed: {path[common:]}")
        self.path = list(path)

    def allowed(self) -> tuple[bytes, bool, list[int]]:
        """(the mask's bytes, is EOS allowed, the tokens a path may take next); records dead ends."""
        self.result.nodes += 1
        self.matcher.fill_bitmask(self.row, 0)
        ids = np.flatnonzero(np.unpackbits(self.row[0].view(np.uint8), bitorder="little"))
        eos = self.backend.eos_token_id
        tokens = ids[(ids < self.limit) & (ids != eos)].tolist()
        accepting = bool((ids == eos).any())
        if not tokens and not accepting:
            self.result.lacking.update(self.backend.token_text(t) for t in ids[ids >= self.backend.vocab_size].tolist())
        return self.row[0].tobytes(), accepting, tokens


def shortest_output(backend: GrammarBackend, matcher: GrammarMatcher, *, stand_ins: bool = False,
                    max_nodes: int = MAX_NODES) -> SearchResult:
    """Breadth-first search (states merged by mask) for a short complete output from the
    matcher's start. ``stand_ins=True``: the path may use stand-in tokens (an example of what the
    constraint wants, whatever the vocabulary). Proves nothing when it finds none."""
    result = SearchResult(exhausted=False)
    walker = _Walker(backend, matcher, backend.bitmask_width * 32 if stand_ins else backend.vocab_size, result)
    seen: set[bytes] = set()
    frontier: deque[list[int]] = deque([[]])
    while frontier and result.nodes < max_nodes:
        path = frontier.popleft()
        walker.goto(path)
        mask, eos, tokens = walker.allowed()
        if eos:
            result.path = path
            return result
        if len(tokens) == 1 or mask not in seen:  # a forced token never merges: no branching to save
            seen.add(mask)
            frontier.extend(path + [t] for t in tokens)
    return result


def any_output(backend: GrammarBackend, matcher: GrammarMatcher, *, max_nodes: int = MAX_NODES,
               max_depth: int = MAX_DEPTH) -> SearchResult:
    """Depth-first search over every path of model tokens (nothing merged): ``exhausted`` with no
    ``path`` proves that no complete output exists. Tokens that complete the output are tried first."""
    result = SearchResult()
    walker = _Walker(backend, matcher, backend.vocab_size, result)
    eos = backend.eos_token_id

    def visit(path: list[int]) -> bool:
        if result.nodes >= max_nodes:
            result.exhausted = False
            return False
        walker.goto(path)
        _, accepting, tokens = walker.allowed()
        if accepting:
            result.path = path
            return True
        if tokens and len(path) == max_depth:
            result.exhausted = False
            return False
        finishing = [t for t in tokens if matcher.validate_tokens([t, eos]) == 2]
        done = set(finishing)
        return any(visit(path + [t]) for t in finishing + [t for t in tokens if t not in done])

    visit([])
    return result


def check_vocabulary(backend: GrammarBackend, field_name: str, new_matcher: Callable[[bool], GrammarMatcher],
                     *, max_nodes: int = MAX_NODES) -> None:
    """Raise :class:`GrammarError` naming ``field_name`` and the characters the vocabulary lacks
    when no output of the constraint can be spelled with it (see the module docstring).

    ``new_matcher(stand_ins)`` gives a fresh matcher of the constraint's search grammar; with
    ``stand_ins=True`` it must accept stand-in tokens too (for the example in the message)."""
    found = shortest_output(backend, new_matcher(False), max_nodes=max_nodes)
    if found.path is not None:
        return
    proof = any_output(backend, new_matcher(False), max_nodes=max_nodes)
    if proof.path is not None:
        return
    if not proof.exhausted:
        logger.info("vocabulary check of a %s constraint undecided after %d masks: admitted",
                    field_name, found.nodes + proof.nodes)
        return
    example = shortest_output(backend, new_matcher(True), stand_ins=True, max_nodes=max_nodes)
    lacking = found.lacking | proof.lacking
    shown = ""
    if example.path is not None:
        text = "".join(backend.token_text(t) for t in example.path)
        lacking |= missing_characters(backend, text)
        shown = f" (an output it allows: {text!r})"
    if not lacking and example.path is None:  # not the vocabulary: nothing at all matches
        raise GrammarError(field_name, NO_OUTPUT)
    chars = ", ".join(repr(c) for c in sorted(lacking)) or "(none found)"
    raise GrammarError(field_name, f"cannot be spelled by the model's vocabulary: it has no {chars}{shown}")


def missing_characters(backend: GrammarBackend, text: str) -> set[str]:
    """The characters of ``text`` that the model's vocabulary cannot spell (the backend
    tokenizes them into stand-ins, ids past ``vocab_size``)."""
    return {ch for ch in set(text) if any(t >= backend.vocab_size for t in backend.tokenize(ch))}
