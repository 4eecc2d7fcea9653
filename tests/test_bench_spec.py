"""`python -m fleetlab bench spec --tiny`: a seconds-long run writes a complete result, and its
counts hang together. Benchmarks are commands, not timed tests: nothing here checks a speed."""

import json

import pytest

from fleetlab.lab.bench import spec as bench_spec


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    from fleetlab.lab.bench.cli import main

    out = tmp_path_factory.mktemp("bench-spec")
    assert main(["spec", "--tiny", "--out", str(out)]) == 0
    return out, json.loads((out / "spec.json").read_text())


def test_tiny_run_writes_json_and_plot(tiny_result):
    out, r = tiny_result
    assert r["schema_version"] == 1 and r["preset"] == "tiny"
    assert r["plots"] == ["spec.png"] and (out / "spec.png").read_bytes()[:4] == b"\x89PNG"
    assert set(r["workloads"]) == {"trained", "repetitive"}
    cfg = bench_spec.PRESETS["tiny"]
    names = [run["name"] for run in r["workloads"]["trained"]["runs"]]
    assert names == ["off"] + [f"draft k={k}" for k in cfg.draft_ks] + [f"ngram k={k}" for k in cfg.ngram_ks]
    assert "token_ids" not in r["workloads"]["trained"]["runs"][0]


def test_tiny_runs_agree_with_speculation_off_and_count_per_request(tiny_result):
    _, r = tiny_result
    trained = r["workloads"]["trained"]
    assert all(len(trained["prompts"]) == len(run["forwards_per_token_by_request"]) for run in trained["runs"])
    for wl in r["workloads"].values():
        off = wl["runs"][0]
        assert off["method"] == "off" and off["forwards_per_token"] == 1.0  # every prompt fits one step
        for run in wl["runs"]:
            assert run["identical_to_off"]  # greedy: speculation never changes the tokens
            assert run["num_output_tokens"] == off["num_output_tokens"] == sum(run["num_tokens_by_request"])
            per = [f / t for f, t in zip(run["num_forwards_by_request"], run["num_tokens_by_request"])]
            assert per == pytest.approx(run["forwards_per_token_by_request"])
            assert len(run["wall_s"]) == r["config"]["rounds"] and run["speedup"] > 0
            if run["method"] != "off":
                assert 0 <= run["acceptance_rate"] <= 1 and run["num_draft_tokens"] > 0
    assert all(n >= bench_spec.MIN_OUTPUT_TOKENS for n in trained["runs"][0]["num_tokens_by_request"])
    alone = r["alone"]["runs"]
    assert [a["k"] for a in alone] == [0, *bench_spec.PRESETS["tiny"].alone_ks]
    assert all(len(a["wall_s"]) == r["config"]["rounds"] and a["speedup"] > 0 for a in alone)
    assert alone[1]["num_steps"] < alone[0]["num_steps"]
    g = r["goal"]
    assert g["k"] == r["config"]["headline_k"] and g["num_requests"] == len(trained["prompts"])
    assert g["met"] == (g["worst_ratio"] <= 0.5)
    text = bench_spec.summary(r)
    assert "goal (draft k=4" in text and "why:" in text and "one at a time" in text


def test_workloads_are_deterministic_and_of_the_trained_kinds():
    prompts = bench_spec.trained_prompts(3, 3, seed=0)
    assert prompts == bench_spec.trained_prompts(3, 3, seed=0) and len(set(prompts)) == 6
    assert all(p.startswith("count ") and len(p.split()) == 2 for p in prompts[:3])
    assert all(len(p.split()) == 3 and not p.startswith("count") for p in prompts[3:])
    reps = bench_spec.repetitive_prompts(4, (2, 5), 3, vocab_size=50, seed=1)
    for p in reps:
        n = len(p) // 3
        assert p == p[:n] * 3 and 2 <= n <= 5 and all(3 <= t < 50 for t in p)


def test_cli_lists_spec_and_rejects_bad_rounds(capsys):
    from fleetlab.lab.bench.cli import main

    assert main(["--help"]) == 0 and "``spec``" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["spec", "--rounds", "0"])
