"""The engine benchmark: a tiny run completes and writes valid results; its arithmetic is right.

Benchmarks are commands, not timed tests: nothing here checks a speed.
"""

import contextlib
import io
import json

import numpy as np
import pytest

from fleetlab.inspect.recorder import RowTrace, StepTrace
from fleetlab.lab.bench import engine
from fleetlab.lab.bench.workloads import (
    FIRST_TOKEN_ID,
    Workload,
    mixed_workload,
    padded_batches,
    shared_prefix_workload,
)

STEP_PARTS = ("schedule", "batch_update", "metadata", "forward", "sample", "propose", "update", "other")


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    from fleetlab.lab.bench.cli import main

    out = tmp_path_factory.mktemp("bench")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["engine", "--tiny", "--out", str(out)]) == 0
    return out, json.loads((out / "bench.json").read_text()), err.getvalue()


def test_tiny_run_writes_json_and_plots(tiny_result):
    out, r, _ = tiny_result
    assert r["schema_version"] == 1 and r["preset"] == "tiny"
    assert set(r["machine"]) >= {"processor", "cpu_count", "paddle", "paddleformers", "device", "omp_num_threads",
                                 "load_average", "load_average_end", "cpu_use"}
    assert r["plots"] and all((out / name).read_bytes()[:4] == b"\x89PNG" for name in r["plots"])
    assert engine.headline_table(r).count("\n| ") >= 5


def test_tiny_run_shows_a_progress_bar_per_section(tiny_result):
    *_, err = tiny_result
    bars = {piece.split(":")[0] for piece in err.replace("\r", "\n").splitlines() if "100%" in piece}
    assert bars == {"throughput, tiny model", "prefix caching", "step breakdown"}, err


def test_tiny_throughput_counts_real_tokens_and_agrees(tiny_result):
    _, r, _ = tiny_result
    tp = r["throughput"]
    n_out = tp["workload"]["num_output_tokens"]
    for m in tp["models"]:
        pf, fl = m["paddleformers"], m["fleetlab"]
        assert pf["output_tokens"] == fl["output_tokens"] == n_out
        assert pf["generated_tokens"] >= n_out  # static batches decode to their longest request
        assert m["speedup"] == pytest.approx(fl["tokens_per_s"] / pf["tokens_per_s"])
        # Both sides are greedy on the same model: the tokens must be the same.
        assert m["agreement"]["identical_requests"] == m["agreement"]["requests"] == tp["workload"]["num_requests"]


def test_tiny_memory_prefix_and_breakdown_are_consistent(tiny_result):
    _, r, _ = tiny_result
    kv = r["kv_memory"]
    for key in ("paged", "padded", "reserved"):
        assert 0 < kv[key]["token_fill"] <= 1
        assert kv[key]["peak_bytes"] == kv[key]["peak_slots"] * kv["bytes_per_token"]
    px = r["prefix_caching"]
    assert px["identical_outputs"]
    assert px["off"]["hit_rate"] == 0 and px["on"]["hit_rate"] > 0
    assert px["on"]["prefill_tokens_computed"] < px["off"]["prefill_tokens_computed"]
    assert [b["batch_size"] for b in r["step_breakdown"]] == list(r["config"]["breakdown_batches"])
    for b in r["step_breakdown"]:
        ms = b["ms_per_step"]
        assert b["num_steps"] > 0
        assert sum(ms[k] for k in STEP_PARTS) == pytest.approx(ms["total"])
        assert 0 <= b["overhead_share"] < 1


def test_workloads_are_seeded_and_in_range():
    a = mixed_workload(20, (3, 9), (2, 5), vocab_size=50, seed=4)
    assert a == mixed_workload(20, (3, 9), (2, 5), vocab_size=50, seed=4)
    assert all(3 <= n <= 9 for n in a.prompt_lens) and all(2 <= n <= 5 for n in a.output_lens)
    assert all(FIRST_TOKEN_ID <= t < 50 for p in a.prompts for t in p)
    s = shared_prefix_workload(5, 12, (1, 3), (1, 2), vocab_size=50, seed=0)
    assert len({tuple(p[:12]) for p in s.prompts}) == 1
    with pytest.raises(ValueError, match="prompt_len"):
        mixed_workload(2, (5, 3), (1, 1), vocab_size=50)


