"""``python -m fleetlab disagg``: a prefill rank and a decode rank behind one OpenAI server;
the official ``openai`` client streams from it the greedy text one engine writes."""

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


def test_disagg_streams_what_one_engine_writes():
    openai = pytest.importorskip("openai")
    from fleetlab import LLM, SamplingParams, models

    model, tokenizer = models.load_tiny()
    with LLM(model, tokenizer) as llm:
        want = [o.text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6), use_tqdm=False)]
    proc = subprocess.Popen([sys.executable, "-m", "fleetlab", "disagg", "--model", "tiny", "--port", "0"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            m = re.search(r"on (http://\S+/v1)", line)
            url = m and m.group(1)
        assert url, "".join(lines)
        client = openai.OpenAI(base_url=url, api_key="none")
        got = ["".join(chunk.choices[0].text for chunk in client.completions.create(
            model="tiny", prompt=p, max_tokens=6, temperature=0, stream=True)) for p in PROMPTS]
        assert got == want
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, "".join(lines) + rest
    noisy = [x for x in lines + rest.splitlines() if re.search(r"ccache|Modified FLAGS|Traceback", x)]
    assert noisy == []


def test_a_kv_role_outside_a_two_rank_job_is_refused():
    for role in ("prefill", "decode"):
        done = subprocess.run([sys.executable, "-m", "fleetlab", "serve", "--kv-role", role, "--port", "0"],
                              env=env(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "fleetlab disagg" in done.stderr, done.stderr[-2000:]
