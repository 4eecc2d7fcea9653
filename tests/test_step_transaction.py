"""The whole step is the transaction: an extension that raises anywhere in a step (a KV
connector while the step is planned or committed, a prefix cache, a scheduling policy) leaves
every counter and block as before the step; the same requests carry on and finish with the
model's own tokens; the error names the extension and the method. An observer that raises
loses no output (in both loops)."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from fleetlab import LLM, KVConnector, SamplingParams
from fleetlab.errors import ExtensionError, ObserverError
from fleetlab.inspect.pool import check_kv_manager
from fleetlab.patching.parity import reference_greedy

SP = SamplingParams(max_tokens=6, ignore_eos=True)
PREFIX = random_prompts([8], seed=40, low=10)[0]  # two full blocks every prompt shares
PROMPTS = [PREFIX + p for p in random_prompts([3, 6, 1, 5], seed=31, low=10)]


@pytest.fixture(scope="module")
def oracle(fleet_model):
    want, _ = reference_greedy(fleet_model, PROMPTS, SP.max_tokens)
    return want


def assert_idle(llm):
    """Nothing queued or held, every block back, the pool's books consistent."""
    assert not llm.has_unfinished_requests() and llm.scheduler.requests == {}
    assert llm.scheduler._held == {} and llm.scheduler._sent == {}
    assert llm.pool.num_free_blocks == llm.pool.num_blocks
    check_kv_manager(llm.scheduler.kv, [])


def raise_on_call(obj, method, call, error=ValueError):
    """Make ``obj.method`` raise ``error`` on its ``call``-th call (1-based), once."""
    real, calls = getattr(obj, method), [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise error(f"injected into call {call}")
        return real(*args, **kwargs)

    setattr(obj, method, flaky)
    return calls


def run_through(llm, prompts=PROMPTS, errors=(ExtensionError,), sp=SP, record=lambda out: out.token_ids):
    """Queue ``prompts`` (token ids, or text) and step until all finish, catching ``errors`` (the loop
    carries on, as a server's would); returns ``record(output)`` of each prompt's final output and the
    errors' messages."""
    ids = [llm.add_request(p, sp) if isinstance(p, str) else llm.add_request(prompt_token_ids=p, sampling_params=sp)
           for p in prompts]
    done, seen = {}, []
    for _ in range(500):
        if not llm.has_unfinished_requests():
            break
        try:
            outs = llm.step()
        except errors as exc:
            seen.append(str(exc))
            continue
        for out in outs:
            assert out.request_id not in done, f"{out.request_id} finished twice"
            if out.finished:
                done[out.request_id] = record(out)
    return [done.get(i) for i in ids], seen


def engine(model, connector=None, **config):
    kv = None if connector is None else {"connector": connector, "role": "both",
                                         **({"capacity_bytes": 1 << 20} if connector == "offload" else {})}
    return LLM(model, block_size=4, max_num_batched_tokens=12, kv_transfer_config=kv, **config)


@pytest.mark.parametrize("connector", [KVConnector, "offload"])
@pytest.mark.parametrize("method, call", [
    ("update_state_after_alloc", 2),  # after the blocks are allocated: the retry must not take them twice
    ("get_num_new_matched_tokens", 3),
    ("build_connector_meta", 2),  # after the runner's view was updated
    ("request_finished", 1),  # while the step that retires the request commits
    ("request_finished", 2),
])
def test_a_connector_raising_once_rolls_the_step_back(fleet_model, oracle, connector, method, call):
    llm = engine(fleet_model, connector)
    calls = raise_on_call(llm.kv_connector, method, call)
    tokens, errors = run_through(llm)
    assert calls[0] >= call and len(errors) == 1
    assert f"KV connector '{llm.kv_connector.name}'" in errors[0] and f".{method} raised ValueError" in errors[0]
    assert tokens == oracle
    assert_idle(llm)
    llm.close()


@pytest.mark.parametrize("where", ["forward", "request_finished"])
def test_a_rolled_back_steps_saves_are_planned_again(fleet_model, where):
    # The offload tier ends up holding every block the model computed: the saves a rolled-back
    # step planned happen in the step that runs again (they were not lost with the plan).
    prompts = random_prompts([13, 10], seed=41, low=10)  # no block in common
    want, _ = reference_greedy(fleet_model, prompts, SP.max_tokens)
    ref = engine(fleet_model, "offload")
    assert run_through(ref, prompts)[0] == want
    llm = engine(fleet_model, "offload")
    raise_on_call(llm.handle if where == "forward" else llm.kv_connector,
                  "compute_logits" if where == "forward" else where, 1)
    tokens, errors = run_through(llm, prompts, errors=(ValueError, ExtensionError))
    assert tokens == want and len(errors) == 1
    assert llm.kv_connector.num_blocks_held == ref.kv_connector.num_blocks_held == (13 + 5) // 4 + (10 + 5) // 4
    ref.close()
    llm.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("method, call", [("lookup", 2), ("cache_blocks", 3)])
def test_a_prefix_cache_raising_once_rolls_the_step_back(fleet_model, oracle, async_scheduling, method, call):
    llm = engine(fleet_model, async_scheduling=async_scheduling)
    raise_on_call(llm.pool.prefix_cache, method, call)
    tokens, errors = run_through(llm)
    assert len(errors) == 1 and f"prefix cache 'hash' (HashChainCache).{method} raised ValueError" in errors[0]
    assert tokens == oracle
    assert_idle(llm)
    llm.close()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_policy_raising_while_planning_rolls_the_step_back(fleet_model, oracle, async_scheduling):
    llm = engine(fleet_model, async_scheduling=async_scheduling)
    raise_on_call(llm.scheduler.policy, "admission_key", 3, error=KeyError)
    tokens, errors = run_through(llm, errors=(KeyError,))
    assert len(errors) == 1 and tokens == oracle
    assert_idle(llm)
    llm.close()


class Flaky:
    """An observer whose ``on_step`` raises on its ``call``-th call."""

    def __init__(self, call):
        self.call, self.calls = call, 0

    def on_step(self, sched, result, outputs):
        self.calls += 1
        if self.calls == self.call:
            raise RuntimeError("observer broke")


class Counting:
    def __init__(self):
        self.steps = 0

    def on_step(self, sched, result, outputs):
        self.steps += 1


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("call", [1, 4, 7])
def test_an_observer_raising_loses_no_output(fleet_model, oracle, async_scheduling, call):
    llm = engine(fleet_model, async_scheduling=async_scheduling)
    flaky, counting = Flaky(call), Counting()
    llm.observers.extend([flaky, counting])
    tokens, errors = run_through(llm, errors=(ObserverError,))
    assert len(errors) == 1 and "step observer Flaky.on_step raised RuntimeError: observer broke" in errors[0]
    assert tokens == oracle  # the step's outputs came with the next call
    assert counting.steps == flaky.calls  # the observer after the broken one saw every step
    assert_idle(llm)
    llm.close()


def test_an_observer_error_in_generate_names_the_observer_and_leaves_the_engine_clean(fleet_model, oracle):
    llm = engine(fleet_model)
    llm.observers.append(Flaky(2))
    with pytest.raises(ObserverError, match="Flaky.on_step"):
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    assert_idle(llm)  # generate's requests were aborted, none of their outputs is left to come
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SP, use_tqdm=False)
    assert [o.token_ids for o in outs] == oracle
    llm.close()