def test_padded_batches_pad_on_the_left():
    wl = Workload("w", [[5, 6], [7, 8, 9, 10], [11]], [1, 3, 2])
    first, second = padded_batches(wl, batch_size=2, pad_token_id=0)
    assert first.indices == [0, 1] and second.indices == [2]
    np.testing.assert_array_equal(first.input_ids, [[0, 0, 5, 6], [7, 8, 9, 10]])
    np.testing.assert_array_equal(first.attention_mask, [[0, 0, 1, 1], [1, 1, 1, 1]])
    assert (first.max_new_tokens, second.max_new_tokens) == (3, 2)


def test_padded_occupancy_by_hand():
    # One batch, width 4, three model calls: real 6/7/8 tokens in 8/10/12 slots.
    wl = Workload("w", [[5, 6], [7, 8, 9, 10]], [1, 3])
    occ = engine.padded_occupancy(wl, batch_size=2)
    assert (occ["token_steps"], occ["slot_steps"], occ["peak_slots"]) == (21, 30, 12)
    assert occ["token_fill"] == pytest.approx(0.7)


def test_paged_occupancy_counts_shared_blocks_once():
    def step(rows):
        return StepTrace(step=0, rows=rows, order_before=[], order_after=[], num_decodes=0, reordered=False,
                         tokens={}, preempted=[], finished=[], num_free_blocks=0, num_blocks=8,
                         num_batched_tokens=0)

    # Block size 4. Request a: 5 tokens after the step in blocks [0, 1]; b shares block 0
    # (a cached prefix) and holds 6 tokens in [0, 2]: blocks 0, 1, 2 hold 4 + 1 + 2 tokens.
    rows = [RowTrace("a", "prefill", 5, 0, 5, [0, 1]), RowTrace("b", "prefill", 2, 4, 6, [0, 2])]
    occ = engine.paged_occupancy([step(rows)], block_size=4)
    assert (occ["token_steps"], occ["slot_steps"]) == (7, 12)


def test_agreement_measures_the_common_prefix():
    got = engine.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert got == {"requests": 2, "identical_requests": 1, "matching_token_fraction": pytest.approx(4 / 6)}


def test_tiny_overlapped_side_runs_the_overlapped_core_beside_the_synchronous_one():
    """``bench engine --async-scheduling``: the third side is ``LLM(async_scheduling=True)``'s own core (not
    the synchronous one under another name), every side reports positive figures, the ratios are the
    figures' own, and the interpreter's switch interval is put back."""
    import dataclasses
    import sys

    from fleetlab.lab.bench.report import overlap_row

    cfg, _, _ = engine._parse(["--tiny", "--async-scheduling", "--repeats", "2"])
    assert cfg.async_scheduling and cfg.repeats == 2
    vocab = engine.MODEL_SIZES["tiny"]["vocab_size"]
    wl = mixed_workload(cfg.num_requests, cfg.prompt_len, cfg.output_len, vocab, seed=cfg.seed)
    switch = sys.getswitchinterval()
    tp, _ = engine.bench_throughput(dataclasses.replace(cfg, sizes=("tiny",)), wl)
    assert sys.getswitchinterval() == switch
    (m,) = tp["models"]
    sync, over = m["fleetlab"], m["fleetlab_overlap"]
    assert sync["core"] == "EngineCore" and over["core"] == "OverlapEngineCore"
    for side in (m["paddleformers"], sync, over):
        assert side["tokens_per_s"] > 0 and len(side["seconds"]) == 2
    for side in (sync, over):
        assert side["num_steps"] > 0 and len(side["ttft_ms"]) == 2 and side["best_ttft_ms"] > 0
    assert m["overlap_speedup"] == pytest.approx(over["tokens_per_s"] / m["paddleformers"]["tokens_per_s"])
    # Greedy on the same model: the overlapped loop gives the same tokens as generate.
    assert m["overlap_agreement"]["identical_requests"] == wl.num_requests
    paired = m["paired"]
    assert paired["overlap_over_sync"] == pytest.approx([s / o for s, o in zip(sync["seconds"], over["seconds"])])
    assert paired["overlap_speedup_median"] == pytest.approx(np.median(paired["overlap_speedup"]))
    assert f"{m['overlap_speedup']:.2f}x" in overlap_row(m, tp["paddleformers_batch_size"])
