"""``python -m fleetlab disagg``: a prefill rank and a decode rank behind the proxy; the official
``openai`` client streams from it the greedy text one engine writes; a killed rank makes the
proxy answer 503 naming it, within seconds."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["count 11 12 13 14 15 ", "12+7=19 45+38="]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}


def start_disagg():
    """``fleetlab disagg`` on a free port: (process, proxy's /v1 url, {role: pid}, lines read)."""
    proc = subprocess.Popen([sys.executable, "-m", "fleetlab", "disagg", "--model", "tiny", "--port", "0"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, "".join(lines)
        lines.append(line)
        m = re.search(r"proxy on (http://\S+/v1) \((.*)\)", line)
        if m:
            return proc, m.group(1), {k: int(v) for k, v in re.findall(r"(\w+) pid (\d+)", m.group(2))}, lines
    proc.kill()
    raise AssertionError("".join(lines))


def stop(proc, lines) -> str:
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=30)[0]
    return "".join(lines) + rest


def test_disagg_streams_what_one_engine_writes():
    openai = pytest.importorskip("openai")
    from fleetlab import LLM, SamplingParams, models

    model, tokenizer = models.load_tiny()
    with LLM(model, tokenizer) as llm:
        want = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6), use_tqdm=False)]
    proc, url, pids, lines = start_disagg()
    try:
        assert set(pids) == {"prefill", "decode"}
        client = openai.OpenAI(base_url=url, api_key="none")
        got = ["".join(chunk.choices[0].text for chunk in client.completions.create(
            model="tiny", prompt=p, max_tokens=6, temperature=0, stream=True)) for p in PROMPTS]
        assert got == want
    finally:
        out = stop(proc, lines)
    assert proc.returncode == 0, out
    noisy = [x for x in out.splitlines() if re.search(r"ccache|Modified FLAGS|Traceback", x)]
    assert noisy == [] and len(re.findall(r"on http://", out)) == 1  # the proxy's address only


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_killed_rank_makes_the_proxy_answer_503(role):
    """SIGKILL one rank mid-stream: the stream ends (finished, or with an error event) and every
    later request gets 503 naming the dead process, within seconds."""
    openai = pytest.importorskip("openai")
    proc, url, pids, lines = start_disagg()
    try:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=20)
        assert client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3).choices[0].text
        stream = iter(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=100, stream=True))
        next(stream)
        os.kill(pids[role], signal.SIGKILL)
        t0 = time.monotonic()
        try:
            for _ in stream:
                pass
        except openai.APIError as e:
            assert f"the {role} engine" in str(e) or "stopped answering" in str(e), e
        while True:
            try:
                client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3)
            except openai.APIStatusError as e:
                assert e.status_code == 503 and f"the {role} engine (rank {1 if role == 'prefill' else 0}" in str(e)
                break
            assert time.monotonic() - t0 < 5, "still answering 200 after the kill"
        assert time.monotonic() - t0 < 10
    finally:
        out = stop(proc, lines)
    assert proc.returncode == 1, out  # the job was down when the proxy stopped


def test_a_kv_role_outside_a_two_rank_job_is_refused():
    for role in ("prefill", "decode"):
        done = subprocess.run([sys.executable, "-m", "fleetlab", "serve", "--kv-role", role, "--port", "0"],
                              env=env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "fleetlab disagg" in done.stderr, done.stderr[-2000:]
