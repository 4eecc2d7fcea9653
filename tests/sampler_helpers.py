"""Sampling settings built from host arrays, for tests that drive a sampler without an engine."""

import numpy as np

from fleetlab.device import upload
from fleetlab.engine.sampler import SamplingTensors


def host_tensors(temperature, top_k, top_p, seeds, draw_index, banned=None, draft_token_ids=None) -> SamplingTensors:
    """One position per row: the settings the sampler reads on the device are uploaded."""
    temperature = np.asarray(temperature, dtype=np.float32)
    return SamplingTensors(temperature == 0, upload(temperature), upload(top_k), upload(top_p, np.float32),
                           np.asarray(seeds), np.asarray(draw_index), banned or [[] for _ in temperature],
                           None if draft_token_ids is None else np.asarray(draft_token_ids, dtype=np.int64))
