"""The grammar-backend interface: compile a constraint once, match each request's tokens.

Three objects, from slow and shared to fast and per request:

- :class:`GrammarBackend` (one per served model): knows the tokenizer; ``compile(params)``
  turns a validated :class:`StructuredOutputsParams` into a :class:`CompiledGrammar`. Slow
  (milliseconds to seconds for a large schema), so it runs ahead on a thread pool and its
  result is cached by the constraint's canonical key (``fleetlab.structured_output.manager``).
- :class:`CompiledGrammar` (one per distinct constraint): immutable, shared by every request
  with the same constraint; ``matcher()`` starts a request's matcher.
- :class:`GrammarMatcher` (one per constrained request): where the request is in the
  grammar. It accepts the tokens the request gains, rolls back rejected speculative drafts,
  validates drafts, and fills the request's row of the step's token bitmask.

**The token bitmask** is int32 ``[num_rows, bitmask_width]``: bit ``t % 32`` of word
``t // 32`` of a row is 1 when token ``t`` is allowed next. ``bitmask_width`` is at least
``ceil(vocab_size / 32)``; a backend may use ids past the model's vocabulary for characters
the vocabulary cannot spell (see ``fleetlab.structured_output.guidance``): the logits have no
column for them, so :func:`~fleetlab.structured_output.bitmask.apply_token_bitmask` ignores
them, and a row whose only allowed bits lie there is a dead end.

Backends register by name (:func:`register_grammar_backend`); ``"guidance"`` (llguidance)
is built in and loads on first use.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fleetlab.engine.structured_outputs_params import StructuredOutputsParams


class GrammarError(ValueError):
    """A constraint the backend refuses (a schema it cannot compile, a bad regex, a vocabulary
    that cannot spell it). ``field`` names the params field at fault; the manager adds the
    request id to the message it reports."""

    def __init__(self, field: str, message: str):
        super().__init__(f"structured_outputs field {field}: {message}")
        self.field = field

    def for_request(self, request_id: str) -> ValueError:
        """The error as reported for one request: ``request 'r': structured_outputs field json: ...``."""
        return ValueError(f"request {request_id!r}: {self}")


class GrammarMatcher(ABC):
    """One request's position in its grammar (see the module docstring).

    Token ids are the model's. Methods that take tokens never leave the matcher broken: a
    token the grammar does not allow is refused (``accept_tokens`` returns False) and the
    state stays as it was.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advance by ``token_ids`` if the grammar allows all of them, in order; else change
        nothing and return False."""

    @abstractmethod
    def validate_tokens(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` (a prefix) the grammar allows from here; no state change.
        For speculative drafts: the drafts past that prefix cannot be accepted."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative drafts)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (int32 ``[rows, bitmask_width]``)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True when the grammar is complete and only EOS may follow: the request must stop.
        (EOS is allowed exactly when the output so far is a complete match.)"""

    @property
    @abstractmethod
    def num_accepted_tokens(self) -> int:
        """Tokens accepted since the matcher started (after rollbacks)."""

    @property
    def error(self) -> str:
        """Why the matcher cannot go on, when its last bitmask row allowed no token; else ``""``."""
        return ""

    def fill_bitmask_with_drafts(self, bitmask: np.ndarray, row: int, draft_token_ids: Sequence[int]) -> int:
        """Masks for a speculative verify row: ``bitmask[row + i]`` gets the tokens allowed after
        the first ``i`` drafts, for ``i`` in ``0..len(drafts)``. Past the first draft the grammar
        refuses, the rows are all ones (that draft is rejected by its own row's mask, so what
        follows is never kept). Returns how many drafts the grammar allows. State is unchanged."""
        num_valid = self.validate_tokens(draft_token_ids)
        self.fill_bitmask(bitmask, row)
        for i, token in enumerate(draft_token_ids[:num_valid]):
            self.accept_tokens([token])
            self.fill_bitmask(bitmask, row + i + 1)
        bitmask[row + num_valid + 1: row + len(draft_token_ids) + 1] = -1
        if num_valid:
            self.rollback(num_valid)
        return num_valid


@dataclass(slots=True)
class CompiledGrammar:
    """A compiled constraint, shared by every request that asks for it (immutable).

    key: the constraint's canonical key (``StructuredOutputsParams.cache_key()``).
    kind: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"`` or ``"json_object"``.
    compile_time_s: wall-clock seconds the backend took to compile it (vocabulary check included).
    check_time_s: of which the vocabulary check (0 where the vocabulary spells every byte).
    handle: the backend's own compiled object, which ``backend.new_matcher`` starts from.
    """

    key: tuple
    kind: str
    compile_time_s: float
    backend: GrammarBackend = field(repr=False)
    handle: object = field(repr=False)
    check_time_s: float = 0.0

    def matcher(self, replay: Sequence[int] = ()) -> GrammarMatcher:
        """A new matcher at the grammar's start, advanced by ``replay`` (a request's output
        tokens: how a matcher is rebuilt after a preemption or a runner reset). A replay the
        grammar refuses raises ``ValueError``: those tokens were not produced under this grammar."""
        m = self.backend.new_matcher(self)
        if replay and not m.accept_tokens(list(replay)):
            num_valid = m.validate_tokens(list(replay))
            raise ValueError(f"replaying {len(replay)} output tokens through a {self.kind} grammar: token "
                             f"{num_valid} ({replay[num_valid]}) is not allowed there")
        return m


