"""Latency metrics (TTFT / TPOT in seconds and in engine steps) and their drawing."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetlab import LLM, SamplingParams, viz
from fleetlab.engine.outputs import RequestOutput
from fleetlab.inspect.latency import LatencyStats, Percentiles, latency_stats, latency_table, token_steps
from fleetlab.inspect.recorder import StepTrace


def output(rid, n_tokens, arrival=None, first=None, finish=None):
    metrics = {"arrival_time": arrival, "first_token_time": first, "finish_time": finish}
    return RequestOutput(rid, [1, 2], list(range(n_tokens)), finish_reason="length", metrics=metrics)


def trace(step, tokens):
    return StepTrace(step=step, rows=[], order_before=[], order_after=[], num_decodes=0, reordered=False,
                     tokens={rid: [0] for rid in tokens}, preempted=[], finished=[], num_free_blocks=0,
                     num_blocks=1, num_batched_tokens=0)


@pytest.fixture()
def run():
    """Three requests: "a" 5 tokens (steps 1,2,3,5,6), "b" one token (step 4), "c" none (an error)."""
    outputs = [output("a", 5, 1.0, 1.5, 2.5), output("b", 1, 2.0, 2.25, 2.25), output("c", 0, 3.0)]
    steps = {0: [], 1: ["a"], 2: ["a"], 3: ["a"], 4: ["b"], 5: ["a"], 6: ["a"]}
    return outputs, [trace(s, t) for s, t in steps.items()]


def test_per_request_seconds_and_steps(run):
    outputs, traces = run
    stats = latency_stats(outputs, traces, arrival_steps={"b": 2})
    a, b, c = stats.requests
    assert (a.ttft_s, a.tpot_s, a.ttft_steps, a.tpot_steps) == (0.5, 0.25, 2, (6 - 1) / 4)
    assert (b.ttft_s, b.tpot_s, b.ttft_steps, b.tpot_steps) == (0.25, None, 3, None)  # arrived before step 2
    assert (c.ttft_s, c.tpot_s, c.ttft_steps, c.tpot_steps) == (None, None, None, None)
    assert stats.ttft_s.count == 2 and stats.tpot_s.count == 1 and stats.has_steps
    assert stats.ttft_steps.p50 == 2.5 and stats.tpot_s.p99 == 0.25
    assert token_steps(traces) == {"a": [1, 2, 3, 5, 6], "b": [4]}


def test_without_traces_only_seconds(run):
    stats = latency_stats(run[0])
    assert stats.ttft_steps is None and stats.tpot_steps is None and not stats.has_steps
    assert stats.requests[0].ttft_steps is None
    table = latency_table({"x": stats})
    assert "TTFT ms" in table and "steps" not in table


def test_traces_that_disagree_with_the_outputs_are_refused(run):
    outputs, traces = run
    with pytest.raises(ValueError, match="'a'.*traces show 4 output tokens"):
        latency_stats(outputs, traces[2:])  # the first tokens' steps are missing
    with pytest.raises(ValueError, match="'b'.*before its arrival step 5"):
        latency_stats(outputs, traces, arrival_steps={"b": 5})


@settings(max_examples=30, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0, 1e3)), max_size=30))
def test_percentiles_skip_missing_values_and_are_ordered(values):
    p = Percentiles.of(values)
    kept = [v for v in values if v is not None]
    assert p.count == len(kept)
    if not kept:
        assert math.isnan(p.p50) and math.isnan(p.mean)
        return
    assert min(kept) <= p.p50 <= p.p90 <= p.p99 <= max(kept)
    assert p.p90 == pytest.approx(np.percentile(kept, 90))


def test_engine_run_one_row_at_a_time(fleet_model):
    """One row, three short prompts queued at step 0, k tokens each: request i gets its first
    token in step i*k (TTFT i*k + 1 steps) and then one token every step (TPOT 1 step)."""
    k = 4
    llm = LLM(fleet_model, block_size=4, max_num_seqs=1, record_traces=True)
    try:
        outs = llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9], [10, 11, 12, 13]],
                            sampling_params=SamplingParams(max_tokens=k, ignore_eos=True), use_tqdm=False)
    finally:
        llm.handle.unpatch()
    stats = latency_stats(outs, llm.traces)
    assert [r.ttft_steps for r in stats.requests] == [1, k + 1, 2 * k + 1]
    assert [r.tpot_steps for r in stats.requests] == [1.0] * 3
    for r, out in zip(stats.requests, outs):
        m = out.metrics
        assert r.ttft_s == pytest.approx(m["first_token_time"] - m["arrival_time"]) and r.ttft_s > 0
        assert r.tpot_s == pytest.approx((m["finish_time"] - m["first_token_time"]) / (k - 1))
    assert stats.requests[2].ttft_s > stats.requests[0].ttft_s  # it waited for two others


def test_engine_run_with_late_arrivals(fleet_model):
    """A request added before step 3 and served at once has a TTFT of 1 step, not 4."""
    llm = LLM(fleet_model, block_size=4, max_num_seqs=4, record_traces=True)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    arrivals, done = {}, []
    try:
        for step in range(12):
            if step in (0, 3):
                rid = llm.add_request(prompt_token_ids=[5 + step, 6, 7], sampling_params=params)
                arrivals[rid] = llm.stats()["num_steps"]
            done += [o for o in llm.step() if o.finished]
    finally:
        llm.handle.unpatch()
    stats = latency_stats(done, llm.traces, arrivals)
    assert arrivals == {"0": 0, "1": 3}
    assert [r.ttft_steps for r in stats.requests] == [1, 1]
    assert latency_stats(done, llm.traces).requests[1].ttft_steps == 4  # as if it had arrived at step 0


def test_latency_table_lines(run):
    outputs, traces = run
    stats = {"fcfs": latency_stats(outputs, traces), "spf": latency_stats(outputs[:1], traces)}
    lines = latency_table(stats).splitlines()
    assert len(lines) == 4 and "TTFT steps" in lines[0] and "TPOT ms" in lines[0]
    assert lines[2].startswith("fcfs") and lines[3].startswith("spf")
    assert "   2.0" in lines[3]  # spf's TTFT p50 in steps: request "a" only


def test_draw_latency_bars_are_the_percentiles(run):
    outputs, traces = run
    stats = {"fcfs": latency_stats(outputs, traces), "spf": latency_stats(outputs[:1], traces)}
    fig = viz.draw_latency(stats)
    bars = {p.get_gid(): p for ax in fig.axes for p in ax.patches if p.get_gid()}
    assert len(bars) == 4 * 3 * 2  # panels x percentiles x runs
    assert bars["ttft_steps:fcfs:p50"].get_height() == pytest.approx(3.5)  # (2 + 5) / 2: "b" from step 0
    assert bars["ttft_s:spf:p90"].get_height() == pytest.approx(500.0)  # milliseconds
    assert bars["tpot_steps:spf:p99"].get_height() == pytest.approx(1.25)
    seconds_only = {"x": latency_stats(outputs)}
    fig = viz.draw_latency(seconds_only)
    gids = {p.get_gid() for ax in fig.axes for p in ax.patches if p.get_gid()}
    assert gids == {f"{f}:x:p{q}" for f in ("ttft_s", "tpot_s") for q in (50, 90, 99)}


def test_draw_latency_refusals(run):
    outputs, _ = run
    with pytest.raises(ValueError, match="no step figures"):
        viz.draw_latency({"x": latency_stats(outputs)}, steps=True)
    with pytest.raises(ValueError, match="at least one run"):
        viz.draw_latency({})
    with pytest.raises(ValueError, match="nothing to draw"):
        viz.draw_latency({"x": latency_stats(outputs)}, ms=False)
    nan_stats = LatencyStats((), Percentiles.of([]), Percentiles.of([]))
    fig = viz.draw_latency({"empty": nan_stats})  # no values: bars of height 0 marked n/a
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert texts.count("n/a") == 6
