"""Benchmark: an engine step on 1 process and on 2 tensor-parallel processes, side by side.

Three runs of the same greedy workload on the same random Llama, each a fresh process
(or pair) started by :mod:`fleetlab.distributed.launch`:

- ``tp1 x 1 thread``: one process, ``OMP_NUM_THREADS=1``;
- ``tp1 x 2 threads``: one process using both cores of a 2-core machine;
- ``tp2 x 1 thread``: two ranks through ``paddle.distributed.launch`` (gloo on CPU), each
  holding half the heads and MLP columns, 2 all-reduces per layer.

It reports the mean step time of decode-only steps and of steps with prefill, the time
inside all-reduces (counted by the ranks' :class:`~fleetlab.distributed.TensorParallelGroup`,
so it includes waiting for the slower rank), and checks that every run produced the same
tokens. Results: ``<out>/tp.json`` and ``<out>/tp_step_time.png``.

Run: ``python -m fleetlab bench tp [--tiny] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from fleetlab.distributed.launch import LaunchResult, launch
from fleetlab.lab.bench.machine import MachineRecord, describe
from fleetlab.lab.bench.progress import add_quiet, section
from fleetlab.lab.viz.tp import draw_tp_step_times

PRESETS = {
    # ~12M parameters: matmuls big enough that splitting them shows, small enough for 2 cores.
    "default": {"model_overrides": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 4,
                                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
                                    "vocab_size": 128},
                "workload": {"prompt_lens": [40, 56, 24, 64, 48, 32, 60, 36, 44, 52, 28, 40, 58, 34, 46, 38],
                             "max_tokens": 32, "block_size": 16, "num_blocks": None,
                             "max_num_batched_tokens": 256, "max_num_seqs": 16}},
    "tiny": {"model_overrides": {},
             "workload": {"prompt_lens": [9, 14, 5, 12], "max_tokens": 6, "block_size": 4, "num_blocks": None,
                          "max_num_batched_tokens": 32, "max_num_seqs": 8}},
}
RUNS = (("tp1 x 1 thread", 1, 1), ("tp1 x 2 threads", 1, 2), ("tp2 x 1 thread", 2, 1))


def run(preset: str = "default", out: str | Path | None = None, timeout: float = 600, runs=RUNS,
        quiet: bool = True, argv=None) -> dict:
    """Run the configurations ``runs`` (``(name, tp_size, threads)``; default all three);
    return (and, with ``out``, write) the result dict. ``quiet=False``: a progress bar on stderr."""
    start = time.perf_counter()
    machine = MachineRecord()
    cfg = PRESETS[preset]
    workload = {**cfg["workload"], "model_overrides": cfg["model_overrides"], "record_step": 3}
    results = []
    with section("bench tp runs", len(runs), quiet=quiet) as bar:
        for name, tp_size, threads in runs:
            bar.set_postfix_str(name)
            folder = Path(tempfile.mkdtemp(prefix="fleetlab-bench-tp-"))
            args = ["fleetlab.lab.tp_worker", "--out", str(folder / "out"), "--families", "llama",
                    "--tensor-parallel-size", str(tp_size), "--workload", json.dumps(workload)]
            t0 = time.perf_counter()
            if tp_size == 1:
                result = _run_alone(args, threads, timeout)
            else:
                result = launch(args, tp_size, log_dir=folder / "logs", timeout=timeout, threads_per_rank=threads)
            if result.returncode:
                raise RuntimeError(f"bench tp: run {name!r} failed (exit {result.returncode}):\n"
                                   f"{result.output[-3000:]}")
            ranks = [json.loads((folder / "out" / f"rank{r}.json").read_text())["families"]["llama"]
                     for r in range(tp_size)]
            results.append(_summarize(name, tp_size, threads, ranks, time.perf_counter() - t0))
            bar.update()
    tokens = [r.pop("tokens") for r in results]
    result = {"schema_version": 1, "preset": preset,
              "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m fleetlab bench tp " + " ".join(argv or []),
              "machine": machine.close(), "model": cfg["model_overrides"], "workload": cfg["workload"],
              "runs": results, "identical_tokens": all(t == tokens[0] for t in tokens),
              "elapsed_s": time.perf_counter() - start}
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        result["plots"] = ["tp_step_time.png"]
        (out / "tp.json").write_text(json.dumps(result, indent=1) + "\n")
        draw_tp_step_times(result).savefig(out / "tp_step_time.png", dpi=110, bbox_inches="tight")
    return result


def _run_alone(args, threads: int, timeout: float):
    """The one-process baseline, started like a rank (a fresh interpreter, its own threads)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    for key in ("PADDLE_TRAINER_ID", "PADDLE_TRAINERS_NUM"):
        env.pop(key, None)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *args], env=env, text=True, capture_output=True, timeout=timeout)
    return LaunchResult(proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0, {}, args)


