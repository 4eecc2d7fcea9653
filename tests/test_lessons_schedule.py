"""fleetlab.lab.lessons.schedule_exercise: the checker agrees with the engine for a correct toy
scheduler (notebook 05's reference solution, read from the notebook), and names the step and
the request where a wrong one first differs."""

import re
import threading
import time
from pathlib import Path

import pytest
from conftest import random_prompts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetlab import LLM, SamplingParams
from fleetlab.lab.lessons import schedule_exercise as ex

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05_decode_loop.py"


def notebook_schedule():
    """The reference ``toy_schedule`` of notebook 05 (its cell, run here on its own)."""
    cells = re.split(r"^# %%.*$", NOTEBOOK.read_text(), flags=re.M)
    cell = next(c for c in cells if "def toy_schedule(" in c)
    scope = {}
    exec(cell, scope)
    return scope["toy_schedule"]


def serve(llm, arrivals):
    """``arrivals``: step -> [(prompt ids, max_tokens)]; returns request id -> arrival step."""
    arrival_steps, step = {}, 0
    while llm.has_unfinished_requests() or step <= max(arrivals):
        for prompt, max_tokens in arrivals.get(step, []):
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            rid = llm.add_request(prompt_token_ids=prompt, sampling_params=params)
            arrival_steps[rid] = step
        llm.step()
        step += 1
    return arrival_steps


def tight_run(model, *, num_blocks=10, seed=0):
    llm = LLM(model, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=12, max_num_seqs=3,
              enable_prefix_caching=False, record_traces=True)
    prompts = random_prompts([5, 13, 4, 7, 9], seed=seed)
    arrivals = {0: [(prompts[0], 8), (prompts[1], 6), (prompts[2], 10)], 3: [(prompts[3], 9), (prompts[4], 5)]}
    return llm, serve(llm, arrivals)


@pytest.fixture(scope="module")
def run(fleet_model):
    llm, arrival_steps = tight_run(fleet_model)
    assert any(t.preempted for t in llm.traces), "the workload must preempt to test the preemption half"
    assert any(r.num_scheduled_tokens < r.num_prompt_tokens - r.num_computed_tokens
               for t in llm.traces for r in t.rows), "and chunk a prompt"
    return llm, arrival_steps


def test_the_notebooks_reference_schedule_agrees_with_the_engine(run):
    llm, arrival_steps = run
    assert ex.check_schedule(notebook_schedule(), llm, arrival_steps) is None


def wrong_at(step, mutate):
    """The reference, except that its plan for ``step`` is changed by ``mutate(plan)``."""
    reference = notebook_schedule()

    def schedule(state):
        plan = reference(state)
        if state.step == step:
            mutate(plan)
        return plan
    return schedule


