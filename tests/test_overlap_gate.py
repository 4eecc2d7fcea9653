"""The overlapped loop's gate (``fleetlab.overlap.gate``): it probes both ways, keeps the faster,
says why, and a loop that switches between overlapped and in-line steps gives the same tokens."""

from __future__ import annotations

import time

import pytest
from conftest import random_prompts

from fleetlab import LLM, SamplingParams
from fleetlab.engine.messages import SchedulerOutput
from fleetlab.overlap import OverlapGate
from fleetlab.patching.parity import reference_greedy

PROMPTS = random_prompts([7, 12, 4, 9, 15, 5], seed=46, low=10)


def _run(gate: OverlapGate, seconds: dict[bool, float], steps: int) -> list[bool]:
    """Drive ``gate`` as the loop does, each step taking ``seconds[mode]`` on the gate's clock; the
    modes it chose."""
    now = [0.0]
    gate.clock = lambda: now[0]
    sched = SchedulerOutput(step=0)
    sched.num_scheduled_tokens = {"a": 1}
    modes = []
    for _ in range(steps):
        modes.append(gate.overlap())
        now[0] += seconds[modes[-1]]
        gate.on_step(sched, None, [])
    return modes


@pytest.mark.parametrize("faster", [True, False])
def test_the_gate_keeps_the_faster_way_and_records_why(faster):
    gate = OverlapGate(probe_steps=3, settle_steps=1, run_steps=10)
    seconds = {faster: 0.002, not faster: 0.02}
    modes = _run(gate, seconds, 8 + 10)
    assert modes[:8] == [True] * 4 + [False] * 4  # the first probe: overlapped first, then in line
    assert modes[8:] == [faster] * 10
    (probe,) = gate.history
    assert probe.overlap is faster and (probe.overlapped < probe.in_line) is faster
    assert _run(gate, seconds, 8)[:4] == [False] * 4  # the next probe starts the other way


def test_an_always_gate_never_probes():
    gate = OverlapGate(always=True)
    assert all(gate.overlap() for _ in range(50)) and gate.history == [] and gate.overlapping


@pytest.fixture(scope="module")
def oracle(fleet_model):
    return reference_greedy(fleet_model, PROMPTS, 10)[0]


@pytest.mark.parametrize("config", [dict(), dict(num_blocks=12), dict(max_num_batched_tokens=7)],
                         ids=["plain", "preempting", "chunk-7"])
def test_switching_every_few_steps_gives_the_full_forwards_tokens(fleet_model, oracle, config):
    with LLM(fleet_model, block_size=4, **{"max_num_batched_tokens": 16, **config}, async_scheduling=True) as llm:
        gate = llm.core.gate
        gate.probe_steps, gate.settle_steps, gate.run_steps = 1, 1, 2
        outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == oracle
        assert gate.history  # it probed and chose at least once
        assert llm.pool.num_free_blocks == llm.pool.num_blocks


def test_a_slow_overlap_is_left_and_a_slow_in_line_step_kept_out(fleet_model, monkeypatch):
    """Overlapped steps made slow (a sleep where the model thread fills placeholders): the gate runs
    in line after its probe; in-line steps made slow: it overlaps."""
    import fleetlab.overlap.core as core

    for slow, want in (("overlap", False), ("in_line", True)):
        with LLM(fleet_model, block_size=4, max_num_batched_tokens=16, async_scheduling=True) as llm:
            gate = llm.core.gate
            gate.probe_steps, gate.settle_steps, gate.run_steps = 4, 1, 1000
            if slow == "overlap":
                monkeypatch.setattr(core, "fill", lambda p, r, fill=core.fill: (time.sleep(0.08), fill(p, r))[1])
            else:
                inner = type(llm.core)._step_in_line
                monkeypatch.setattr(type(llm.core), "_step_in_line",
                                    lambda self, inner=inner: (time.sleep(0.08), inner(self))[1])
            for p in PROMPTS:
                llm.add_request(prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=40, ignore_eos=True))
            gate.always = True  # past the prefill first: the probe then compares decode steps with decode steps
            for _ in range(6):
                llm.step()
            gate.always = False
            while llm.has_unfinished_requests() and not gate.history:
                llm.step()
            assert gate.history and gate.history[0].overlap is want, (slow, gate.history)
            monkeypatch.undo()
            while llm.has_unfinished_requests():
                llm.step()
