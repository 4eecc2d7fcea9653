"""``python -m fleetlab serve`` as a real process, and ``python -m fleetlab bench serve`` against it."""

import json
import math

import pytest

openai = pytest.importorskip("openai")

from fleetlab.bench.serving import RequestRecord, poisson_offsets, summarize
from fleetlab.serving.cli import build_parser, engine_config
from fleetlab.serving.launch import ServerProcess


def test_serve_process_fleet_impl_and_bench_serve_smoke(tmp_path):
    from fleetlab.bench.cli import main as bench_main

    args = ["--model", "tiny", "--model-impl", "fleet", "--max-num-seqs", "8", "--block-size", "8"]
    with ServerProcess(args, timeout=120) as server:
        c = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        r = c.completions.create(model="tiny", prompt="12+7=", max_tokens=4, temperature=0)
        assert r.choices[0].text == "19"  # the trained weights, moved into the Fleet-style model
        # quiet unless -v: the one line saying where it listens, no library notices, no access log
        lines = [line for line in server.log_text().splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("fleetlab serve: 'tiny' (fleet"), lines
        out = tmp_path / "results"
        assert bench_main(["serve", "--tiny", "--url", server.url, "--out", str(out)]) == 0
    assert server.process.returncode == 0  # Ctrl-C (SIGINT) stops it cleanly
    result = json.loads((out / "serving.json").read_text())
    assert result["schema_version"] == 1 and result["model"] == "tiny"
    assert [r["rate"] for r in result["runs"]] == [20.0, "inf"]
    for run in result["runs"]:
        assert run["completed"] == run["num_requests"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] >= 6 * 3  # ignore_eos: every request makes its 3-6 tokens
        assert run["output_throughput"] > 0 and run["ttft_ms"]["p99"] >= run["ttft_ms"]["median"] > 0
    assert (out / "serving.png").read_bytes()[:4] == b"\x89PNG"


def test_serve_options_reach_the_engine():
    args = build_parser().parse_args(["--max-num-seqs", "3", "--backend", "triton", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2}', "--no-enable-prefix-caching"])
    cfg = engine_config(args)
    assert cfg["max_num_seqs"] == 3 and cfg["backend"] == "triton" and cfg["enable_prefix_caching"] is False
    assert cfg["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert "speculative_config" not in engine_config(build_parser().parse_args([]))


def test_serve_refuses_a_bad_engine_option(capsys):
    from fleetlab.__main__ import main

    assert main(["serve", "--port", "0", "--scheduling-policy", "nope"]) == 2
    assert "scheduling_policy" in capsys.readouterr().err


def test_bench_arithmetic():
    recs = [RequestRecord(sent=0.0, chunk_times=[0.1, 0.2, 0.4], output_tokens=3),
            RequestRecord(sent=0.5, chunk_times=[0.8, 1.0], output_tokens=5),
            RequestRecord(sent=0.6, error="HTTP 503")]
    s = summarize(recs, 4.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["duration_s"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(8.0) and s["request_throughput"] == pytest.approx(2.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)  # (100 + 300) / 2
    assert s["tpot_ms"]["mean"] == pytest.approx((150 + 50) / 2)  # 0.3 s / 2 tokens; 0.2 s / 4 tokens
    assert s["itl_ms"]["median"] == pytest.approx(200.0)  # gaps 100, 200, 200
    offsets = poisson_offsets(4000, 50.0, seed=0)
    assert offsets[0] == 0 and offsets[-1] / 4000 == pytest.approx(1 / 50, rel=0.1)
    assert not poisson_offsets(5, math.inf, 0).any()