@pytest.mark.parametrize("which", [0, -1])
def test_a_plan_changed_in_one_step_is_caught_at_that_step_and_request(run, which):
    llm, arrival_steps = run
    step = llm.traces[len(llm.traces) // 2].step
    rid = llm.traces[len(llm.traces) // 2].rows[which].request_id
    found = ex.check_schedule(wrong_at(step, lambda plan: plan.num_scheduled_tokens.pop(rid)), llm, arrival_steps)
    assert (found.step, found.request_id) == (step, rid)
    assert f"step {step}, request {rid}: the engine ran" in found.describe() and "yours left it out" in found.describe()


def test_a_toy_preempting_the_oldest_is_caught_at_the_first_preemption(run):
    llm, arrival_steps = run
    first = next(t for t in llm.traces if t.preempted)
    reference = notebook_schedule()

    def oldest_first(state):  # the reference with the victim taken from the front
        return reference(state, pick_victim=lambda running: running[0])
    found = ex.check_schedule(oldest_first, llm, arrival_steps)
    assert found.step == first.step and found.request_id is not None
    assert found.engine.preempted == first.preempted and found.toy.preempted != first.preempted


def test_a_toy_without_chunked_prefill_is_caught_at_the_first_chunk(run):
    llm, arrival_steps = run
    chunked = next((t.step, r.request_id) for t in llm.traces for r in t.rows
                   if r.num_scheduled_tokens < r.num_prompt_tokens - r.num_computed_tokens)
    reference = notebook_schedule()

    def whole_prompts(state):  # drop any chunk shorter than what the request has left
        plan = reference(state)
        left = {r.request_id: r.num_tokens - r.num_computed_tokens for r in state.running + state.waiting}
        plan.num_scheduled_tokens = {rid: n for rid, n in plan.num_scheduled_tokens.items() if n == left[rid]}
        return plan
    found = ex.check_schedule(whole_prompts, llm, arrival_steps)
    assert (found.step, found.request_id) == chunked


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_blocks=st.integers(7, 14), seed=st.integers(0, 1000))
def test_the_reference_agrees_on_other_pools_and_prompts(fleet_model, num_blocks, seed):
    llm, arrival_steps = tight_run(fleet_model, num_blocks=num_blocks, seed=seed)
    assert ex.check_schedule(notebook_schedule(), llm, arrival_steps) is None


def test_an_engine_the_toy_does_not_model_is_refused(fleet_model):
    llm = LLM(fleet_model, block_size=4, num_blocks=10, record_traces=True)  # prefix caching on
    serve(llm, {0: [(random_prompts([5])[0], 3)]})
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        ex.check_schedule(notebook_schedule(), llm, {"0": 0})
    with pytest.raises(ValueError, match="record_traces"):
        ex.check_schedule(notebook_schedule(), LLM(fleet_model, block_size=4, num_blocks=10,
                                                   enable_prefix_caching=False), {})


# ---------------------------------------------------------------- a learner's slips, named (#45 item 9)
def _forgets_return(state):
    notebook_schedule()(state)  # the plan is made, and dropped


def _returns_a_dict(state):
    return dict(notebook_schedule()(state).num_scheduled_tokens)


def _tokens_none(state):
    return ex.ToyPlan(num_scheduled_tokens=None)


def _string_counts(state):
    plan = notebook_schedule()(state)
    return ex.ToyPlan({rid: str(n) for rid, n in plan.num_scheduled_tokens.items()}, plan.preempted)


def _divides_by_zero(state):
    per_request = state.max_num_batched_tokens // len(state.running)  # no running request at step 0
    return ex.ToyPlan({r.request_id: per_request for r in state.running})


def _never_returns(state):
    while True:
        pass


def _swallows_everything(state):
    while True:
        try:
            while True:
                pass
        except Exception:  # a learner's catch-all does not keep the checker waiting
            pass


@pytest.mark.parametrize("schedule, says", [
    (_forgets_return, "returned None: did it forget `return plan`?"),
    (_returns_a_dict, "returned a dict, not a ToyPlan (wrap it: ToyPlan(num_scheduled_tokens=...))"),
    (_tokens_none, "returned ToyPlan(num_scheduled_tokens=None): it must be a dict"),
    (_string_counts, "each entry must be a request id (str) -> a number of tokens (int >= 1)"),
    (_divides_by_zero, "raised ZeroDivisionError: integer division or modulo by zero"),
])
def test_a_learners_slip_is_named_not_a_crash_inside_the_checker(run, schedule, says):
    llm, arrival_steps = run
    found = ex.check_schedule(schedule, llm, arrival_steps)
    assert isinstance(found, ex.Slip) and found.step == llm.traces[0].step, found
    assert found.describe().startswith(f"step {found.step}: your schedule() ") and says in found.describe()


def test_an_exception_is_shown_in_the_learners_lines_only(run):
    llm, arrival_steps = run
    text = ex.check_schedule(_divides_by_zero, llm, arrival_steps).describe()
    assert "in _divides_by_zero: per_request = state.max_num_batched_tokens // len(state.running)" in text
    assert "schedule_exercise.py" not in text  # none of the checker's own frames


@pytest.mark.parametrize("schedule", [_never_returns, _swallows_everything])
def test_a_schedule_that_never_returns_is_stopped_at_the_time_limit(run, schedule):
    llm, arrival_steps = run
    found = ex.check_schedule(schedule, llm, arrival_steps, time_limit=0.5)
    assert isinstance(found, ex.Slip) and "did not return within 0.5 s" in found.describe()
    # stopped, not left spinning: no thread of the checker is still running
    deadline = time.monotonic() + 5
    while any(t.name == "schedule-exercise" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.name == "schedule-exercise" for t in threading.enumerate())