def test_a_connector_raising_while_a_stop_string_ends_a_request_loses_no_output():
    """A stop string ends a request after the step committed (the output processor finds it), and
    ``LLM.step`` then aborts it in the scheduler, which tells the KV connector (``request_finished``).
    If that raises, the step's outputs come with the next call, which aborts the request first: the
    user sees what a run without the fault shows, once, and every block comes back."""
    from fleetlab.models import load_tiny

    model, tok = load_tiny()
    prompts = ["12+7=", "45+38=", "3+4="]

    def run(fault: bool):
        llm = LLM(model, tok, block_size=4, kv_transfer_config={"connector": KVConnector, "role": "both"})
        plain = SamplingParams(max_tokens=8, ignore_eos=True)
        texts = [o.text for o in llm.generate(prompts, plain, use_tqdm=False)]
        stopped = SamplingParams(max_tokens=8, ignore_eos=True, stop=[texts[1][1:3]])
        if fault:
            raise_on_call(llm.scheduler.connector, "request_finished", 1)
        got, errors = run_through(llm, prompts, sp=stopped,
                                  record=lambda out: (out.text, out.token_ids, out.finish_reason, out.stop_reason))
        assert_idle(llm)
        llm.close()
        return got, errors

    want, no_errors = run(fault=False)
    got, errors = run(fault=True)
    assert not no_errors and want[1][2:] == ("stop", want[1][3]) and want[1][3]
    assert got == want
    assert len(errors) == 1 and "request_finished" in errors[0], errors
