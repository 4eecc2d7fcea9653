"""Shared fixtures: small models built once per session (no downloads)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")

import matplotlib

matplotlib.use("Agg")

import numpy as np

from fleetlab.lab.cpu_tuning import tune_malloc

tune_malloc()  # tests are a program of ours: keep freed CPU buffers (fleetlab.lab.cpu_tuning)
import pytest


@pytest.fixture(scope="session")
def fleet_model():
    from fleetlab.models import tiny

    return tiny("fleet", seed=0)


@pytest.fixture(scope="session")
def family_models():
    """One tiny model per family, built lazily and cached."""
    from fleetlab.models import tiny

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = tiny(family, seed=0)
        return cache[family]

    return get


def random_prompts(lengths, vocab=100, seed=0, low=3):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(low, vocab, size=n)] for n in lengths]