def _summarize(name: str, tp_size: int, threads: int, ranks: list[dict], wall_s: float) -> dict:
    """Step times of rank 0 (every rank runs every step); all-reduce time is the mean over ranks."""
    r0 = ranks[0]
    step_s = np.array(r0["step_s"])
    prefill = np.array(r0["step_has_prefill"])
    decode_steps = step_s[~prefill][1:] if (~prefill).sum() > 1 else step_s[~prefill]  # first decode warms up
    summary = {
        "name": name, "tp_size": tp_size, "threads_per_rank": threads, "num_steps": int(len(step_s)),
        "job_wall_s": wall_s, "serve_s": float(step_s.sum()),
        "decode_step_ms": float(decode_steps.mean() * 1e3) if len(decode_steps) else float("nan"),
        "prefill_step_ms": float(step_s[prefill].mean() * 1e3) if prefill.any() else float("nan"),
        "kv_cache_bytes_per_rank": r0["kv_cache_bytes"], "num_kv_heads_per_rank": r0["num_kv_heads"],
        "tokens": r0["tokens"], "ranks_identical": all(r["tokens"] == r0["tokens"] for r in ranks),
    }
    if tp_size > 1:
        comm = np.array([r["step_all_reduce"] for r in ranks])  # [rank, step, (calls, seconds)]
        ar_s = comm[:, :, 1].mean(axis=0)
        calls = int(comm[0, :, 0].sum())
        summary.update({
            "all_reduce_calls": calls, "all_reduce_per_step": int(comm[0, 0, 0]),
            "all_reduce_s": float(ar_s.sum()), "all_reduce_share": float(ar_s.sum() / step_s.sum()),
            "all_reduce_ms_per_call": float(ar_s.sum() / calls * 1e3),
            "all_reduce_alone_ms": float(np.mean([r["all_reduce_alone_ms"] for r in ranks])),
            "decode_all_reduce_ms": float(ar_s[~prefill][1:].mean() * 1e3) if (~prefill).sum() > 1 else float("nan"),
            "prefill_all_reduce_ms": float(ar_s[prefill].mean() * 1e3) if prefill.any() else float("nan"),
            "recorded_step": r0["recorded_all_reduces"],
            "all_reduce_bytes_per_step": int(sum(a["nbytes"] for a in r0["recorded_all_reduces"])),
        })
    return summary




def table(result: dict) -> str:
    """The markdown table of a ``tp.json`` result: what ``bench tp`` prints and README shows."""
    lines = ["| run | decode step | step with prefill | all-reduces per step | time inside all-reduce | "
             "KV cache per rank |", "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        ar, share = "0", "-"
        if r["tp_size"] > 1:
            ar = (f"{r['all_reduce_per_step']}: {_ms(r['all_reduce_ms_per_call'])} ms each in a step, "
                  f"{r['all_reduce_alone_ms']:.2f} ms alone")
            share = f"{100 * r['all_reduce_share']:.0f}% of serving"
        heads = r["num_kv_heads_per_rank"]
        lines.append(f"| {r['name']} | {_ms(r['decode_step_ms'])} ms | {_ms(r['prefill_step_ms'])} ms | {ar} | "
                     f"{share} | {r['kv_cache_bytes_per_rank'] / 2**20:.3g} MiB ({heads} KV head"
                     f"{'s' if heads != 1 else ''}) |")
    return "\n".join(lines)


def _ms(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m fleetlab bench tp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a seconds-long run on the tiny test model")
    p.add_argument("--out", default="benchmarks/results", help="folder for tp.json and tp_step_time.png")
    add_quiet(p)
    args = p.parse_args(argv)
    result = run("tiny" if args.tiny else "default", args.out, quiet=args.quiet, argv=argv)
    print(f"bench tp ({result['preset']}): Llama {result['model'] or 'tiny'}, {len(result['workload']['prompt_lens'])} "
          f"requests x {result['workload']['max_tokens']} tokens; {describe(result['machine'])}\n")
    print(table(result))
    same = result["identical_tokens"] and all(r["ranks_identical"] for r in result["runs"])
    print(f"\ntokens identical across runs and ranks: {same}")
    print(f"wrote {Path(args.out) / 'tp.json'}")
    return 0
