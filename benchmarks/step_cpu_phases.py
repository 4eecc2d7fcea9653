"""The engine's own work per batch-64 decode step with the real forward, checkouts side by side.

    python benchmarks/step_cpu_phases.py ROUNDS CHECKOUT [CHECKOUT ...]

Each checkout runs in a worker process of its own (its root on ``PYTHONPATH``, one OpenMP
thread) serving ``bench overlap``'s workload on the shipped tiny model (64 requests of 16-32
prompt tokens, 48 output tokens each, synchronous loop); the workers take turns, a whole
workload each per round. Each phase of each step is timed in *thread CPU time*
(``time.thread_time``, less disturbed by other work on a shared machine than wall time), and per
round the median over the steady decode steps is taken; printed: the medians of the rounds.
The engine's own work is schedule + batch update + metadata + sample + update, plus, in
checkouts that build them inside the forward, the tiled backend's plan and the KV cache's write
plan (``inner``); ``model-only`` is the rest of the step.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import subprocess
import sys
import time
import types

HOST = ("schedule", "batch_update", "metadata", "sample", "update")


def worker() -> None:
    """Serve the workload once per ``go`` on stdin; print each round's per-phase medians (ms)."""
    import numpy as np

    import fleetlab.engine.hooks as hooks

    hooks.time = types.SimpleNamespace(perf_counter=time.thread_time)  # every phase in thread CPU time
    import fleetlab.attention.tiled as tiled
    import fleetlab.kv.paged_cache as paged_cache
    from fleetlab import LLM, SamplingParams
    from fleetlab.models import load_tiny

    inner, state = collections.Counter(), {"in_forward": False}

    def timed(module, name):  # the plans an older checkout builds inside the forward
        f = getattr(module, name, None)
        if f is None:
            return

        def g(*a, **k):
            start = time.thread_time()
            out = f(*a, **k)
            if state["in_forward"]:
                inner["inner"] += time.thread_time() - start
            return out
        setattr(module, name, g)

    timed(tiled, "_step_plan")
    timed(paged_cache, "_skip_plan")

    class Phases:
        def __init__(self):
            self.steps = []

        def on_phase(self, name, seconds):
            if name == "schedule":
                self.steps.append(collections.Counter())
            if name == "metadata":
                state["in_forward"] = True
                inner.clear()
            if name == "forward":
                state["in_forward"] = False
                self.steps[-1]["inner"] += inner["inner"] * 1e3
            if self.steps:
                self.steps[-1][name] += seconds * 1e3

    model, _ = load_tiny()
    batch = 64
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    llm = LLM(model, block_size=16, max_num_seqs=batch, max_num_batched_tokens=batch * 32, num_blocks=batch * 6)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, llm.handle.vocab_size, size=int(rng.integers(16, 32))).tolist() for _ in range(batch)]
    phases = Phases()
    llm.hooks.attach(phases)

    def one_round() -> dict:
        phases.steps.clear()
        for p in prompts:
            llm.add_request(prompt_token_ids=p, sampling_params=sp)
        while llm.has_unfinished_requests():
            llm.step()
        steady = phases.steps[5:-4]
        return {k: statistics.median(s[k] for s in steady) for k in (*HOST, "forward", "inner")}

    one_round()
    print("ready", flush=True)
    for _ in sys.stdin:
        print(json.dumps(one_round()), flush=True)


def main() -> None:
    rounds, roots = int(sys.argv[1]), sys.argv[2:]
    procs = {}
    for root in roots:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(root), "OMP_NUM_THREADS": "1"}
        procs[root] = subprocess.Popen([sys.executable, __file__, "--worker"], env=env, text=True,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if procs[root].stdout.readline().strip() != "ready":
            raise SystemExit(f"{root}: the worker did not start")
    results = {root: [] for root in roots}
    for k in range(rounds):
        for root in (roots if k % 2 == 0 else roots[::-1]):
            procs[root].stdin.write("go\n")
            procs[root].stdin.flush()
            results[root].append(json.loads(procs[root].stdout.readline()))
    for root in roots:
        procs[root].stdin.close()
        procs[root].wait()
        med = {k: statistics.median(r[k] for r in results[root]) for k in results[root][0]}
        engine = sum(med[k] for k in HOST) + med["inner"]
        step = sum(med[k] for k in HOST) + med["forward"]
        print(root, " ".join(f"{k} {v:.3f}" for k, v in med.items()),
              f"| engine {engine:.3f} ms of step {step:.3f} = {engine / step:.3f}, model-only {step - engine:.3f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker()
    else:
        main()
