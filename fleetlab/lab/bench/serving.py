"""``python -m fleetlab bench serve``: a server under Poisson traffic, measured as serving engines are.

For each request rate (requests/s; ``inf`` sends them all at once) the benchmark sends the same
prompts to ``/v1/completions`` with ``stream=true``, request ``i`` leaving at the ``i``-th arrival
of a Poisson process (exponential gaps of mean ``1 / rate``), and times what each client sees:

- **TTFT**: send -> the first chunk (the server sends one per engine step that made tokens);
- **ITL** (inter-token latency): the gap between consecutive chunks (pooled over requests);
- **TPOT**: ``(last chunk - first chunk) / (output tokens - 1)`` per request;
- **E2E**: send -> last chunk;

and per rate the request throughput (completed requests / duration) and output tokens/s
(``usage.completion_tokens`` summed / duration), where the duration runs from the first send to
the last answer. Latencies are reported as mean, median and p99 (milliseconds), as vLLM's
``benchmark_serving`` does. Every request asks for an exact number of tokens (``ignore_eos``,
output lengths uniform in ``--output-len``), so the work is the same at every rate.

Without ``--url`` the benchmark starts ``python -m fleetlab serve`` itself (``--server-args``)
and stops it at the end; the client and the server then share this machine's cores.

Results: ``<out>/serving.json`` and ``<out>/serving.png`` (latency and throughput against the
rate). Schema (``schema_version`` 1)::

    schema_version, created, command, elapsed_s
    machine: see fleetlab.lab.bench.machine (threads, load average, cpu_use while measuring: the
             server is this command's child, so its work counts as ``own``)
    server: {url, started_here, args}
    model; workload: {num_prompts, output_len: [lo, hi], seed, prompt_chars: [min, max]}
    runs: list of {rate (float, inf as "inf"), num_requests, completed, failed, duration_s,
                   request_throughput, output_throughput, total_output_tokens,
                   ttft_ms / tpot_ms / itl_ms / e2e_ms: {mean, median, p99}, errors: the first 5}
    plots: ["serving.png"]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.progress import add_quiet, section
from fleetlab.models.corpus import make_prompts
from fleetlab.serving.launch import ServerProcess

DEFAULT_RATES = (2.0, 8.0, 32.0, math.inf)


@dataclass(slots=True)
class RequestRecord:
    """What one client saw (``time.perf_counter`` seconds)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)


def poisson_offsets(n: int, rate: float, seed: int) -> np.ndarray:
    """Send times (s from the start) of ``n`` arrivals of a Poisson process of ``rate`` per second."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def _one(client, model: str, prompt: str, max_tokens: int, start: float, offset: float) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    rec = RequestRecord(sent=time.perf_counter())
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    rec.error = str(chunk["error"])
                elif chunk.get("choices"):  # a step's tokens (the text may be empty: a special token)
                    rec.chunk_times.append(time.perf_counter())
                if chunk.get("usage"):
                    rec.output_tokens = chunk["usage"]["completion_tokens"]
    except Exception as e:  # a refused or broken connection counts as a failed request
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_rate(url: str, model: str, prompts: list[str], output_lens: list[int], rate: float,
                   seed: int = 0, bar=None) -> dict:
    """Send every prompt at Poisson arrivals of ``rate``; returns the run's figures (see the module docstring).
    ``bar``: a progress bar advanced as each request ends."""
    # httpx (the ``serve`` extra) is imported where requests are sent: the results' tables and
    # figures, and the tests of them, work without it.
    import httpx

    async def one(client, prompt, n, start, offset):
        rec = await _one(client, model, prompt, n, start, offset)
        if bar is not None:
            bar.update()
        return rec

    offsets = poisson_offsets(len(prompts), rate, seed)
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()
        records = await asyncio.gather(*(one(client, p, n, start, o)
                                         for p, n, o in zip(prompts, output_lens, offsets)))
    return summarize(records, rate)


def _stats_ms(values) -> dict:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64) * 1e3
    if v.size == 0:
        return {"mean": None, "median": None, "p99": None}
    return {"mean": float(v.mean()), "median": float(np.median(v)), "p99": float(np.percentile(v, 99))}


def summarize(records: list[RequestRecord], rate: float) -> dict:
    """Throughput and latency figures of one rate's records."""
    ok = [r for r in records if r.ok]
    end = max((r.chunk_times[-1] for r in ok), default=0.0)
    duration = end - min(r.sent for r in records) if ok else 0.0
    tokens = sum(r.output_tokens for r in ok)
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in records if not r.ok]
    return {"rate": "inf" if math.isinf(rate) else rate, "num_requests": len(records), "completed": len(ok),
            "failed": len(records) - len(ok), "errors": errors[:5], "duration_s": duration,
            "request_throughput": len(ok) / duration if duration else 0.0,
            "output_throughput": tokens / duration if duration else 0.0, "total_output_tokens": tokens,
            "ttft_ms": _stats_ms(r.chunk_times[0] - r.sent for r in ok), "tpot_ms": _stats_ms(tpot),
            "itl_ms": _stats_ms(itl), "e2e_ms": _stats_ms(r.chunk_times[-1] - r.sent for r in ok)}


