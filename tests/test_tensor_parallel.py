"""Tensor parallelism: the split (in one process), then real 2-process launches on CPU (gloo).

The launched tests start ``fleetlab.lab.tp_worker`` through ``paddle.distributed.launch``:
the greedy tokens of 2 ranks must equal one process's and the oracle's (with chunked
prefill and preemption in the run), each rank's pool must be whole afterwards, and a rank
that dies -- or serves different prompts -- must end the job with a clear error in seconds.
"""

import copy
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import paddle
import pytest

from fleetlab import LLM
from fleetlab.distributed import plan_shards
from fleetlab.distributed.shard import plan_for, shard_model, sharded_info
from fleetlab.engine.config import engine_config
from fleetlab.lab.tp_worker import PARITY, prompts_for, run_family
from fleetlab.models import tiny


class FakeGroup:
    """Rank ``rank`` of ``size`` in one process: all_reduce returns the partial sum unchanged,
    so a test can add the ranks' partial outputs itself."""

    backend = "fake"

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def all_reduce(self, x, name=""):
        return x


# ----- the plan: pure arithmetic -----

def test_two_ranks_split_heads_kv_heads_and_mlp_columns():
    plan = plan_shards(num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128, tp_size=2)
    assert [s.q_heads for s in plan.ranks] == [(0, 1), (2, 3)]
    assert [s.kv_heads for s in plan.ranks] == [(0,), (1,)]
    assert [s.mlp_columns for s in plan.ranks] == [(0, 64), (64, 128)]
    assert plan.ranks[1].q_columns()[:2] == [32, 33] and len(plan.ranks[1].kv_columns()) == 16
    assert plan.kv_replicas == 1


