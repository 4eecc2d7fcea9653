"""What every tiny random-init model shares, PaddleFormers' (:mod:`~fleetlab.models.small`) and
fleetlab's own Fleet-style one (:mod:`~fleetlab.models.fleet`): the dtypes it may be cast to,
and a seeded block to draw its weights in that leaves the caller's random state alone."""

from __future__ import annotations

import contextlib

import paddle

DTYPES = ("float32", "bfloat16", "float16")


def check_dtype(dtype) -> str:
    """A supported model dtype's name; ``ValueError`` naming ``dtype`` otherwise."""
    name = str(dtype).removeprefix("paddle.")
    if name not in DTYPES:
        raise ValueError(f"tiny models: dtype={dtype!r} is not supported; choose one of {list(DTYPES)}")
    return name


@contextlib.contextmanager
def seeded(seed: int):
    """Seed Paddle's generator for the block, then put the caller's random state back."""
    state = paddle.get_rng_state()
    paddle.seed(seed)
    try:
        yield
    finally:
        paddle.set_rng_state(state)
