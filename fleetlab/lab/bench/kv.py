"""Benchmark: KV beyond one engine (``python -m fleetlab bench kv [--tiny] [--out DIR]``).

Three sections, each on the same random Llama, greedy, requests one after another:

- ``offload``: a working set twice the pool (``--prompts`` distinct prompts, each asked
  ``--rounds`` times in turn, the pool holding half of their blocks): prefix hit rate and the
  repeats' TTFT with the pool alone against the pool over an ``offload`` host tier; engines
  built in turns (pool, offload, pool, offload...), so load on the machine falls on both;
- ``shared_storage``: a prompt saved by one engine, then TTFT of a *new* engine loading it
  from the directory against a new engine computing it, in turns;
- ``paddle_distributed``: a prefill rank and a decode rank (``fleetlab.serving.disagg.parity``
  under ``paddle.distributed.launch``, gloo): bytes moved per loaded token against ``2 x
  layers x kv_heads x head_dim x dtype bytes``, the transfer time per request (its handshake
  leaving the decode side to its last layer arriving: the prefill rank's compute included;
  the decode side keeps stepping meanwhile), and whether tokens equal one engine's and the
  full forward; then a mixed workload (:mod:`fleetlab.serving.disagg.mixed`: long prompts
  arriving while short requests decode): the short requests' inter-token latency p50 / p99,
  the long prompts' TTFT and every step's timeline on the pair (one thread each, plus the
  decode side's link thread, idle in a receive) against one engine with chunked prefill.

Tokens are checked equal across modes in every section. Results: ``<out>/kv.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from fleetlab.lab.bench.machine import MachineRecord
from fleetlab.lab.bench.progress import add_quiet, section

PRESETS = {
    "default": {"model": {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
                          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 128},
                "prompt_len": 192, "prompts": 4, "rounds": 3, "turns": 3, "block_size": 16, "max_tokens": 4},
    "tiny": {"model": {}, "prompt_len": 24, "prompts": 4, "rounds": 2, "turns": 1, "block_size": 4, "max_tokens": 3},
}


def _model(overrides: dict):
    from fleetlab.models import tiny

    return tiny("llama", seed=0, **overrides)


def _serve_one(llm, prompt, sp) -> tuple[float, list[int]]:
    """TTFT (seconds from add_request to the step that gave the first token) and the tokens."""
    t0 = time.perf_counter()
    llm.add_request(prompt_token_ids=prompt, sampling_params=sp)
    ttft, tokens = None, []
    while llm.has_unfinished_requests():
        for out in llm.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
            if out.finished:
                tokens = list(out.token_ids)
    return ttft, tokens


def offload(model, cfg: dict, bar) -> dict:
    from fleetlab import LLM, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 120, cfg["prompt_len"])] for _ in range(cfg["prompts"])]
    bs, sp = cfg["block_size"], SamplingParams(max_tokens=cfg["max_tokens"], ignore_eos=True)
    per_request = -(-(cfg["prompt_len"] + cfg["max_tokens"]) // bs)
    num_blocks = cfg["prompts"] * per_request // 2  # the working set is twice the pool
    modes = {"pool alone": None, "pool + offload": {"connector": "offload", "capacity_bytes": 2**30}}
    runs = {name: {"repeat_ttft_s": [], "first_ttft_s": []} for name in modes}
    tokens = {}
    for _ in range(cfg["turns"]):
        for name, kv in modes.items():
            llm = LLM(model, block_size=bs, num_blocks=num_blocks, max_num_seqs=1, max_num_batched_tokens=512,
                      kv_transfer_config=kv)
            got = []
            for r in range(cfg["rounds"]):
                for p in prompts:
                    ttft, toks = _serve_one(llm, p, sp)
                    runs[name]["repeat_ttft_s" if r else "first_ttft_s"].append(ttft)
                    got.append(toks)
            tokens[name] = got
            runs[name]["pool_hit_rate"] = llm.stats()["prefix_cache_hit_rate"]
            if kv is not None:
                s = llm.kv_connector.stats
                runs[name].update(tier_hit_rate=s.hit_rate, loaded_blocks=s.loaded_blocks,
                                  saved_blocks=s.saved_blocks, evicted_blocks=s.extra["evicted_blocks"])
            runs[name]["free_blocks_at_end"] = llm.pool.num_free_blocks
            llm.close()
            bar.update()
    for r in runs.values():
        r["repeat_ttft_median_ms"] = 1e3 * float(np.median(r["repeat_ttft_s"]))
        r["first_ttft_median_ms"] = 1e3 * float(np.median(r["first_ttft_s"]))
    return {"num_blocks": num_blocks, "blocks_per_request": per_request, "runs": runs,
            "identical_tokens": tokens["pool alone"] == tokens["pool + offload"]}


def shared_storage(model, cfg: dict, bar) -> dict:
    from fleetlab import LLM, SamplingParams

    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, 120, cfg["prompt_len"])]
    bs, sp = cfg["block_size"], SamplingParams(max_tokens=cfg["max_tokens"], ignore_eos=True)
    path = tempfile.mkdtemp(prefix="fleetlab-bench-kv-")
    with LLM(model, block_size=bs, kv_transfer_config={"connector": "shared_storage", "path": path}) as writer:
        _, want = _serve_one(writer, prompt, sp)
    modes = {"new engine, computing": None,
             "new engine, loading": {"connector": "shared_storage", "role": "consumer", "path": path}}
    ttft = {name: [] for name in modes}
    same = True
    for _ in range(cfg["turns"] + 2):
        for name, kv in modes.items():
            with LLM(model, block_size=bs, kv_transfer_config=kv) as llm:
                t, toks = _serve_one(llm, prompt, sp)
                ttft[name].append(t)
                same &= toks == want
                if kv is not None:
                    loaded = llm.kv_connector.stats.loaded_tokens
        bar.update()
    files = list(Path(path).rglob("*.safetensors"))
    return {"prompt_len": len(prompt), "loaded_tokens": loaded, "files": len(files),
            "bytes_on_disk": sum(f.stat().st_size for f in files),
            "ttft_median_ms": {n: 1e3 * float(np.median(v)) for n, v in ttft.items()}, "ttft_s": ttft,
            "identical_tokens": same}


def distributed(preset: str, bar) -> dict:
    from fleetlab.distributed.launch import launch
    from fleetlab.serving.disagg.mixed import collect

    args = ["fleetlab.serving.disagg.parity", "--prompts", "8", "--max-tokens", "4"]
    if preset == "default":
        args += ["--block-size", "16", "--budget", "64", "--prompt-len", "96"]
    r = launch(args, 2, timeout=300)
    bar.update()
    lines = [line for line in r.output.splitlines() if line.startswith("DISAGG_RESULT ")]
    if r.returncode or not lines:
        raise RuntimeError(f"bench kv: the two-rank run failed (exit {r.returncode}):\n{r.output[-3000:]}")
    res = json.loads(lines[-1].removeprefix("DISAGG_RESULT "))
    res["recv_ms_per_request"] = 1e3 * res["recv_seconds"] / res["num_prompts"]
    res["job_wall_s"] = r.seconds
    mixed = ["fleetlab.serving.disagg.mixed"] + ([] if preset == "default" else
                                              ["--model-overrides", "{}", "--long-len", "40", "--short-tokens", "10"])
    runs = []
    for _ in range(MIXED_REPEATS[preset]):  # the pair and one engine take turns inside each run
        r = launch(mixed, 2, timeout=300)
        if r.returncode:
            raise RuntimeError(f"bench kv: the mixed workload failed (exit {r.returncode}):\n{r.output[-3000:]}")
        runs.append(collect(r.output, r.worker_logs.get(1, "")))
    bar.update()
    res["mixed"] = runs[len(runs) // 2]  # a whole run (its timeline drawn), and every run's figures:
    res["mixed_runs"] = [{k: run[k] for k in ("pair", "one engine", "identical_tokens")} for run in runs]
    res["mixed_spread"] = spread(res["mixed_runs"])
    return res


MIXED_REPEATS = {"default": 3, "tiny": 1}
MIXED_FIGURES = ("itl_p50_ms", "itl_p99_ms", "long_ttft_median_ms")


def spread(runs: list[dict]) -> dict:
    """Per setup and figure, the ``[median, min, max]`` over runs, and per figure the median of the
    runs' pair / one-engine ratios (each run's pair and engine met the same moments of the machine)."""
    import statistics

    out = {name: {f: [statistics.median(r[name][f] for r in runs), min(r[name][f] for r in runs),
                      max(r[name][f] for r in runs)] for f in MIXED_FIGURES} for name in ("pair", "one engine")}
    out["pair_over_one_engine"] = {f: statistics.median(r["pair"][f] / r["one engine"][f] for r in runs)
                                   for f in MIXED_FIGURES}
    return out


def run(preset: str = "default", out=None, quiet: bool = True, argv=None) -> dict:
    start = time.perf_counter()
    machine = MachineRecord()
    cfg = PRESETS[preset]
    model = _model(cfg["model"])
    with section("bench kv", 2 * cfg["turns"] + cfg["turns"] + 2 + 2, quiet=quiet) as bar:
        result = {"schema_version": 1, "preset": preset, "config": cfg,
                  "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": "python -m fleetlab bench kv " + " ".join(argv or []),
                  "offload": offload(model, cfg, bar), "shared_storage": shared_storage(model, cfg, bar),
                  "paddle_distributed": distributed(preset, bar)}
    result["machine"] = machine.close()
    result["elapsed_s"] = time.perf_counter() - start
    if out is not None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "kv.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fleetlab bench kv", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a seconds-long run (for tests)")
    p.add_argument("--out", default=os.path.join("benchmarks", "results"))
    add_quiet(p)
    args = p.parse_args(argv)
    r = run("tiny" if args.tiny else "default", args.out, quiet=args.quiet, argv=argv)
    o, s, d = r["offload"], r["shared_storage"], r["paddle_distributed"]
    print(f"offload: pool hit rate {o['runs']['pool alone']['pool_hit_rate']:.2f}, host tier hit rate "
          f"{o['runs']['pool + offload']['tier_hit_rate']:.2f}; repeat TTFT "
          f"{o['runs']['pool alone']['repeat_ttft_median_ms']:.1f} ms (pool) vs "
          f"{o['runs']['pool + offload']['repeat_ttft_median_ms']:.1f} ms (offload); tokens identical: "
          f"{o['identical_tokens']}")
    t = s["ttft_median_ms"]
    print(f"shared_storage: a new engine's TTFT {t['new engine, loading']:.1f} ms loading vs "
          f"{t['new engine, computing']:.1f} ms computing ({s['loaded_tokens']} of {s['prompt_len']} tokens loaded)")
    print(f"paddle_distributed: {d['bytes_per_token']:.0f} bytes per token (expected "
          f"{d['expected_bytes_per_token']}), {d['recv_ms_per_request']:.1f} ms transfer per request (handshake to "
          f"last layer); tokens "
          f"equal one engine's: {d['equal_single']}, the full forward's: {d['equal_forward']}")
    m, ratio = d["mixed_spread"], d["mixed_spread"]["pair_over_one_engine"]
    pair, one = m["pair"], m["one engine"]
    print(f"mixed workload ({len(d['mixed_runs'])} runs, medians): decode ITL p50 / p99 "
          f"{pair['itl_p50_ms'][0]:.1f} / {pair['itl_p99_ms'][0]:.1f} ms on the pair vs {one['itl_p50_ms'][0]:.1f} / "
          f"{one['itl_p99_ms'][0]:.1f} ms on one engine; long-prompt TTFT {pair['long_ttft_median_ms'][0]:.0f} vs "
          f"{one['long_ttft_median_ms'][0]:.0f} ms; pair / one engine: ITL p99 {ratio['itl_p99_ms']:.2f}x, TTFT "
          f"{ratio['long_ttft_median_ms']:.2f}x; tokens identical: "
          f"{all(r['identical_tokens'] for r in d['mixed_runs'])}")
    print(f"wrote {Path(args.out) / 'kv.json'}")
    return 0