def test_more_ranks_than_kv_heads_replicates_each_kv_head():
    plan = plan_shards(num_heads=8, num_kv_heads=2, head_dim=4, intermediate_size=64, tp_size=4)
    assert [s.kv_heads for s in plan.ranks] == [(0,), (0,), (1,), (1,)]  # each KV head on 2 ranks
    assert all(s.num_heads == 2 and s.num_kv_heads == 1 for s in plan.ranks)
    # every query head reads the KV head of its group: h // (8 / 2)
    assert all(h // 4 == s.kv_heads[0] for s in plan.ranks for h in s.q_heads)
    assert plan.kv_replicas == 2


@pytest.mark.parametrize("size, match", [(3, "does not divide num_attention_heads=4"),
                                         (0, "must be an int >= 1")])
def test_a_size_that_does_not_split_raises_naming_the_field(size, match):
    with pytest.raises(ValueError, match=match):
        plan_shards(4, 2, 16, 128, size)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        plan_shards(12, 8, 16, 96, 3)  # 3 ranks, 8 KV heads: neither divides the other


# ----- engine hooks, without a launch -----

def test_llm_refuses_tensor_parallel_without_a_launch_and_leaves_the_model_alone():
    model = tiny("fleet", seed=0)
    before = [p.numpy().copy() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"paddle\.distributed\.launch --nproc_per_node 2"):
        LLM(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        LLM(model, tensor_parallel_size=3)
    assert sharded_info(model) is None and not any(
        type(m).__name__ == "PagedCoreAttention" for m in model.sublayers())
    assert all(np.array_equal(a, p.numpy()) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_config(tensor_parallel_size=0)


# ----- the split is exact: partial outputs of the ranks add up to the whole layer -----

def _shards(model, size):
    out = []
    for rank in range(size):
        m = copy.deepcopy(model)
        shard_model(m, FakeGroup(rank, size))
        out.append(m)
    return out


@pytest.mark.parametrize("size", [2, 4])
def test_fleet_layer_partials_add_up_to_the_full_layer(size):
    from fleetlab.models.fleet import rope_cos_sin

    model = tiny("fleet", seed=0, num_attention_heads=8, num_kv_heads=2, head_dim=8)
    x = paddle.randn([1, 5, model.config.hidden_size])
    cos, sin = rope_cos_sin(paddle.arange(5).reshape([1, 5]), 8, model.config.rope_theta)
    layer = model.decoder.layers[0]
    with paddle.no_grad():
        want_att = layer.self_attention(x, cos, sin)
        want_mlp = layer.mlp(x)
        shards = _shards(model, size)
        got_att = sum(m.decoder.layers[0].self_attention(x, cos, sin) for m in shards)
        got_mlp = sum(m.decoder.layers[0].mlp(x) for m in shards)
    np.testing.assert_allclose(got_att.numpy(), want_att.numpy(), atol=1e-5)
    np.testing.assert_allclose(got_mlp.numpy(), want_mlp.numpy(), atol=1e-5)
    info = sharded_info(shards[-1])
    assert info.shard.num_kv_heads == 1 and info.shard.num_heads == 8 // size
    assert info.weight_shapes["linear_qkv"] == ((64, (8 + 4) * 8), (64, (8 // size + 2 * max(1, 2 // size)) * 8))
    assert len(info.row_parallel) == 2 * model.config.num_layers


def test_llama_layer_partials_add_up_to_the_full_layer():
    model = tiny("llama", seed=0)
    x = paddle.randn([1, 6, 64])
    pos = paddle.arange(6).reshape([1, 6])
    att = model.model.layers[0].self_attn
    with paddle.no_grad():
        emb = model.model.rotary_emb(x, pos)
        want_att = att(x, position_embeddings=emb)[0]
        want_mlp = model.model.layers[0].mlp(x)
        shards = _shards(model, 2)
        got_att = sum(m.model.layers[0].self_attn(x, position_embeddings=emb)[0] for m in shards)
        got_mlp = sum(m.model.layers[0].mlp(x) for m in shards)
    np.testing.assert_allclose(got_att.numpy(), want_att.numpy(), atol=1e-5)
    np.testing.assert_allclose(got_mlp.numpy(), want_mlp.numpy(), atol=1e-5)
    assert plan_for(shards[0], 2).tp_size == 2
    with pytest.raises(ValueError, match="already sharded for rank 0 of 2"):
        shard_model(shards[0], FakeGroup(1, 2))


def test_families_without_a_plan_say_so():
    with pytest.raises(NotImplementedError, match="family 'phi3' has no sharding plan"):
        plan_for(tiny("phi3", seed=0), 2)


# ----- real launches: 2 processes on CPU, gloo -----

def _launch(tmp_path, *extra, check_every="1", families="fleet,llama,llama:sampled,fleet:radix",
            module="fleetlab.lab.tp_worker"):
    """Two ranks of ``module`` (``tp_faults``, beside this file, wraps the worker with failures)."""
    from fleetlab.distributed.launch import launch

    out = tmp_path / "out"
    tests = str(Path(__file__).parent)
    env = {"FLEETLAB_TP_CHECK_EVERY": check_every,
           "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p)}
    result = launch([module, "--out", str(out), "--families", families, *extra], 2, log_dir=tmp_path / "logs",
                    timeout=240, env=env)
    return result, out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    result, out = _launch(tmp_path_factory.mktemp("tp2"), "--check-fleet-layers")
    assert result.returncode == 0, result.output[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["fleet", "llama", "fleet:radix"])
def test_two_ranks_give_one_process_tokens_with_chunked_prefill_and_preemption(two_ranks, family):
    from fleetlab.patching.parity import reference_greedy

    base, _, mode = family.partition(":")  # "fleet:radix": the radix-tree prefix cache
    alone = run_family(base, 1, **({"prefix_cache": "radix"} if mode else {}))
    want, _ = reference_greedy(tiny(base, seed=0), prompts_for(PARITY["prompt_lens"]), PARITY["max_tokens"])
    assert alone["tokens"] == want
    for rank, report in enumerate(two_ranks):
        r = report["families"][family]
        assert r["tokens"] == alone["tokens"], f"rank {rank}"
        assert r["num_preemptions"] > 0 and r["chunked_prefill"]
        assert r["pool_ok"] is True and r["num_free_blocks"] == r["num_blocks"] == PARITY["num_blocks"]
        assert r["num_kv_heads"] == 1 and r["kv_cache_bytes"] * 2 == alone["kv_cache_bytes"]
        assert r["q_heads"] == [2 * rank, 2 * rank + 1] and r["kv_heads"] == [rank]
        steps = len(r["step_s"])
        assert r["all_reduce_calls"] == 2 * 3 * steps  # two per layer, three layers, every step
        assert [a["name"].split()[-1] for a in r["recorded_all_reduces"]][:2] in (
            ["linear_proj", "linear_fc2"], ["o_proj", "down_proj"])
        assert r["agreement_checks"] == steps  # FLEETLAB_TP_CHECK_EVERY=1
    assert two_ranks[0]["families"][family]["step_num_tokens"] == two_ranks[1]["families"][family]["step_num_tokens"]


@pytest.mark.slow
def test_seeded_sampling_gives_the_same_tokens_on_every_rank(two_ranks):
    """Sampled (temperature 1, top-k 20), seeds drawn by the engine: the ranks agree token for
    token -- their logits are identical after each all-reduce, and each request's random
    numbers come from its seed. (One process agrees too here; its logits differ from the
    split run's only in rounding.)"""
    alone = run_family("llama", 1, temperature=1.0, top_k=20)
    greedy = two_ranks[0]["families"]["llama"]["tokens"]
    ranks = [r["families"]["llama:sampled"]["tokens"] for r in two_ranks]
    assert ranks[0] == ranks[1] and ranks[0] != greedy
    assert ranks[0] == alone["tokens"]


@pytest.mark.slow
def test_paddle_fleet_layers_on_cpu_column_runs_row_needs_a_gpu(two_ranks):
    """Pins what the README says about Paddle's own TP layers on CPU with gloo (Paddle 3.3)."""
    for report in two_ranks:
        assert report["fleet_layers"]["column"] == "ok"
        assert "ProcessGroupGLOO does not support all_reduce" in report["fleet_layers"]["row"]


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_with_a_clear_error_within_seconds(tmp_path):
    result, out = _launch(tmp_path, "--kill-rank", "1", "--kill-at-step", "3", families="fleet", check_every="0",
                          module="tp_faults")
    ended = time.time()
    killed = float((out / "killed_rank1").read_text())
    assert result.returncode != 0
    # the survivor's collective fails (a peer rank died or stopped answering), or, when it was busy
    # computing, the launcher's SIGTERM stops it (a peer rank died or exited): the next test forces that
    assert "TensorParallelError" in result.output and "a peer rank died" in result.output
    assert ended - killed < 15, f"the job took {ended - killed:.1f} s to end after the kill"
    assert not (out / "rank0.json").exists()


@pytest.mark.slow
def test_a_rank_busy_when_its_peer_dies_is_told_why_the_launcher_stops_it(tmp_path):
    result, out = _launch(tmp_path, "--kill-rank", "1", "--stall-rank", "0", "--kill-at-step", "3",
                          families="fleet", check_every="0", module="tp_faults")
    ended = time.time()
    assert result.returncode != 0 and ended - float((out / "killed_rank1").read_text()) < 15
    assert "TensorParallelError: tensor-parallel rank 0/2: stopped by SIGTERM" in result.output, result.output[-2000:]


def test_a_failed_jobs_output_gets_the_rank_errors_the_launcher_did_not_pass_on():
    """Paddle's launcher tails only the rank it saw fail first: a SIGKILLed rank's empty log, while
    the peer's TensorParallelError sits unrelayed in its own log (a race under load)."""
    from fleetlab.distributed.launch import failure_summary, last_error

    error = "fleetlab.distributed.group.TensorParallelError: tensor-parallel rank 0/2: a peer rank died"
    log0 = ("step 2\nTraceback (most recent call last):\n  File \"x.py\", line 1, in f\n    g()\n"
            f"ValueError: first\n\nThe above exception was the direct cause of the following exception:\n\n"
            f"Traceback (most recent call last):\n  File \"y.py\", line 2, in h\n{error}\n")
    banner = "== Modified FLAGS detected ==\n"
    assert last_error(log0) == error and last_error(banner) is None
    summary = failure_summary(247, {0: log0, 1: banner}, banner, "/logs")
    assert summary.splitlines() == ["fleetlab: the job failed (exit status 247); from the ranks' logs:",
                                    f"  rank 0: {error}"]
    assert failure_summary(1, {0: log0, 1: banner}, banner + log0, "/logs") == ""  # nothing missing
    assert "no rank wrote an error: one was killed" in failure_summary(247, {0: "step 2\n", 1: banner}, "", "/logs")


@pytest.mark.slow
def test_ranks_that_disagree_are_stopped_by_the_agreement_check(tmp_path):
    result, out = _launch(tmp_path, "--diverge-rank", "1", families="fleet", module="tp_faults")
    assert result.returncode != 0
    assert re.search(r"ranks disagree on engine step \d+", result.output)


# The demo on two ranks (answers equal to one process', no launcher notices): tests/test_cli.py.


# ----- bench tp and the drawings -----

@pytest.mark.slow
def test_bench_tp_tiny_runs_one_and_two_processes_and_draws(tmp_path):
    from fleetlab.lab.bench.cli import BENCHES
    from fleetlab.lab.bench.tp import run, table

    assert BENCHES["tp"] == "fleetlab.lab.bench.tp"
    from fleetlab.lab.bench.tp import RUNS

    result = run("tiny", tmp_path, runs=RUNS[::2])  # the 2-thread baseline adds nothing to check here
    assert [r["name"] for r in result["runs"]] == ["tp1 x 1 thread", "tp2 x 1 thread"]
    assert result["identical_tokens"] and all(r["ranks_identical"] for r in result["runs"])
    tp2 = result["runs"][1]
    assert tp2["all_reduce_per_step"] == 6 and 0 < tp2["all_reduce_share"] < 1 and tp2["all_reduce_alone_ms"] > 0
    assert tp2["kv_cache_bytes_per_rank"] * 2 == result["runs"][0]["kv_cache_bytes_per_rank"]
    assert (tmp_path / "tp_step_time.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "tp.json").read_text())["preset"] == "tiny"
    assert table(result).count("\n| tp") == 2


def test_shard_plan_drawing_colours_each_item_by_its_ranks():
    from fleetlab.lab.viz.tp import draw_shard_plan, rank_color

    fig = draw_shard_plan([plan_shards(8, 2, 4, 64, 4)])
    cells = {}
    for patch in fig.axes[0].patches:
        cells.setdefault(patch.get_gid(), []).append(patch.get_facecolor())
    from matplotlib.colors import to_rgba

    assert cells["query heads:5"] == [to_rgba(rank_color(2))]
    assert cells["KV heads (cached):1"] == [to_rgba(rank_color(2)), to_rgba(rank_color(3))]  # replicated