def workload(num_prompts: int, output_len: tuple[int, int], seed: int) -> tuple[list[str], list[int]]:
    """Prompts the tiny model knows (``fleetlab.models.corpus.make_prompts``) and exact output lengths."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(output_len[0], output_len[1] + 1, size=num_prompts)
    return make_prompts(num_prompts, seed=seed), [int(n) for n in lens]


def run_benchmark(url: str, rates=DEFAULT_RATES, num_prompts: int = 64, output_len=(16, 64), seed: int = 0,
                  warmup: int = 4, quiet: bool = True) -> dict:
    """Measure a running server at ``url`` (``http://host:port``) at each rate; returns the result dict
    (``runs`` and ``workload`` of the JSON schema). ``quiet=False``: a progress bar per rate on stderr."""
    import httpx

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    prompts, lens = workload(num_prompts, tuple(output_len), seed)
    if warmup:
        _run(run_rate(url, model, prompts[:warmup], [2] * min(warmup, len(prompts)), math.inf, seed))
    runs = []
    for rate in rates:
        name = "all at once" if math.isinf(rate) else f"{rate:g} requests/s"
        with section(f"serve, {name}", len(prompts), quiet=quiet, unit="req") as bar:
            runs.append(_run(run_rate(url, model, prompts, lens, float(rate), seed, bar)))
    return {"workload": {"num_prompts": num_prompts, "output_len": list(output_len), "seed": seed,
                         "prompt_chars": [min(map(len, prompts)), max(map(len, prompts))]},
            "model": model, "runs": runs}


def _run(coro):
    """``asyncio.run(coro)``, on a thread of its own when this one already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def draw(result: dict):
    """Latency (TTFT, TPOT, ITL: mean, median, p99) and throughput against the request rate; a Figure."""
    runs = result["runs"]
    labels = [("all at once" if r["rate"] == "inf" else f"{r['rate']:g}") for r in runs]
    x = np.arange(len(runs))
    fig = Figure(figsize=(9.5, 6.2), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"),
                              ("time to first token (ms)", "time per output token (ms)", "inter-token latency (ms)")):
        for stat, style in (("mean", "o-"), ("median", "s--"), ("p99", "^:")):
            ax.plot(x, [r[key][stat] if r[key][stat] is not None else np.nan for r in runs], style, label=stat)
        ax.set_title(title, fontsize=10)
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    ax = axes[3]
    ax.bar(x, [r["output_throughput"] for r in runs], color="tab:green", label="output tokens/s")
    ax.set_ylabel("output tokens / s")
    ax.set_xticks(x, labels)
    ax.set_xlabel("request rate (requests/s)")
    twin = ax.twinx()
    twin.plot(x, [r["request_throughput"] for r in runs], "ko-", label="requests/s")
    twin.set_ylabel("completed requests / s")
    # headroom above both, so the legend in the top-left corner covers nothing
    ax.set_ylim(0, 1.35 * max([r["output_throughput"] for r in runs] + [1e-9]))
    twin.set_ylim(0, 1.35 * max([r["request_throughput"] for r in runs] + [1e-9]))
    ax.set_title("throughput", fontsize=10)
    handles, names = (sum(z, []) for z in zip(ax.get_legend_handles_labels(), twin.get_legend_handles_labels()))
    ax.legend(handles, names, loc="upper left", fontsize=8)
    n = result["workload"]["num_prompts"]
    fig.suptitle(f"fleetlab serve, {result.get('model', '?')}: {n} streamed requests per rate, "
                 f"{result['workload']['output_len'][0]}-{result['workload']['output_len'][1]} output tokens each",
                 fontsize=10)
    return fig


def table(result: dict) -> str:
    """A text table of the runs."""
    head = (f"{'rate':>10} {'done':>5} {'req/s':>6} {'tok/s':>7} | {'TTFT mean/p50/p99 ms':>22} | "
            f"{'TPOT mean/p50/p99 ms':>20} | {'ITL mean/p50/p99 ms':>20}")
    rows = [head, "-" * len(head)]

    def f(s):
        return "/".join("-" if s[k] is None else f"{s[k]:.0f}" if s[k] >= 10 else f"{s[k]:.1f}"
                        for k in ("mean", "median", "p99"))

    for r in result["runs"]:
        rows.append(f"{r['rate']!s:>10} {r['completed']:>5} {r['request_throughput']:>6.1f} "
                    f"{r['output_throughput']:>7.0f} | {f(r['ttft_ms']):>22} | {f(r['tpot_ms']):>20} | "
                    f"{f(r['itl_ms']):>20}")
    return "\n".join(rows)




def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m fleetlab bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (http://host:port); default: start one here")
    p.add_argument("--server-args", default="--model tiny --max-num-seqs 64",
                   help="options for the server started here (python -m fleetlab serve ...)")
    p.add_argument("--rates", default=",".join("inf" if math.isinf(r) else f"{r:g}" for r in DEFAULT_RATES),
                   help="comma-separated request rates (requests/s); inf sends all at once")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--output-len", default="16-64", help="LO-HI: output tokens per request, uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results", help="folder for serving.json and serving.png")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run (tests): 6 prompts, 2 rates, 3-6 tokens")
    add_quiet(p)
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    lo, hi = (int(x) for x in args.output_len.split("-"))
    if args.tiny:
        rates, args.num_prompts, lo, hi = [20.0, math.inf], 6, 3, 6
    if args.num_prompts < 1 or not 1 <= lo <= hi or any(not r > 0 for r in rates):
        p.error("need --num-prompts >= 1, 1 <= LO <= HI, rates > 0")
    return args, rates, (lo, hi)


def main(argv=None) -> int:
    """Entry point of ``python -m fleetlab bench serve [options]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rates, output_len = _parse(argv)
    t0 = time.perf_counter()
    machine = MachineRecord()
    server = None
    if args.url is None:
        print(f"starting python -m fleetlab serve {args.server_args} ...", flush=True)
        server = ServerProcess(args.server_args.split())
    url = args.url or server.url
    try:
        print(f"fleetlab serving benchmark: {url}, rates {rates}, {args.num_prompts} prompts each", flush=True)
        result = run_benchmark(url, rates, args.num_prompts, output_len, args.seed, quiet=args.quiet)
    finally:
        if server is not None:
            server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"schema_version": 1, "created": datetime.datetime.now().isoformat(timespec="seconds"),
              "command": " ".join(["python -m fleetlab bench serve", *argv]), "elapsed_s": time.perf_counter() - t0,
              "machine": machine.close(),
              "server": {"url": url, "started_here": server is not None,
                         "args": args.server_args if server is not None else None},
              **result, "plots": ["serving.png"]}
    (out / "serving.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    draw(result).savefig(out / "serving.png", dpi=110)
    print(table(result))
    print(f"\n{describe(result['machine'])}")
    print(f"wrote {out / 'serving.json'} and {out / 'serving.png'} in {result['elapsed_s']:.0f} s")
    return 0 if all(r["failed"] == 0 for r in result["runs"]) else 1
