"""The synthetic corpus that the shipped tiny Llama is trained on.

Every line is one training sample (``<bos> + line + <eos>``); the mix is mostly
arithmetic, so a reader can check what the model prints by eye:

    ``12+70=82``       two-digit addition (the bulk: the test measures it)
    ``12+7=19``        additions with a one-digit operand
    ``345+28=373``     additions of 1- to 3-digit numbers
    ``9-4=5``          subtraction with a non-negative result
    ``6*7=42``         single-digit multiplication
    ``count 3 4 5 6``  counting up
    ``the red cat sat on the mat.``  sentences of a small template grammar

Held-out pairs: a two-digit addition ``a+b`` (10 <= a, b <= 99) is held out when
``(7*a + b) % 11 == 3`` or ``(7*b + a) % 11 == 3`` (symmetric, so ``b+a`` cannot leak
the answer either). No held-out pair ever appears in the corpus, in either order;
1,393 of the 8,100 two-digit pairs (17%) are held out. The modulus is 11, not 10, on
purpose: ``(7*a + b) % 10`` depends only on the units digits, so it would hold out
whole units-digit combinations (every ``..0+..3``, say) and test extrapolation to
digit patterns never seen, rather than addition on unseen pairs. Modulo 11 every
units-digit combination and every tens-digit combination keeps 65+ training pairs.

The generator is a pure function of its seed (``numpy.random.default_rng``).
:func:`make_prompts` draws prompts of the same kinds (the demo's and ``bench serve``'s workload).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

TWO_DIGIT = range(10, 100)


def is_held_out(a: int, b: int) -> bool:
    """True when the addition ``a+b`` is held out of the corpus (see the module docstring)."""
    if a not in TWO_DIGIT or b not in TWO_DIGIT:
        return False
    return (7 * a + b) % 11 == 3 or (7 * b + a) % 11 == 3


def held_out_pairs() -> list[tuple[int, int]]:
    """All held-out two-digit pairs ``(a, b)``, sorted."""
    return [(a, b) for a in TWO_DIGIT for b in TWO_DIGIT if is_held_out(a, b)]


@dataclass(slots=True, frozen=True)
class CorpusMix:
    """Relative weights of each kind of line (normalised when sampling)."""

    add2: float = 0.50
    add1: float = 0.15
    add3: float = 0.07
    sub: float = 0.08
    mul: float = 0.05
    count: float = 0.07
    sentence: float = 0.08

    def probabilities(self) -> tuple[list[str], np.ndarray]:
        """The kind names and their sampling probabilities."""
        names = list(_KINDS)
        weights = np.array([getattr(self, n) for n in names], dtype=np.float64)
        if (weights < 0).any() or weights.sum() <= 0:
            raise ValueError(f"CorpusMix: weights must be >= 0 with a positive sum, got {self}")
        return names, weights / weights.sum()


def _addition(a: int, b: int) -> str | None:
    # Returning None makes the caller draw again, so held-out pairs never appear.
    return None if is_held_out(a, b) else f"{a}+{b}={a + b}"


def _add2(rng: np.random.Generator) -> str | None:
    return _addition(int(rng.integers(10, 100)), int(rng.integers(10, 100)))


def _add1(rng: np.random.Generator) -> str | None:
    a, b = int(rng.integers(0, 100)), int(rng.integers(0, 10))
    return _addition(a, b) if rng.integers(2) else _addition(b, a)


def _add3(rng: np.random.Generator) -> str | None:
    a_digits, b_digits = rng.integers(1, 4, size=2)
    a = int(rng.integers(0 if a_digits == 1 else 10 ** (a_digits - 1), 10**a_digits))
    b = int(rng.integers(0 if b_digits == 1 else 10 ** (b_digits - 1), 10**b_digits))
    return _addition(a, b)


def _sub(rng: np.random.Generator) -> str:
    a, b = sorted(int(x) for x in rng.integers(0, 100, size=2))
    return f"{b}-{a}={b - a}"


def _mul(rng: np.random.Generator) -> str:
    a, b = (int(x) for x in rng.integers(0, 10, size=2))
    return f"{a}*{b}={a * b}"


def _count(rng: np.random.Generator) -> str:
    start, length = int(rng.integers(0, 96)), int(rng.integers(3, 7))
    return "count " + " ".join(str(start + i) for i in range(length))


_ADJECTIVES = ("red", "big", "small", "old", "green", "happy", "blue", "little")
_NOUNS = ("cat", "dog", "bird", "fox", "man", "girl", "frog", "cow")
_PLACES = ("mat", "hill", "box", "bed", "log", "road", "tree", "rug")
_VERBS = ("sat", "ran", "slept", "sang", "stood", "hid")
_PREPOSITIONS = ("on", "under", "near", "by")


def _sentence(rng: np.random.Generator) -> str:
    def pick(words: tuple[str, ...]) -> str:
        return words[int(rng.integers(len(words)))]

    form = int(rng.integers(4))
    if form == 0:
        return f"the {pick(_ADJECTIVES)} {pick(_NOUNS)} {pick(_VERBS)} {pick(_PREPOSITIONS)} the {pick(_PLACES)}."
    if form == 1:
        return f"a {pick(_ADJECTIVES)} {pick(_NOUNS)} {pick(_VERBS)} {pick(_PREPOSITIONS)} a {pick(_PLACES)}."
    if form == 2:
        return f"a {pick(_NOUNS)} is {pick(_ADJECTIVES)}."
    return f"is the {pick(_NOUNS)} {pick(_ADJECTIVES)}? yes, it is."


_KINDS = {
    "add2": _add2, "add1": _add1, "add3": _add3, "sub": _sub, "mul": _mul, "count": _count, "sentence": _sentence,
}  # fmt: skip


def iter_lines(seed: int, mix: CorpusMix = CorpusMix()) -> Iterator[str]:
    """An endless, deterministic stream of corpus lines for ``seed``."""
    rng = np.random.default_rng(seed)
    names, probs = mix.probabilities()
    while True:
        line = _KINDS[names[int(rng.choice(len(names), p=probs))]](rng)
        if line is not None:
            yield line


def generate_lines(seed: int, n: int, mix: CorpusMix = CorpusMix()) -> list[str]:
    """The first ``n`` lines of :func:`iter_lines` for ``seed``."""
    if n < 0:
        raise ValueError(f"generate_lines: n must be >= 0, got {n}")
    stream = iter_lines(seed, mix)
    return [next(stream) for _ in range(n)]


PROMPT_KINDS = ("add", "times", "count", "add", "text")


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts of the kinds the tiny model was trained on (``PROMPT_KINDS`` in turn), deterministic:
    what ``python -m fleetlab demo`` and ``bench serve`` send."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        kind = PROMPT_KINDS[i % len(PROMPT_KINDS)]
        if kind == "add":
            prompts.append(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=")
        elif kind == "times":
            prompts.append(f"{rng.randint(2, 9)}*{rng.randint(2, 9)}=")
        elif kind == "count":
            prompts.append(f"count {rng.randint(1, 80)} ")
        else:
            prompts.append(rng.choice(["the red cat ", "a small dog ", "the old man "]))
    return prompts
