"""Prefill and decode on two ranks (paddle.distributed.launch, gloo): K/V sent layer by layer
into the blocks the decode side named; greedy tokens equal one engine's and the full forward;
a request the prefill side refuses is recomputed on the decode side; a request waits for its
K/V outside the batch while the others decode, and may be preempted meanwhile; structured
outputs; ngram drafts on the decode side; both pools end empty."""

from __future__ import annotations

import json
import os

import pytest

from fleetlab.distributed.launch import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_pair(*args) -> dict:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = launch(["fleetlab.serving.disagg.parity", *args], 2, timeout=60, env=env)
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


SLOW_PEER = ("--stagger", "2", "--prefill-delay", "0.4", "--max-tokens", "12")


def check_pools(res):
    assert res["decode_pool"][0] == res["decode_pool"][1] and res["prefill_pool"][0] == res["prefill_pool"][1]


def test_parallel_sampling_and_logprobs_through_prefill_and_decode():
    """``n = 3`` seeded sequences per prompt with their logprobs: the pair's equal one engine's
    (the children share the prompt's blocks, loaded once per request the decode side admits)."""
    res = run_pair("--sequences", "3", "--temperature", "0.8", "--seed", "2", "--logprobs", "2")
    assert res["equal_single"] and len(res["tokens"]) == 3 * res["num_prompts"]
    assert res["num_logprobs"] == 3 * res["num_prompts"] * 5 and res["logprob_max_diff"] < 1e-4
    assert res["loaded_tokens"] > 0 and res["failed_loads"] == 0
    assert res["decode_pool"][0] == res["decode_pool"][1] and res["prefill_pool"][0] == res["prefill_pool"][1]


def test_every_family_through_prefill_and_decode():
    """One job, a pair of engines per family: greedy tokens through the two ranks equal one
    engine's and the model's own full forward, bytes per token as the family's layout says."""
    from fleetlab.models import FAMILIES

    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    r = launch(["fleetlab.serving.disagg.parity", "--model", ",".join(FAMILIES)], 2, timeout=120, env=env)
    results = [json.loads(line.removeprefix("DISAGG_RESULT ")) for line in r.output.splitlines()
               if line.startswith("DISAGG_RESULT ")]
    assert r.returncode == 0 and [res["model"] for res in results] == list(FAMILIES), r.output[-3000:]
    for res in results:
        assert res["equal_single"] and res["equal_forward"], res["model"]
        assert res["loaded_tokens"] > 0 and res["bytes_per_token"] == res["expected_bytes_per_token"], res["model"]
        assert res["decode_pool"][0] == res["decode_pool"][1] and res["prefill_pool"][0] == res["prefill_pool"][1]


def test_a_request_waits_for_its_kv_while_the_others_decode():
    """Half the prompts arrive while the first half decodes, and the prefill side is slow: the
    decode side runs steps while their K/V is on the wire (held out of the batch), then they join;
    ngram drafts on the decode side, verified there: still the full forward's tokens."""
    res = run_pair(*SLOW_PEER, "--ngram", "3")
    assert res["held_steps"] >= 3 and res["loaded_tokens"] > 0 and res["failed_loads"] == 0
    assert res["equal_single"] and res["equal_forward"]
    check_pools(res)


def test_a_request_preempted_while_its_kv_arrives():
    """A pool too small for both halves: the newest request, still waiting for its K/V, is the
    victim; what arrives for it later is discarded and it asks again; the tokens stay the same."""
    res = run_pair(*SLOW_PEER, "--decode-num-blocks", "12")
    assert res["discarded_loads"] > 0 and res["decode_preemptions"] >= res["discarded_loads"]
    assert res["equal_single"] and res["equal_forward"] and res["failed_loads"] == 0
    check_pools(res)


def test_structured_outputs_through_prefill_and_decode():
    """JSON-schema and regex requests through prefill -> decode: one engine's tokens, and each
    follows its constraint."""
    import re

    import jsonschema

    from fleetlab.models.json_tiny import json_tokenizer
    from fleetlab.structured_output.examples import SCHEMAS

    res = run_pair("--structured", "--prompts", "4")
    assert res["equal_single"] and res["loaded_tokens"] > 0
    tok = json_tokenizer()
    texts = [tok.decode(t, skip_special_tokens=True) for t in res["tokens"]]
    jsonschema.validate(json.loads(texts[0]), SCHEMAS["person"])
    assert re.fullmatch(r"[0-9]{2,3}-[a-z]{2}", texts[2]), texts
    check_pools(res)


def test_bench_kv_tiny(tmp_path):
    """``python -m fleetlab bench kv --tiny`` runs its three sections and writes kv.json."""
    from fleetlab.lab.bench.cli import main

    assert main(["kv", "--tiny", "-q", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "kv.json").read_text())
    o = r["offload"]["runs"]
    assert r["offload"]["identical_tokens"] and r["shared_storage"]["identical_tokens"]
    assert o["pool alone"]["pool_hit_rate"] == 0 < o["pool + offload"]["tier_hit_rate"]
    assert all(run["free_blocks_at_end"] == r["offload"]["num_blocks"] for run in o.values())
    d = r["paddle_distributed"]
    assert d["equal_single"] and d["bytes_per_token"] == d["expected_bytes_per_token"]
    assert d["mixed"]["identical_tokens"] and d["mixed"]["pair"]["num_itl"] == d["mixed"]["one engine"]["num_itl"]


def test_the_prefill_rank_takes_several_handshakes_in_one_step():
    """Long prompts arriving every decode step while the prefill rank computes: it takes the
    handshakes queued meanwhile together, so one of its steps runs more than one prompt (K/V
    still sent layer by layer); one engine's tokens; each long prompt's path on one clock, in order."""
    from fleetlab.serving.disagg.mixed import collect

    env = {"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    long_len = 40
    r = launch(["fleetlab.serving.disagg.mixed", "--model-overrides", "{}", "--long", "6", "--long-len",
                str(long_len), "--every", "1", "--short-tokens", "12"], 2, timeout=120, env=env)
    assert r.returncode == 0, r.output[-3000:] + r.worker_logs.get(1, "")[-3000:]
    mixed = collect(r.output, r.worker_logs.get(1, ""))
    assert mixed["identical_tokens"]
    prefill_steps = mixed["timeline"]["prefill rank"]["timeline"]
    assert max(step[2] for step in prefill_steps) >= 2 * (long_len - 1), prefill_steps  # two prompts in a step
    for rid, path in mixed["long_requests"].items():
        # (the last layer may be in, and the decode step started, before the prefill step has sampled)
        assert path["arrive"] <= path["prefill"][0] < path["join"][0] < path["join"][1] <= path["first_token"], (
            rid, path)
