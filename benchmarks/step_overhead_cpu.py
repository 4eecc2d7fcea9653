"""The engine's own CPU time in a decode step at batch 64, robust to a shared machine.

    PYTHONPATH=<a checkout> OMP_NUM_THREADS=1 python benchmarks/step_overhead_cpu.py [batch]

``bench engine``'s step breakdown times wall-clock means; on a machine whose speed swings from
run to run (a shared VM), two checkouts compared that way differ by more than the change under
test. This measures process CPU time instead (``time.process_time``: time other processes take
is not counted), for the whole step and for the model's forward, and reports the medians over
the steps where every one of ``batch`` rows decodes. Run it for each checkout in turn, several
rounds interleaved, and compare the overhead (step minus forward) side by side. Works on every
fleetlab checkout since the forward was a runner method (``forward`` or ``_forward``).
"""

import json
import sys
import time

import numpy as np

from fleetlab import SamplingParams
from fleetlab.bench.engine import MODEL_SIZES, BenchConfig, build_model, make_llm, run_fleetlab
from fleetlab.bench.workloads import mixed_workload

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
cfg = BenchConfig()
wl = mixed_workload(batch, cfg.breakdown_prompt_len, (96, 96), MODEL_SIZES["small"]["vocab_size"], seed=cfg.seed + 2)
model = build_model("small", wl.max_seq_len + 1, seed=cfg.seed)
run_fleetlab(model, wl.head(2), cfg)  # warm-up
llm = make_llm(model, cfg, wl.max_seq_len + 1, max_num_seqs=max(batch, cfg.max_num_seqs), record_traces=False)
runner = getattr(llm.runner, "runner", llm.runner)
name = "forward" if hasattr(runner, "forward") else "_forward"
forward, forward_s = getattr(runner, name), [0.0]


def timed(*args, **kwargs):
    start = time.process_time()
    try:
        return forward(*args, **kwargs)
    finally:
        forward_s[0] += time.process_time() - start


setattr(runner, name, timed)
for prompt, n in zip(wl.prompts, wl.output_lens):
    llm.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=n, ignore_eos=True))
steps = []
while llm.has_unfinished_requests():
    running, forward_s[0] = list(llm.scheduler.running), 0.0
    before = sum(len(r.output_token_ids) for r in running)
    start = time.process_time()
    llm.step()
    total = time.process_time() - start
    gained = sum(len(r.output_token_ids) for r in running) - before
    if len(running) == batch == len(llm.scheduler.running) and before >= batch and gained == batch:
        steps.append((total, forward_s[0]))  # every row decoded one token
ms = 1000 * np.array(steps)
overhead, fwd = float(np.median(ms[:, 0] - ms[:, 1])), float(np.median(ms[:, 1]))
print(json.dumps({"batch": batch, "steps": len(ms), "cpu_overhead_ms": round(overhead, 3),
                  "cpu_forward_ms": round(fwd, 2), "overhead_share": round(100 * overhead / (overhead + fwd), 2)}))
