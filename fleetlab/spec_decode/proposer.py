"""The ``Proposer`` interface and its registry (built-ins load lazily, like attention backends)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

_BUILTIN_MODULES = {"ngram": "fleetlab.spec_decode.ngram", "draft": "fleetlab.spec_decode.draft"}
_REGISTRY: dict[str, type[Proposer]] = {}


@dataclass(slots=True)
class ProposeInput:
    """What the runner tells a proposer after verifying a step; arrays are ``[num_reqs]`` by row.

    num_tokens: each row's known tokens after the step (accepted drafts and the new token
      are already in ``batch.token_ids``; ``batch.num_tokens`` still counts the old ones).
    num_computed_tokens: the target's K/V-computed tokens after the step (past rejected drafts).
    max_drafts: drafts each row may get: 0 for rows that sampled nothing or failed, else
      at most ``k``, the room left before ``max_tokens`` or the model's length, and the
      row's allocated slots.
    """

    num_tokens: np.ndarray
    num_computed_tokens: np.ndarray
    max_drafts: np.ndarray


class Proposer:
    """Drafts tokens for the rows of an ``InputBatch``.

    Class attribute ``name`` is the registry name. ``num_lookahead_tokens``: slots the
    scheduler must reserve past a row's last token when it samples (a draft model writes
    its proposals' K/V there; a model-free proposer needs none).
    """

    name: ClassVar[str] = "base"

    def __init__(self, config, context) -> None:
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens

    @property
    def num_lookahead_tokens(self) -> int:
        return 0

    def bind(self, batch) -> None:
        """Called once with the runner's (empty) ``InputBatch``."""

    def propose(self, batch, inputs: ProposeInput) -> dict[str, list[int]]:
        """Drafts per request id for the rows with ``max_drafts > 0``."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget per-request state (the runner was reset after a failed step)."""

    def close(self) -> None:
        """Release what the proposer holds (a draft model's patch)."""


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may need from the engine to build itself.

    backend: the target's attention backend instance; num_blocks / block_size: the paged
    pool the draft cache mirrors (same block ids); max_model_len; vocab_size: the target's.
    """

    backend: object
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    decode_threshold: int


def register_proposer(name: str, cls: type[Proposer]) -> type[Proposer]:
    """Make ``cls`` selectable as ``speculative_config={"method": name, ...}``."""
    if not (isinstance(cls, type) and issubclass(cls, Proposer)):
        raise TypeError(f"proposer {name!r} must be a subclass of fleetlab.spec_decode.proposer.Proposer")
    _REGISTRY[name] = cls
    return cls


def get_proposer(name: str) -> type[Proposer]:
    """The proposer class registered as ``name`` (built-ins load on first use)."""
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        importlib.import_module(_BUILTIN_MODULES[name])
    if name not in _REGISTRY:
        raise ValueError(f"unknown proposer {name!r}; registered: {list_proposers()}")
    return _REGISTRY[name]


def list_proposers() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))
