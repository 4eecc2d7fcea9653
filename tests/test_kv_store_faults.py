"""A store only holds K/V it can vouch for, and serves only what it can: nothing computed on top
of a failed load is saved; a file of the wrong dtype is not served; writers sharing a directory
(engines in one process, threads) never collide; a connector that loads between steps
(``load_kv_async``) is correct by construction, and a loop waiting for it blocks instead of
spinning; a path that cannot be a directory is refused naming the field."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest
from conftest import random_prompts
from safetensors.numpy import load_file, save_file

from fleetlab import LLM, SamplingParams
from fleetlab.inspect.pool import check_kv_manager
from fleetlab.kv_transfer.block_store import LoadError
from fleetlab.kv_transfer.shared_storage import SharedStorageConnector
from fleetlab.patching.parity import reference_greedy

MAX_NEW = 5
SP = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
BS = 4


def engine(model, connector, role, path, **config):
    return LLM(model, block_size=BS, max_num_batched_tokens=64,
               kv_transfer_config={"connector": connector, "role": role, "path": str(path)}, **config)


def generate(llm, prompts):
    return [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=SP, use_tqdm=False)]


def assert_idle(llm):
    assert not llm.has_unfinished_requests()
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    check_kv_manager(llm.scheduler.kv, [])


class FirstLayerFails(SharedStorageConnector):
    """Shared storage whose loads fail at layer 0: every layer computed on top of them is garbage."""

    name = "first_layer_fails"

    def read(self, key, layer_id):
        if layer_id == 0:
            raise LoadError("disk on fire")
        return super().read(key, layer_id)


def test_nothing_computed_on_top_of_a_failed_load_is_saved(fleet_model, tmp_path):
    prefix, tail = random_prompts([12, 9], vocab=100, seed=21)
    prompt = prefix + tail
    want, _ = reference_greedy(fleet_model, [prompt], MAX_NEW)
    for path, connector in ((tmp_path / "clean", "shared_storage"), (tmp_path / "failing", FirstLayerFails)):
        with engine(fleet_model, "shared_storage", "producer", path) as a:
            generate(a, [prefix])  # the store holds the prefix's three blocks
        with engine(fleet_model, connector, "both", path) as b:  # loads them (or fails to), computes the tail
            assert generate(b, [prompt]) == want
            assert b.kv_connector.stats.failed_loads == (connector is FirstLayerFails)
            assert b.kv_connector.stats.loaded_tokens == (0 if connector is FirstLayerFails else 12)  # what arrived
    # The blocks computed on top of the failed load were not saved; those saved once the request
    # was recomputed hold what a clean engine saves.
    files = sorted(p.relative_to(tmp_path / "clean") for p in (tmp_path / "clean").rglob("*.safetensors"))
    assert files == sorted(p.relative_to(tmp_path / "failing") for p in (tmp_path / "failing").rglob("*.safetensors"))
    for f in files:
        clean, failing = load_file(tmp_path / "clean" / f), load_file(tmp_path / "failing" / f)
        np.testing.assert_allclose(failing["k"], clean["k"], atol=1e-4, err_msg=str(f))
        np.testing.assert_allclose(failing["v"], clean["v"], atol=1e-4, err_msg=str(f))
    with engine(fleet_model, "shared_storage", "consumer", tmp_path / "failing") as c:
        assert generate(c, [prompt]) == want
        assert c.kv_connector.stats.loaded_tokens == len(prompt) // BS * BS
        assert_idle(c)


def test_a_store_file_of_the_wrong_dtype_is_not_served(fleet_model, tmp_path):
    prompt = random_prompts([14], vocab=100, seed=22)[0]
    want, _ = reference_greedy(fleet_model, [prompt], MAX_NEW)
    with engine(fleet_model, "shared_storage", "producer", tmp_path) as a:
        generate(a, [prompt])
    files = sorted(tmp_path.rglob("layer_*.safetensors"))
    assert files
    for f in files:  # the same K/V, rounded to float16: shape and token ids still match
        data = load_file(f)
        save_file({"k": data["k"].astype(np.float16), "v": data["v"].astype(np.float16),
                   "token_ids": data["token_ids"]}, f)
    with engine(fleet_model, "shared_storage", "consumer", tmp_path) as b:
        assert generate(b, [prompt]) == want
        assert b.kv_connector.stats.failed_loads >= 1 and b.kv_connector.stats.loaded_tokens == 0
        assert_idle(b)


def test_writers_sharing_a_directory_never_collide(fleet_model, tmp_path):
    engines = [engine(fleet_model, "shared_storage", "both", tmp_path) for _ in range(2)]
    spec = engines[0].kv_connector.spec
    k = np.random.default_rng(0).standard_normal((BS, spec.num_kv_heads, spec.head_dim)).astype(np.float32)
    tokens, errors = [1, 2, 3, 4], []

    def write_many(connector):
        try:
            for _ in range(60):
                connector.write("ab" * 16, 0, k, k, tokens)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=write_many, args=(e.kv_connector,)) for e in engines * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got_k, _, got_tokens = engines[1].kv_connector.read("ab" * 16, 0)
    assert np.array_equal(got_k, k) and got_tokens == tokens
    assert [p.name for p in (tmp_path / "ab").rglob("*") if p.is_file()] == ["layer_0.safetensors"]  # no temp left
    for e in engines:
        e.close()


def test_two_engines_in_one_process_save_the_same_blocks_at_once(fleet_model, tmp_path):
    prompts = random_prompts([13, 17, 9], vocab=100, seed=23)
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    results, errors = [None, None], []

    def run(i):
        try:
            with engine(fleet_model, "shared_storage", "both", tmp_path) as llm:
                results[i] = generate(llm, prompts)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [want, want]


def test_a_path_under_a_regular_file_is_refused_naming_the_field(fleet_model, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match=r"field path: .*is a file"):
        engine(fleet_model, "shared_storage", "both", tmp_path / "file" / "kv")


class AsyncStorage(SharedStorageConnector):
    """Shared storage that says its loads arrive between steps (and does nothing else about it)."""

    name = "async_storage"
    load_kv_async = True


class SlowStorage(AsyncStorage):
    """Loads that arrive 0.3 s after admission, as over a slow link."""

    name = "slow_storage"

    def update_state_after_alloc(self, request, block_ids, num_computed_tokens, num_external_tokens):
        if super().update_state_after_alloc(request, block_ids, num_computed_tokens, num_external_tokens) is None:
            return None
        gate = Future()
        threading.Timer(0.3, gate.set_result, [True]).start()
        return gate


class Steps:
    def __init__(self):
        self.empty = self.total = 0

    def on_step(self, sched, result, outputs):
        self.total += 1
        self.empty += not sched.num_scheduled_tokens


@pytest.mark.parametrize("connector", [AsyncStorage, SlowStorage])
def test_a_block_store_that_loads_between_steps_is_correct(fleet_model, tmp_path, connector):
    prompts = random_prompts([17, 13], vocab=100, seed=24)
    want, _ = reference_greedy(fleet_model, prompts, MAX_NEW)
    with engine(fleet_model, "shared_storage", "producer", tmp_path) as a:
        generate(a, prompts)
    with engine(fleet_model, connector, "consumer", tmp_path) as b:
        assert generate(b, prompts) == want
        assert b.kv_connector.stats.loaded_tokens == 16 + 12 and b.kv_connector.stats.failed_loads == 0
        assert_idle(b)


def test_a_loop_waiting_for_kv_with_a_full_pool_waits_instead_of_spinning(fleet_model, tmp_path):
    long, short = random_prompts([17, 9], vocab=100, seed=25)
    want, _ = reference_greedy(fleet_model, [long, short], MAX_NEW)
    with engine(fleet_model, "shared_storage", "producer", tmp_path) as a:
        generate(a, [long])
    # The long prompt's blocks fill most of the pool while its K/V arrives: the short one cannot
    # be admitted, nothing runs for 0.3 s.
    with engine(fleet_model, SlowStorage, "consumer", tmp_path, num_blocks=7) as b:
        steps = Steps()
        b.observers.append(steps)
        assert generate(b, [long, short]) == want
        assert steps.empty <= 30, f"{steps.empty} empty steps of {steps.total}: the loop spun"
        assert_idle(b)
