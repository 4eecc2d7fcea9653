"""Prefill and decode on two ranks (paddle.distributed.launch, gloo): K/V sent layer by layer
into the blocks the decode side named; greedy tokens equal one engine's and the full forward;
a request the prefill side refuses is recomputed on the decode side; both pools end empty."""

from __future__ import annotations

import json
import os

import pytest

from fleetlab.distributed.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_pair(*args) -> dict:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = launch(["fleetlab.kv_transfer.disagg", *args], 2, timeout=60, env=env)
    lines = [line for line in r.output.splitlines() if line.startswith("DISAGG_RESULT ")]
    assert r.returncode == 0 and lines, r.output[-3000:] + r.worker_logs.get(1, "")[-3000:]
    return json.loads(lines[-1].removeprefix("DISAGG_RESULT "))


@pytest.mark.parametrize("args, refused", [
    ((), 0),
    (("--prefill-max-model-len", "16", "--prompts", "6"), 1),  # the prefill side refuses the long prompts
    (("--decode-num-blocks", "9", "--max-tokens", "12"), 0),  # the decode side preempts: pulled again
    (("--temperature", "0.9", "--seed", "3"), 0),  # seeded sampling: one engine's tokens
])
def test_prefill_rank_to_decode_rank(args, refused):
    res = run_pair(*args)
    assert res["equal_single"]
    assert res["equal_forward"] is (None if "--temperature" in args else True)  # sampled: no greedy forward
    assert res["loaded_tokens"] > 0
    assert res["bytes_per_token"] == res["expected_bytes_per_token"]  # 2 x layers x kv_heads x head_dim x 4
    assert (res["failed_loads"] > 0) == bool(refused)
    if "--decode-num-blocks" in args:
        assert res["decode_preemptions"] > 0  # and still the same tokens, every block back
    assert res["decode_pool"][0] == res["decode_pool"][1] and res["prefill_pool"][0] == res["prefill_pool"][1]


def test_bench_kv_tiny(tmp_path):
    """``python -m fleetlab bench kv --tiny`` runs its three sections and writes kv.json."""
    from fleetlab.bench.cli import main

    assert main(["kv", "--tiny", "-q", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "kv.json").read_text())
    o = r["offload"]["runs"]
    assert r["offload"]["identical_tokens"] and r["shared_storage"]["identical_tokens"]
    assert o["pool alone"]["pool_hit_rate"] == 0 < o["pool + offload"]["tier_hit_rate"]
    assert all(run["free_blocks_at_end"] == r["offload"]["num_blocks"] for run in o.values())
    d = r["paddle_distributed"]
    assert d["equal_single"] and d["bytes_per_token"] == d["expected_bytes_per_token"]
    assert d["mixed"]["identical_tokens"] and d["mixed"]["pair"]["num_itl"] == d["mixed"]["one engine"]["num_itl"]