class GrammarBackend(ABC):
    """A grammar library behind fleetlab's interface, bound to one tokenizer.

    tokenizer: the served model's tokenizer (fleetlab's ``CharTokenizer``, or a PaddleFormers /
      Hugging Face fast tokenizer); vocab_size: the model's logits width (>= the tokenizer's).
    """

    name = "?"

    def __init__(self, tokenizer, vocab_size: int | None = None, **options):
        if options:
            raise TypeError(f"grammar backend {self.name!r} takes no options; got {sorted(options)}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))

    @property
    @abstractmethod
    def bitmask_width(self) -> int:
        """int32 words per bitmask row (>= ``ceil(vocab_size / 32)``)."""

    @property
    @abstractmethod
    def eos_token_id(self) -> int:
        """The token the grammar allows once the output is complete."""

    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise :class:`GrammarError` if the (validated) constraint cannot compile: an invalid
        schema, a bad regex. Fast enough to run when the request arrives."""

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile a validated constraint for this tokenizer (slow: run it ahead, cache it).
        Raises :class:`GrammarError`, including when the vocabulary cannot spell the constraint."""

    @abstractmethod
    def new_matcher(self, grammar: CompiledGrammar) -> GrammarMatcher:
        """A matcher at the start of ``grammar``."""

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The ids the grammar's vocabulary spells ``text`` with (ids past ``vocab_size`` for
        characters the model's vocabulary lacks, where the backend has such stand-ins)."""

    def token_text(self, token_id: int) -> str:
        """What a token id stands for, for messages (ids past ``vocab_size`` included)."""
        return self.tokenizer.decode([token_id])

    def allocate_bitmask(self, num_rows: int) -> np.ndarray:
        """An all-allowed int32 bitmask ``[num_rows, bitmask_width]``."""
        return np.full((num_rows, self.bitmask_width), -1, dtype=np.int32)

    def fill_bitmasks(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Fill ``bitmask[row]`` for every ``(matcher, row)``: one call per engine step. A
        backend may do it in parallel (llguidance does, without the GIL)."""
        for matcher, row in rows:
            matcher.fill_bitmask(bitmask, row)

    def close(self) -> None:  # noqa: B027 - optional: most backends hold nothing to release
        """Release what the backend holds (threads)."""


_BUILTIN: dict[str, str] = {"guidance": "fleetlab.structured_output.guidance:GuidanceBackend"}
_REGISTRY: dict[str, type[GrammarBackend] | str] = dict(_BUILTIN)


def register_grammar_backend(name: str, cls: type[GrammarBackend] | str) -> None:
    """Make ``cls`` selectable by ``name``: a :class:`GrammarBackend` subclass, or
    ``"module:Class"`` to import on first use. Replacing a built-in is allowed and explicit."""
    if isinstance(cls, str):
        if ":" not in cls:
            raise ValueError(f"grammar backend {name!r}: a lazy backend is spelled 'module:Class', got {cls!r}")
    elif not (isinstance(cls, type) and issubclass(cls, GrammarBackend)):
        raise TypeError(f"grammar backend {name!r} must be a subclass of GrammarBackend")
    _REGISTRY[name] = cls


def get_grammar_backend(name: str) -> type[GrammarBackend]:
    """The backend class registered as ``name`` (imported on first use)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown grammar backend {name!r}; registered: {list_grammar_backends()}")
    entry = _REGISTRY[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        register_grammar_backend(name, entry)
    return entry


def list_grammar_backends() -> list[str]:
    return sorted(_REGISTRY)


def make_grammar_backend(backend, tokenizer, vocab_size: int | None = None, **options) -> GrammarBackend:
    """``backend`` as an instance bound to ``tokenizer``: a registered name, a class, or an
    instance (returned as it is). ``options`` go to the class (``fill_threads=`` for guidance)."""
    if isinstance(backend, GrammarBackend):
        return backend
    cls = get_grammar_backend(backend) if isinstance(backend, str) else backend
    if not (isinstance(cls, type) and issubclass(cls, GrammarBackend)):
        raise TypeError(f"grammar backend must be a name, a GrammarBackend subclass or instance; got {backend!r}")
    return cls(tokenizer, vocab_size, **options)
