"""The engine's own host time per decode step, checkouts compared side by side on a noisy machine.

    python benchmarks/step_host_time.py --rounds 40 CHECKOUT [CHECKOUT ...]

``bench engine``'s step breakdown times one checkout at a time; on a machine whose speed swings
from minute to minute (a shared VM), two checkouts timed one after the other differ by more than
the change under test. Here each checkout runs in a worker process of its own (its root on
``PYTHONPATH``, one OpenMP thread), the same decode workload (64 requests, small Llama), and the
workers take turns: one runs 10 steps while the others wait, for many rounds, in alternating
order, so every checkout meets the same moments of the machine. Each step's model forward is
replaced by its cached output (the logits of the first step of that shape): what is left is the
engine's own work, the step's host time. Once a round each worker also times one real forward
(that of the first all-decode step, contexts of 65 to 129 tokens), so that the engine's share of
a whole step is computed from numbers taken side by side.
Prints one JSON line per checkout (medians over the rounds) and writes them, with each
checkout's commit and the machine's load, to ``--out`` (default
``benchmarks/results/step_host_time.json``, which README's figure block is rendered from).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

STEPS_PER_ROUND = 10


def worker(batch: int) -> None:
    """Serve the workload; on each "go" from stdin run a round and print its timings."""
    from fleetlab import SamplingParams

    try:
        from fleetlab.lab.bench.engine import MODEL_SIZES, BenchConfig, build_model, make_llm
        from fleetlab.lab.bench.workloads import mixed_workload
    except ImportError:  # older checkouts: the bench was fleetlab/bench
        from fleetlab.bench.engine import MODEL_SIZES, BenchConfig, build_model, make_llm
        from fleetlab.bench.workloads import mixed_workload

    cfg = BenchConfig()
    wl = mixed_workload(batch, cfg.breakdown_prompt_len, (1000, 1000), MODEL_SIZES["small"]["vocab_size"],
                        seed=cfg.seed + 2)
    llm = make_llm(build_model("small", wl.max_seq_len + 1, seed=cfg.seed), cfg, wl.max_seq_len + 1,
                   max_num_seqs=max(batch, cfg.max_num_seqs), record_traces=False)
    runner = getattr(llm.runner, "runner", llm.runner)
    name = "forward" if hasattr(runner, "forward") else "_forward"  # older checkouts: _forward
    real, cache, last = getattr(runner, name), {}, {}

    def cached(inputs):
        last["inputs"] = inputs
        n = int(inputs.logits_indices.shape[0])
        if n not in cache:
            cache[n] = real(inputs)
        return cache[n]

    setattr(runner, name, cached)
    for prompt, n in zip(wl.prompts, wl.output_lens):
        llm.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=n, ignore_eos=True))
    while sum(1 for r in llm.scheduler.running if r.output_token_ids) < batch:  # past every prefill
        llm.step()
    llm.step()
    first_decode = last["inputs"]  # contexts of 65 to 129 tokens, as in bench engine's breakdown
    for _ in range(20):
        llm.step()
    print("ready", flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        for _ in range(STEPS_PER_ROUND):
            llm.step()
        host = (time.perf_counter() - start) / STEPS_PER_ROUND
        start = time.perf_counter()
        real(first_decode)  # that step's forward again: same slots, same values
        print(host, time.perf_counter() - start, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", help="repository roots (each put on PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/step_host_time.json")
    args = parser.parse_args()
    if 21 + args.rounds * STEPS_PER_ROUND > 1000:
        raise SystemExit("--rounds: at most 97 (the requests stop at 1,000 tokens)")
    os.environ["OMP_NUM_THREADS"] = "1"  # the workers' setting, recorded with the machine
    from fleetlab.lab.bench.machine import MachineRecord

    machine = MachineRecord()
    procs = {}
    for root in args.checkouts:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(root), "OMP_NUM_THREADS": "1"}
        procs[root] = subprocess.Popen([sys.executable, __file__, "--worker", str(args.batch)], env=env, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if procs[root].stdout.readline().strip() != "ready":
            raise SystemExit(f"{root}: the worker did not start")
    times = {root: [] for root in args.checkouts}
    for k in range(args.rounds):
        for root in (args.checkouts if k % 2 == 0 else args.checkouts[::-1]):
            procs[root].stdin.write("go\n")
            procs[root].stdin.flush()
            times[root].append(tuple(map(float, procs[root].stdout.readline().split())))
    rows = []
    for root, proc in procs.items():
        proc.stdin.close()
        proc.wait()
        host = statistics.median(1000 * h for h, _ in times[root])
        forward = statistics.median(1000 * f for _, f in times[root])
        commit = subprocess.run(["git", "-C", root, "log", "-1", "--format=%h %s"], capture_output=True,
                                text=True).stdout.strip()
        rows.append({"checkout": root, "commit": commit[:7], "subject": commit[8:80], "batch": args.batch,
                     "rounds": args.rounds, "host_ms_per_step": round(host, 3), "forward_ms": round(forward, 2),
                     "host_share_of_step": round(host / (host + forward), 4)})
        print(json.dumps(rows[-1]))
    result = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/step_host_time.py --rounds " + str(args.rounds) + " <checkouts>",
              "machine": machine.close(), "steps_per_round": STEPS_PER_ROUND, "checkouts": rows}
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(int(sys.argv[2]))
    else:
        main()
