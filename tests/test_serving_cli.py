"""``python -m fleetlab serve`` as a real process, and ``python -m fleetlab bench serve`` against it."""

import asyncio
import json
import math
import re
import signal
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from fleetlab.lab.bench.serving import RequestRecord, poisson_offsets, summarize
from fleetlab.serving.cli import build_parser, engine_config
from fleetlab.serving.launch import ServerProcess


async def _open_streams(url: str, n: int, max_tokens: int) -> list:
    """``n`` streamed completions, open (their headers read) and not read further."""
    body = {"model": "tiny", "prompt": "count 1 ", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    client = httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=None))
    responses = await asyncio.gather(*(client.send(client.build_request("POST", "/v1/completions", json=body),
                                                   stream=True) for _ in range(n)))
    assert [r.status_code for r in responses] == [200] * n
    return client, responses


async def _events(response) -> list:
    """Every ``data:`` payload of an SSE response, to its end."""
    return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


async def _running(client, n: int) -> None:
    """Until the server's ``/metrics`` reports ``n`` requests in its running batch (all admitted and
    none finished: the first of them must not be done before the last was admitted)."""
    while True:
        text = (await client.get("/metrics")).text
        running = re.search(r"^fleetlab:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
        if running and float(running.group(1)) >= n:
            return
        assert "fleetlab:num_requests_running" in text, text[:500]
        await asyncio.sleep(0.02)


async def _stopped_listening(url: str) -> None:
    """Until the server refuses new connections: its shutdown began, and the drain with it."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    while True:
        try:
            _, writer = await asyncio.open_connection(host, int(port))
        except OSError:
            return
        writer.close()
        await asyncio.sleep(0.02)


def _stop_with_open_streams(server, sig, n: int, max_tokens: int, running: bool = False) -> list:
    """Open ``n`` streams, send ``sig`` to the server, read every stream to its end. ``running``:
    signal only once the server reports all ``n`` in its running batch (else: once their headers came)."""
    async def run():
        client, responses = await _open_streams(server.url, n, max_tokens)
        if running:
            await asyncio.wait_for(_running(client, n), 60)
        server.process.send_signal(sig)
        events = await asyncio.gather(*(_events(r) for r in responses))
        await client.aclose()
        return events

    return asyncio.run(run())


# What a clean stop never prints: a traceback, uvicorn's cancelled tasks, asyncio's warnings.
UNCLEAN = re.compile(r"Traceback|Exception|ERROR|Cancel|Task was destroyed|Task exception")


def test_serve_process_bench_serve_and_ctrl_c_with_200_open_streams(tmp_path):
    from fleetlab.lab.bench.cli import main as bench_main

    args = ["--model", "tiny", "--model-impl", "paddlefleet", "--max-num-seqs", "8", "--block-size", "8",
            "--max-model-len", "4096"]
    with ServerProcess(args, timeout=120) as server:
        c = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        r = c.completions.create(model="tiny", prompt="12+7=", max_tokens=4, temperature=0)
        assert r.choices[0].text == "19"  # the trained weights, moved into the Fleet-style model
        out = tmp_path / "results"
        assert bench_main(["serve", "--tiny", "--url", server.url, "--out", str(out)]) == 0
        # Ctrl-C with 200 streams open (100 steps each: far from done): each ends with an error, then [DONE]
        events = _stop_with_open_streams(server, signal.SIGINT, 200, 100)
        assert server.process.wait(30) == 0
    for stream in events:
        *chunks, error, done = stream
        assert done == "[DONE]" and json.loads(error)["error"]["code"] == "shutting_down", stream[-2:]
        assert all(json.loads(c)["choices"][0]["finish_reason"] is None for c in chunks)
    # quiet unless -v: fleetlab's own warning (the model has 128 positions), the line saying where it
    # listens, and nothing else: no library notices, no access log, nothing per cancelled request
    log = server.log_text()
    assert not UNCLEAN.search(log), log[-3000:]
    lines = [line for line in log.splitlines() if line.strip()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("WARNING fleetlab") and "max_model_len=4096 exceeds the model's 128" in lines[0]
    assert lines[1].startswith("fleetlab serve: 'tiny' (paddlefleet"), lines
    result = json.loads((out / "serving.json").read_text())
    assert result["schema_version"] == 1 and result["model"] == "tiny"
    assert [r["rate"] for r in result["runs"]] == [20.0, "inf"]
    for run in result["runs"]:
        assert run["completed"] == run["num_requests"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] >= 6 * 3  # ignore_eos: every request makes its 3-6 tokens
        assert run["output_throughput"] > 0 and run["ttft_ms"]["p99"] >= run["ttft_ms"]["median"] > 0
    assert (out / "serving.png").read_bytes()[:4] == b"\x89PNG"


def test_sigterm_lets_requests_finish_and_verbose_shows_uvicorn_and_fleetlab_lines():
    # The signal goes once the server reports the 3 requests in its running batch, each with ~100
    # tokens still to make: headers alone did not say so (on a loaded machine the first 12-token
    # request was done before the last one's headers came, and the drain counted fewer than 3).
    with ServerProcess(["-v", "--model", "tiny", "--shutdown-timeout", "60"], timeout=120) as server:
        events = _stop_with_open_streams(server, signal.SIGTERM, 3, 100, running=True)
        assert server.process.wait(30) == 0  # SIGTERM: a clean exit too, not 143
    for stream in events:  # they ran to the end within the shutdown timeout
        assert stream[-1] == "[DONE]" and json.loads(stream[-2])["choices"][0]["finish_reason"] == "length"
    log = server.log_text()
    assert not UNCLEAN.search(log), log[-3000:]
    assert re.search(r'INFO: .*"POST /v1/completions HTTP/1.1" 200', log)  # uvicorn's access lines
    assert "INFO:     Waiting for application startup." in log  # uvicorn's own INFO lines
    assert "INFO fleetlab.serving.app: shutdown: waiting up to 60.0 s for 3 requests to finish" in log


def test_a_second_ctrl_c_during_the_drain_ends_every_stream_at_once_quietly():
    with ServerProcess(["--model", "tiny", "--shutdown-timeout", "60"], timeout=120) as server:
        async def run():
            client, responses = await _open_streams(server.url, 20, 100)
            server.process.send_signal(signal.SIGINT)  # the drain: up to 60 s for the streams to finish
            await _stopped_listening(server.url)  # the drain has begun (not a guess at how long that takes)
            t0 = time.monotonic()
            server.process.send_signal(signal.SIGINT)  # do not wait
            events = await asyncio.gather(*(_events(r) for r in responses))
            await client.aclose()
            return events, time.monotonic() - t0

        events, waited = asyncio.run(run())
        assert server.process.wait(30) == 0
    assert waited < 20  # not the 60 s of the drain
    for stream in events:
        assert stream[-1] == "[DONE]" and json.loads(stream[-2])["error"]["code"] == "shutting_down", stream[-2:]
    log = server.log_text()
    assert not UNCLEAN.search(log), log[-3000:]
    assert [line for line in log.splitlines() if line.strip()][1:] == [], log  # the address line, nothing else


def test_serve_options_reach_the_engine():
    args = build_parser().parse_args(["--max-num-seqs", "3", "--backend", "triton", "--speculative-config",
                                      '{"method": "ngram", "num_speculative_tokens": 2}', "--no-enable-prefix-caching"])
    cfg = engine_config(args)
    assert cfg["max_num_seqs"] == 3 and cfg["backend"] == "triton" and cfg["enable_prefix_caching"] is False
    assert cfg["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert "speculative_config" not in engine_config(build_parser().parse_args([]))
    default = engine_config(build_parser().parse_args([]))
    assert default["prefix_cache"] == "hash" and default["scheduling_policy"] == "fcfs"
    radix = engine_config(build_parser().parse_args(["--prefix-cache", "radix", "--scheduling-policy", "lpm"]))
    assert radix["prefix_cache"] == "radix" and radix["scheduling_policy"] == "lpm"
    none = engine_config(build_parser().parse_args(["--prefix-cache", "none"]))
    assert none["prefix_cache"] is None and none["enable_prefix_caching"] is False


def test_serve_runs_the_radix_cache_under_lpm(fleet_model):
    from fleetlab import LLM, SamplingParams

    cfg = engine_config(build_parser().parse_args(["--prefix-cache", "radix", "--scheduling-policy", "lpm",
                                                   "--block-size", "4", "--max-num-seqs", "2"]))
    with LLM(fleet_model, **cfg) as llm:
        assert type(llm.pool.prefix_cache).__name__ == "RadixCache" and llm.scheduler.policy.name == "lpm"
        llm.generate(prompt_token_ids=[[5] * 9, [5] * 7 + [6]], sampling_params=SamplingParams(max_tokens=2),
                     use_tqdm=False)
        assert llm.stats()["prefix_cache_hit_tokens"] > 0


def test_serve_refuses_a_bad_engine_option(capsys):
    from fleetlab.__main__ import main

    assert main(["serve", "--port", "0", "--scheduling-policy", "nope"]) == 2
    assert "scheduling_policy" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--prefix-cache", "radix", "--no-enable-prefix-caching"]) == 2
    assert "contradicts prefix_cache" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefix-cache", "trie"])
    assert main(["serve", "--port", "0", "--shutdown-timeout", "-1"]) == 2
    assert "--shutdown-timeout" in capsys.readouterr().err


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
