"""Request sets for the engine benchmark, and the padded batches a static-batch baseline needs.

A :class:`Workload` is a list of prompts (token ids) with the number of tokens each request
must generate. Both sides of a comparison run the very same workload: fleetlab's ``LLM``
with ``SamplingParams(max_tokens=n, ignore_eos=True)``, PaddleFormers' ``generate`` on
left-padded static batches. Token ids start at :data:`FIRST_TOKEN_ID`, so prompts never
hold the pad (0), BOS (1) or EOS (2) ids of fleetlab's tiny models.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Ids below this are special in fleetlab's tiny models (pad 0, bos 1, eos 2).
FIRST_TOKEN_ID = 3


@dataclass(slots=True)
class Workload:
    """Requests to serve: ``prompts[i]`` (token ids) must generate ``output_lens[i]`` tokens."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError(f"workload {self.name!r}: {len(self.prompts)} prompts but "
                             f"{len(self.output_lens)} output lengths")
        if any(len(p) == 0 for p in self.prompts) or any(n < 1 for n in self.output_lens):
            raise ValueError(f"workload {self.name!r}: every prompt needs >= 1 token and every output >= 1")

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    @property
    def num_output_tokens(self) -> int:
        return int(sum(self.output_lens))

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + output of any request."""
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens))

    def describe(self) -> dict:
        """JSON-ready summary: sizes and length ranges."""
        pl, ol = self.prompt_lens, self.output_lens
        return {"name": self.name, "num_requests": self.num_requests,
                "prompt_len": [min(pl), max(pl)], "output_len": [min(ol), max(ol)],
                "num_prompt_tokens": int(sum(pl)), "num_output_tokens": self.num_output_tokens}

    def head(self, n: int) -> Workload:
        """The first ``n`` requests."""
        return Workload(f"{self.name}[:{n}]", self.prompts[:n], self.output_lens[:n])


def _random_tokens(rng, n: int, vocab_size: int) -> list[int]:
    return [int(t) for t in rng.integers(FIRST_TOKEN_ID, vocab_size, size=n)]


def _check_range(name: str, lo_hi) -> tuple[int, int]:
    lo, hi = (int(x) for x in lo_hi)
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must be (low, high) with 1 <= low <= high; got {lo_hi!r}")
    return lo, hi


def mixed_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                   vocab_size: int, seed: int = 0) -> Workload:
    """``num_requests`` requests with prompt and output lengths uniform in the given inclusive
    ranges and uniformly random prompt tokens (the small-engine benchmark's workload, scaled)."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1; got {num_requests}")
    (plo, phi), (olo, ohi) = _check_range("prompt_len", prompt_len), _check_range("output_len", output_len)
    rng = np.random.default_rng(seed)
    plens = rng.integers(plo, phi + 1, size=num_requests)
    olens = rng.integers(olo, ohi + 1, size=num_requests)
    prompts = [_random_tokens(rng, int(n), vocab_size) for n in plens]
    return Workload(f"mixed-{num_requests}", prompts, [int(n) for n in olens])


def shared_prefix_workload(num_requests: int, prefix_len: int, suffix_len: tuple[int, int],
                           output_len: tuple[int, int], vocab_size: int, seed: int = 0) -> Workload:
    """Requests that all start with the same ``prefix_len`` tokens (a system prompt), then a
    random suffix and output length, each uniform in its inclusive range."""
    if num_requests < 1 or prefix_len < 1:
        raise ValueError(f"num_requests and prefix_len must be >= 1; got {num_requests}, {prefix_len}")
    (slo, shi), (olo, ohi) = _check_range("suffix_len", suffix_len), _check_range("output_len", output_len)
    rng = np.random.default_rng(seed)
    prefix = _random_tokens(rng, prefix_len, vocab_size)
    prompts = [prefix + _random_tokens(rng, int(rng.integers(slo, shi + 1)), vocab_size)
               for _ in range(num_requests)]
    olens = [int(n) for n in rng.integers(olo, ohi + 1, size=num_requests)]
    return Workload(f"shared-prefix-{num_requests}x{prefix_len}", prompts, olens)


@dataclass(slots=True)
class PaddedBatch:
    """One static batch, left-padded for a decoder-only ``generate``.

    indices: ``[B]`` request indices in the workload; input_ids, attention_mask: int64
    ``[B, L]`` (``L`` = the batch's longest prompt; pads sit on the left, mask 0);
    max_new_tokens: the batch's longest output (every row decodes that many steps).
    """

    indices: list[int]
    input_ids: np.ndarray
    attention_mask: np.ndarray
    max_new_tokens: int


def padded_batches(workload: Workload, batch_size: int, pad_token_id: int = 0) -> list[PaddedBatch]:
    """Cut the workload into static batches of ``batch_size`` requests, in order, left-padded."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    batches = []
    for start in range(0, workload.num_requests, batch_size):
        idx = list(range(start, min(start + batch_size, workload.num_requests)))
        width = max(len(workload.prompts[i]) for i in idx)
        ids = np.full((len(idx), width), pad_token_id, dtype=np.int64)
        mask = np.zeros((len(idx), width), dtype=np.int64)
        for row, i in enumerate(idx):
            p = workload.prompts[i]
            ids[row, width - len(p):] = p
            mask[row, width - len(p):] = 1
        batches.append(PaddedBatch(idx, ids, mask, max(workload.output_lens[i] for i in idx)))
    return batches
